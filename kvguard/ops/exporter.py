"""The downstream edge, pure part: Prometheus exposition and Alertmanager alert mapping.

``ExportState`` folds what ``kvguard export`` consumes (metric ticks, alerts, commands, acks, DLQ
records) into per-node series; ``ExportCollector`` is a prometheus_client custom collector over it,
so the text format (0.0.4) and OpenMetrics both come from prometheus_client's own encoders. The
collector reads the state at scrape time and never creates client-side metric objects, which keeps
kvguard's event-time semantics:

- gauges (``kvguard_u_kv`` …) hold the newest tick per node by *event time*: a redelivered or
  late tick older than the one shown never moves a gauge back. Samples carry no timestamp (a
  simulator's event time starts at 0; Prometheus would refuse it): the event time of the tick
  shown is its own gauge, ``kvguard_tick_timestamp_seconds``;
- counters (``kvguard_ooms_total``, ``kvguard_tokens_total`` …) add each tick's per-tick count once:
  a tick is counted once per (node, ts_ns), so at-least-once redelivery does not double count. The
  seen set is bounded per node (``dedupe_ticks``); a tick older than everything it remembers is
  treated as already counted (one node's ticks arrive in order on one partition, so such a tick is a
  redelivery). Rates are counters, not gauges: ``rate(kvguard_tokens_total[5m])`` in PromQL;
- a node's ticks are ordered by (producer ``epoch``, ts_ns): a tick of a newer epoch is a
  restarted node whose event time starts over, so the node's tick series start over with it
  (gauges take its values, counters restart at its deltas: a counter reset to Prometheus); a
  tick of an older epoch is ignored (stale, not counted);
- memory is bounded: at most ``max_nodes`` nodes are held (records of further nodes are refused
  and counted until one leaves), and a node not heard from for ``ttl_s`` of wall time (the
  ``now_ns`` callers pass) is dropped with all its series, so Prometheus sees it go stale instead of
  a frozen value (counted as ``nodes_expired``).

Every per-node series is labelled ``node``, ``gpu``, ``model``, ``instance``: a node id
``<host>/gpu<i>`` gives ``gpu="<i>"`` (DCGM's label) and ``instance="<host>"``; ``model`` is the
tick's ``model`` field when it has one, else the state's default (a setting). Units are base units:
ratios (0..1), seconds, bytes; allocator units become bytes where the tick says how many bytes a
unit holds (``unit_bytes``), and stay ``*_units`` gauges (a count of allocator units) always.

The fleet risk (``kvguard_fleet_risk``, ``kvguard.ml.fleet_risk``) is computed at scrape time from
the newest minute of ticks of every node held. A *fleet* is the nodes that share a ``model``
label: one model's serving Deployment behind one router, the unit an autoscaler scales; with no
model label anywhere (no ``--model-label``, ticks without ``model``) every node of the export is one
fleet, ``model=""``. Each exporter replica sees only the nodes of its partitions, so each serves the
risk of its share of the fleet (a ratio of load to capacity of the same GPUs); take ``max`` over
replicas.

``alertmanager_alert`` maps a ``kvguard.alerts`` record onto Alertmanager's ``/api/v2/alerts``
shape. Inputs are duck-typed (the wire models' attributes), so this module imports no pydantic
and never reads the clock: time is an argument.
"""

from __future__ import annotations

import hashlib
import re
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from prometheus_client.exposition import generate_latest as _text_format
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.openmetrics.exposition import generate_latest as _openmetrics_format

from kvguard.contracts.units import NS_PER_S
from kvguard.ml.fleet_risk import WINDOW_S as FLEET_WINDOW_S
from kvguard.ml.fleet_risk import NodeLoad, fleet_risk

# The classic text format; prometheus_client's bytes for these (legacy-valid) names are 0.0.4 as is
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"

NODE_LABELS: tuple[str, ...] = ("node", "gpu", "model", "instance")
_NODE_ID = re.compile(r"^(?P<host>.+)/gpu(?P<gpu>\d+)$")
# event times before 2000-01-01 come from a simulator's clock (it starts at 0), never from a fleet
SIMULATED_BEFORE_NS = 946_684_800 * NS_PER_S

# gauge name -> (tick attribute, factor, help): the newest tick's value times the factor
TICK_GAUGES: dict[str, tuple[str, float, str]] = {
    "kvguard_u_kv": ("u_kv", 1.0, "KV cache usage U_kv: live KV bytes over the dynamic pool D (ratio)."),
    "kvguard_f_ext": ("f_ext", 1.0, "External fragmentation F_ext: 1 - largest free run / free (ratio)."),
    "kvguard_f_int": ("f_int", 1.0, "Internal fragmentation F_int: unused token slots in live pages (ratio)."),
    "kvguard_psi": ("psi", 1.0, "Pressure index Psi: (KV + workspace + reserve) / D x (1 + 2 F_ext + F_int); "
                                "alerts at 0.95. A pressure score, not a probability of an OOM."),
    "kvguard_u_kv_slope_per_second": ("slope_per_min", 1 / 60, "Slope of U_kv per second of event time "
                                                               "(least squares over the trailing window)."),
    "kvguard_p_oom": ("p_oom", 1.0, "Predicted probability of an OOM within the horizon (absent when no "
                                    "model runs)."),
    "kvguard_kv_free_units": ("free_units", 1.0, "Free allocator units of the dynamic KV pool."),
    # the router series (issue 29; deploy/llm-d/): absent for a node without kvguard's admission gate
    "kvguard_endpoint_admit": ("endpoint_admit", 1.0, "1 while the node's admission gate admits a typical request "
                               "(priority 5), 0 while it holds or refuses (route away)."),
    "kvguard_endpoint_saturation": ("endpoint_saturation", 1.0, "Predicted KV saturation in [0, 1]: the KV blocks "
                                    "running and queued requests will need at their expected final lengths over "
                                    "the cache (predictive, not kv_cache_usage_perc)."),
    "kvguard_endpoint_queue_delay_seconds": ("endpoint_queue_delay_s", 1.0, "Expected queueing delay of a typical "
                                             "request arriving now, until its prefill ends (seconds)."),
    "kvguard_kv_largest_free_run_units": ("largest_free_run_units", 1.0,
                                          "Largest run of contiguous free allocator units."),
    "kvguard_kv_pool_units": ("dynamic_units", 1.0, "Allocator units of the dynamic KV pool D."),
    "kvguard_requests_running": ("requests_running", 1.0, "Requests running on the node."),
    "kvguard_requests_waiting": ("requests_waiting", 1.0, "Requests waiting for KV pages."),
    "kvguard_requests_holding_pages": ("requests_holding_pages", 1.0, "Requests holding KV pages."),
    # the caching-allocator layer (PyTorch's memory_stats names), on nodes that report it
    "kvguard_allocator_reserved_bytes": ("alloc_reserved_bytes", 1.0,
                                         "Bytes the caching allocator reserved from the device (segments)."),
    "kvguard_allocator_allocated_bytes": ("alloc_allocated_bytes", 1.0,
                                          "Bytes allocated by live tensors outside the KV cache."),
    "kvguard_allocator_inactive_split_bytes": ("alloc_inactive_split_bytes", 1.0,
                                               "Free bytes inside segments that still hold an allocation: cached "
                                               "memory empty_cache() cannot return."),
    "kvguard_allocator_largest_free_block_bytes": ("alloc_largest_free_block_bytes", 1.0,
                                                   "Largest cached free block of the caching allocator."),
    "kvguard_allocator_f_ext": ("alloc_f_ext", 1.0, "The allocator's F_ext: 1 - largest free block / cached free "
                                                    "bytes (ratio)."),
    "kvguard_allocator_segments": ("alloc_segments", 1.0, "Segments the caching allocator holds."),
}
# bytes gauge name -> (tick attributes summed, help); present when the tick carries unit_bytes > 0
TICK_BYTES: dict[str, tuple[tuple[str, ...], str]] = {
    "kvguard_kv_free_bytes": (("free_units",), "Free bytes of the dynamic KV pool."),
    "kvguard_kv_largest_free_run_bytes": (("largest_free_run_units",), "Largest contiguous free run, bytes."),
    "kvguard_kv_pool_bytes": (("dynamic_units",), "Bytes of the dynamic KV pool D."),
    "kvguard_kv_live_bytes": (("live_units",), "Bytes of live KV pages."),
    "kvguard_kv_cached_bytes": (("cached_units", "retained_units"), "Bytes of cached (reusable) KV pages."),
    "kvguard_kv_workspace_bytes": (("workspace_units",), "Bytes of workspace buffers in the KV pool."),
}
# the utilization split when a tick has no ``utilization`` map: part -> tick attribute
UTILIZATION_PARTS: dict[str, str] = {
    "weights": "util_weights", "kv_live": "util_kv_live", "kv_cached": "util_kv_cached",
    "workspace": "util_workspace", "free": "util_free", "headroom": "util_headroom", "reserved": "util_reserved",
}
PAGE_QUANTILES: dict[str, str] = {"0.5": "pages_per_request_p50", "0.95": "pages_per_request_p95",
                                  "0.99": "pages_per_request_p99"}
# labelled gauge name -> (extra label, help)
LABELLED_GAUGES: dict[str, tuple[str, str]] = {
    "kvguard_memory_utilization_ratio": ("part", "Device memory split by use (ratio of device memory): "
                                                 "weights, kv_live, kv_cached, workspace, free, headroom; "
                                                 "reserved is the part of D held back."),
    "kvguard_request_pages": ("quantile", "KV pages held per request holding pages, by quantile."),
}
# counter name -> (tick attribute, is a per-second rate, help); a rate attribute times tick_s is the
# tick's count (the stream computes the rate as count / tick_s)
TICK_COUNTERS: dict[str, tuple[str, bool, str]] = {
    "kvguard_ooms_total": ("ooms", False, "KV-cache OOMs (engine crashes) seen in ticks."),
    "kvguard_preemptions_total": ("preemptions", False, "Requests preempted by the engine."),
    "kvguard_evicted_pages_total": ("evicted_pages", False, "Pages evicted."),
    "kvguard_evicted_requests_total": ("evicted_requests", False, "Requests evicted."),
    "kvguard_evicted_tokens_total": ("evicted_tokens", False, "Tokens of evicted KV pages."),
    "kvguard_alloc_failures_total": ("alloc_failures", False, "Failed allocations."),
    "kvguard_requests_arrived_total": ("arrivals", False, "Requests that arrived."),
    "kvguard_requests_finished_total": ("finished", False, "Requests that finished."),
    "kvguard_tokens_total": ("tokens_per_s", True, "Tokens processed (prefill and decode)."),
    "kvguard_decode_tokens_total": ("decode_tokens_per_s", True, "Tokens decoded."),
    "kvguard_allocator_retries_total": ("alloc_retries", False, "Mallocs that found no memory, released the "
                                                              "allocator's cache and retried (the step before an OOM)."),
    "kvguard_governor_decisions_total": ("governed", False, "Engine steps the step governor shrank to fit the "
                                                          "allocator's headroom, and requests it refused."),
    "kvguard_requests_never_fit_total": ("never_fits", False, "Requests refused at arrival because their smallest "
                                                              "step can never fit the node (not retryable there)."),
}
OTHER_FAMILIES: dict[str, tuple[str, str]] = {
    "kvguard_tick_timestamp_seconds": ("gauge", "Event time of the newest tick shown for the node (seconds since "
                                                "the simulation started, in simulator mode)."),
    "kvguard_node_last_seen_timestamp_seconds": ("gauge", "Wall time the exporter last received a record of the "
                                                          "node."),
    "kvguard_budget_remaining_seconds": (
        "gauge", "Fragmentation budget left this ISO week, as of the newest budget alert of the node."),
    "kvguard_alert_firing": ("gauge", "1 while a kvguard alert is firing (from kvguard.alerts)."),
    "kvguard_dlq_records_total": ("counter", "Records dead-lettered on kvguard.dlq, by reason."),
    "kvguard_commands_total": ("counter", "Signed commands the policy issued on kvguard.commands, by action and mode."),
    "kvguard_acks_total": ("counter", "Actuator acknowledgements on kvguard.acks, by action and outcome."),
    "kvguard_ack_units_freed_total": ("counter", "Allocator units freed by acknowledged commands."),
    "kvguard_fleet_risk": ("gauge", "Fleet hazard level in [0, 1] from the newest minute of ticks: prompt tokens "
                                    "taken in against the KV capacity of the GPUs up, and GPUs down. A scale-out "
                                    "signal, not an OOM predictor (kvguard.ml.fleet_risk)."),
    "kvguard_fleet_load_ratio": ("gauge", "Prompt tokens the fleet processed per minute over the KV token capacity of "
                                          "its GPUs up (ratio; +Inf when none is up)."),
    "kvguard_fleet_gpus": ("gauge", "GPUs of the fleet by state: up, or down (unsynced, stale, or routed around)."),
    "kvguard_exporter_nodes": ("gauge", "Nodes whose series the exporter holds."),
    "kvguard_exporter_nodes_limit": ("gauge", "Most nodes the exporter holds (records of further nodes are refused)."),
    "kvguard_exporter_state_events_total": ("counter", "What the exporter's state did with the records it folded, "
                                                       "by event (ticks_duplicate, nodes_expired, records_over_cap "
                                                       "…)."),
}


def node_labels(node: str, model: str = "") -> tuple[str, str, str, str]:
    """(node, gpu, model, instance) of a node id: ``<host>/gpu<i>`` gives gpu ``i`` and instance
    ``<host>``; any other id has no gpu and is its own instance."""
    match = _NODE_ID.match(node)
    if match is None:
        return node, "", model, node
    return node, match["gpu"], model, match["host"]


def is_simulated(ts_ns: int) -> bool:
    """True for an event time on a simulator's clock (before 2000-01-01), not on the wall clock."""
    return 0 <= ts_ns < SIMULATED_BEFORE_NS


class ExportError(ValueError):
    """A record cannot be exported; ``field`` names what is wrong."""

    def __init__(self, field_name: str, problem: str):
        super().__init__(f"{field_name}: {problem}")
        self.field = field_name


@dataclass(slots=True)
class _NodeSeries:
    labels: tuple[str, str, str, str]  # NODE_LABELS values
    epoch: int = 0  # producer epoch of the ticks shown
    last_ts_ns: int = -1
    last_seen_ns: int = 0
    gauges: dict[str, float] = field(default_factory=dict)
    labelled: dict[str, dict[str, float]] = field(default_factory=dict)  # LABELLED_GAUGES name -> {label: v}
    counters: dict[str, float] = field(default_factory=dict)
    seen_ts: set[int] = field(default_factory=set)
    seen_order: deque = field(default_factory=deque)
    budget: dict[str, float] = field(default_factory=dict)  # week -> remaining seconds
    firing: dict[tuple[str, str, str], str] = field(default_factory=dict)  # (alertname, severity, tier) -> fp
    alert_ts: dict[tuple[str, str, str], int] = field(default_factory=dict)  # newest transition's ts_ns
    commands: dict[tuple[str, str], int] = field(default_factory=dict)  # (action, mode) -> count
    acks: dict[tuple[str, str], int] = field(default_factory=dict)
    units_freed: int = 0
    loads: deque = field(default_factory=deque)  # NodeLoad of the ticks shown in the newest FLEET_WINDOW_S


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
    commands: int = 0
    commands_duplicate: int = 0
    acks: int = 0
    acks_duplicate: int = 0
    dlq: int = 0
    dlq_duplicate: int = 0
    nodes_expired: int = 0  # silent for longer than the TTL: dropped with their series
    records_over_cap: int = 0  # of a new node while max_nodes are held: refused

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


class ExportState:
    """Per-node series built from consumed records; ``families(now_ns)`` gives them as
    prometheus_client metric families, ``render(now_ns)`` as exposition text."""

    def __init__(self, *, ttl_s: float = 300.0, max_nodes: int = 5000, dedupe_ticks: int = 512,
                 dedupe_records: int = 100_000, model: str = ""):
        if ttl_s <= 0:
            raise ExportError("ttl_s", f"must be > 0, got {ttl_s}")
        if max_nodes <= 0:
            raise ExportError("max_nodes", f"must be > 0, got {max_nodes}")
        if dedupe_ticks <= 0:
            raise ExportError("dedupe_ticks", f"must be > 0, got {dedupe_ticks}")
        self.ttl_ns = int(ttl_s * NS_PER_S)
        self.max_nodes = max_nodes
        # a redelivery replays at most the uncommitted tail (the consumer commits every batch), so a
        # short window per node suffices; it bounds memory at max_nodes x dedupe_ticks timestamps
        self.dedupe_ticks = dedupe_ticks
        self.model = model
        self.nodes: dict[str, _NodeSeries] = {}
        self.dlq_by_reason: dict[str, int] = {}
        self._dlq_seen = BoundedKeys(dedupe_records)
        self._acks_seen = BoundedKeys(dedupe_records)
        self._commands_seen = BoundedKeys(dedupe_records)
        self.counters = ObserveCounters()
        self._next_room_scan_ns = 0

    def _node(self, node: str, now_ns: int) -> _NodeSeries | None:
        """The node's series (created if there is room); None when max_nodes others are held."""
        series = self.nodes.get(node)
        if series is None:
            if len(self.nodes) >= self.max_nodes and not self._expire_for_room(now_ns):
                self.counters.records_over_cap += 1
                return None
            series = self.nodes[node] = _NodeSeries(labels=node_labels(node, self.model))
        series.last_seen_ns = max(series.last_seen_ns, now_ns)
        return series

    # -- observing ------------------------------------------------------------------------------

    def observe_tick(self, tick: Any, now_ns: int) -> bool:
        """Fold one ``MetricTick``; True when it was new (counted). ``now_ns`` is wall time (TTL)."""
        node, ts_ns = _required(tick, "node"), int(_required(tick, "ts_ns"))
        epoch = int(getattr(tick, "epoch", 0) or 0)
        deltas = tick_counts(tick)  # checked before anything changes
        self.counters.ticks += 1
        series = self._node(node, now_ns)
        if series is None:
            return False
        if epoch < series.epoch:
            self.counters.ticks_old_epoch += 1
            return False
        if epoch > series.epoch:
            self._restart(series, epoch)
        if ts_ns > series.last_ts_ns:
            series.last_ts_ns = ts_ns
            self._show(series, tick)
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
        for name, delta in deltas.items():
            series.counters[name] = series.counters.get(name, 0.0) + delta
        return True

    def _show(self, series: _NodeSeries, tick: Any) -> None:
        """The newest tick's gauges replace the node's (a value the tick lacks disappears)."""
        model = getattr(tick, "model", "") or self.model
        if model != series.labels[2]:
            series.labels = node_labels(series.labels[0], model)
        series.gauges = tick_gauges(tick)
        series.labelled = tick_labelled_gauges(tick)
        series.loads.append(NodeLoad.of(tick))
        oldest_ns = series.loads[-1].ts_ns - int(FLEET_WINDOW_S * NS_PER_S)
        while series.loads[0].ts_ns <= oldest_ns:
            series.loads.popleft()

    def _restart(self, series: _NodeSeries, epoch: int) -> None:
        """The node's producer restarted: its tick series (and the event times they are ordered
        by, alert transitions' included) start over; firing alerts and the budget stay."""
        if series.last_ts_ns >= 0:
            self.counters.node_restarts += 1
        series.epoch, series.last_ts_ns = epoch, -1
        series.gauges.clear()
        series.labelled.clear()
        series.loads.clear()
        series.counters.clear()
        series.seen_ts.clear()
        series.seen_order.clear()
        series.alert_ts.clear()

    def observe_alert(self, alert: Any, now_ns: int) -> None:
        """Track firing alerts per node and, from budget-tier alerts, the budget left."""
        node = _required(alert, "node")
        self.counters.alerts += 1
        series = self._node(node, now_ns)
        if series is None:
            return
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

    def observe_command(self, command: Any, now_ns: int) -> bool:
        """Count one signed command by (action, mode), once per command id."""
        if not self._commands_seen.add(_required(command, "id")):
            self.counters.commands_duplicate += 1
            return False
        self.counters.commands += 1
        series = self._node(_required(command, "node"), now_ns)
        if series is None:
            return False
        key = (getattr(command, "action", "") or "", getattr(command, "mode", "") or "")
        series.commands[key] = series.commands.get(key, 0) + 1
        return True

    def observe_ack(self, ack: Any, now_ns: int) -> bool:
        # an actuator acks a redelivered command again with outcome "duplicate": a distinct ack
        if not self._acks_seen.add((_required(ack, "node"), _required(ack, "command_id"), ack.outcome)):
            self.counters.acks_duplicate += 1
            return False
        self.counters.acks += 1
        series = self._node(ack.node, now_ns)
        if series is None:
            return False
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

    def _expire_for_room(self, now_ns: int) -> bool:
        """Expire idle nodes to make room, scanning at most once a second of wall time (a fleet
        larger than the cap would otherwise scan every node for each refused record)."""
        if now_ns < self._next_room_scan_ns:
            return False
        self._next_room_scan_ns = now_ns + NS_PER_S
        return bool(self.expire(now_ns))

    def expire(self, now_ns: int) -> list[str]:
        """Drop nodes silent for longer than the TTL; returns their names."""
        gone = [node for node, s in self.nodes.items() if now_ns - s.last_seen_ns > self.ttl_ns]
        for node in gone:
            del self.nodes[node]
        self.counters.nodes_expired += len(gone)
        return gone

    # -- exposition -----------------------------------------------------------------------------

    def families(self, now_ns: int) -> list[Metric]:
        """Every non-empty metric family after dropping stale nodes, nodes sorted by id."""
        self.expire(now_ns)
        nodes = [s for _, s in sorted(self.nodes.items())]
        out = _Families()
        for name, (_, _, help_text) in TICK_GAUGES.items():
            out.per_node(name, "gauge", help_text, ((s, (), s.gauges[name]) for s in nodes if name in s.gauges))
        for name, (_, help_text) in TICK_BYTES.items():
            out.per_node(name, "gauge", help_text, ((s, (), s.gauges[name]) for s in nodes if name in s.gauges))
        for name, (label, help_text) in LABELLED_GAUGES.items():
            out.per_node(name, "gauge", help_text, ((s, (k,), v) for s in nodes
                                                    for k, v in sorted(s.labelled.get(name, {}).items())), (label,))
        self._event_families(out, nodes)
        for name, (_, _, help_text) in TICK_COUNTERS.items():
            out.per_node(name, "counter", help_text,
                         ((s, (), s.counters[name]) for s in nodes if name in s.counters))
        self._record_families(out, nodes)
        self._fleet_families(out)
        self._own_families(out)
        return out.non_empty()

    def fleet_risks(self) -> dict[str, Any]:
        """model label -> ``FleetRisk`` of the nodes sharing it (nodes with a tick shown)."""
        fleets: dict[str, dict[str, list]] = {}
        for node, series in sorted(self.nodes.items()):
            if series.loads:
                fleets.setdefault(series.labels[2], {})[node] = list(series.loads)
        return {model: fleet_risk(history) for model, history in fleets.items()}

    def _fleet_families(self, out: _Families) -> None:
        risks = sorted(self.fleet_risks().items())
        out.plain("kvguard_fleet_risk", *_other("kvguard_fleet_risk"), [((m,), r.hazard) for m, r in risks], ("model",))
        out.plain("kvguard_fleet_load_ratio", *_other("kvguard_fleet_load_ratio"),
                  [((m,), r.load_ratio) for m, r in risks], ("model",))
        out.plain("kvguard_fleet_gpus", *_other("kvguard_fleet_gpus"),
                  [((m, state), n) for m, r in risks for state, n in (("up", r.gpus_up), ("down", r.gpus_down))],
                  ("model", "state"))

    def _event_families(self, out: _Families, nodes: list[_NodeSeries]) -> None:
        out.per_node("kvguard_tick_timestamp_seconds", *_other("kvguard_tick_timestamp_seconds"),
                     ((s, (), s.last_ts_ns / NS_PER_S) for s in nodes if s.last_ts_ns >= 0))
        out.per_node("kvguard_node_last_seen_timestamp_seconds",
                     *_other("kvguard_node_last_seen_timestamp_seconds"),
                     ((s, (), s.last_seen_ns / NS_PER_S) for s in nodes))
        out.per_node("kvguard_budget_remaining_seconds", *_other("kvguard_budget_remaining_seconds"),
                     ((s, (w,), v) for s in nodes for w, v in sorted(s.budget.items())), ("week",))
        out.per_node("kvguard_alert_firing", *_other("kvguard_alert_firing"),
                     ((s, key, 1.0) for s in nodes for key in sorted(s.firing)), ("alertname", "severity", "tier"))

    def _record_families(self, out: _Families, nodes: list[_NodeSeries]) -> None:
        out.per_node("kvguard_commands_total", *_other("kvguard_commands_total"),
                     ((s, key, v) for s in nodes for key, v in sorted(s.commands.items())), ("action", "mode"))
        out.per_node("kvguard_acks_total", *_other("kvguard_acks_total"),
                     ((s, key, v) for s in nodes for key, v in sorted(s.acks.items())), ("action", "outcome"))
        out.per_node("kvguard_ack_units_freed_total", *_other("kvguard_ack_units_freed_total"),
                     ((s, (), s.units_freed) for s in nodes if s.acks))
        out.plain("kvguard_dlq_records_total", *_other("kvguard_dlq_records_total"),
                  [((r,), v) for r, v in sorted(self.dlq_by_reason.items())], ("reason",))

    def _own_families(self, out: _Families) -> None:
        out.plain("kvguard_exporter_nodes", *_other("kvguard_exporter_nodes"), [((), len(self.nodes))])
        out.plain("kvguard_exporter_nodes_limit", *_other("kvguard_exporter_nodes_limit"), [((), self.max_nodes)])
        out.plain("kvguard_exporter_state_events_total", *_other("kvguard_exporter_state_events_total"),
                  [((event,), n) for event, n in self.counters.as_dict().items()], ("event",))

    def render(self, now_ns: int, *, openmetrics: bool = False) -> str:
        """The exposition text (the 0.0.4 text format, or OpenMetrics) after dropping stale nodes."""
        return encode(ExportCollector(self, lambda: now_ns), openmetrics=openmetrics).decode()


class ExportCollector:
    """A prometheus_client custom collector over an ``ExportState``: register it on a
    ``CollectorRegistry`` (``registry.register(ExportCollector(state, time.time_ns))``). ``clock``
    gives the wall time, in ns, that the TTL is measured against at each scrape."""

    def __init__(self, state: ExportState, clock: Callable[[], int]):
        self.state, self.clock = state, clock

    def collect(self) -> Iterable[Metric]:
        return self.state.families(self.clock())


class _Collectors:
    def __init__(self, collectors: tuple[Any, ...]):
        self.collectors = collectors

    def collect(self) -> Iterable[Metric]:
        for collector in self.collectors:
            yield from collector.collect()


def encode(*collectors: Any, openmetrics: bool = False) -> bytes:
    """The families of ``collectors`` (anything with ``collect()``, a registry too) in the 0.0.4
    text format, or in OpenMetrics (``# EOF`` terminated)."""
    source = _Collectors(collectors)
    return _openmetrics_format(source) if openmetrics else _text_format(source)


def wants_openmetrics(accept: str) -> bool:
    """True when an HTTP ``Accept`` header asks for OpenMetrics (Prometheus does by default)."""
    return "application/openmetrics-text" in (accept or "")


class _Families:
    """Collects metric families in exposition order; empty ones are left out."""

    def __init__(self) -> None:
        self.families: list[Metric] = []

    def per_node(self, name: str, kind: str, help_text: str,
                 samples: Iterable[tuple[_NodeSeries, tuple[str, ...], float]], extra: tuple[str, ...] = ()) -> None:
        family = _family(name, kind, help_text, NODE_LABELS + extra)
        for series, values, value in samples:
            family.add_metric([*series.labels, *values], float(value))
        self.families.append(family)

    def plain(self, name: str, kind: str, help_text: str, samples: Iterable[tuple[tuple[str, ...], float]],
              labels: tuple[str, ...] = ()) -> None:
        family = _family(name, kind, help_text, labels)
        for values, value in samples:
            family.add_metric(list(values), float(value))
        self.families.append(family)

    def non_empty(self) -> list[Metric]:
        return [family for family in self.families if family.samples]


def _family(name: str, kind: str, help_text: str, labels: tuple[str, ...]) -> Metric:
    if kind == "counter":
        return CounterMetricFamily(name, help_text, labels=list(labels))
    return GaugeMetricFamily(name, help_text, labels=list(labels))


def _other(name: str) -> tuple[str, str]:
    return OTHER_FAMILIES[name]


def tick_gauges(tick: Any) -> dict[str, float]:
    """The unlabelled gauges of one tick: TICK_GAUGES, and TICK_BYTES when it carries ``unit_bytes``."""
    out = {}
    for name, (attr, factor, _) in TICK_GAUGES.items():
        value = getattr(tick, attr, None)
        if value is not None:
            out[name] = float(value) * factor
    unit_bytes = int(getattr(tick, "unit_bytes", 0) or 0)
    if unit_bytes > 0:
        for name, (attrs, _) in TICK_BYTES.items():
            out[name] = float(sum(int(getattr(tick, a, 0) or 0) for a in attrs) * unit_bytes)
    return out


def tick_labelled_gauges(tick: Any) -> dict[str, dict[str, float]]:
    """The utilization split (the tick's ``utilization`` map, else its util_* fields) and the
    per-request page quantiles, by their extra label's value."""
    split = getattr(tick, "utilization", None) or {
        part: getattr(tick, attr) for part, attr in UTILIZATION_PARTS.items() if getattr(tick, attr, None) is not None}
    pages = {q: getattr(tick, attr) for q, attr in PAGE_QUANTILES.items() if getattr(tick, attr, None) is not None}
    return {"kvguard_memory_utilization_ratio": {str(k): float(v) for k, v in split.items()},
            "kvguard_request_pages": {q: float(v) for q, v in pages.items()}}


def tick_counts(tick: Any) -> dict[str, float]:
    """The tick's count for each counter (a rate times ``tick_s``); ExportError when one is negative."""
    tick_s = float(getattr(tick, "tick_s", 0.0) or 0.0)
    out = {}
    for name, (attr, per_second, _) in TICK_COUNTERS.items():
        value = float(getattr(tick, attr, 0) or 0)
        count = round(value * tick_s) if per_second else value
        if count < 0:
            raise ExportError(attr, f"per-tick count must be >= 0, got {value} (node {tick.node}, ts_ns {tick.ts_ns})")
        out[name] = float(count)
    return out


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


# alertname -> its runbook (docs/runbooks/), put on forwarded alerts as the Prometheus rules do
RUNBOOKS: dict[str, str] = {
    "KVCacheUsageHigh": "kv-cache-usage.md", "KVCacheUsageCritical": "kv-cache-usage.md",
    "KVCacheUsageRising": "kv-cache-usage.md", "KVCachePressureCritical": "kv-cache-pressure.md",
    "KVCacheOOMRisk": "kv-cache-oom-risk.md", "KVCacheOOMPredicted": "kv-cache-oom-predicted.md",
    "KVCacheOOMOccurred": "kv-cache-oom-occurred.md", "FragmentationBudgetExhausted": "fragmentation-budget.md",
}
RUNBOOK_PREFIX = "docs/runbooks/"


def alertmanager_alert(alert: Any, *, generator_url: str = "", valid_until_ns: int | None = None,
                       received_ns: int | None = None, first_received_ns: int | None = None) -> dict[str, Any]:
    """One ``kvguard.alerts`` record as an Alertmanager v2 postable alert.

    A firing alert carries ``endsAt`` = ``valid_until_ns`` when given (the sender promises to
    resend before then, as Prometheus does), else none (Alertmanager then keeps it for its
    ``resolve_timeout``). A resolved one carries ``endsAt`` = the record's ``ends_at_ns`` (else its
    ``ts_ns``), which is what makes Alertmanager resolve it.

    Times are the record's event times, which on a fleet are wall times. A simulator's event time
    (``is_simulated``: it starts at 0) would read as 1970, so then, when the caller passes the wall
    time it received the record (``received_ns``) and the episode's first record
    (``first_received_ns``), ``startsAt``/``endsAt`` are those wall times of receipt; the
    ``event_time`` annotation always gives the record's own event time, and ``time_source`` says
    which clock ``startsAt`` is on.
    """
    node, name = _required(alert, "node"), _required(alert, "name")
    status = getattr(alert, "status", "") or "firing"
    if status not in ("firing", "resolved"):
        raise ExportError("status", f"expected firing or resolved, got {status!r} (alert {name} on {node})")
    labels = {str(k): str(v) for k, v in (getattr(alert, "labels", None) or {}).items()}
    labels.update({"alertname": name, "node": node, "severity": alert.severity, "tier": alert.tier})
    annotations = _annotations(alert, name)
    started_ns = int(getattr(alert, "started_at_ns", 0) or 0) or int(alert.ts_ns)
    ends_ns = getattr(alert, "ends_at_ns", None)
    ends_ns = int(ends_ns) if ends_ns is not None else int(alert.ts_ns)
    simulated = is_simulated(started_ns)
    if simulated and received_ns is not None:
        started_ns, ends_ns = first_received_ns or received_ns, received_ns
        annotations["event_time"] = f"{int(alert.ts_ns) / NS_PER_S:.1f} s on the simulator's clock"
        annotations["time_source"] = "wall time of receipt (simulated event time)"
    else:
        annotations["event_time"] = rfc3339(int(alert.ts_ns))
        annotations["time_source"] = "simulated event time" if simulated else "event time"
    out: dict[str, Any] = {"labels": labels, "annotations": annotations, "startsAt": rfc3339(started_ns)}
    if status == "resolved":
        out["endsAt"] = rfc3339(ends_ns)
    elif valid_until_ns is not None:
        out["endsAt"] = rfc3339(valid_until_ns)
    if generator_url:
        out["generatorURL"] = generator_url
    return out


def _annotations(alert: Any, name: str) -> dict[str, str]:
    annotations = {str(k): str(v) for k, v in (getattr(alert, "annotations", None) or {}).items()}
    summary = getattr(alert, "summary", "") or annotations.get("summary", "")
    if summary:
        annotations["summary"] = summary
    for attr in ("value", "threshold", "p_oom"):
        value = getattr(alert, attr, None)
        if value is not None:
            annotations[attr] = f"{float(value):.6g}"
    if name in RUNBOOKS:
        annotations.setdefault("runbook_url", RUNBOOK_PREFIX + RUNBOOKS[name])
    annotations["fingerprint"] = alert_fingerprint(alert)
    return annotations


def webhook_payload(alert: Any, record: dict[str, Any], *, generator_url: str = "", received_ns: int | None = None,
                    first_received_ns: int | None = None) -> dict[str, Any]:
    """The generic JSON webhook body (a chat bridge): the Alertmanager view plus the raw record."""
    view = alertmanager_alert(alert, generator_url=generator_url, received_ns=received_ns,
                              first_received_ns=first_received_ns)
    return {"version": "kvguard.export/1", "status": getattr(alert, "status", "") or "firing",
            "alert": view, "record": record}
