"""The allocator guard (``batch_cap`` command): cap the per-step token budget under allocator pressure.

On by ``allocator_guard`` (vLLM-engine profiles) with ``batch_cap_tokens`` > 0. A CUDA OOM on such a
node comes from PyTorch's caching allocator, not from the KV blocks (a KV shortage preempts), and its
transient peak grows with the tokens of one step (activations, and the logits of requests asking for
prompt logprobs, which vLLM's profiling run does not count: vllm#5907). When the node shows allocator
pressure (an OOM, a malloc retried after releasing cached blocks: ``alloc_retries``, or, with
``batch_cap_on_prediction``, P(OOM) at the strategy's threshold) the guard caps the per-step token
budget at ``batch_cap_tokens`` (vLLM's ``max_num_batched_tokens``, lowered between steps by the
plugin) and releases it after ``batch_cap_calm_ticks`` ticks without pressure. A held cap is re-sent
every ``headroom_refresh_s`` (acks may be lost).

State: per node the cap sent and when (dropped when the node restarts: its fresh engine runs
uncapped), and the ticks since allocator pressure, kept over a restart (an OOM restarts the node), so
the cap is re-sent to the fresh engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from kvguard.contracts.commands import BatchCapPayload
from kvguard.contracts.units import NS_PER_S
from kvguard.policy.guards.base import NOTHING, Finding, Observation, Phase, Placement, Proposal

if TYPE_CHECKING:
    from kvguard.policy.engine import EngineConfig


class BatchCap:
    name: ClassVar[str] = "batch_cap"
    phase: ClassVar[Phase] = Phase.ACT
    placement: ClassVar[Placement] = Placement.AFTER_PLAN

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.sent: dict[str, tuple[int, int]] = {}  # node -> (cap sent, ts_ns it was sent); not sent: absent
        self.calm: dict[str, int] = {}  # node -> ticks since allocator pressure (kept over restarts)

    def observe(self, seen: Observation) -> Finding:
        cfg, view, strategy = self.config, seen.view, seen.strategy
        if not (cfg.allocator_guard and cfg.batch_cap_tokens > 0):
            return NOTHING
        pressure = None
        if view.ooms:
            pressure = f"{view.ooms} allocator OOM(s) in the last tick"
        elif view.alloc_retries:
            pressure = f"{view.alloc_retries} allocator retries (cached blocks released to serve a malloc)"
        elif (cfg.batch_cap_on_prediction and view.p_oom is not None and strategy.use_prediction
              and view.p_oom >= strategy.p_oom_threshold):
            pressure = f"P(OOM in 5 min) {view.p_oom:.2f} >= {strategy.p_oom_threshold}"
        calm = 0 if pressure else self.calm.get(view.node, cfg.batch_cap_calm_ticks) + 1
        self.calm[view.node] = calm
        want = cfg.batch_cap_tokens if calm < cfg.batch_cap_calm_ticks else 0
        sent = self.sent.get(view.node)
        stale = sent is not None and sent[0] and view.ts_ns - sent[1] >= cfg.headroom_refresh_s * NS_PER_S
        if (sent is None and not want) or (sent is not None and sent[0] == want and not stale):
            return NOTHING
        self.sent[view.node] = (want, view.ts_ns)
        why = pressure or (f"allocator pressure {calm} tick(s) ago" if want else
                           f"{calm} ticks without allocator pressure: cap released")
        return Finding(proposals=(Proposal(BatchCapPayload(tokens=want), f"token budget {want or 'restored'}: {why}"),))

    def restart(self, node: str) -> None:
        self.sent.pop(node, None)

    def forget(self, node: str) -> None:
        self.sent.pop(node, None)
        self.calm.pop(node, None)
