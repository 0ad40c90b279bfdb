"""Signal guards on the KV layer's free space: the contiguity forecast and the structural guard.

* ``ContiguityRisk`` (a risk): will the next full engine step find one contiguous run? Its need is
  the planner's ``required_run_units`` (one step's workspace buffer and a largest-class page) with
  ``run_margin`` on top; queued prefills count against the free space they will take.
* ``StructuralGuard`` (a cause): fires when the largest free run is shorter than that need (the
  fragmentation OOM about to happen; compaction is cheap), when it falls under
  ``planner.compact_run_factor`` run requirements while the free space in total is at least that
  (the "fragmentation" trigger of docs/ARCHITECTURE.md "Policy", read on the real need: free space
  suffices, it is only scattered, so the plan compacts and evicts nothing), and, when the node's
  fragmentation budget is running low (``budget_low_frac``), on F_ext above the budget's line
  (``budget_f_ext``).

Both are stateless: pure functions of the tick and the config.
"""

from __future__ import annotations

from typing import ClassVar

from kvguard.policy.guards.base import NOTHING, Finding, Observation, Phase, StatelessGuard
from kvguard.policy.planner import compaction_run_units


class ContiguityRisk(StatelessGuard):
    name: ClassVar[str] = "contiguity"
    phase: ClassVar[Phase] = Phase.SIGNAL

    def observe(self, seen: Observation) -> Finding:
        view = seen.view
        required = self.config.planner.required_run_units
        if not required:
            return NOTHING
        wanted = required * (1 + self.config.planner.run_margin)
        if view.largest_free_run_units < wanted:
            return Finding(risk=f"largest free run {view.largest_free_run_units} < {wanted:.0f} units "
                                "one full step needs")
        room = view.free_units - view.pending_prefill_units
        if room < wanted:
            return Finding(risk=f"queued prefills ({view.pending_prefill_units} units) would leave {room} free "
                                f"units, under the {wanted:.0f} one full step needs")
        return NOTHING


class StructuralGuard(StatelessGuard):
    name: ClassVar[str] = "structural"
    phase: ClassVar[Phase] = Phase.SIGNAL

    def observe(self, seen: Observation) -> Finding:
        view, cfg = seen.view, self.config
        required = cfg.planner.required_run_units
        if required and view.largest_free_run_units < required * (1 + cfg.planner.run_margin):
            return Finding(cause=f"largest free run {view.largest_free_run_units} < "
                                 f"{required * (1 + cfg.planner.run_margin):.0f} units one full step needs")
        compact_below = compaction_run_units(cfg.planner)
        if required and view.largest_free_run_units < compact_below <= view.free_units:
            return Finding(cause=f"fragmented: largest free run {view.largest_free_run_units} < {compact_below} "
                                 f"units ({cfg.planner.compact_run_factor:g}x one full step's need), "
                                 f"{view.free_units} free in total")
        budget = seen.budget_remaining_frac
        if budget is not None and budget <= cfg.budget_low_frac and view.f_ext > cfg.budget_f_ext:
            return Finding(cause=f"fragmentation budget low ({budget:.0%} left) and "
                                 f"f_ext {view.f_ext:.2f} > {cfg.budget_f_ext}")
        return NOTHING
