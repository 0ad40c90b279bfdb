"""The downstream edge, pure part: Prometheus exposition and Alertmanager alert mapping.

``ExportState`` folds what ``kvguard export`` consumes (metric ticks, alerts, acks, DLQ records)
into per-node series and renders them in the Prometheus text exposition format (0.0.4):

- gauges (``kvguard_u_kv`` …) hold the newest tick per node by *event time*: a redelivered or
  late tick older than the one shown never moves a gauge back;
- counters (``kvguard_ooms_total`` …) add each tick's per-tick deltas once: a tick is counted
  once per (node, ts_ns), so at-least-once redelivery does not double count. The seen set is
  bounded per node (``dedupe_ticks``); a tick older than everything it remembers is treated as
  already counted (one node's ticks arrive in order on one partition, so such a tick is a
  redelivery);
- a node's ticks are ordered by (producer ``epoch``, ts_ns): a tick of a newer epoch is a
  restarted node whose event time starts over, so the node's tick series start over with it
  (gauges take its values, counters restart at its deltas: a counter reset to Prometheus); a
  tick of an older epoch is ignored (stale, not counted);
- a node not heard from for ``ttl_s`` of wall time (the ``now_ns`` callers pass) is dropped with
  all its series, so Prometheus sees it go stale instead of a frozen value.

``alertmanager_alert`` maps a ``kvguard.alerts`` record onto Alertmanager's ``/api/v2/alerts``
shape. Inputs are duck-typed (the wire models' attributes), so this module imports no pydantic
and never reads the clock: time is an argument.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from kvguard.contracts.units import NS_PER_S

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# gauge name -> (tick attribute, help); the names deploy/prometheus/kvguard-rules.yaml expects first
TICK_GAUGES: dict[str, tuple[str, str]] = {
    "kvguard_u_kv": ("u_kv", "KV cache usage U_kv: live KV units over the dynamic pool D (0..1)."),
    "kvguard_f_ext": ("f_ext", "External fragmentation F_ext: 1 - largest free run / free units (0..1)."),
    "kvguard_f_int": ("f_int", "Internal fragmentation F_int: unused token slots in live pages (0..1)."),
    "kvguard_psi": ("psi", "Pressure index Psi (>= 1 means an OOM is unavoidable)."),
    "kvguard_u_kv_slope_per_min": ("slope_per_min", "Slope of U_kv per minute of event time."),
    "kvguard_p_oom": ("p_oom", "LSTM probability of an OOM within the horizon (absent when no model runs)."),
    "kvguard_free_units": ("free_units", "Free units of the dynamic KV pool."),
    "kvguard_largest_free_run_units": ("largest_free_run_units", "Largest run of contiguous free units."),
    "kvguard_requests_running": ("requests_running", "Requests running on the node."),
    "kvguard_tokens_per_second": ("tokens_per_s", "Tokens processed per second of event time."),
    "kvguard_alloc_failures_per_second": ("alloc_fail_per_s", "Allocation failures per second of event time."),
}
# counter name -> (tick attribute holding the per-tick delta, help)
TICK_COUNTERS: dict[str, tuple[str, str]] = {
    "kvguard_ooms_total": ("ooms", "KV-cache OOMs (engine crashes) seen in ticks."),
    "kvguard_preemptions_total": ("preemptions", "Requests preempted by the engine."),
    "kvguard_evicted_pages_total": ("evicted_pages", "Pages evicted."),
    "kvguard_evicted_requests_total": ("evicted_requests", "Requests evicted."),
    "kvguard_alloc_failures_total": ("alloc_failures", "Failed allocations."),
}
OTHER_FAMILIES: dict[str, tuple[str, str]] = {
    "kvguard_tick_timestamp_seconds": ("gauge", "Event time of the newest tick shown for the node."),
    "kvguard_budget_remaining_seconds": (
        "gauge", "Fragmentation budget left this ISO week, as of the newest budget alert of the node."),
    "kvguard_alert_firing": ("gauge", "1 while a kvguard alert is firing (from kvguard.alerts)."),
    "kvguard_dlq_records_total": ("counter", "Records dead-lettered on kvguard.dlq, by reason."),
    "kvguard_acks_total": ("counter", "Actuator acknowledgements on kvguard.acks, by action and outcome."),
    "kvguard_ack_units_freed_total": ("counter", "Units freed by acknowledged commands."),
}


class ExportError(ValueError):
    """A record cannot be exported; ``field`` names what is wrong."""

    def __init__(self, field_name: str, problem: str):
        super().__init__(f"{field_name}: {problem}")
        self.field = field_name


@dataclass(slots=True)
class _NodeSeries:
    epoch: int = 0  # producer epoch of the ticks shown
    last_ts_ns: int = -1
    last_seen_ns: int = 0
    gauges: dict[str, float] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    seen_ts: set[int] = field(default_factory=set)
    seen_order: deque = field(default_factory=deque)
    budget: dict[str, float] = field(default_factory=dict)  # week -> remaining seconds
    firing: dict[tuple[str, str, str], str] = field(default_factory=dict)  # (alertname, severity, tier) -> fp
    alert_ts: dict[tuple[str, str, str], int] = field(default_factory=dict)  # newest transition's ts_ns
    acks: dict[tuple[str, str], int] = field(default_factory=dict)
    units_freed: int = 0


class BoundedKeys:
    """A set that remembers the newest ``bound`` keys (O(1) add/lookup, oldest forgotten first)."""

    def __init__(self, bound: int):
        self.bound = bound
        self._keys: OrderedDict = OrderedDict()

    def add(self, key: Any) -> bool:
        """True when ``key`` is new."""
        if key in self._keys:
            return False
        self._keys[key] = None
        if len(self._keys) > self.bound:
            self._keys.popitem(last=False)
        return True


@dataclass(slots=True)
class ObserveCounters:
    ticks: int = 0
    ticks_stale: int = 0  # older than the gauge shown (gauges kept)
    ticks_duplicate: int = 0  # (node, ts_ns) already counted
    ticks_old_epoch: int = 0  # of a producer epoch older than the node's (ignored)
    node_restarts: int = 0  # ticks of a newer epoch: the node's tick series started over
    alerts: int = 0
    alerts_stale: int = 0  # older than the newest transition of the same alert (ignored)
    acks: int = 0
    acks_duplicate: int = 0
    dlq: int = 0
    dlq_duplicate: int = 0
    nodes_expired: int = 0


class ExportState:
    """Per-node series built from consumed records; ``render(now_ns)`` gives the exposition text."""

    def __init__(self, *, ttl_s: float = 300.0, dedupe_ticks: int = 4096, dedupe_records: int = 100_000):
        if ttl_s <= 0:
            raise ExportError("ttl_s", f"must be > 0, got {ttl_s}")
        if dedupe_ticks <= 0:
            raise ExportError("dedupe_ticks", f"must be > 0, got {dedupe_ticks}")
        self.ttl_ns = int(ttl_s * NS_PER_S)
        self.dedupe_ticks = dedupe_ticks
        self.nodes: dict[str, _NodeSeries] = {}
        self.dlq_by_reason: dict[str, int] = {}
        self._dlq_seen = BoundedKeys(dedupe_records)
        self._acks_seen = BoundedKeys(dedupe_records)
        self.counters = ObserveCounters()
        # the exporter's own health series: name -> (type, help, {label tuple: value})
        self.own: dict[str, tuple[str, str, dict[tuple[tuple[str, str], ...], float]]] = {}

    def _node(self, node: str, now_ns: int) -> _NodeSeries:
        series = self.nodes.get(node)
        if series is None:
            series = self.nodes[node] = _NodeSeries()
        series.last_seen_ns = max(series.last_seen_ns, now_ns)
        return series

    # -- observing ------------------------------------------------------------------------------

    def observe_tick(self, tick: Any, now_ns: int) -> bool:
        """Fold one ``MetricTick``; True when it was new (counted). ``now_ns`` is wall time (TTL)."""
        node, ts_ns = _required(tick, "node"), int(_required(tick, "ts_ns"))
        epoch = int(getattr(tick, "epoch", 0) or 0)
        series = self._node(node, now_ns)
        self.counters.ticks += 1
        if epoch < series.epoch:
            self.counters.ticks_old_epoch += 1
            return False
        if epoch > series.epoch:
            self._restart(series, epoch)
        if ts_ns > series.last_ts_ns:
            series.last_ts_ns = ts_ns
            for name, (attr, _) in TICK_GAUGES.items():
                value = getattr(tick, attr, None)
                if value is None:
                    series.gauges.pop(name, None)
                else:
                    series.gauges[name] = float(value)
        else:
            self.counters.ticks_stale += 1
        oldest_kept = series.seen_order[0] if len(series.seen_order) >= self.dedupe_ticks else None
        if ts_ns in series.seen_ts or (oldest_kept is not None and ts_ns < oldest_kept):
            self.counters.ticks_duplicate += 1
            return False
        series.seen_ts.add(ts_ns)
        series.seen_order.append(ts_ns)
        if len(series.seen_order) > self.dedupe_ticks:
            series.seen_ts.discard(series.seen_order.popleft())
        for name, (attr, _) in TICK_COUNTERS.items():
            delta = getattr(tick, attr, 0) or 0
            if delta < 0:
                raise ExportError(f"{attr}", f"per-tick count must be >= 0, got {delta} (node {node}, ts_ns {ts_ns})")
            series.counters[name] = series.counters.get(name, 0.0) + float(delta)
        return True

    def _restart(self, series: _NodeSeries, epoch: int) -> None:
        """The node's producer restarted: its tick series (and the event times they are ordered
        by, alert transitions' included) start over; firing alerts and the budget stay."""
        if series.last_ts_ns >= 0:
            self.counters.node_restarts += 1
        series.epoch, series.last_ts_ns = epoch, -1
        series.gauges.clear()
        series.counters.clear()
        series.seen_ts.clear()
        series.seen_order.clear()
        series.alert_ts.clear()

    def observe_alert(self, alert: Any, now_ns: int) -> None:
        """Track firing alerts per node and, from budget-tier alerts, the budget left."""
        node = _required(alert, "node")
        series = self._node(node, now_ns)
        self.counters.alerts += 1
        key = (_required(alert, "name"), getattr(alert, "severity", ""), getattr(alert, "tier", ""))
        ts_ns = int(_required(alert, "ts_ns"))
        if ts_ns < series.alert_ts.get(key, ts_ns):
            self.counters.alerts_stale += 1  # a redelivered older transition must not undo a newer one
            return
        series.alert_ts[key] = ts_ns
        if getattr(alert, "status", "firing") == "resolved":
            series.firing.pop(key, None)
        else:
            series.firing[key] = alert_fingerprint(alert)
        if getattr(alert, "tier", "") == "budget" and alert.value is not None and alert.threshold is not None:
            week = (getattr(alert, "labels", None) or {}).get("week", "")
            series.budget[week] = float(alert.threshold) - float(alert.value)

    def observe_ack(self, ack: Any, now_ns: int) -> bool:
        # an actuator acks a redelivered command again with outcome "duplicate": a distinct ack
        if not self._acks_seen.add((_required(ack, "node"), _required(ack, "command_id"), ack.outcome)):
            self.counters.acks_duplicate += 1
            return False
        series = self._node(ack.node, now_ns)
        self.counters.acks += 1
        key = (getattr(ack, "action", "") or "", ack.outcome)
        series.acks[key] = series.acks.get(key, 0) + 1
        series.units_freed += int(getattr(ack, "units_freed", 0) or 0)
        return True

    def observe_dlq(self, record: Any) -> bool:
        """Count one DLQ record by reason, once per original (topic, partition, offset)."""
        key = (_required(record, "topic"), record.partition, record.offset, record.group)
        if not self._dlq_seen.add(key):
            self.counters.dlq_duplicate += 1
            return False
        self.counters.dlq += 1
        self.dlq_by_reason[record.reason] = self.dlq_by_reason.get(record.reason, 0) + 1
        return True

    def set_own(self, name: str, metric_type: str, help_text: str, value: float, labels: dict[str, str]) -> None:
        """Set one of the exporter's own series (forwarder queue, decode errors …)."""
        family = self.own.setdefault(name, (metric_type, help_text, {}))
        family[2][tuple(sorted(labels.items()))] = float(value)

    def expire(self, now_ns: int) -> list[str]:
        """Drop nodes silent for longer than the TTL; returns their names."""
        gone = [node for node, s in self.nodes.items() if now_ns - s.last_seen_ns > self.ttl_ns]
        for node in gone:
            del self.nodes[node]
        self.counters.nodes_expired += len(gone)
        return gone

    # -- rendering ------------------------------------------------------------------------------

    def render(self, now_ns: int) -> str:
        """The exposition text after dropping stale nodes (HELP/TYPE once per family)."""
        self.expire(now_ns)
        out = _Exposition()
        nodes = sorted(self.nodes.items())
        for name, (_, help_text) in TICK_GAUGES.items():
            out.family(name, "gauge", help_text,
                       [({"node": n}, s.gauges[name]) for n, s in nodes if name in s.gauges])
        out.family("kvguard_tick_timestamp_seconds", "gauge", OTHER_FAMILIES["kvguard_tick_timestamp_seconds"][1],
                   [({"node": n}, s.last_ts_ns / NS_PER_S) for n, s in nodes if s.last_ts_ns >= 0])
        for name, (_, help_text) in TICK_COUNTERS.items():
            out.family(name, "counter", help_text,
                       [({"node": n}, s.counters[name]) for n, s in nodes if name in s.counters])
        kind, help_text = OTHER_FAMILIES["kvguard_budget_remaining_seconds"]
        out.family("kvguard_budget_remaining_seconds", kind, help_text,
                   [({"node": n, "week": w}, v) for n, s in nodes for w, v in sorted(s.budget.items())])
        kind, help_text = OTHER_FAMILIES["kvguard_alert_firing"]
        out.family("kvguard_alert_firing", kind, help_text,
                   [({"node": n, "alertname": a, "severity": sev, "tier": t}, 1.0)
                    for n, s in nodes for (a, sev, t) in sorted(s.firing)])
        kind, help_text = OTHER_FAMILIES["kvguard_dlq_records_total"]
        out.family("kvguard_dlq_records_total", kind, help_text,
                   [({"reason": r}, v) for r, v in sorted(self.dlq_by_reason.items())])
        kind, help_text = OTHER_FAMILIES["kvguard_acks_total"]
        out.family("kvguard_acks_total", kind, help_text,
                   [({"node": n, "action": a, "outcome": o}, v)
                    for n, s in nodes for (a, o), v in sorted(s.acks.items())])
        kind, help_text = OTHER_FAMILIES["kvguard_ack_units_freed_total"]
        out.family("kvguard_ack_units_freed_total", kind, help_text,
                   [({"node": n}, s.units_freed) for n, s in nodes if s.acks])
        for name, (kind, help_text, samples) in sorted(self.own.items()):
            out.family(name, kind, help_text, [(dict(labels), v) for labels, v in sorted(samples.items())])
        return out.text()


class _Exposition:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str, samples: list[tuple[dict[str, str], float]]) -> None:
        if not samples:
            return
        self.lines.append(f"# HELP {name} {_escape_help(help_text)}")
        self.lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            label_text = ",".join(f'{k}="{_escape_label(str(v))}"' for k, v in labels.items())
            self.lines.append(f"{name}{{{label_text}}} {format_value(value)}" if labels
                              else f"{name} {format_value(value)}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n" if self.lines else ""


def format_value(value: float) -> str:
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def _escape_label(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _required(obj: Any, name: str) -> Any:
    value = getattr(obj, name, None)
    if value is None or value == "":
        raise ExportError(name, f"missing on {type(obj).__name__}")
    return value


# ---- alerts ------------------------------------------------------------------------------------


def alert_fingerprint(alert: Any) -> str:
    """The record's fingerprint, or a stable one from node and alert name when it has none."""
    fp = getattr(alert, "fingerprint", "") or ""
    if fp:
        return fp
    return hashlib.sha256(f"{alert.node}\x00{alert.name}".encode()).hexdigest()[:16]


def alert_dedupe_key(alert: Any) -> tuple[str, str, int]:
    """(fingerprint, status, started_at_ns): a redelivered record repeats it; the same rule firing
    again later (a new episode) starts at another time and is sent again."""
    status = getattr(alert, "status", "") or "firing"
    return alert_fingerprint(alert), status, int(getattr(alert, "started_at_ns", 0) or 0)


def rfc3339(ts_ns: int) -> str:
    """``2026-11-29T10:58:02.123Z`` (millisecond precision, UTC)."""
    when = datetime.fromtimestamp(ts_ns // 1_000_000 / 1000, tz=timezone.utc)
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def alertmanager_alert(alert: Any, *, generator_url: str = "", valid_until_ns: int | None = None) -> dict[str, Any]:
    """One ``kvguard.alerts`` record as an Alertmanager v2 postable alert.

    A firing alert carries ``endsAt`` = ``valid_until_ns`` when given (the sender promises to
    resend before then, as Prometheus does), else none (Alertmanager then keeps it for its
    ``resolve_timeout``). A resolved one carries ``endsAt`` = the record's ``ends_at_ns`` (else its
    ``ts_ns``), which is what makes Alertmanager resolve it.
    """
    node, name = _required(alert, "node"), _required(alert, "name")
    status = getattr(alert, "status", "") or "firing"
    if status not in ("firing", "resolved"):
        raise ExportError("status", f"expected firing or resolved, got {status!r} (alert {name} on {node})")
    labels = {str(k): str(v) for k, v in (getattr(alert, "labels", None) or {}).items()}
    labels.update({"alertname": name, "node": node, "severity": alert.severity, "tier": alert.tier})
    annotations = {str(k): str(v) for k, v in (getattr(alert, "annotations", None) or {}).items()}
    summary = getattr(alert, "summary", "") or annotations.get("summary", "")
    if summary:
        annotations["summary"] = summary
    for attr in ("value", "threshold", "p_oom"):
        value = getattr(alert, attr, None)
        if value is not None:
            annotations[attr] = f"{float(value):.6g}"
    annotations["fingerprint"] = alert_fingerprint(alert)
    started_ns = int(getattr(alert, "started_at_ns", 0) or 0) or int(alert.ts_ns)
    out: dict[str, Any] = {"labels": labels, "annotations": annotations, "startsAt": rfc3339(started_ns)}
    if status == "resolved":
        ends_ns = getattr(alert, "ends_at_ns", None)
        out["endsAt"] = rfc3339(int(ends_ns) if ends_ns is not None else int(alert.ts_ns))
    elif valid_until_ns is not None:
        out["endsAt"] = rfc3339(valid_until_ns)
    if generator_url:
        out["generatorURL"] = generator_url
    return out


def webhook_payload(alert: Any, record: dict[str, Any], *, generator_url: str = "") -> dict[str, Any]:
    """The generic JSON webhook body (a chat bridge): the Alertmanager view plus the raw record."""
    return {"version": "kvguard.export/1", "status": getattr(alert, "status", "") or "firing",
            "alert": alertmanager_alert(alert, generator_url=generator_url), "record": record}
