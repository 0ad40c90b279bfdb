"""The admission hold (``headroom`` command): keep back from admission what the mode's strategy wants free.

An engine admits (and re-admits evicted requests) as soon as its free-space count allows, and fills
its KV region to its own small watermark; within one tick the running requests' growth then takes
the last free units, and a step's workspace finds no contiguous run: the fragmentation OOM, and
after it the restart backlog that makes the next one likelier. So while a node is busy (U_kv ≥
``headroom_from_u_kv``) or at risk (any trigger, a signal guard's risk, EMERGENCY, an OOM) the guard
asks the node to hold back from admission what the strategy wants free: ``(1 - target_u_kv)·D``
minus the engine's own reserve (``engine_reserve_units``). The strategy's U_kv target is thereby
enforced where the memory is handed out, instead of by evicting the same requests again every tick.
After ``headroom_calm_ticks`` calm ticks the hold is released. It is a level, not a delta, so a
repeated or reordered command does no harm; it is re-sent every ``headroom_refresh_s`` (acks may be
lost).

The engine's admission check looks only at a request's first prefill chunk; a long prompt admitted
into a node with less free space than the whole prompt then fills the node during its own prefill,
and the next step's workspace finds no contiguous run. So the hold is at least the largest prompt
seen on any node within ``prompt_horizon_s`` (from the candidates' ``prompt_tokens``) plus
``prompt_safety_runs`` run requirements, minus the engine's own reserve, capped at
``max_headroom_frac`` of D: whatever the engine admits then still fits whole, with one step's
workspace to spare. The size is learnt from the traffic, not from a constant. This part of the hold
is not released on calm ticks (only when the prompt ages out of the horizon): the burst it guards
against lands on a calm node within one tick, and on a calm node it costs nothing, since admission
only feels it once the node is past the hold (docs/RESULTS.md, "Policy guards").

State: per node the units held and when they were sent, and the calm-tick count (both dropped when
the node restarts: its fresh engine holds nothing); fleet-wide the largest prompt per minute of
event time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from kvguard.contracts.commands import HeadroomPayload
from kvguard.contracts.units import NS_PER_S
from kvguard.policy.guards.base import NOTHING, Finding, Observation, Phase, Placement, Proposal
from kvguard.policy.planner import NodeView

if TYPE_CHECKING:
    from kvguard.policy.engine import EngineConfig


class AdmissionHeadroom:
    name: ClassVar[str] = "headroom"
    phase: ClassVar[Phase] = Phase.ACT
    placement: ClassVar[Placement] = Placement.BEFORE_PLAN  # first: its command keeps position 0

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.held: dict[str, tuple[int, int]] = {}  # node -> (units held, ts_ns of the last command)
        self.calm: dict[str, int] = {}
        self.prompt_max: dict[int, int] = {}  # minute of event time -> largest prompt seen (units)

    def observe(self, seen: Observation) -> Finding:
        self._note_prompts(seen.view)
        units = self._hold(seen.view, seen.strategy.target_u_kv, seen.at_risk)
        if units is None:
            return NOTHING
        return Finding(proposals=(Proposal(HeadroomPayload(units=units), seen.at_risk or "pressure fell"),))

    def restart(self, node: str) -> None:
        self.held.pop(node, None)
        self.calm.pop(node, None)

    def forget(self, node: str) -> None:
        self.restart(node)

    def hold_units(self, target_u_kv: float) -> int:
        """The hold at a strategy's U_kv target: ``(1 - target_u_kv)`` of D free, or room for the
        largest prompt seen (plus one run requirement) when that is more, capped."""
        d = self.config.dynamic_units or 0
        return max(int((1.0 - target_u_kv) * d) - self.config.engine_reserve_units, self.prompt_hold_units())

    def prompt_hold_units(self) -> int:
        """The hold that lets the largest prompt seen land whole with one run requirement to
        spare (0 when off or nothing seen), capped at ``max_headroom_frac`` of D."""
        if not (self.config.prompt_headroom and self.prompt_max):
            return 0
        d = self.config.dynamic_units or 0
        required = self.config.planner.required_run_units
        by_prompt = max(self.prompt_max.values()) + int(self.config.prompt_safety_runs * required)
        return max(0, min(by_prompt, int(self.config.max_headroom_frac * d)) - self.config.engine_reserve_units)

    def largest_prompt_units(self) -> int:
        return max(self.prompt_max.values(), default=0)

    def _note_prompts(self, view: NodeView) -> None:
        minute = view.ts_ns // (60 * NS_PER_S)
        horizon = int(self.config.prompt_horizon_s // 60)
        for old in [m for m in self.prompt_max if m < minute - horizon]:
            del self.prompt_max[old]
        unit = max(1, self.config.unit_tokens)
        largest = max((-(-c.prompt_tokens // unit) for c in view.candidates), default=0)
        if largest > self.prompt_max.get(minute, 0):
            self.prompt_max[minute] = largest

    def _hold(self, view: NodeView, target_u_kv: float, risk: str | None) -> int | None:
        """The admission hold to command now, or None to leave it as it is."""
        if not self.config.use_headroom or not self.config.dynamic_units:
            return None
        held, last_ns = self.held.get(view.node, (0, view.ts_ns))
        if risk:
            self.calm[view.node] = 0
            want = self.hold_units(target_u_kv)
        else:
            self.calm[view.node] = self.calm.get(view.node, 0) + 1
            # calm: the strategy's part is released; the prompt-sized part stays, since the
            # burst it guards against lands on a calm node within one tick
            want = self.prompt_hold_units() if self.calm[view.node] >= self.config.headroom_calm_ticks else held
        stale = view.ts_ns - last_ns >= self.config.headroom_refresh_s * NS_PER_S
        if want == held and not (held and stale):
            return None
        self.held[view.node] = (want, view.ts_ns)
        return want
