"""The policy service: a thin shell that feeds ticks to ``PolicyEngine`` and publishes its output.

Per tick: debit the node's fragmentation budget (idempotent per (node, tick)), read what is left
of it this week, ask the engine for a decision, then publish

* each command on ``kvguard.commands`` keyed by node (the actuator of that node consumes it);
* each mode change as an alert on ``kvguard.alerts`` (``KVGuardPolicyEmergency``: firing on
  escalation, resolved on de-escalation), and logs it;
* budget alerts the ledger raised (exhaustion: RCA required) on ``kvguard.alerts``;

and, with an ``SloRecorder``, records the tick's prediction outcome, OOMs with per-tier lead
times and evictions in the SLO ledger. With a ``Canary`` (``policy.canary``) each decided tick
is recorded for its node's arm and the rollout evaluated (``canary_changes`` keeps its moves);
the recorder hands it the evictions and their outcomes. Delivery: ``run`` commits a batch of
ticks only after its commands and alerts were delivered (``deliver_all`` retries through a
broker outage).

``handle_tick`` is synchronous and returns the records, so the embedded loop calls it directly
and deterministically; ``run`` is the async consumer over any bus (in-process or Kafka).
Ticks from the bus are validated against the wire contract (``kvguard.wire.schemas.MetricTick``,
DLQ on failure) and handed on as the core's ``Tick`` (``MetricTick.to_tick()``): the embedded loop
and a consumer over Kafka give the engine the same value.

Error isolation: a tick that fails the wire checks (``kvguard.wire.validate``: e.g. ``u_kv =
1e308``), whose epoch the engine rejects, or whose handling raises is dead-lettered with the
reason (counted in ``errors`` / the decoder's counters, and logged) and committed past: one poison
record never stops the service or comes back after a restart. Per-node state is bounded by the
engine's ``max_nodes``; ``run`` also forgets nodes without ticks for ``policy.node_idle_timeout_s``
of wall time.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from kvguard.bus.deliver import deliver_all
from kvguard.bus.dlq import RecordDecoder
from kvguard.bus.idle import IdleSweep
from kvguard.contracts.commands import Action, Command, Mode
from kvguard.contracts.events import EventKind, Outcome
from kvguard.contracts.tick import Tick
from kvguard.contracts.tiers import LEAD_TIME_SIGNALS, AlertThresholds, signal_conditions
from kvguard.policy.budget import tick_week
from kvguard.policy.canary import Canary, Transition
from kvguard.policy.engine import Decision, PolicyEngine
from kvguard.policy.modes import ModeChange
from kvguard.policy.slo import OutcomeTracker
from kvguard.wire.schemas import make_headers

log = logging.getLogger(__name__)
ledger_log = logging.getLogger("policy.ledger")  # budget/SLO ledger unreachable (once per outage)

MODE_ALERT = "KVGuardPolicyEmergency"


@dataclass(slots=True)
class Outgoing:
    """What one tick produced: the decision, the commands to publish, the alert records."""

    decision: Decision
    commands: list[Command] = field(default_factory=list)
    alerts: list[dict] = field(default_factory=list)


class PolicyService:
    def __init__(self, engine: PolicyEngine, settings: Any, *, bus: Any = None, ledger: Any = None,
                 slo: "SloRecorder | None" = None, canary: Canary | None = None) -> None:
        self.engine = engine
        self.canary = canary
        self.canary_changes: list[Transition] = []
        self.settings = settings
        self.bus = bus
        self.ledger = ledger
        self.slo = slo
        self.budget_s = float(settings.budget.minutes_per_week) * 60.0
        self.mode_changes: list[ModeChange] = []
        self.ticks = 0
        self.budget_errors = 0  # ticks decided without the budget (ledger unreachable)
        self.errors = 0  # ticks whose handling raised (dead-lettered by ``run``)
        self.rejected = 0  # ticks the engine rejected (epoch jump; dead-lettered by ``run``)
        self.nodes_forgotten = 0  # nodes dropped after the idle timeout
        self.idle_sweep = IdleSweep(  # the nodes' last ticks in ``run``, wall (monotonic) time
            settings.policy.node_idle_timeout_s, now_s=time.monotonic())
        self._budget_down = False
        self._warned_priority: set[str] = set()

    # -- the synchronous core of the shell ------------------------------------------------------

    def handle_tick(self, tick: Tick) -> Outgoing:
        self.ticks += 1
        remaining_frac = self._budget(tick)
        decision = self.engine.decide(tick, budget_remaining_frac=remaining_frac)
        out = Outgoing(decision, commands=list(decision.commands))
        if self.slo is not None and not decision.stale:
            self.slo.observe_tick(tick)
            self.slo.observe_decision(decision)
        if self.canary is not None and not decision.stale:
            moved = self.canary.observe_decision(tick, decision)
            if moved is not None:
                self.canary_changes.append(moved)
        if decision.mode_change is not None:
            change = decision.mode_change
            self.mode_changes.append(change)
            log.warning("policy: node %s %s -> %s: %s", change.node, change.from_mode.value,
                        change.to_mode.value, change.reason)
            out.alerts.append(mode_alert(change))
        if decision.plan is not None and decision.plan.priority_defaulted and decision.node not in self._warned_priority:
            self._warned_priority.add(decision.node)
            log.warning("policy: node %s has requests without a priority; treated as 5 (counted in "
                        "priority_defaulted)", decision.node)
        if self.ledger is not None:
            out.alerts.extend(budget_alert_record(a) for a in self.ledger.take_alerts())
        return out

    def _budget(self, tick: Tick) -> float | None:
        if self.ledger is None:
            return None
        try:
            self.ledger.debit_tick(tick)
            remaining_s = self.ledger.remaining(tick.node, tick_week(tick.ts_ns))
        except Exception as err:  # the budget informs the policy; an unreachable ledger must not stop it
            self.budget_errors += 1
            if not self._budget_down:
                self._budget_down = True
                ledger_log.warning("policy: budget ledger unavailable, deciding without it: %s", err)
            return None
        if self._budget_down:
            self._budget_down = False
            ledger_log.warning("policy: budget ledger reachable again after %d tick(s) without it",
                               self.budget_errors)
        return max(0.0, remaining_s) / self.budget_s if self.budget_s > 0 else None

    # -- the async shell over a bus ----------------------------------------------------------------

    def messages(self, out: Outgoing) -> list[tuple[str, str, bytes, list]]:
        """``out`` as (topic, key, value, headers) records, in publishing order."""

        topics = self.settings.topics
        records = [(topics.name("commands"), cmd.node, cmd.to_bytes(),
                    make_headers("commands", "kvguard-policy", record_id=cmd.id)) for cmd in out.commands]
        records += [(topics.name("alerts"), alert["node"], orjson.dumps(alert),
                     make_headers("alerts", "kvguard-policy")) for alert in out.alerts]
        return records

    async def publish(self, out: Outgoing, *, stop: Any = None) -> bool:
        """Publish and wait until every record is delivered (retrying through a broker outage);
        False only when ``stop`` was set before that."""
        return await deliver_all(self.bus, self.messages(out), stop=stop, label="policy")

    async def run(self, *, group: str = "kvguard-policy", stop: Any = None, poll_s: float = 0.1,
                  on_output: Any = None) -> None:
        """Consume ``kvguard.metrics`` until ``stop`` (an asyncio.Event) is set.

        The batch's offsets are committed only after every command and alert it produced was
        delivered (``deliver_all``: a full send buffer or a failed send is retried with backoff,
        so a broker outage pauses the service instead of killing it or losing commands). If
        ``stop`` interrupts the retries the batch is not committed, so the group's next consumer
        gets it again (commands are idempotent by id). Within one process the engine skips ticks
        it has decided on already (``PolicyEngine.decide``: stale ticks).
        """

        decoder = RecordDecoder(self.bus, self.settings.topics.name("dlq"), component="policy", group=group)
        self.decoder = decoder
        subscription = self.bus.subscribe([self.settings.topics.name("metrics")], group)
        try:
            while stop is None or not stop.is_set():
                records = await subscription.getmany(max_records=512, timeout_s=poll_s)
                pending: list = []
                for record in records:
                    model = await decoder.decode("metrics", record)
                    if model is None:
                        continue
                    try:
                        out = self.handle_tick(model.to_tick())
                    except Exception as err:  # noqa: BLE001 - one poison tick must not stop the service
                        self.errors += 1
                        await decoder.handler_failed(record, err)
                        continue
                    self._seen(out.decision.node)
                    if out.decision.rejected:
                        self.rejected += 1
                        log.warning("policy: tick of %s dead-lettered: %s", out.decision.node, out.decision.reason)
                        await decoder.dead_letter(record, "invalid", out.decision.reason or "")
                        continue
                    pending += self.messages(out)
                    if on_output is not None:
                        on_output(out)
                if self.idle_sweep.due(time.monotonic()):
                    self.forget_idle(time.monotonic())
                if not await deliver_all(self.bus, pending, stop=stop, label="policy"):
                    break  # stopping mid-outage: leave the batch uncommitted
                if records:
                    await subscription.commit()
        finally:
            await subscription.close()


    def _seen(self, node: str) -> None:
        """Note a node's tick (wall time); the table is bounded like the engine's state."""
        self.idle_sweep.seen(node, time.monotonic())
        for oldest in self.idle_sweep.over(self.engine.config.max_nodes):
            self._warned_priority.discard(oldest)
            if self.slo is not None:
                self.slo.forget(oldest)

    def forget_idle(self, now_s: float) -> list[str]:
        """Forget the nodes whose last tick (in ``run``) is older than ``policy.node_idle_timeout_s``
        at the monotonic time ``now_s``; returns them."""
        idle = self.idle_sweep.sweep(now_s)
        for node in idle:
            self.engine.forget(node)
            self._warned_priority.discard(node)
            if self.slo is not None:
                self.slo.forget(node)
            self.nodes_forgotten += 1
        if idle:
            log.info("policy: forgot %d node(s) idle for more than %g s", len(idle), self.idle_sweep.timeout_s)
        return idle


def mode_alert(change: ModeChange) -> dict:
    """A mode change as a ``kvguard.alerts`` record (Alertmanager-shaped)."""
    firing = change.to_mode is Mode.EMERGENCY
    return {
        "schema": "1.0", "node": change.node, "ts_ns": change.ts_ns, "name": MODE_ALERT, "tier": "policy",
        "severity": "warning" if firing else "info", "status": "firing" if firing else "resolved",
        "fingerprint": hashlib.sha256(f"{change.node}\x00{MODE_ALERT}".encode()).hexdigest()[:16],
        "started_at_ns": change.ts_ns, "summary": change.reason,
        "labels": {"alertname": MODE_ALERT, "node": change.node, "mode": change.to_mode.value},
        "annotations": {"summary": f"policy {change.from_mode.value} -> {change.to_mode.value}",
                        "description": change.reason},
    }


def budget_alert_record(alert: Any) -> dict:
    fields = dict(alert.alert_fields()) if hasattr(alert, "alert_fields") else dict(alert.to_dict())
    fields.setdefault("schema", "1.0")
    return fields


# ----------------------------------------------------------------------------- SLO recording

@dataclass(slots=True)
class SloCounters:
    ticks: int = 0
    predictions: int = 0
    ooms: int = 0
    evictions: int = 0
    outcomes: int = 0
    errors: int = 0
    pending_dropped: int = 0  # unacked commands or unfinished evictions dropped past MAX_PENDING (oldest first)

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


MAX_PENDING = 100_000  # commands awaiting an ack and evicted requests awaiting their FINISH, each


class SloRecorder:
    """Feeds the SLO ledger (``policy.slo``) from what the policy sees.

    * predictions: each tick with a P(OOM) is labelled by ``OutcomeTracker`` at the operating
      ``threshold`` once its horizon has passed (positive: an OOM on the node within the horizon);
    * OOMs: a tick counting OOMs records one OOM at the tick's time with each tier's lead time,
      the time since that tier's condition has held without a break on the node's earlier ticks
      (0: the tier did not see it coming). Tier conditions are the alert rules' (docs/ARCHITECTURE.md, "Alerts and prediction")
      without their ``for`` durations: threshold = U_kv or Ψ above critical, slope = U_kv rising
      faster than the slope line, fragmentation = U_kv and F_ext both high, lstm = P(OOM) at or
      above the operating threshold (only when ticks carry a P(OOM));
    * evictions: each EVICT target, when its command is issued (``confirm_with_acks=False``, the
      standalone policy service) or when its ack says EXECUTED (the demo, which sees the acks);
    * eviction outcomes: ``observe_batches`` reads the nodes' FINISH events (completed or not);
    * with a ``canary``, the evictions and their outcomes also go to its arms.

    Ledger errors are logged and counted, never raised: the SLO ledger informs, it does not steer.
    """

    def __init__(self, ledger: Any, *, threshold: float, horizon_s: float, thresholds: Any = None,
                 confirm_with_acks: bool = False, max_nodes: int = 10_000, canary: Canary | None = None) -> None:
        self.ledger = ledger
        self.canary = canary
        self.threshold = float(threshold)
        self.thresholds = thresholds
        self.confirm_with_acks = confirm_with_acks
        self.tracker = OutcomeTracker(self.threshold, horizon_s, max_nodes=max_nodes)
        self.counters = SloCounters()
        self._onset: dict[str, dict[str, int]] = {}
        self._last_ts: dict[str, int] = {}
        self._issued: dict[str, tuple[str, int, tuple[int, ...]]] = {}  # command id -> (node, ts, reqs)
        self._evicted: dict[tuple[str, int], None] = {}  # insertion-ordered: the oldest is dropped first
        self._logged_error = False

    def forget(self, node: str) -> None:
        """Drop the per-node onset, ordering and labelling state of an idle node."""
        self._onset.pop(node, None)
        self._last_ts.pop(node, None)
        self.tracker.forget(node)

    # ticks ---------------------------------------------------------------------------------------

    def observe_tick(self, tick: Tick) -> None:
        node, ts_ns = tick.node, tick.ts_ns
        if ts_ns <= self._last_ts.get(node, -1):
            return  # a redelivered tick was counted already
        self._last_ts[node] = ts_ns
        self.counters.ticks += 1
        p_oom = tick.p_oom
        onset = self._onset.setdefault(node, {})
        if tick.ooms > 0:
            tiers = [t for t in LEAD_TIME_SIGNALS if t != "lstm" or p_oom is not None]
            leads = {t: (ts_ns - onset[t]) / 1e9 if t in onset else 0.0 for t in tiers}
            self.tracker.observe_oom(node, ts_ns)
            if self._call(self.ledger.record_oom, node, ts_ns, leads):
                self.counters.ooms += 1
        for tier, holds in self._conditions(tick).items():
            if holds:
                onset.setdefault(tier, ts_ns)
            else:
                onset.pop(tier, None)
        self.tracker.observe_tick(node, ts_ns, None if p_oom is None else float(p_oom))
        self._resolve(ts_ns)

    def _conditions(self, tick: Tick) -> dict[str, bool]:
        return signal_conditions(self.thresholds or AlertThresholds(), u_kv=tick.u_kv, psi=tick.psi, f_ext=tick.f_ext,
                                 slope_per_min=tick.slope_per_min, p_oom=tick.p_oom, p_oom_threshold=self.threshold)

    def _resolve(self, now_ns: int) -> None:
        for outcome in self.tracker.resolve(now_ns):
            if self._call(self.ledger.record_prediction, outcome.node, outcome.ts_ns, outcome.predicted,
                          outcome.actual):
                self.counters.predictions += 1

    def finish(self, now_ns: int) -> None:
        """Label what the horizon allows at the end of a run (later ticks stay unlabelled)."""
        self._resolve(now_ns)

    # evictions -----------------------------------------------------------------------------------

    def observe_decision(self, decision: Any) -> None:
        for cmd in getattr(decision, "commands", ()):
            if cmd.action is not Action.EVICT:
                continue
            reqs = tuple(int(t.req) for t in cmd.payload.targets)
            if self.confirm_with_acks:
                self._issued[cmd.id] = (cmd.node, cmd.issued_at_ns, reqs)
                self._bound(self._issued)
            else:
                self._record_evictions(cmd.node, cmd.issued_at_ns, reqs)

    def observe_ack(self, ack: Any) -> None:
        issued = self._issued.pop(ack.command_id, None)
        if issued is not None and getattr(ack.outcome, "value", ack.outcome) == "executed":
            self._record_evictions(*issued)

    def _record_evictions(self, node: str, ts_ns: int, reqs: tuple[int, ...]) -> None:
        for req in reqs:
            self._evicted[(node, req)] = None
            self._bound(self._evicted)
            if self._call(self.ledger.record_eviction, node, str(req), ts_ns):
                self.counters.evictions += 1
            if self.canary is not None:
                self.canary.observe_eviction(node, req)

    def observe_batches(self, batches: Any) -> None:
        """Outcomes of evicted requests from the nodes' event batches (FINISH rows)."""
        if not self._evicted:
            return

        for batch in batches:
            events = batch.events
            if not len(events):
                continue
            finish = events[events["kind"] == int(EventKind.FINISH)]
            for row in finish:
                key = (batch.node, int(row["req"]))
                if key in self._evicted:
                    del self._evicted[key]
                    completed = int(row["flags"]) == int(Outcome.COMPLETED)
                    if self._call(self.ledger.record_eviction_outcome, batch.node, str(key[1]), completed):
                        self.counters.outcomes += 1
                    if self.canary is not None:
                        self.canary.observe_outcome(batch.node, key[1], completed)

    def _bound(self, pending: dict) -> None:
        """A command never acked or an evicted request whose FINISH never comes must not grow memory."""
        while len(pending) > MAX_PENDING:
            del pending[next(iter(pending))]
            self.counters.pending_dropped += 1

    def _call(self, fn: Any, *args: Any) -> bool:
        try:
            return bool(fn(*args))
        except Exception as err:  # noqa: BLE001 - an unreachable ledger must not stop the policy
            self.counters.errors += 1
            if not self._logged_error:
                self._logged_error = True
                ledger_log.warning("policy: SLO ledger write failed: %s: %s", type(err).__name__, err)
            return False
