"""The policy service: a thin shell that feeds ticks to ``PolicyEngine`` and publishes its output.

Per tick: debit the node's fragmentation budget (idempotent per (node, tick)), read what is left
of it this week, ask the engine for a decision, then publish

* each command on ``kvguard.commands`` keyed by node (the actuator of that node consumes it);
* each mode change as an alert on ``kvguard.alerts`` (``KVGuardPolicyEmergency``: firing on
  escalation, resolved on de-escalation), and logs it;
* budget alerts the ledger raised (exhaustion: RCA required) on ``kvguard.alerts``.

``handle_tick`` is synchronous and returns the records, so the embedded loop calls it directly
and deterministically; ``run`` is the async consumer over any bus (in-process or Kafka).
Ticks are validated against the wire contract (``kvguard.schemas.MetricTick``, DLQ on failure)
but read from the record's JSON itself, so fields a newer stream adds (the candidates' prompt
sizes, the utilization split in units) reach the planner.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

from policy.commands import Command, Mode
from policy.engine import Decision, PolicyEngine
from policy.modes import ModeChange

log = logging.getLogger(__name__)

MODE_ALERT = "KVGuardPolicyEmergency"


@dataclass(slots=True)
class Outgoing:
    """What one tick produced: the decision, the commands to publish, the alert records."""

    decision: Decision
    commands: list[Command] = field(default_factory=list)
    alerts: list[dict] = field(default_factory=list)


class PolicyService:
    def __init__(self, engine: PolicyEngine, settings: Any, *, bus: Any = None, ledger: Any = None) -> None:
        self.engine = engine
        self.settings = settings
        self.bus = bus
        self.ledger = ledger
        self.budget_s = float(settings.budget.minutes_per_week) * 60.0
        self.mode_changes: list[ModeChange] = []
        self.ticks = 0
        self._warned_priority: set[str] = set()

    # -- the synchronous core of the shell ------------------------------------------------------

    def handle_tick(self, tick: Any) -> Outgoing:
        self.ticks += 1
        remaining_frac = self._budget(tick)
        decision = self.engine.decide(tick, budget_remaining_frac=remaining_frac)
        out = Outgoing(decision, commands=list(decision.commands))
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

    def _budget(self, tick: Any) -> float | None:
        if self.ledger is None:
            return None
        from policy.budget import tick_week

        get = tick.get if isinstance(tick, dict) else (lambda k, d=None: getattr(tick, k, d))
        try:
            if isinstance(tick, dict):
                self.ledger.debit(str(tick["node"]), int(tick["ts_ns"]),
                                  float(tick.get("tick_s") or self.settings.streams.tick_s), float(tick["f_ext"]))
            else:
                self.ledger.debit_tick(tick)
            remaining_s = self.ledger.remaining(str(get("node")), tick_week(int(get("ts_ns"))))
        except Exception as err:  # the budget informs the policy; an unreachable ledger must not stop it
            log.warning("policy: budget ledger unavailable: %s", err)
            return None
        return max(0.0, remaining_s) / self.budget_s if self.budget_s > 0 else None

    # -- the async shell over a bus ----------------------------------------------------------------

    async def publish(self, out: Outgoing) -> None:
        from kvguard.schemas import make_headers

        topics = self.settings.topics
        for cmd in out.commands:
            await self.bus.publish(topics.name("commands"), cmd.node, cmd.to_bytes(),
                                   make_headers("commands", "kvguard-policy", record_id=cmd.id))
        for alert in out.alerts:
            import orjson

            await self.bus.publish(topics.name("alerts"), alert["node"], orjson.dumps(alert),
                                   make_headers("alerts", "kvguard-policy"))

    async def run(self, *, group: str = "kvguard-policy", stop: Any = None, poll_s: float = 0.1,
                  on_output: Any = None) -> None:
        """Consume ``kvguard.metrics`` until ``stop`` (an asyncio.Event) is set."""
        import orjson

        from kvguard.bus.dlq import RecordDecoder

        decoder = RecordDecoder(self.bus, self.settings.topics.name("dlq"), component="policy", group=group)
        subscription = self.bus.subscribe([self.settings.topics.name("metrics")], group)
        try:
            while stop is None or not stop.is_set():
                records = await subscription.getmany(max_records=512, timeout_s=poll_s)
                for record in records:
                    if await decoder.decode("metrics", record) is not None:
                        out = self.handle_tick(orjson.loads(record.value))
                        await self.publish(out)
                        if on_output is not None:
                            on_output(out)
                if records:
                    await subscription.commit()
        finally:
            await subscription.close()


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
