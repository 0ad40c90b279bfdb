"""Fragmentation budget: per node and cluster, per ISO week (UTC), the seconds spent with
F_ext above a threshold, debited once per tick, like an SRE error budget.

The F_ext debited is the layer's where fragmentation exists (``fragmented_f_ext``): the KV layer's,
or the caching allocator's where the node reports that layer and it is the more fragmented. On
uniform-block engines (vLLM's paged KV cache: any free block serves any request) the KV layer's F_ext
is 0 by construction, and the fragmentation that can fail a step is the allocator's.

Pure core: week arithmetic, the debit computation, the ledger interface, the in-memory ledger
(the embedded default) and the outage buffer used by the Redis ledger (policy/budget_redis.py).
No clock is read here: every debit carries the tick's own timestamp, so a replay of the same
ticks gives the same ledger. A tick stamped ``ts_ns`` covers [ts_ns − tick_s, ts_ns) (as streams'
``Tick`` does) and is attributed whole to the ISO week and burn bucket of its last instant,
ts_ns − 1 ns: the tick stamped Monday 00:00:00 UTC closes the old week. Streams' tick boundaries
are multiples of tick_s since the epoch, so for any tick_s dividing a week no tick straddles.

Idempotency: a debit is keyed by (node, ts_ns). The first debit of a key counts, later ones
(replays, at-least-once redelivery, the outage buffer replayed) are duplicates and change nothing.
Only burning ticks (F_ext > threshold) are recorded at all, so a healthy fleet costs the ledger
nothing.
"""

from __future__ import annotations

import datetime as _dt
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol

from kvguard.contracts.tick import Tick
from kvguard.contracts.units import NS_PER_S

WEEK_S = 7 * 86_400
ALERT_RULE = "FragmentationBudgetExhausted"
_WEEK_RE = re.compile(r"^(\d{4})-W(\d{2})$")


class BudgetConfigError(ValueError):
    """A budget setting is out of range; the message names the field."""

    def __init__(self, field_name: str, value: Any, expected: str) -> None:
        super().__init__(f"budget.{field_name}={value!r}: expected {expected}")
        self.field_name = field_name
        self.value = value


class WeekFormatError(ValueError):
    """A week label is not an ISO week such as ``2026-W48``."""

    def __init__(self, value: str) -> None:
        super().__init__(f"week {value!r}: expected an ISO week YYYY-Www, e.g. 2026-W48")
        self.value = value


class LedgerUnavailable(RuntimeError):
    """A read (status, report) could not reach the ledger's store."""


@dataclass(slots=True, frozen=True)
class BudgetConfig:
    """Budget settings. ``interval_s`` is the width of the burn buckets that exhaustion reports
    (the intervals that burned the most); ``buffer_max`` bounds the outage buffer."""

    budget_s: float = 3600.0
    threshold: float = 0.5
    retention_weeks: int = 5
    key_prefix: str = "kvguard:"
    cluster: str = "default"
    interval_s: int = 3600
    top_intervals: int = 5
    buffer_max: int = 100_000

    def __post_init__(self) -> None:
        if not self.budget_s > 0:
            raise BudgetConfigError("budget_s", self.budget_s, "seconds > 0 (60 min = 3600)")
        if not 0.0 <= self.threshold < 1.0:
            raise BudgetConfigError("threshold", self.threshold, "an F_ext level in [0, 1)")
        if self.retention_weeks < 1:
            raise BudgetConfigError("retention_weeks", self.retention_weeks, "an integer >= 1")
        if self.interval_s < 1 or WEEK_S % self.interval_s:
            raise BudgetConfigError("interval_s", self.interval_s, "seconds >= 1 dividing a week")
        if self.top_intervals < 1:
            raise BudgetConfigError("top_intervals", self.top_intervals, "an integer >= 1")
        if self.buffer_max < 1:
            raise BudgetConfigError("buffer_max", self.buffer_max, "an integer >= 1")
        if not self.cluster:
            raise BudgetConfigError("cluster", self.cluster, "a non-empty cluster name")

    @property
    def budget_ms(self) -> int:
        return round(self.budget_s * 1000)

    @property
    def retention_s(self) -> int:
        """Keys live this long after their last write: the week itself plus the retention."""
        return (self.retention_weeks + 1) * WEEK_S


# ----------------------------------------------------------------------------- weeks

def iso_week(ts_ns: int) -> str:
    """The ISO week label (UTC) of a timestamp: ``2026-W48``."""
    day = _dt.date(1970, 1, 1) + _dt.timedelta(days=ts_ns // NS_PER_S // 86_400)
    year, week, _ = day.isocalendar()
    return f"{year:04d}-W{week:02d}"


def parse_week(week: str) -> tuple[int, int]:
    """``"2026-W48"`` → (2026, 48); raises WeekFormatError for labels that do not exist
    (e.g. 2025-W53: 2025 has 52 ISO weeks)."""
    match = _WEEK_RE.match(week.strip()) if isinstance(week, str) else None
    if not match:
        raise WeekFormatError(str(week))
    year, number = int(match.group(1)), int(match.group(2))
    try:
        monday = _dt.date.fromisocalendar(year, number, 1)
    except ValueError:
        raise WeekFormatError(week) from None
    if monday.isocalendar()[:2] != (year, number):
        raise WeekFormatError(week)
    return year, number


def week_start_ns(week: str) -> int:
    """Monday 00:00:00 UTC of an ISO week, in ns since the epoch."""
    year, number = parse_week(week)
    monday = _dt.date.fromisocalendar(year, number, 1)
    return (monday - _dt.date(1970, 1, 1)).days * 86_400 * NS_PER_S


def week_bounds_ns(week: str) -> tuple[int, int]:
    """[start, end) of an ISO week in ns."""
    start = week_start_ns(week)
    return start, start + WEEK_S * NS_PER_S


def shift_week(week: str, weeks: int) -> str:
    return iso_week(week_start_ns(week) + weeks * WEEK_S * NS_PER_S)


def interval_start_s(ts_ns: int, interval_s: int) -> int:
    """Start (s since epoch) of the burn bucket holding ``ts_ns``; buckets align to the epoch,
    and since the epoch's Monday is a multiple of any divisor of a week away, also to weeks."""
    ts_s = ts_ns // NS_PER_S
    return ts_s - (ts_s - _EPOCH_MONDAY_S) % interval_s


_EPOCH_MONDAY_S = -3 * 86_400  # 1969-12-29, the Monday of the epoch's ISO week


# ----------------------------------------------------------------------------- debits

@dataclass(slots=True, frozen=True)
class Debit:
    """One burning tick, ready to be recorded: ``ms`` milliseconds over the threshold.
    Integer milliseconds keep sums exact whatever order debits arrive in."""

    node: str
    cluster: str
    ts_ns: int
    ms: int
    week: str
    interval_start_s: int


def compute_debit(config: BudgetConfig, node: str, ts_ns: int, tick_s: float, f_ext: float,
                  cluster: str | None = None) -> Debit | None:
    """The debit for one tick, or None when the tick does not burn (F_ext ≤ threshold)."""
    if not node:
        raise ValueError("debit: node must be a non-empty node id")
    if not tick_s > 0:
        raise ValueError(f"debit for {node}: tick_s={tick_s!r}, expected seconds > 0")
    if not f_ext > config.threshold:  # also false for NaN: an undefined F_ext burns nothing
        return None
    last_ns = int(ts_ns) - 1
    return Debit(node=node, cluster=cluster or config.cluster, ts_ns=int(ts_ns),
                 ms=round(tick_s * 1000), week=iso_week(last_ns),
                 interval_start_s=interval_start_s(last_ns, config.interval_s))


@dataclass(slots=True, frozen=True)
class BurnInterval:
    start_s: int
    burned_s: float

    def label(self, interval_s: int) -> str:
        start = _dt.datetime.fromtimestamp(self.start_s, _dt.timezone.utc)
        end = _dt.datetime.fromtimestamp(self.start_s + interval_s, _dt.timezone.utc)
        return f"{start:%Y-%m-%d %H:%M}–{end:%H:%M}Z"


@dataclass(slots=True, frozen=True)
class BudgetAlert:
    """RCA-required alert, raised once per node per week when the node's budget is spent.
    Plain values so the wire layer (kvguard/schemas.py Alert) can map it."""

    node: str
    cluster: str
    week: str
    ts_ns: int
    used_s: float
    budget_s: float
    top_intervals: tuple[BurnInterval, ...]
    rule: str = ALERT_RULE
    severity: str = "critical"
    rca_required: bool = True

    @property
    def summary(self) -> str:
        return (f"{self.node}: fragmentation budget for {self.week} exhausted "
                f"({self.used_s / 60:.1f} of {self.budget_s / 60:.0f} min with F_ext above "
                f"threshold); root-cause analysis required")

    def alert_fields(self) -> dict[str, Any]:
        """Keyword arguments for the wire model ``kvguard.wire.schemas.Alert(**fields)``; the
        fingerprint is stable per node and week, so a redelivered alert dedups downstream."""
        intervals = "; ".join(f"{i.start_s}:{i.burned_s:g}s" for i in self.top_intervals)
        return {"node": self.node, "ts_ns": self.ts_ns, "name": self.rule, "tier": "budget",
                "severity": self.severity, "status": "firing",
                "fingerprint": f"{self.rule}:{self.node}:{self.week}",
                "value": self.used_s, "threshold": self.budget_s, "summary": self.summary,
                "labels": {"cluster": self.cluster, "week": self.week, "rca_required": "true"},
                "annotations": {"top_intervals": intervals}}

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "cluster": self.cluster, "week": self.week,
                "ts_ns": self.ts_ns, "rule": self.rule, "severity": self.severity,
                "rca_required": self.rca_required, "summary": self.summary,
                "used_s": self.used_s, "budget_s": self.budget_s,
                "top_intervals": [{"start_s": i.start_s, "burned_s": i.burned_s}
                                  for i in self.top_intervals]}


@dataclass(slots=True, frozen=True)
class DebitResult:
    """What a debit did. ``counted`` is False for a duplicate or a non-burning tick;
    ``buffered`` is True when the store was unreachable (or refused the write for a while,
    e.g. a replica during failover) and the debit waits in memory (then ``used_s`` is a local
    estimate); ``failed`` is True when the store refused the debit for good (a script or
    key-type error): it was logged and counted in ``LedgerStats.errors``, and is lost."""

    node: str
    week: str
    counted: bool
    used_s: float
    remaining_s: float
    exhausted: bool
    buffered: bool = False
    failed: bool = False


@dataclass(slots=True, frozen=True)
class NodeBudget:
    node: str
    cluster: str
    week: str
    used_s: float
    budget_s: float
    alerted: bool
    top_intervals: tuple[BurnInterval, ...]

    @property
    def remaining_s(self) -> float:
        return max(0.0, self.budget_s - self.used_s)

    @property
    def exhausted(self) -> bool:
        return self.used_s >= self.budget_s

    def to_dict(self, interval_s: int) -> dict[str, Any]:
        return {"node": self.node, "cluster": self.cluster, "week": self.week,
                "used_s": self.used_s, "budget_s": self.budget_s,
                "remaining_s": self.remaining_s, "exhausted": self.exhausted,
                "alerted": self.alerted,
                "top_intervals": [{"start_s": i.start_s, "label": i.label(interval_s),
                                   "burned_s": i.burned_s} for i in self.top_intervals]}


@dataclass(slots=True, frozen=True)
class WeekStatus:
    week: str
    budget_s: float
    interval_s: int
    nodes: tuple[NodeBudget, ...]
    clusters: dict[str, float]  # cluster → seconds burned by all its nodes

    def to_dict(self) -> dict[str, Any]:
        return {"week": self.week, "budget_s": self.budget_s, "interval_s": self.interval_s,
                "nodes": [n.to_dict(self.interval_s) for n in self.nodes],
                "clusters": [{"cluster": c, "used_s": s,
                              "nodes": sum(1 for n in self.nodes if n.cluster == c)}
                             for c, s in sorted(self.clusters.items())],
                "total_used_s": sum(self.clusters.values())}


@dataclass(slots=True)
class LedgerStats:
    """Counters a caller can export as metrics. ``outage`` is True while the store is down."""

    backend: str
    debits: int = 0
    counted: int = 0
    duplicates: int = 0
    below_threshold: int = 0
    alerts: int = 0
    outage: bool = False
    outages: int = 0
    buffered: int = 0
    buffer_max: int = 0
    dropped: int = 0
    replayed: int = 0
    # refusals Redis answered (READONLY, OOM, WRONGTYPE…): transient ones are also buffered and
    # retried, so a failover counts once per attempt; the rest are dropped (logged at ERROR)
    errors: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


class BudgetLedger(Protocol):
    """What the policy engine and the CLI use; memory and Redis ledgers implement it.
    ``debit`` never raises for store trouble; ``status`` raises LedgerUnavailable."""

    config: BudgetConfig

    def debit(self, node: str, ts_ns: int, tick_s: float, f_ext: float,
              cluster: str | None = None) -> DebitResult: ...

    def debit_tick(self, tick: Tick, tick_s: float | None = None,
                   cluster: str | None = None) -> DebitResult: ...

    def remaining(self, node: str, week: str) -> float: ...

    def status(self, week: str, node: str | None = None) -> WeekStatus: ...

    def weeks(self) -> list[str]: ...

    def take_alerts(self) -> list[BudgetAlert]: ...

    def stats(self) -> LedgerStats: ...

    def close(self) -> None: ...


def tick_week(ts_ns: int) -> str:
    """The budget week of a tick stamped ``ts_ns`` (the week of its last instant)."""
    return iso_week(int(ts_ns) - 1)


def fragmented_f_ext(f_ext: float, alloc_f_ext: float = 0.0, alloc_reserved_bytes: int = 0) -> float:
    """The F_ext the budget debits: the KV layer's ``f_ext``, or the caching allocator's
    ``alloc_f_ext`` when the node reports an allocator layer (``alloc_reserved_bytes`` > 0) and it is
    higher. A NaN KV F_ext stays NaN (burns nothing)."""
    if alloc_reserved_bytes and alloc_f_ext > f_ext:
        return float(alloc_f_ext)
    return float(f_ext)


def tick_values(tick: Tick, tick_s: float | None) -> tuple[str, int, float, float]:
    """(node, ts_ns, tick_s, f_ext) of a streams Tick (or anything with node, ts_ns, f_ext and,
    unless ``tick_s`` is given, tick_s); f_ext is the layer's that fragments (``fragmented_f_ext``;
    the allocator fields count as absent on a record without them)."""
    try:
        seconds = float(tick.tick_s) if tick_s is None else float(tick_s)
        f_ext = fragmented_f_ext(float(tick.f_ext), float(getattr(tick, "alloc_f_ext", 0.0)),
                                 int(getattr(tick, "alloc_reserved_bytes", 0)))
        return str(tick.node), int(tick.ts_ns), seconds, f_ext
    except AttributeError as exc:
        raise TypeError(f"debit_tick: {type(tick).__name__} lacks {exc.name!r}; "
                        "expected attributes node, ts_ns, f_ext (and tick_s unless given)") from None


# ----------------------------------------------------------------------------- memory ledger

@dataclass(slots=True)
class _NodeWeek:
    cluster: str
    used_ms: int = 0
    seen_ts: set[int] = field(default_factory=set)
    burn_ms: dict[int, int] = field(default_factory=dict)
    alerted_ts_ns: int | None = None


class LedgerFront:
    """What both ledgers share: the debit entry points (threshold check, counters), the
    result built from the backend's view of a node's week, and the alert queue, which passes
    each (node, week) once per ledger object however often the backend reports the claim (a
    replayed debit whose first reply was lost reports it again)."""

    _ALERTED_MAX = 100_000

    def __init__(self, config: BudgetConfig | None, stats: LedgerStats) -> None:
        self.config = config or BudgetConfig()
        self._stats = stats
        self._alerts: list[BudgetAlert] = []
        self._alerted: set[tuple[str, str]] = set()

    def debit(self, node: str, ts_ns: int, tick_s: float, f_ext: float,
              cluster: str | None = None) -> DebitResult:
        self._stats.debits += 1
        debit = compute_debit(self.config, node, ts_ns, tick_s, f_ext, cluster)
        if debit is None:
            self._stats.below_threshold += 1
            return self._result(node, tick_week(ts_ns), counted=False)
        return self.apply(debit)

    def debit_tick(self, tick: Tick, tick_s: float | None = None,
                   cluster: str | None = None) -> DebitResult:
        node, ts_ns, seconds, f_ext = tick_values(tick, tick_s)
        return self.debit(node, ts_ns, seconds, f_ext, cluster)

    def apply(self, debit: Debit) -> DebitResult:
        raise NotImplementedError

    def take_alerts(self) -> list[BudgetAlert]:
        alerts, self._alerts = self._alerts, []
        return alerts

    def _emit(self, alert: BudgetAlert) -> bool:
        """Queue an alert unless this (node, week) already had one; True when queued."""
        key = (alert.node, alert.week)
        if key in self._alerted:
            return False
        if len(self._alerted) >= self._ALERTED_MAX:
            self._alerted.clear()  # bounded; a repeat past this is deduped by its fingerprint
        self._alerted.add(key)
        self._alerts.append(alert)
        self._stats.alerts += 1
        return True

    def _used_ms(self, node: str, week: str) -> int:
        raise NotImplementedError

    def _result(self, node: str, week: str, *, counted: bool, buffered: bool = False,
                failed: bool = False) -> DebitResult:
        used_s = self._used_ms(node, week) / 1000
        return DebitResult(node=node, week=week, counted=counted, used_s=used_s,
                           remaining_s=max(0.0, self.config.budget_s - used_s),
                           exhausted=used_s >= self.config.budget_s, buffered=buffered,
                           failed=failed)


class MemoryBudgetLedger(LedgerFront):
    """The embedded ledger: same semantics as the Redis one, in a dict of
    week → node → totals. Weeks older than the retention (counted back from the newest week
    seen) are dropped when a new week first appears, so memory stays bounded."""

    def __init__(self, config: BudgetConfig | None = None) -> None:
        super().__init__(config, LedgerStats(backend="memory"))
        self._weeks: dict[str, dict[str, _NodeWeek]] = {}

    def apply(self, debit: Debit) -> DebitResult:
        """Record a computed debit (idempotent per node and ts_ns)."""
        entry = self._node_week(debit)
        if debit.ts_ns in entry.seen_ts:
            self._stats.duplicates += 1
            return self._result(debit.node, debit.week, counted=False)
        entry.seen_ts.add(debit.ts_ns)
        entry.used_ms += debit.ms
        entry.burn_ms[debit.interval_start_s] = entry.burn_ms.get(debit.interval_start_s, 0) + debit.ms
        self._stats.counted += 1
        if entry.used_ms >= self.config.budget_ms and entry.alerted_ts_ns is None:
            entry.alerted_ts_ns = debit.ts_ns
            self._emit(BudgetAlert(
                node=debit.node, cluster=entry.cluster, week=debit.week, ts_ns=debit.ts_ns,
                used_s=entry.used_ms / 1000, budget_s=self.config.budget_s,
                top_intervals=_top(entry.burn_ms, self.config.top_intervals)))
        return self._result(debit.node, debit.week, counted=True)

    def remaining(self, node: str, week: str) -> float:
        entry = self._weeks.get(week, {}).get(node)
        used_ms = entry.used_ms if entry else 0
        return max(0.0, (self.config.budget_ms - used_ms) / 1000)

    def status(self, week: str, node: str | None = None) -> WeekStatus:
        parse_week(week)
        nodes = self._weeks.get(week, {})
        clusters: dict[str, float] = {}
        for entry in nodes.values():
            clusters[entry.cluster] = clusters.get(entry.cluster, 0.0) + entry.used_ms / 1000
        rows = tuple(
            NodeBudget(node=name, cluster=entry.cluster, week=week, used_s=entry.used_ms / 1000,
                       budget_s=self.config.budget_s, alerted=entry.alerted_ts_ns is not None,
                       top_intervals=_top(entry.burn_ms, self.config.top_intervals))
            for name, entry in sorted(nodes.items()) if node is None or name == node)
        return WeekStatus(week=week, budget_s=self.config.budget_s,
                          interval_s=self.config.interval_s, nodes=rows, clusters=clusters)

    def weeks(self) -> list[str]:
        return sorted(self._weeks)

    def stats(self) -> LedgerStats:
        return LedgerStats(**self._stats.to_dict())

    def close(self) -> None:
        pass

    def _node_week(self, debit: Debit) -> _NodeWeek:
        nodes = self._weeks.get(debit.week)
        if nodes is None:
            nodes = self._weeks[debit.week] = {}
            self._expire_before(debit.week)
        entry = nodes.get(debit.node)
        if entry is None:
            entry = nodes[debit.node] = _NodeWeek(cluster=debit.cluster)
        return entry

    def _expire_before(self, newest: str) -> None:
        oldest_kept = shift_week(max(self._weeks), -self.config.retention_weeks)
        for week in [w for w in self._weeks if w < oldest_kept and w != newest]:
            del self._weeks[week]

    def _used_ms(self, node: str, week: str) -> int:
        entry = self._weeks.get(week, {}).get(node)
        return entry.used_ms if entry else 0


def _top(burn_ms: dict[int, int], k: int) -> tuple[BurnInterval, ...]:
    ranked = sorted(burn_ms.items(), key=lambda item: (-item[1], item[0]))[:k]
    return tuple(BurnInterval(start_s=start, burned_s=ms / 1000) for start, ms in ranked)


# ----------------------------------------------------------------------------- outage buffer

class OutageBuffer:
    """Operations waiting for the store while it is unreachable, oldest first, bounded:
    past ``max_items`` the oldest is dropped and counted. Replaying is safe because every
    operation is idempotent in the store. ``peek``/``commit`` let a replay keep what it sent
    until the store confirmed it, so a replay cut short by a new failure loses nothing."""

    def __init__(self, max_items: int) -> None:
        if max_items < 1:
            raise ValueError(f"OutageBuffer: max_items={max_items}, expected >= 1")
        self.max_items = max_items
        self.dropped = 0
        self._items: deque[Any] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def append(self, item: Any) -> None:
        if len(self._items) >= self.max_items:
            self._items.popleft()
            self.dropped += 1
        self._items.append(item)

    def peek(self, n: int) -> list[Any]:
        return [self._items[i] for i in range(min(n, len(self._items)))]

    def push_front(self, items: list[Any]) -> None:
        """Put items taken out by ``commit`` back at the head, in their order (a replay that
        the store refused for a while). Past ``max_items`` the oldest are dropped."""
        self._items.extendleft(reversed(items))
        while len(self._items) > self.max_items:
            self._items.popleft()
            self.dropped += 1

    def commit(self, n: int) -> None:
        for _ in range(min(n, len(self._items))):
            self._items.popleft()

    def items(self) -> Iterable[Any]:
        return iter(self._items)


class OutageTracker:
    """Up/down state of a store, so an outage is reported once when it starts and once when
    it ends instead of on every failed call. Returns True from ``failed``/``succeeded`` exactly
    on a transition."""

    def __init__(self) -> None:
        self.down = False
        self.outages = 0
        self.failures_this_outage = 0

    def failed(self) -> bool:
        self.failures_this_outage += 1
        if self.down:
            return False
        self.down = True
        self.outages += 1
        return True

    def succeeded(self) -> bool:
        if not self.down:
            return False
        self.down = False
        self.failures_this_outage = 0
        return True
