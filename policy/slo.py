"""SLO ledger: per ISO week, how well kvguard predicted and prevented OOMs.

Three records, each idempotent so replays and redelivery never double count:

- prediction outcomes at the operating threshold (TP/FP/TN/FN), one per (node, tick). A tick's
  outcome is only known ``horizon_s`` later (was there an OOM in (t, t + horizon]?);
  ``OutcomeTracker`` turns ticks and OOMs into outcomes. Idempotency is a per-node, per-week
  watermark: an outcome counts only if its ts_ns is later than the last counted one of that node,
  which holds for the in-order per-node stream the bus delivers (key = node) and costs O(nodes)
  instead of a key per tick.
- OOMs with the lead time each tier (threshold, slope, fragmentation, lstm) gave, keyed by
  (node, OOM ts_ns); lead 0 means the tier missed it.
- evictions keyed by (node, request, ts_ns), and the later outcome of each evicted request
  (completed or failed), first outcome wins; the completion rate counts in the eviction's week.

Both ledgers also keep the canary rollout's records and state (``policy.canary``), keyed by the
rollout instead of the week.

Pure core: no clock, no Redis; policy/slo_redis.py stores the same records in Redis.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Protocol

from kvguard.contracts.tiers import LEAD_TIME_SIGNALS
from kvguard.contracts.units import NS_PER_S
from kvguard.policy.budget import iso_week, parse_week
from kvguard.policy.canary import MemoryCanaryLedger

TIERS = LEAD_TIME_SIGNALS
PENDING, COMPLETED, FAILED = "pending", "completed", "failed"


class SloConfigError(ValueError):
    def __init__(self, field_name: str, value: Any, expected: str) -> None:
        super().__init__(f"slo.{field_name}={value!r}: expected {expected}")
        self.field_name = field_name


@dataclass(slots=True, frozen=True)
class SloConfig:
    recall_target: float = 0.90
    fpr_target: float = 0.05
    horizon_s: float = 300.0
    retention_weeks: int = 5
    key_prefix: str = "kvguard:"
    buffer_max: int = 100_000

    def __post_init__(self) -> None:
        for name in ("recall_target", "fpr_target"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise SloConfigError(name, getattr(self, name), "a fraction in [0, 1]")
        if not self.horizon_s > 0:
            raise SloConfigError("horizon_s", self.horizon_s, "seconds > 0")
        if self.retention_weeks < 1:
            raise SloConfigError("retention_weeks", self.retention_weeks, "an integer >= 1")
        if self.buffer_max < 1:
            raise SloConfigError("buffer_max", self.buffer_max, "an integer >= 1")

    @property
    def retention_s(self) -> int:
        return (self.retention_weeks + 1) * 7 * 86_400


def check_tier(tier: str) -> str:
    if not tier or not tier.replace("_", "").isalnum() or "|" in tier:
        raise ValueError(f"tier {tier!r}: expected a name such as {', '.join(TIERS)}")
    return tier


# ----------------------------------------------------------------------------- report

@dataclass(slots=True, frozen=True)
class TierLeads:
    tier: str
    lead_times_s: tuple[float, ...]  # one per OOM, 0 = missed

    @property
    def detected(self) -> int:
        return sum(1 for lead in self.lead_times_s if lead > 0)

    @property
    def median_lead_s(self) -> float | None:
        detected = [lead for lead in self.lead_times_s if lead > 0]
        return statistics.median(detected) if detected else None

    def to_dict(self) -> dict[str, Any]:
        return {"tier": self.tier, "ooms": len(self.lead_times_s), "detected": self.detected,
                "median_lead_s": self.median_lead_s,
                "mean_lead_s": (sum(self.lead_times_s) / len(self.lead_times_s)
                                if self.lead_times_s else None)}


def _ratio(numerator: int, denominator: int) -> float | None:
    return numerator / denominator if denominator else None


@dataclass(slots=True, frozen=True)
class SloReport:
    week: str
    tp: int
    fp: int
    tn: int
    fn: int
    ooms: int
    tiers: tuple[TierLeads, ...]
    evictions: int
    evicted_requests: int
    completed: int
    failed: int
    recall_target: float = 0.90
    fpr_target: float = 0.05

    @property
    def precision(self) -> float | None:
        return _ratio(self.tp, self.tp + self.fp)

    @property
    def recall(self) -> float | None:
        return _ratio(self.tp, self.tp + self.fn)

    @property
    def fpr(self) -> float | None:
        return _ratio(self.fp, self.fp + self.tn)

    @property
    def completion_rate(self) -> float | None:
        return _ratio(self.completed, self.completed + self.failed)

    @property
    def pending(self) -> int:
        return self.evicted_requests - self.completed - self.failed

    @property
    def recall_met(self) -> bool | None:
        return None if self.recall is None else self.recall >= self.recall_target

    @property
    def fpr_met(self) -> bool | None:
        return None if self.fpr is None else self.fpr <= self.fpr_target

    @property
    def slo_met(self) -> bool | None:
        """True/False when both are measurable; None when a week lacks positives or negatives."""
        if self.recall_met is None or self.fpr_met is None:
            return None
        return self.recall_met and self.fpr_met

    def to_dict(self) -> dict[str, Any]:
        return {"week": self.week,
                "predictions": {"tp": self.tp, "fp": self.fp, "tn": self.tn, "fn": self.fn,
                                "precision": self.precision, "recall": self.recall,
                                "fpr": self.fpr},
                "slo": {"recall_target": self.recall_target, "fpr_target": self.fpr_target,
                        "recall_met": self.recall_met, "fpr_met": self.fpr_met,
                        "met": self.slo_met},
                "ooms": self.ooms, "tiers": [t.to_dict() for t in self.tiers],
                "evictions": {"events": self.evictions, "requests": self.evicted_requests,
                              "completed": self.completed, "failed": self.failed,
                              "pending": self.pending, "completion_rate": self.completion_rate}}


def order_tiers(names: Iterable[str]) -> list[str]:
    names = set(names)
    return [t for t in TIERS if t in names] + sorted(names - set(TIERS))


class SloLedger(Protocol):
    config: SloConfig

    def record_prediction(self, node: str, ts_ns: int, predicted: bool, actual: bool) -> bool: ...

    def record_oom(self, node: str, ts_ns: int, lead_s_by_tier: Mapping[str, float]) -> bool: ...

    def record_eviction(self, node: str, req: str, ts_ns: int) -> bool: ...

    def record_eviction_outcome(self, node: str, req: str, completed: bool) -> bool: ...

    def report(self, week: str) -> SloReport: ...

    def weeks(self) -> list[str]: ...

    def close(self) -> None: ...


# ----------------------------------------------------------------------------- memory ledger

@dataclass(slots=True)
class _SloWeek:
    counts: dict[str, int] = field(default_factory=lambda: {"tp": 0, "fp": 0, "tn": 0, "fn": 0})
    watermark: dict[str, int] = field(default_factory=dict)
    ooms: set[tuple[str, int]] = field(default_factory=set)
    leads: dict[str, dict[tuple[str, int], float]] = field(default_factory=dict)
    evictions: set[tuple[str, str, int]] = field(default_factory=set)
    evicted: dict[tuple[str, str], str] = field(default_factory=dict)


class MemorySloLedger(MemoryCanaryLedger):
    """The embedded SLO ledger. Record methods return True when the record counted."""

    def __init__(self, config: SloConfig | None = None) -> None:
        super().__init__()
        self.config = config or SloConfig()
        self._weeks: dict[str, _SloWeek] = {}
        self._eviction_week: dict[tuple[str, str], str] = {}

    def record_prediction(self, node: str, ts_ns: int, predicted: bool, actual: bool) -> bool:
        week = self._week(ts_ns)
        if ts_ns <= week.watermark.get(node, -1 << 63):
            return False
        week.watermark[node] = ts_ns
        week.counts[outcome_field(predicted, actual)] += 1
        return True

    def record_oom(self, node: str, ts_ns: int, lead_s_by_tier: Mapping[str, float]) -> bool:
        week = self._week(ts_ns)
        if (node, ts_ns) in week.ooms:
            return False
        week.ooms.add((node, ts_ns))
        for tier, lead_s in lead_s_by_tier.items():
            week.leads.setdefault(check_tier(tier), {})[(node, ts_ns)] = max(0.0, float(lead_s))
        return True

    def record_eviction(self, node: str, req: str, ts_ns: int) -> bool:
        week_label = iso_week(ts_ns)
        week = self._week(ts_ns)
        if (node, str(req), ts_ns) in week.evictions:
            return False
        week.evictions.add((node, str(req), ts_ns))
        week.evicted.setdefault((node, str(req)), PENDING)
        self._eviction_week.setdefault((node, str(req)), week_label)
        return True

    def record_eviction_outcome(self, node: str, req: str, completed: bool) -> bool:
        week_label = self._eviction_week.get((node, str(req)))
        week = self._weeks.get(week_label) if week_label else None
        if week is None or week.evicted.get((node, str(req))) != PENDING:
            return False
        week.evicted[(node, str(req))] = COMPLETED if completed else FAILED
        return True

    def report(self, week: str) -> SloReport:
        parse_week(week)
        data = self._weeks.get(week) or _SloWeek()
        tiers = tuple(TierLeads(t, tuple(data.leads[t][k] for k in sorted(data.leads[t])))
                      for t in order_tiers(data.leads))
        states = list(data.evicted.values())
        return SloReport(week=week, **data.counts, ooms=len(data.ooms), tiers=tiers,
                         evictions=len(data.evictions), evicted_requests=len(states),
                         completed=states.count(COMPLETED), failed=states.count(FAILED),
                         recall_target=self.config.recall_target,
                         fpr_target=self.config.fpr_target)

    def weeks(self) -> list[str]:
        return sorted(self._weeks)

    def close(self) -> None:
        pass

    def _week(self, ts_ns: int) -> _SloWeek:
        label = iso_week(ts_ns)
        week = self._weeks.get(label)
        if week is None:
            week = self._weeks[label] = _SloWeek()
            # keep the retention_weeks + 1 newest weeks that hold records: counted, not measured from
            # the newest week, so one record of a far-future week cannot expire every real one
            for old in sorted(self._weeks)[: max(0, len(self._weeks) - (self.config.retention_weeks + 1))]:
                if old != label:
                    del self._weeks[old]
            self._eviction_week = {k: w for k, w in self._eviction_week.items() if w in self._weeks}
        return week


def outcome_field(predicted: bool, actual: bool) -> str:
    return ("tp" if actual else "fp") if predicted else ("fn" if actual else "tn")


# ----------------------------------------------------------------------------- labelling

@dataclass(slots=True, frozen=True)
class PredictionOutcome:
    node: str
    ts_ns: int
    predicted: bool
    actual: bool


class OutcomeTracker:
    """Labels predictions once their horizon has passed: the tick at t is positive if an OOM
    happened on its node in (t, t + horizon]. Feed ticks and OOMs in event time per node,
    then ``resolve(now_ns)`` returns the outcomes whose horizon ended before ``now_ns``.

    Per-node state is bounded: a node's OOMs are kept only while it has ticks waiting for their
    label (an OOM cannot label a tick after it), a node is dropped once it has none, and at most
    ``max_nodes`` nodes are held, the least recently seen evicted first (``nodes_evicted``; their
    waiting ticks stay unlabelled). ``resolve`` walks the nodes only when the earliest horizon has
    ended, so a fleet of N nodes costs O(N) per tick interval, not per tick."""

    def __init__(self, threshold: float, horizon_s: float = 300.0, *, max_nodes: int = 10_000) -> None:
        if max_nodes < 1:
            raise SloConfigError("max_nodes", max_nodes, "an integer >= 1")
        self.threshold = threshold
        self.horizon_ns = int(horizon_s * NS_PER_S)
        self.max_nodes = max_nodes
        self.nodes_evicted = 0
        self._pending: dict[str, deque[tuple[int, bool]]] = {}  # least recently seen first
        self._ooms: dict[str, deque[int]] = {}
        self._next_due_ns: int | None = None  # no waiting tick's horizon ends before this

    def observe_tick(self, node: str, ts_ns: int, p_oom: float | None) -> None:
        if p_oom is None:
            return
        pending = self._pending.pop(node, None)
        self._pending[node] = pending = deque() if pending is None else pending
        pending.append((ts_ns, p_oom >= self.threshold))
        due = ts_ns + self.horizon_ns
        if self._next_due_ns is None or due < self._next_due_ns:
            self._next_due_ns = due
        while len(self._pending) > self.max_nodes:
            self.forget(next(iter(self._pending)))
            self.nodes_evicted += 1

    def observe_oom(self, node: str, ts_ns: int) -> None:
        if node in self._pending:  # only a tick already waiting can be labelled by it
            self._ooms.setdefault(node, deque()).append(ts_ns)

    def forget(self, node: str) -> None:
        """Drop a node's waiting ticks and OOMs (an idle node; they stay unlabelled)."""
        self._pending.pop(node, None)
        self._ooms.pop(node, None)

    @property
    def nodes(self) -> int:
        return len(self._pending)

    def resolve(self, now_ns: int) -> list[PredictionOutcome]:
        # a horizon (t, t + h] is closed at its end: an OOM at exactly t + h still labels the tick, and
        # another node's record of that same instant may come first, so only horizons that ended
        # strictly before ``now_ns`` are labelled
        if self._next_due_ns is None or now_ns <= self._next_due_ns:
            return []
        outcomes = []
        done = []
        next_due = None
        for node, pending in self._pending.items():
            ooms = self._ooms.get(node, deque())
            while pending and pending[0][0] + self.horizon_ns < now_ns:
                ts_ns, predicted = pending.popleft()
                while ooms and ooms[0] <= ts_ns:
                    ooms.popleft()
                actual = bool(ooms) and ooms[0] <= ts_ns + self.horizon_ns
                outcomes.append(PredictionOutcome(node, ts_ns, predicted, actual))
            if pending:
                due = pending[0][0] + self.horizon_ns
                next_due = due if next_due is None or due < next_due else next_due
            else:
                done.append(node)
        for node in done:
            self.forget(node)
        self._next_due_ns = next_due
        return outcomes
