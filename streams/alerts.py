"""Alert tiers over ticks: thresholds (tier 1), slope and fragmentation (tier 2), predictor (tier 3).

Pure (stdlib). Each rule is a condition on a ``Tick`` with a ``for`` duration (the condition must
hold that long, in event time, before the alert fires) and a hysteresis (a firing alert resolves
only after the condition has been clear for ``resolve_for_s``). An alert is emitted on each
transition (firing, resolved), never repeated while the state holds. Its fingerprint depends only
on node and rule, so consumers (Alertmanager, the policy) can deduplicate redeliveries.

Unsynced ticks (the mirror missed events) do not move a rule's state: their values are best effort.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

from kvguard.contracts.tick import Tick
from kvguard.contracts.tiers import TIER_NAMES, AlertThresholds
from kvguard.contracts.units import NS_PER_S

FIRING = "firing"
RESOLVED = "resolved"


@dataclass(slots=True, frozen=True)
class Rule:
    name: str
    tier: int
    severity: str
    condition: Callable[[Tick], bool]
    value: Callable[[Tick], float]
    threshold: float
    for_s: float
    resolve_for_s: float
    summary: str


@dataclass(slots=True)
class Alert:
    """One transition of one rule on one node, ready for Alertmanager (labels/annotations)."""

    fingerprint: str
    node: str
    rule: str
    tier: int
    severity: str
    state: str
    ts_ns: int
    starts_at_ns: int
    ends_at_ns: int | None
    value: float
    threshold: float = 0.0
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "fingerprint": self.fingerprint, "node": self.node, "rule": self.rule, "tier": self.tier,
            "severity": self.severity, "state": self.state, "ts_ns": self.ts_ns,
            "ts_s": self.ts_ns / NS_PER_S, "starts_at_ns": self.starts_at_ns,
            "ends_at_ns": self.ends_at_ns, "value": self.value, "threshold": self.threshold,
            "labels": dict(self.labels), "annotations": dict(self.annotations),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Alert":
        return cls(
            fingerprint=d["fingerprint"], node=d["node"], rule=d["rule"], tier=int(d["tier"]),
            severity=d["severity"], state=d["state"], ts_ns=int(d["ts_ns"]),
            starts_at_ns=int(d["starts_at_ns"]),
            ends_at_ns=None if d.get("ends_at_ns") is None else int(d["ends_at_ns"]),
            value=float(d["value"]), threshold=float(d.get("threshold", 0.0)), labels=dict(d.get("labels", {})),
            annotations=dict(d.get("annotations", {})),
        )


WIRE_SCHEMA = "1.0"


def alert_record(alert: Alert) -> dict:
    """The alert as a ``kvguard.alerts`` record (``kvguard.wire.schemas.Alert`` plus the Alert fields)."""
    d = alert.to_dict()
    d.update({"schema": WIRE_SCHEMA, "name": alert.rule, "tier": TIER_NAMES[alert.tier], "tier_level": alert.tier,
              "status": alert.state, "started_at_ns": alert.starts_at_ns,
              "p_oom": alert.value if alert.tier == 3 else None,
              "summary": alert.annotations.get("summary", "")})
    return d


def fingerprint(node: str, rule: str) -> str:
    return hashlib.sha256(f"{node}\x00{rule}".encode()).hexdigest()[:16]





def default_rules(t: AlertThresholds = AlertThresholds(), *, with_predictor: bool = False) -> list[Rule]:
    """Tiers 1 and 2 (docs/ARCHITECTURE.md, "Alerts and prediction"), plus the tier-3 rule on ``p_oom`` when a predictor runs."""
    r = t.resolve_for_s
    rules = [
        Rule("KVCacheUsageCritical", 1, "critical", lambda k: k.u_kv > t.u_kv_critical, lambda k: k.u_kv,
             t.u_kv_critical, t.threshold_for_s, r, f"KV cache usage above {t.u_kv_critical:.0%} of D"),
        Rule("KVCacheUsageHigh", 1, "warning", lambda k: k.u_kv > t.u_kv_warning, lambda k: k.u_kv,
             t.u_kv_warning, t.threshold_for_s, r, f"KV cache usage above {t.u_kv_warning:.0%} of D"),
        Rule("KVCachePressureCritical", 1, "critical", lambda k: k.psi >= t.psi_critical, lambda k: k.psi,
             t.psi_critical, t.threshold_for_s, r, f"pressure index Psi at or above {t.psi_critical}"),
        Rule("KVCacheUsageRising", 2, "warning", lambda k: k.slope_per_min > t.slope_per_min,
             lambda k: k.slope_per_min, t.slope_per_min, t.slope_for_s, r,
             f"KV cache usage rising faster than {t.slope_per_min}/min"),
        Rule("KVCacheOOMRisk", 2, "critical", lambda k: k.u_kv > t.frag_u_kv and k.f_ext > t.frag_f_ext,
             lambda k: k.f_ext, t.frag_f_ext, t.frag_for_s, r,
             f"KV usage above {t.frag_u_kv:.0%} with external fragmentation above {t.frag_f_ext}"),
    ]
    if with_predictor:
        rules.append(Rule("KVCacheOOMPredicted", 3, "critical",
                          lambda k: k.p_oom is not None and k.p_oom >= t.p_oom,
                          lambda k: -1.0 if k.p_oom is None else k.p_oom, t.p_oom, t.lstm_for_s, r,
                          f"predicted probability of OOM within 5 min at or above {t.p_oom}"))
    return rules


@dataclass(slots=True)
class RuleState:
    """Where one rule stands on one node. ``pending_since``: first tick of the current true run;
    ``clear_since``: first tick of the current false run while firing."""

    firing: bool = False
    pending_since: int | None = None
    clear_since: int | None = None
    starts_at: int | None = None

    def to_list(self) -> list:
        return [int(self.firing), self.pending_since, self.clear_since, self.starts_at]

    @classmethod
    def from_list(cls, v: list) -> "RuleState":
        return cls(bool(v[0]), v[1], v[2], v[3])


class AlertEvaluator:
    """Runs the rules over one node's ticks, in tick order. State: ``states[rule name]``."""

    def __init__(self, rules: list[Rule]):
        self.rules = rules
        self.states: dict[str, RuleState] = {r.name: RuleState() for r in rules}

    def evaluate(self, tick: Tick) -> list[Alert]:
        if not tick.synced:
            return []
        out: list[Alert] = []
        for rule in self.rules:
            alert = self._step(rule, self.states[rule.name], tick)
            if alert is not None:
                out.append(alert)
        return out

    def _step(self, rule: Rule, st: RuleState, tick: Tick) -> Alert | None:
        now = tick.ts_ns
        if rule.condition(tick):
            st.clear_since = None
            if st.firing:
                return None
            if st.pending_since is None:
                st.pending_since = now
            if now - st.pending_since >= rule.for_s * NS_PER_S:
                st.firing = True
                st.starts_at = st.pending_since
                return self._alert(rule, tick, FIRING, st.starts_at, None)
            return None
        st.pending_since = None
        if not st.firing:
            return None
        if st.clear_since is None:
            st.clear_since = now
        if now - st.clear_since >= rule.resolve_for_s * NS_PER_S:
            started = st.starts_at if st.starts_at is not None else now
            st.firing, st.clear_since, st.starts_at = False, None, None
            return self._alert(rule, tick, RESOLVED, started, now)
        return None

    @staticmethod
    def _alert(rule: Rule, tick: Tick, state: str, starts_at: int, ends_at: int | None) -> Alert:
        value = float(rule.value(tick))
        return Alert(
            fingerprint=fingerprint(tick.node, rule.name), node=tick.node, rule=rule.name,
            tier=rule.tier, severity=rule.severity, state=state, ts_ns=tick.ts_ns,
            starts_at_ns=starts_at, ends_at_ns=ends_at, value=value, threshold=rule.threshold,
            labels={"alertname": rule.name, "node": tick.node, "severity": rule.severity,
                    "tier": TIER_NAMES[rule.tier], "service": "kvguard"},
            annotations={"summary": rule.summary,
                         "description": (f"{rule.name} {state} on {tick.node}: value {value:.4f}, "
                                         f"u_kv {tick.u_kv:.4f}, f_ext {tick.f_ext:.4f}, psi {tick.psi:.4f}")},
        )

    def state_list(self) -> dict[str, list]:
        return {name: st.to_list() for name, st in self.states.items()}

    def load_state_list(self, d: dict[str, list]) -> None:
        for name, v in d.items():
            if name in self.states:
                self.states[name] = RuleState.from_list(v)
