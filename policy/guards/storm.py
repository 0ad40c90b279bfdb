"""The preemption-storm guard (``storm`` , issue 29): predict a storm from the KV demand trend and
prevent it with vLLM's own knobs, released when the demand falls.

A preemption storm is vLLM preempting running requests step after step because the requests it
admitted grow past the KV cache (v1 preempts by recompute, so each preemption redoes a prefill,
which needs more KV and more time, vllm#18115 and the watermark's help text in
``vllm/config/cache.py``: "helps avoid frequent KV cache eviction and the resulting repeated
preemption"). The signal is the node's predicted saturation (``endpoint_saturation``: the KV blocks
running and queued requests will need at their expected final lengths, ``producers.admission``), and
its trend over the guard's window; the preemptions of the tick confirm one under way.

Predicted (saturation >= ``rise_at`` and rising by >= ``min_rise`` over the window, or >=
``high_at``, or preemptions while >= ``release_at``) -> three proposals with vLLM's real knobs:
the admission watermark (``HeadroomPayload``: blocks kept free when a waiting request is admitted,
vLLM's ``watermark``), a per-step token cap (``BatchCapPayload``: ``max_num_batched_tokens``, so
prefills stop outrunning decode), and a hold of new long prompts (``HoldPayload``: prompts over
``hold_prompt_tokens`` stay queued). Released (0 headroom, no cap, ``ReleasePayload``) after
``calm_ticks`` ticks below ``release_at``. A node that reports no saturation (no gate) is left alone.

State per node: the saturation window, whether the knobs are applied, the calm count. A restart
drops the applied flag (the fresh engine runs without the knobs) and keeps the window, so a storm
still predicted is prevented again on the fresh engine.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from kvguard.contracts.commands import BatchCapPayload, HeadroomPayload, HoldPayload, ReleasePayload
from kvguard.policy.guards.base import NOTHING, Finding, Observation, Phase, Placement, Proposal

if TYPE_CHECKING:
    from kvguard.policy.engine import EngineConfig


@dataclass(slots=True, frozen=True)
class StormConfig:
    window_ticks: int = 3
    rise_at: float = 0.9
    min_rise: float = 0.05
    high_at: float = 0.98
    release_at: float = 0.8
    calm_ticks: int = 2
    watermark_frac: float = 0.05  # of the KV pool, kept free at admission
    batch_tokens: int = 1024
    hold_prompt_tokens: int = 4096


class PreemptionStorm:
    name: ClassVar[str] = "storm"
    phase: ClassVar[Phase] = Phase.ACT
    placement: ClassVar[Placement] = Placement.AFTER_PLAN

    def __init__(self, config: EngineConfig, storm: StormConfig | None = None) -> None:
        self.config = config
        self.storm = storm or getattr(config, "storm", None) or StormConfig()
        self.window: dict[str, deque[float]] = {}
        self.applied: dict[str, bool] = {}
        self.calm: dict[str, int] = {}

    def predicted(self, node: str, saturation: float, preemptions: int) -> str | None:
        s = self.storm
        w = self.window.setdefault(node, deque(maxlen=s.window_ticks))
        w.append(saturation)
        rise = w[-1] - w[0]
        if saturation >= s.high_at:
            return f"predicted KV saturation {saturation:.2f} >= {s.high_at}"
        if saturation >= s.rise_at and len(w) > 1 and rise >= s.min_rise:
            return f"predicted KV saturation {saturation:.2f} rising {rise:+.2f} over {len(w)} ticks"
        if preemptions and saturation >= s.release_at:
            return f"{preemptions} preemption(s) at predicted saturation {saturation:.2f}"
        return None

    def observe(self, seen: Observation) -> Finding:
        view, s = seen.view, self.storm
        if view.endpoint_saturation is None:
            return NOTHING
        node = view.node
        why = self.predicted(node, view.endpoint_saturation, view.preemptions)
        applied = self.applied.get(node, False)
        if why is not None:
            self.calm[node] = 0
            if applied:
                return NOTHING
            self.applied[node] = True
            units = max(1, int(s.watermark_frac * view.dynamic_units))
            return Finding(risk=f"preemption storm: {why}", proposals=(
                Proposal(HeadroomPayload(units=units), f"storm predicted ({why}): watermark {units} blocks"),
                Proposal(BatchCapPayload(tokens=s.batch_tokens), f"storm predicted: {s.batch_tokens} tokens per step"),
                Proposal(HoldPayload(max_prompt_tokens=s.hold_prompt_tokens),
                         f"storm predicted: prompts over {s.hold_prompt_tokens} tokens held"),
            ))
        if not applied:
            return NOTHING
        calm = self.calm.get(node, 0) + (1 if view.endpoint_saturation < s.release_at else 0)
        self.calm[node] = calm
        if calm < s.calm_ticks or seen.at_risk is not None:  # never lift a hold the node's risk still needs
            return NOTHING
        self.applied[node] = False
        return Finding(proposals=(
            Proposal(HeadroomPayload(units=0), f"demand fell below {s.release_at} for {calm} ticks: watermark released"),
            Proposal(BatchCapPayload(tokens=0), "storm over: token budget restored"),
            Proposal(ReleasePayload(), "storm over: long prompts released"),
        ))

    def restart(self, node: str) -> None:
        self.applied.pop(node, None)

    def forget(self, node: str) -> None:
        for table in (self.window, self.applied, self.calm):
            table.pop(node, None)
