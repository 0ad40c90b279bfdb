"""The policy engine: one tick (with its prediction) and the node's budget in, signed commands out.

Per tick and node:

1. ``ModeTracker.observe`` may switch the node between DEFAULT and EMERGENCY.
2. The mode's strategy decides whether to look at all now (timing: sync = every tick,
   async = once per scan interval, predictive = every tick but only on the forecast) and whether
   its trigger fires. In EMERGENCY the DEFAULT trigger still applies too: escalation makes the
   engine act sooner and harder, never later.
3. Independent of the strategy, a structural guard fires when the largest free run is shorter
   than one full engine step needs (its workspace buffer and a largest-class page): that is the
   fragmentation OOM about to happen, and compaction is cheap. When the node's fragmentation
   budget is running low, F_ext above the budget's line triggers compaction as well.
4. ``planner.plan`` says how much to free and from whom; the engine turns the plan into
   commands with idempotency ids derived from (node, tick time, action, position), signed.

Pure and deterministic: time is the tick's event time, no clock, no I/O. The service shell
(``policy.service``) feeds it ticks from the bus and publishes what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from policy.commands import Action, Command, Mode, Target, command_id, sign
from policy.modes import ModeChange, ModeConfig, ModeTracker
from policy.planner import CostModel, NodeView, Plan, PlannerConfig, plan, view_from_tick
from policy.strategy import DEFAULT, EMERGENCY, Strategy, Timing, Trigger

NS = 1_000_000_000


@dataclass(slots=True, frozen=True)
class EngineConfig:
    default: Strategy = DEFAULT
    emergency: Strategy = EMERGENCY
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    cost: CostModel = field(default_factory=CostModel)
    modes: ModeConfig = field(default_factory=ModeConfig)
    command_ttl_s: float = 30.0
    recent_victim_s: float = 25.0  # a request targeted this recently is not targeted again
    forecast_step_s: float = 30.0  # spacing of the u_kv_forecast points
    budget_low_frac: float = 0.25
    budget_f_ext: float = 0.5  # the budget debits seconds above this F_ext
    dynamic_units: int | None = None  # D when the ticks do not carry it


@dataclass(slots=True)
class Decision:
    node: str
    ts_ns: int
    mode: Mode
    variant: str
    reason: str | None = None
    plan: Plan | None = None
    commands: list[Command] = field(default_factory=list)
    mode_change: ModeChange | None = None


@dataclass(slots=True)
class EngineCounters:
    ticks: int = 0
    triggered: int = 0
    commands: int = 0
    evict_commands: int = 0
    compact_commands: int = 0
    reclaim_commands: int = 0
    victims: int = 0
    priority_defaulted: int = 0
    mode_changes: int = 0
    no_candidate: int = 0

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


class PolicyEngine:
    def __init__(self, config: EngineConfig, secret: bytes) -> None:
        self.config = config
        self.secret = secret
        self.modes = ModeTracker(config.modes)
        self.counters = EngineCounters()
        self._last_scan_ns: dict[str, int] = {}
        self._recent: dict[str, dict[int, int]] = {}

    def strategy_for(self, mode: Mode) -> Strategy:
        return self.config.emergency if mode is Mode.EMERGENCY else self.config.default

    def decide(self, tick: Any, *, budget_remaining_frac: float | None = None) -> Decision:
        """Commands for one tick of one node. ``tick``: a ``streams.metrics.Tick`` or a ``NodeView``."""
        view = tick if isinstance(tick, NodeView) else view_from_tick(
            tick, dynamic_units=self.config.dynamic_units)
        self.counters.ticks += 1
        change = self.modes.observe(view)
        if change:
            self.counters.mode_changes += 1
        mode = self.modes.mode(view.node)
        strategy = self.strategy_for(mode)
        decision = Decision(view.node, view.ts_ns, mode, strategy.variant, mode_change=change)
        reason = self._reason(view, strategy, mode, budget_remaining_frac)
        if reason is None:
            return decision
        self.counters.triggered += 1
        recent = self._recent_victims(view)
        the_plan = plan(view, strategy, self.config.planner, self.config.cost, reason=reason,
                        exclude=frozenset(recent))
        decision.reason, decision.plan = reason, the_plan
        self.counters.priority_defaulted += the_plan.priority_defaulted
        if the_plan.units_needed and not the_plan.victims and the_plan.notes:
            self.counters.no_candidate += 1
        decision.commands = self._commands(view, strategy, mode, the_plan)
        if decision.commands:
            self.modes.note_action(view.node, view.ts_ns)
            for victim in the_plan.victims:
                recent[victim.req] = view.ts_ns
        return decision

    # -- when to act -------------------------------------------------------------------------

    def _reason(self, view: NodeView, strategy: Strategy, mode: Mode,
                budget_remaining_frac: float | None) -> str | None:
        guard = self._structural_guard(view, budget_remaining_frac)
        if guard:
            return guard
        if not self._due(view, strategy):
            return None
        reason = trigger_reason(view, strategy, self.config.forecast_step_s)
        if reason is None and mode is Mode.EMERGENCY:
            reason = trigger_reason(view, self.config.default, self.config.forecast_step_s)
        return reason

    def _structural_guard(self, view: NodeView, budget_remaining_frac: float | None) -> str | None:
        required = self.config.planner.required_run_units
        if required and view.largest_free_run_units < required * (1 + self.config.planner.run_margin):
            return (f"largest free run {view.largest_free_run_units} < "
                    f"{required * (1 + self.config.planner.run_margin):.0f} units one full step needs")
        if (budget_remaining_frac is not None and budget_remaining_frac <= self.config.budget_low_frac
                and view.f_ext > self.config.budget_f_ext):
            return (f"fragmentation budget low ({budget_remaining_frac:.0%} left) and "
                    f"f_ext {view.f_ext:.2f} > {self.config.budget_f_ext}")
        return None

    def _due(self, view: NodeView, strategy: Strategy) -> bool:
        if strategy.timing is not Timing.ASYNC:
            return True
        last = self._last_scan_ns.get(view.node)
        if last is not None and view.ts_ns - last < strategy.scan_interval_s * NS:
            return False
        self._last_scan_ns[view.node] = view.ts_ns
        return True

    # -- what to send ------------------------------------------------------------------------

    def _commands(self, view: NodeView, strategy: Strategy, mode: Mode, the_plan: Plan) -> list[Command]:
        ttl_ns = int(self.config.command_ttl_s * NS)
        common = dict(node=view.node, granularity=strategy.granularity, handling=strategy.handling,
                      reason=the_plan.reason, mode=mode, variant=strategy.variant,
                      issued_at_ns=view.ts_ns, ttl_ns=ttl_ns)
        drafts: list[Command] = []
        if the_plan.compact_moves:
            drafts.append(Command(id="", action=Action.COMPACT, targets=(), max_moves=the_plan.compact_moves,
                                  **common))
        if the_plan.reclaim_units:
            drafts.append(Command(id="", action=Action.RECLAIM, targets=(),
                                  units_needed=the_plan.reclaim_units, **common))
        if the_plan.victims:
            targets = tuple(Target(v.req, v.units) for v in the_plan.victims)
            drafts.append(Command(id="", action=Action.EVICT, targets=targets,
                                  units_needed=the_plan.units_needed, **common))
        out = []
        for position, draft in enumerate(drafts):
            cid = command_id(view.node, view.ts_ns, draft.action, position)
            cmd = sign(replace(draft, id=cid), self.secret)
            out.append(cmd)
            self.counters.commands += 1
            if cmd.action is Action.EVICT:
                self.counters.evict_commands += 1
                self.counters.victims += len(cmd.targets)
            elif cmd.action is Action.COMPACT:
                self.counters.compact_commands += 1
            else:
                self.counters.reclaim_commands += 1
        return out

    def _recent_victims(self, view: NodeView) -> dict[int, int]:
        recent = self._recent.setdefault(view.node, {})
        horizon = view.ts_ns - int(self.config.recent_victim_s * NS)
        for req in [r for r, ts in recent.items() if ts < horizon]:
            del recent[req]
        return recent


def trigger_reason(view: NodeView, strategy: Strategy, forecast_step_s: float) -> str | None:
    """Why the strategy's trigger fires on this view, or None."""
    th = strategy.threshold
    if strategy.trigger is Trigger.FRAGMENTATION:
        if view.f_ext > th and view.free_units > 0:
            return f"f_ext {view.f_ext:.2f} > {th}"
        return None
    if strategy.timing is not Timing.PREDICTIVE or strategy.trigger is Trigger.HARD:
        if view.u_kv > th:
            return f"u_kv {view.u_kv:.3f} > {th}"
        if view.psi >= th:
            return f"psi {view.psi:.3f} >= {th}"
    elif view.u_kv > max(th, 0.95) or view.psi >= 1.0:
        return f"u_kv {view.u_kv:.3f} / psi {view.psi:.3f} past the hard line"
    if strategy.trigger is Trigger.SOFT and strategy.use_prediction:
        if view.p_oom is not None and view.p_oom >= strategy.p_oom_threshold:
            return f"P(OOM in 5 min) {view.p_oom:.2f} >= {strategy.p_oom_threshold}"
        horizon = view.u_kv_forecast
        if strategy.timing is Timing.PREDICTIVE:
            horizon = horizon[: max(1, int(strategy.predictive_horizon_s // forecast_step_s))]
        if horizon and max(horizon) > th:
            return f"forecast u_kv {max(horizon):.3f} > {th}"
    return None
