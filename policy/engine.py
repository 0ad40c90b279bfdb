"""The policy engine: one tick (with its prediction) and the node's budget in, signed commands out.

Per tick and node:

1. ``ModeTracker.observe`` may switch the node between DEFAULT and EMERGENCY.
2. The mode's strategy decides whether to look at all now (timing: sync = every tick,
   async = once per scan interval, predictive = every tick but only on the forecast) and whether
   its trigger fires (``trigger_reason``). EMERGENCY acts on every tick, evicts whole requests
   picked by recovery cost, and holds a larger admission headroom (its U_kv target is lower).
3. Independent of the strategy, a structural guard fires when the largest free run is shorter
   than one full engine step needs (its workspace buffer and a largest-class page): that is the
   fragmentation OOM about to happen, and compaction is cheap. When the node's fragmentation
   budget is running low, F_ext above the budget's line triggers compaction as well.
4. ``planner.plan`` says how much to free and from whom; the engine turns the plan into
   commands with idempotency ids derived from (node, tick time, action, position), signed.
5. Admission headroom: an engine admits (and re-admits evicted requests) as soon as its
   free-space count allows, and fills its KV region to its own small watermark; within one
   10-second tick the running requests' growth then takes the last free units, and a step's
   workspace finds no contiguous run: the fragmentation OOM, and after it the restart backlog
   that makes the next one likelier. So while a node is busy (U_kv ≥ ``headroom_from_u_kv``) or
   at risk (any trigger, the structural guard, EMERGENCY, an OOM, or a contiguity forecast that
   fails) the engine asks the node to hold
   back from admission what the mode's strategy wants free: ``(1 - target_u_kv)·D`` minus the
   engine's own reserve. The strategy's U_kv target is thereby enforced where the memory is
   handed out, instead of by evicting the same requests again every tick. After
   ``headroom_calm_ticks`` calm ticks the hold is released. It is a level, not a delta, so a
   repeated or reordered command does no harm.
   The engine's admission check looks only at a request's first prefill chunk; a long prompt
   admitted into a node with less free space than the whole prompt then fills the node during
   its own prefill, a few seconds after admission, and the next step's workspace finds no
   contiguous run (on the shadow engine's ``mixed`` stress, the guarded OOMs were all of this
   kind, with a U_kv-sized hold in place). So the hold is at least the largest prompt seen on
   any node within ``prompt_horizon_s`` (from the candidates' ``prompt_tokens``) plus
   ``prompt_safety_runs`` run requirements, minus the engine's own reserve, capped at
   ``max_headroom_frac`` of D: whatever the engine admits then still fits whole, with one
   step's workspace to spare. The policy learns the size from the traffic, not from a constant.
   This part of the hold is not released on calm ticks (only when the prompt ages out of the
   horizon): the burst it guards against lands on a calm node within one tick (measured: a
   node released after 300 calm seconds crashed 64 s later), and on a calm node it costs
   nothing, since admission only feels it once the node is ~55 % full.
6. Allocator guard (``allocator_guard``, on for vLLM-engine profiles): a CUDA OOM on such a node
   comes from PyTorch's caching allocator, not from the KV blocks (a KV shortage preempts), and
   its transient peak grows with the tokens of one step (activations, and the logits of requests
   asking for prompt logprobs, which vLLM's profiling run does not count: vllm#5907). When the
   node shows allocator pressure — an OOM, a malloc retried after releasing cached blocks
   (``alloc_retries``), or P(OOM) at the strategy's threshold — the engine caps the per-step
   token budget at ``batch_cap_tokens`` (vLLM's ``max_num_batched_tokens``, lowered between
   steps by the plugin; ``batch_cap`` command), and releases it after ``batch_cap_calm_ticks``
   ticks without pressure. The count survives a restart of the node (an OOM restarts it): the
   cap is re-sent to the fresh engine.
7. Compaction trigger (the "fragmentation" trigger of docs/ARCHITECTURE.md "Policy", read on the real need): when the
   largest free run falls under ``planner.compact_run_factor`` run requirements while the free
   space in total is at least that, the structural guard fires and the plan compacts (no
   eviction: free space suffices, it is only scattered).

Canary rollout (``policy.canary``, off by default): with a ``Canary`` the strategy is per node,
``strategy_for(mode, node)``: the candidate on the candidate's nodes in the canary's mode, the
control everywhere else; without one every node runs the mode's strategy, as before.

Pure and deterministic: time is the tick's event time, no clock, no I/O. The service shell
(``policy.service``) feeds it ticks from the bus and publishes what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvguard.contracts.commands import (
    Action,
    BatchCapPayload,
    Command,
    CompactPayload,
    EvictPayload,
    HeadroomPayload,
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
from kvguard.policy.modes import ModeChange, ModeConfig, ModeTracker
from kvguard.policy.planner import CostModel, NodeView, Plan, PlannerConfig, compaction_run_units, plan, view_from_tick
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
    def __init__(self, config: EngineConfig, secret: bytes, canary: Canary | None = None) -> None:
        self.config = config
        self.secret = secret
        self.canary = canary
        self.modes = ModeTracker(config.modes)
        self.counters = EngineCounters()
        self._last_scan_ns: dict[str, int] = {}
        self._recent: dict[str, dict[int, int]] = {}
        self._held: dict[str, tuple[int, int]] = {}  # node -> (units held, ts_ns of the last command)
        self._calm: dict[str, int] = {}
        self._last_ts: dict[str, int] = {}  # node -> ts_ns of the last tick decided on (least recent first)
        self._epoch: dict[str, int] = {}  # node -> producer epoch of the last tick decided on
        self._confirmed: dict[str, bool] = {}  # node -> its epoch was seen on a second tick
        self._prompt_max: dict[int, int] = {}  # minute of event time -> largest prompt seen (units)
        self._cap: dict[str, tuple[int, int]] = {}  # node -> (cap sent, ts_ns it was sent); not sent: absent
        self._cap_calm: dict[str, int] = {}  # node -> ticks since allocator pressure (kept over restarts)

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
        self._note_prompts(view)
        change = self.modes.observe(view)
        if change:
            self.counters.mode_changes += 1
        mode = self.modes.mode(view.node)
        strategy = self.strategy_for(mode, view.node)
        decision = Decision(view.node, view.ts_ns, mode, strategy.variant, mode_change=change)
        risk = self._contiguity_risk(view)
        guard = self._structural_guard(view, budget_remaining_frac)
        trigger = trigger_reason(view, strategy, self.config.forecast_step_s, risk) if self._due(view, strategy) else None
        reason = trigger or guard
        the_plan = Plan()
        if reason is not None:
            self.counters.triggered += 1
            recent = self._recent_victims(view)
            # the guard alone compacts (and frees only a shortfall of free space); a trigger also
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
        headroom = self._headroom(view, mode, at_risk)
        cap, cap_reason = self._batch_cap(view, strategy)
        decision.commands = self._commands(view, strategy, mode, the_plan, headroom, at_risk or "pressure fell",
                                           epoch, cap=cap, cap_reason=cap_reason)
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
        self._cap_calm.pop(node, None)
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
        for per_node in (self._last_ts, self._last_scan_ns, self._recent, self._held, self._calm, self._cap):
            per_node.pop(node, None)

    def _contiguity_risk(self, view: NodeView) -> str | None:
        """The tick's own forecast: will the next full step find one contiguous run?"""
        required = self.config.planner.required_run_units
        if not required:
            return None
        wanted = required * (1 + self.config.planner.run_margin)
        if view.largest_free_run_units < wanted:
            return f"largest free run {view.largest_free_run_units} < {wanted:.0f} units one full step needs"
        room = view.free_units - view.pending_prefill_units
        if room < wanted:
            return (f"queued prefills ({view.pending_prefill_units} units) would leave {room} free units, "
                    f"under the {wanted:.0f} one full step needs")
        return None

    def headroom_units(self, mode: Mode, node: str | None = None) -> int:
        """The admission hold in ``mode`` (on ``node``'s strategy): ``(1 - target_u_kv)`` of D free,
        or room for the largest prompt seen (plus one run requirement) when that is more, capped."""
        d = self.config.dynamic_units or 0
        target = self.strategy_for(mode, node).target_u_kv
        return max(int((1.0 - target) * d) - self.config.engine_reserve_units, self.prompt_hold_units())

    def prompt_hold_units(self) -> int:
        """The hold that lets the largest prompt seen land whole with one run requirement to
        spare (0 when off or nothing seen), capped at ``max_headroom_frac`` of D."""
        if not (self.config.prompt_headroom and self._prompt_max):
            return 0
        d = self.config.dynamic_units or 0
        required = self.config.planner.required_run_units
        by_prompt = max(self._prompt_max.values()) + int(self.config.prompt_safety_runs * required)
        return max(0, min(by_prompt, int(self.config.max_headroom_frac * d)) - self.config.engine_reserve_units)

    def largest_prompt_units(self) -> int:
        """The largest prompt (units) seen within ``prompt_horizon_s`` (0: none yet)."""
        return max(self._prompt_max.values(), default=0)

    def _note_prompts(self, view: NodeView) -> None:
        minute = view.ts_ns // (60 * NS_PER_S)
        horizon = int(self.config.prompt_horizon_s // 60)
        for old in [m for m in self._prompt_max if m < minute - horizon]:
            del self._prompt_max[old]
        unit = max(1, self.config.unit_tokens)
        largest = max((-(-c.prompt_tokens // unit) for c in view.candidates), default=0)
        if largest > self._prompt_max.get(minute, 0):
            self._prompt_max[minute] = largest

    def _headroom(self, view: NodeView, mode: Mode, risk: str | None) -> int | None:
        """The admission hold to command now, or None to leave it as it is."""
        if not self.config.use_headroom or not self.config.dynamic_units:
            return None
        held, last_ns = self._held.get(view.node, (0, view.ts_ns))
        if risk:
            self._calm[view.node] = 0
            want = self.headroom_units(mode, view.node)
        else:
            self._calm[view.node] = self._calm.get(view.node, 0) + 1
            # calm: the strategy's part is released; the prompt-sized part stays, since the
            # burst it guards against lands on a calm node within one tick
            want = self.prompt_hold_units() if self._calm[view.node] >= self.config.headroom_calm_ticks else held
        stale = view.ts_ns - last_ns >= self.config.headroom_refresh_s * NS_PER_S
        if want == held and not (held and stale):
            return None
        self._held[view.node] = (want, view.ts_ns)
        return want

    def _batch_cap(self, view: NodeView, strategy: Strategy) -> tuple[int | None, str]:
        """The token cap to command now (0 releases), or None to leave it as it is; and why."""
        cfg = self.config
        if not (cfg.allocator_guard and cfg.batch_cap_tokens > 0):
            return None, ""
        pressure = None
        if view.ooms:
            pressure = f"{view.ooms} allocator OOM(s) in the last tick"
        elif view.alloc_retries:
            pressure = f"{view.alloc_retries} allocator retries (cached blocks released to serve a malloc)"
        elif (cfg.batch_cap_on_prediction and view.p_oom is not None and strategy.use_prediction
              and view.p_oom >= strategy.p_oom_threshold):
            pressure = f"P(OOM in 5 min) {view.p_oom:.2f} >= {strategy.p_oom_threshold}"
        calm = 0 if pressure else self._cap_calm.get(view.node, cfg.batch_cap_calm_ticks) + 1
        self._cap_calm[view.node] = calm
        want = cfg.batch_cap_tokens if calm < cfg.batch_cap_calm_ticks else 0
        sent = self._cap.get(view.node)
        stale = sent is not None and sent[0] and view.ts_ns - sent[1] >= cfg.headroom_refresh_s * NS_PER_S
        if (sent is None and not want) or (sent is not None and sent[0] == want and not stale):
            return None, ""
        self._cap[view.node] = (want, view.ts_ns)
        why = pressure or (f"allocator pressure {calm} tick(s) ago" if want else
                           f"{calm} ticks without allocator pressure: cap released")
        return want, f"token budget {want or 'restored'}: {why}"

    # -- when to act -------------------------------------------------------------------------

    def _structural_guard(self, view: NodeView, budget_remaining_frac: float | None) -> str | None:
        required = self.config.planner.required_run_units
        if required and view.largest_free_run_units < required * (1 + self.config.planner.run_margin):
            return (f"largest free run {view.largest_free_run_units} < "
                    f"{required * (1 + self.config.planner.run_margin):.0f} units one full step needs")
        compact_below = compaction_run_units(self.config.planner)
        if required and view.largest_free_run_units < compact_below <= view.free_units:
            return (f"fragmented: largest free run {view.largest_free_run_units} < {compact_below} units "
                    f"({self.config.planner.compact_run_factor:g}x one full step's need), "
                    f"{view.free_units} free in total")
        if (budget_remaining_frac is not None and budget_remaining_frac <= self.config.budget_low_frac
                and view.f_ext > self.config.budget_f_ext):
            return (f"fragmentation budget low ({budget_remaining_frac:.0%} left) and "
                    f"f_ext {view.f_ext:.2f} > {self.config.budget_f_ext}")
        return None

    def _due(self, view: NodeView, strategy: Strategy) -> bool:
        if strategy.timing is not Timing.ASYNC:
            return True
        last = self._last_scan_ns.get(view.node)
        if last is not None and view.ts_ns - last < strategy.scan_interval_s * NS_PER_S:
            return False
        self._last_scan_ns[view.node] = view.ts_ns
        return True

    # -- what to send ------------------------------------------------------------------------

    def _commands(self, view: NodeView, strategy: Strategy, mode: Mode, the_plan: Plan,
                  headroom: int | None, reason: str, epoch: int = 0, *, cap: int | None = None,
                  cap_reason: str = "") -> list[Command]:
        ttl_ns = int(self.config.command_ttl_s * NS_PER_S)
        common = dict(node=view.node, reason=reason, mode=mode, variant=strategy.variant,
                      issued_at_ns=view.ts_ns, ttl_ns=ttl_ns, epoch=epoch)
        payloads: list[tuple[Payload, str]] = []
        if headroom is not None:
            payloads.append((HeadroomPayload(units=headroom), reason))
        if the_plan.compact_moves:
            payloads.append((CompactPayload(max_moves=the_plan.compact_moves), reason))
        if the_plan.reclaim_units:
            payloads.append((ReclaimPayload(units=the_plan.reclaim_units), reason))
        if the_plan.victims:
            targets = tuple(Target(v.req, v.units) for v in the_plan.victims)
            payloads.append((EvictPayload(targets, granularity=strategy.granularity, handling=strategy.handling),
                             reason))
        if cap is not None:  # last: the other actions keep their positions (and ids) on every profile
            payloads.append((BatchCapPayload(tokens=cap), cap_reason))
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
            else:
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
