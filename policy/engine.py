"""The policy engine: one tick (with its prediction) and the node's budget in, signed commands out.

Per tick and node:

1. ``ModeTracker.observe`` may switch the node between DEFAULT and EMERGENCY.
2. The mode's strategy decides whether to look at all now (timing: sync = every tick,
   async = once per scan interval, predictive = every tick but only on the forecast) and whether
   its trigger fires (``trigger_reason``). EMERGENCY acts on every tick, evicts whole requests
   picked by recovery cost, and holds a larger admission headroom (its U_kv target is lower).
3. Independent of the strategy, the signal guards (``policy.guards.structural``) look at the
   KV layer's free space: the contiguity forecast (a risk) and the structural guard (a cause to
   compact: the fragmentation OOM about to happen, a scattered free space, or F_ext above the
   fragmentation budget's line while the budget runs low).
4. ``planner.plan`` says how much to free and from whom; the engine turns the plan into
   commands with idempotency ids derived from (node, tick time, action, position), signed.
5. The acting guards propose what the plan does not: the admission hold
   (``policy.guards.headroom``: while the node is busy or at risk, hold back from admission what
   the strategy wants free, and room for the largest prompt seen) and the allocator guard
   (``policy.guards.batch_cap``: cap the per-step token budget under caching-allocator pressure).

Guards are small units that each own their per-node state, run in the order of one table
(``policy.guards.registry``; protocol in ``policy.guards.base``). A restarted node (a newer producer
epoch) has each guard's ``restart`` called, a forgotten one each guard's ``forget``.

Canary rollout (``policy.canary``, off by default): with a ``Canary`` the strategy is per node,
``strategy_for(mode, node)``: the candidate on the candidate's nodes in the canary's mode, the
control everywhere else; without one every node runs the mode's strategy, as before.

Pure and deterministic: time is the tick's event time, no clock, no I/O. The service shell
(``policy.service``) feeds it ticks from the bus and publishes what it returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from kvguard.contracts.commands import (
    Action,
    Command,
    CompactPayload,
    EvictPayload,
    Mode,
    Payload,
    ReclaimPayload,
    Target,
    command_id,
    sign,
)
from kvguard.contracts.tick import Tick
from kvguard.contracts.units import NS_PER_S
from kvguard.policy.canary import Canary
from kvguard.policy.guards.base import Guard, Observation, Phase, Placement, Proposal
from kvguard.policy.guards.headroom import AdmissionHeadroom
from kvguard.policy.guards.registry import GUARDS
from kvguard.policy.modes import ModeChange, ModeConfig, ModeTracker
from kvguard.policy.planner import CostModel, NodeView, Plan, PlannerConfig, plan, view_from_tick
from kvguard.policy.strategy import DEFAULT, EMERGENCY, Strategy, Timing, Trigger


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
    unit_tokens: int = 4
    engine_reserve_units: int = 0  # what the engine keeps free by itself (watermark + one step's workspace)
    use_headroom: bool = True
    headroom_from_u_kv: float = 0.5  # a busy node holds headroom already; 1.0: only when at risk
    headroom_calm_ticks: int = 30  # sticky: a late hold (lagging bus) costs more than a long one
    headroom_refresh_s: float = 60.0  # re-send the current hold this often (acks may be lost)
    prompt_headroom: bool = True  # size the hold by the largest prompt seen (see the module docstring)
    prompt_horizon_s: float = 900.0  # how long a seen prompt size counts
    prompt_safety_runs: float = 1.0  # run requirements left free after the largest prompt lands
    max_headroom_frac: float = 0.45  # never hold back more than this share of D
    allocator_guard: bool = False  # vLLM-engine profiles: cap the token budget on allocator pressure
    batch_cap_tokens: int = 0  # the cap (tokens per step); 0 turns the guard off
    batch_cap_calm_ticks: int = 60  # ticks without allocator pressure before the cap is released
    # whether P(OOM) at the strategy's threshold counts as allocator pressure (off on vLLM profiles:
    # no model predicts their OOMs, and its false alarms cost SLO attainment; see README "Figures")
    batch_cap_on_prediction: bool = True
    max_nodes: int = 10_000  # per-node state held; past it the least recently seen node is evicted
    max_epoch_jump: int = 1 << 61  # a tick of an epoch further ahead is rejected, not a restart


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
    stale: bool = False
    rejected: bool = False  # not a tick to decide on (its epoch jumped too far): dead-letter it


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
    headroom_commands: int = 0
    batch_cap_commands: int = 0
    stale_ticks: int = 0  # duplicate or out-of-order ticks skipped (a redelivery after recovery)
    restarts: int = 0  # ticks of a newer producer epoch: the node restarted, its policy state started over
    epoch_jumps_rejected: int = 0  # ticks whose epoch was more than max_epoch_jump ahead of the node's
    epochs_retracted: int = 0  # a newer epoch seen on one tick only, then the older one again: taken back
    nodes_evicted_cap: int = 0  # least recently seen nodes dropped to stay within max_nodes
    nodes_evicted_idle: int = 0  # nodes dropped by the service after its idle timeout (``forget``)

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


class PolicyEngine:
    def __init__(self, config: EngineConfig, secret: bytes, canary: Canary | None = None, *,
                 guards: Sequence[type[Guard]] = GUARDS) -> None:
        self.config = config
        self.secret = secret
        self.canary = canary
        self.modes = ModeTracker(config.modes)
        self.counters = EngineCounters()
        self._last_scan_ns: dict[str, int] = {}
        self._recent: dict[str, dict[int, int]] = {}
        self._last_ts: dict[str, int] = {}  # node -> ts_ns of the last tick decided on (least recent first)
        self._epoch: dict[str, int] = {}  # node -> producer epoch of the last tick decided on
        self._confirmed: dict[str, bool] = {}  # node -> its epoch was seen on a second tick
        # the guards (policy.guards.registry), each with its own per-node state
        self.guards: tuple[Guard, ...] = tuple(cls(config) for cls in guards)
        self._by_name: dict[str, Guard] = {g.name: g for g in self.guards}
        if len(self._by_name) != len(self.guards):
            raise ValueError(f"policy guards registered twice: {[g.name for g in self.guards]}")
        # the hold's helpers below answer from the registered one (a table without it: one never run)
        self._headroom_guard = next((g for g in self.guards if isinstance(g, AdmissionHeadroom)), None) or \
            AdmissionHeadroom(config)

    def guard(self, name: str) -> Guard:
        """This engine's instance of the registered guard ``name`` (KeyError: none registered)."""
        return self._by_name[name]

    @property
    def _held(self) -> dict[str, tuple[int, int]]:  # the admission hold's per-node state
        return self._headroom_guard.held

    @property
    def _calm(self) -> dict[str, int]:
        return self._headroom_guard.calm

    def strategy_for(self, mode: Mode, node: str | None = None) -> Strategy:
        """The mode's strategy; with a canary and a node, the one the canary gives that node."""
        control = self.config.emergency if mode is Mode.EMERGENCY else self.config.default
        if self.canary is None or node is None:
            return control
        return self.canary.strategy_for(mode, node, control)

    def decide(self, tick: Tick | NodeView, *, budget_remaining_frac: float | None = None) -> Decision:
        """Commands for one tick of one node. ``tick``: a ``Tick`` (``kvguard.contracts.tick``) or a ``NodeView``.

        Ticks are ordered per node by (producer epoch, ts_ns). A tick at or before the node's
        last decided tick (a redelivered duplicate, or an older tick replayed after a consumer
        recovery), or of an older epoch, is skipped and counted in ``stale_ticks``: it would move
        the mode tracker's dwell time and the scan clock backwards and count the same rise or
        calm tick twice. Its decision carries no commands and ``stale=True``. A tick of a newer
        epoch is a restarted node (its clock may start over at 0): the node's policy state
        (mode, last tick, scan clock, recent victims, admission hold) starts over, counted in
        ``restarts``. A newer epoch seen on one tick only, followed by a tick of the older one, was
        bogus (one record must not silence a node): it is taken back (``epochs_retracted``) and the
        node goes on in the older epoch. A ``NodeView`` carries no epoch: it is taken as the node's
        current one.
        """
        view = tick if isinstance(tick, NodeView) else view_from_tick(
            tick, dynamic_units=self.config.dynamic_units, unit_tokens=self.config.unit_tokens)
        epoch = _epoch_of(tick)
        known = self._epoch.get(view.node)
        if epoch is None:
            epoch = 0 if known is None else known
        if known is not None and epoch - known > self.config.max_epoch_jump:
            self.counters.epoch_jumps_rejected += 1
            mode = self.modes.mode(view.node)
            return Decision(view.node, view.ts_ns, mode, self.strategy_for(mode, view.node).variant,
                            stale=True, rejected=True,
                            reason=f"epoch {epoch} is {epoch - known} past the node's epoch {known}, more than "
                                   f"policy.max_epoch_jump ({self.config.max_epoch_jump}): not taken as a restart")
        if known is not None and epoch < known and not self._confirmed.get(view.node, True):
            # the newer epoch was seen on one tick only and an older one goes on: that tick was bogus
            # (one record must not silence a node); start over on the older epoch
            self.counters.epochs_retracted += 1
            self._restart(view.node, count=False)
            known = None
        if known is not None and epoch > known:
            self._restart(view.node)
        self._confirmed[view.node] = known is not None and epoch == known
        last = self._last_ts.get(view.node)
        older_epoch = known is not None and epoch < known
        if older_epoch or (last is not None and view.ts_ns <= last):
            self.counters.stale_ticks += 1
            mode = self.modes.mode(view.node)
            why = (f"stale tick: epoch {epoch} < current {known}" if older_epoch
                   else f"stale tick: ts_ns {view.ts_ns} <= last decided {last}")
            return Decision(view.node, view.ts_ns, mode, self.strategy_for(mode, view.node).variant, reason=why,
                            stale=True)
        self._epoch[view.node] = epoch
        self._last_ts.pop(view.node, None)
        self._last_ts[view.node] = view.ts_ns
        while len(self._last_ts) > self.config.max_nodes:
            self.forget(next(iter(self._last_ts)), idle=False)
        self.counters.ticks += 1
        change = self.modes.observe(view)
        if change:
            self.counters.mode_changes += 1
        mode = self.modes.mode(view.node)
        strategy = self.strategy_for(mode, view.node)
        decision = Decision(view.node, view.ts_ns, mode, strategy.variant, mode_change=change)
        seen = Observation(view, mode, strategy, budget_remaining_frac)
        risk = guard = None
        for signal in self.guards:
            if signal.phase is Phase.SIGNAL:
                found = signal.observe(seen)
                risk, guard = risk or found.risk, guard or found.cause
        trigger = trigger_reason(view, strategy, self.config.forecast_step_s, risk) if self._due(view, strategy) else None
        reason = trigger or guard
        the_plan = Plan()
        if reason is not None:
            self.counters.triggered += 1
            recent = self._recent_victims(view)
            # a cause alone compacts (and frees only a shortfall of free space); a trigger also
            # brings U_kv and the trajectory back under the strategy's targets
            the_plan = plan(view, strategy, self.config.planner, self.config.cost, reason=reason,
                            exclude=frozenset(recent), relieve=trigger is not None)
            self.counters.priority_defaulted += the_plan.priority_defaulted
            if the_plan.units_needed and not the_plan.victims and the_plan.notes:
                self.counters.no_candidate += 1
            for victim in the_plan.victims:
                recent[victim.req] = view.ts_ns
        at_risk = reason or risk or (f"{view.ooms} OOM(s) in the last tick" if view.ooms else None) or (
            "emergency mode" if mode is Mode.EMERGENCY else None) or (
            f"busy: u_kv {view.u_kv:.2f} >= {self.config.headroom_from_u_kv}"
            if view.u_kv >= self.config.headroom_from_u_kv else None)
        decision.reason, decision.plan = at_risk, the_plan
        seen = replace(seen, risk=risk, reason=reason, at_risk=at_risk, plan=the_plan)
        before: list[Proposal] = []
        after: list[Proposal] = []
        for acting in self.guards:
            if acting.phase is Phase.ACT:
                found = acting.observe(seen)
                (before if acting.placement is Placement.BEFORE_PLAN else after).extend(found.proposals)
        decision.commands = self._commands(view, strategy, mode, the_plan, at_risk or "pressure fell", epoch,
                                           before=before, after=after)
        if any(c.action not in (Action.HEADROOM, Action.BATCH_CAP) for c in decision.commands):
            self.modes.note_action(view.node, view.ts_ns)
        return decision

    def forget(self, node: str, *, idle: bool = True) -> bool:
        """Drop everything the engine holds of a node (idle: the caller's timeout; else the cap).
        Its next tick is decided as its first. False when the node was not held."""
        if node not in self._last_ts and node not in self._epoch:
            return False
        self._restart(node, count=False)
        self._epoch.pop(node, None)
        self._confirmed.pop(node, None)
        for g in self.guards:
            g.forget(node)
        if idle:
            self.counters.nodes_evicted_idle += 1
        else:
            self.counters.nodes_evicted_cap += 1
        return True

    def _restart(self, node: str, *, count: bool = True) -> None:
        """Forget a restarted node's policy state: its new run starts in DEFAULT mode, on a new
        clock, with no hold in place on its fresh engine."""
        self.counters.restarts += count
        self.modes.forget(node)
        for per_node in (self._last_ts, self._last_scan_ns, self._recent):
            per_node.pop(node, None)
        for g in self.guards:
            g.restart(node)

    def headroom_units(self, mode: Mode, node: str | None = None) -> int:
        """The admission hold in ``mode`` (on ``node``'s strategy): ``(1 - target_u_kv)`` of D free,
        or room for the largest prompt seen (plus one run requirement) when that is more, capped."""
        return self._headroom_guard.hold_units(self.strategy_for(mode, node).target_u_kv)

    def prompt_hold_units(self) -> int:
        """The hold that lets the largest prompt seen land whole with one run requirement to
        spare (0 when off or nothing seen), capped at ``max_headroom_frac`` of D."""
        return self._headroom_guard.prompt_hold_units()

    def largest_prompt_units(self) -> int:
        """The largest prompt (units) seen within ``prompt_horizon_s`` (0: none yet)."""
        return self._headroom_guard.largest_prompt_units()

    # -- when to act -------------------------------------------------------------------------

    def _due(self, view: NodeView, strategy: Strategy) -> bool:
        if strategy.timing is not Timing.ASYNC:
            return True
        last = self._last_scan_ns.get(view.node)
        if last is not None and view.ts_ns - last < strategy.scan_interval_s * NS_PER_S:
            return False
        self._last_scan_ns[view.node] = view.ts_ns
        return True

    # -- what to send ------------------------------------------------------------------------

    def _commands(self, view: NodeView, strategy: Strategy, mode: Mode, the_plan: Plan, reason: str,
                  epoch: int = 0, *, before: list[Proposal] = (), after: list[Proposal] = ()) -> list[Command]:
        ttl_ns = int(self.config.command_ttl_s * NS_PER_S)
        common = dict(node=view.node, reason=reason, mode=mode, variant=strategy.variant,
                      issued_at_ns=view.ts_ns, ttl_ns=ttl_ns, epoch=epoch)
        payloads: list[tuple[Payload, str]] = [(p.payload, p.reason) for p in before]
        if the_plan.compact_moves:
            payloads.append((CompactPayload(max_moves=the_plan.compact_moves), reason))
        if the_plan.reclaim_units:
            payloads.append((ReclaimPayload(units=the_plan.reclaim_units), reason))
        if the_plan.victims:
            targets = tuple(Target(v.req, v.units) for v in the_plan.victims)
            payloads.append((EvictPayload(targets, granularity=strategy.granularity, handling=strategy.handling),
                             reason))
        # last: the plan's actions keep their positions (and ids) on every profile
        payloads.extend((p.payload, p.reason) for p in after)
        drafts = [Command(id="", payload=payload, **(common | {"reason": why})) for payload, why in payloads]
        out = []
        # a restarted node's clock starts over: its epoch keeps its ids apart from the old run's
        # (which its actuator's journal may still hold); epoch 0 keeps the plain (node, ts) ids
        id_node = f"{view.node}#{epoch}" if epoch else view.node
        for position, draft in enumerate(drafts):
            cid = command_id(id_node, view.ts_ns, draft.action, position)
            cmd = sign(replace(draft, id=cid), self.secret)
            out.append(cmd)
            self.counters.commands += 1
            if cmd.action is Action.EVICT:
                self.counters.evict_commands += 1
                self.counters.victims += len(cmd.payload.targets)
            elif cmd.action is Action.COMPACT:
                self.counters.compact_commands += 1
            elif cmd.action is Action.HEADROOM:
                self.counters.headroom_commands += 1
            elif cmd.action is Action.BATCH_CAP:
                self.counters.batch_cap_commands += 1
            elif cmd.action is Action.RECLAIM:
                self.counters.reclaim_commands += 1
        return out

    def _recent_victims(self, view: NodeView) -> dict[int, int]:
        recent = self._recent.setdefault(view.node, {})
        horizon = view.ts_ns - int(self.config.recent_victim_s * NS_PER_S)
        for req in [r for r, ts in recent.items() if ts < horizon]:
            del recent[req]
        return recent


def _epoch_of(tick: Tick | NodeView) -> int | None:
    """The producer epoch a tick carries; None for a ``NodeView``, which has none."""
    return None if isinstance(tick, NodeView) else tick.epoch


def trigger_reason(view: NodeView, strategy: Strategy, forecast_step_s: float,
                   risk: str | None = None) -> str | None:
    """Why the strategy's trigger fires on this view, or None.

    hard: U_kv above the threshold. soft: U_kv above the threshold *and* the prediction agrees
    (``risk``: the tick's own contiguity forecast, or the LSTM forecast crossing the threshold),
    or P(OOM) from the LSTM alone. fragmentation: F_ext above ``f_ext_trigger`` on the KV layer, or
    on the caching allocator's (``alloc_f_ext``) when the node reports one. With predictive
    timing only the forecast within the horizon (or P(OOM)) triggers, and U_kv past 0.95 as a
    last resort.
    """
    th = strategy.threshold
    if strategy.trigger is Trigger.FRAGMENTATION:
        line = strategy.f_ext_trigger
        if view.f_ext > line and view.free_units > 0:
            return f"f_ext {view.f_ext:.2f} > {line}"
        if view.alloc_reserved_bytes and view.alloc_f_ext > line:
            return f"allocator f_ext {view.alloc_f_ext:.2f} > {line}"
        return None
    if view.p_oom is not None and strategy.use_prediction and view.p_oom >= strategy.p_oom_threshold:
        return f"P(OOM in 5 min) {view.p_oom:.2f} >= {strategy.p_oom_threshold}"
    forecast = view.u_kv_forecast
    if strategy.timing is Timing.PREDICTIVE:
        forecast = forecast[: max(1, int(strategy.predictive_horizon_s // forecast_step_s))]
        if forecast and max(forecast) > th:
            return f"forecast u_kv {max(forecast):.3f} > {th} within {strategy.predictive_horizon_s:g} s"
        if view.u_kv > max(th, 0.95):
            return f"u_kv {view.u_kv:.3f} past the hard line"
        return None
    if view.u_kv <= th:
        return None
    if strategy.trigger is Trigger.HARD or not strategy.use_prediction:
        return f"u_kv {view.u_kv:.3f} > {th}"
    if forecast and max(forecast) > th:
        return f"u_kv {view.u_kv:.3f} > {th} and forecast {max(forecast):.3f}"
    if risk:
        return f"u_kv {view.u_kv:.3f} > {th} and {risk}"
    return None
