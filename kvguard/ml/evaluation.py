"""How well OOMs are predicted: ROC/AUC, recall at a false-positive budget, lead time per tier
(docs/ARCHITECTURE.md, "Alerts and prediction"), false alarms per hour, and the two report plots.

Pure numpy (matplotlib only inside the plotting functions, with the Agg backend). Time is in ns,
as everywhere in kvguard; results are reported in seconds.

Definitions (kept here so the numbers in a report can be traced to one place):

- label: tick t is positive iff an OOM happens in (t, t + horizon] (``labels_for_ticks``).
- AUC: the Mann-Whitney statistic with average ranks for ties, so tied scores count half.
- recall at FPR <= x: the largest true-positive rate over thresholds whose FPR is <= x.
- lead time of a tier for one OOM at T: T - t0, where t0 starts the tier's unbroken firing run
  that reaches T (the last tick strictly before T fires, and so does every tick back to t0). A
  tier not firing at the last tick before T has lead 0 (a miss). The walk back stops at the
  node's previous OOM, so one long firing run is not credited to two crashes.
- false alarm: a firing episode (maximal run of firing ticks) with no OOM in
  (t_start, t_end + horizon]. Rate = false episodes / observed node-hours.
- isolated OOM: one with no OOM on the same node in the ``isolation_s`` (600 s) before it. In a
  crash loop (OOM, restart, OOM again a minute later) no tier can warn longer than the gap since
  the previous crash, so lead times are also reported over isolated OOMs alone.
- masked ticks are neither positive nor negative: a *down* tick falls while the GPU restarts after
  an OOM (T, T_up] (nothing there can be predicted or prevented), a *censored* tick's horizon
  reaches past the end of what was observed (t + horizon > end: its label is unknown). AUC, recall
  and the operating point use scored ticks only; a tier's firing on a masked tick counts neither as
  a warning (lead time) nor as an alarm (false alarms); false alarms per GPU-hour divide by the
  scored hours.
- lead band (a, b]: the positive ticks whose next OOM is a to b seconds ahead, scored against all
  negatives (``LEAD_BANDS_S``: 0-30 s, 30-120 s, 120-300 s), so a model that only sees the last
  seconds shows high AUC in the first band and chance in the last.
- event: OOMs of one fleet within ``cascade_s`` (60 s) of each other are one event (a fleet-wide
  wave); ``auc_ci`` is an event-level bootstrap: resample events (with the positive ticks leading
  to them) and 10-minute blocks of negative ticks per fleet, with replacement, and take the 2.5 and
  97.5 percentiles of the AUC, so a result resting on two waves gets the wide interval it deserves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvguard.contracts.units import NS_PER_S
from kvguard.ml.fleet_risk import fleet_series  # the fleet hazard, evaluated on its own below

DEFAULT_HORIZON_S = 300.0
DEFAULT_ISOLATION_S = 600.0
DEFAULT_CASCADE_S = 60.0
LEAD_BANDS_S: tuple[tuple[float, float], ...] = ((0.0, 30.0), (30.0, 120.0), (120.0, 300.0))
NEGATIVE_BLOCK_S = 600.0  # negatives are resampled in blocks this long: neighbouring ticks are alike
BOOTSTRAP_DRAWS = 500
MIN_CLASS_TICKS = 30  # fewer positive or negative ticks than this: AUC/recall are withheld (noise)


def labels_for_ticks(ts_ns: np.ndarray, oom_ts_ns: np.ndarray, horizon_s: float = DEFAULT_HORIZON_S) -> np.ndarray:
    """1 where an OOM happens in (t, t + horizon], else 0, for each tick time t of one node."""
    ts = np.asarray(ts_ns, dtype=np.int64)
    ooms = np.sort(np.asarray(oom_ts_ns, dtype=np.int64))
    horizon_ns = int(round(horizon_s * NS_PER_S))
    if len(ooms) == 0:
        return np.zeros(len(ts), dtype=np.uint8)
    # the first OOM strictly after t; positive iff it is within the horizon
    nxt = np.searchsorted(ooms, ts, side="right")
    has_next = nxt < len(ooms)
    next_oom = np.where(has_next, ooms[np.minimum(nxt, len(ooms) - 1)], np.iinfo(np.int64).max)
    return (has_next & (next_oom - ts <= horizon_ns)).astype(np.uint8)


def down_mask(ts_ns: np.ndarray, oom_ts_ns: np.ndarray, up_ts_ns: np.ndarray) -> np.ndarray:
    """True for the ticks while the GPU is down: t in (T_k, U_k] for an OOM at T_k back up at U_k."""
    ts = np.asarray(ts_ns, dtype=np.int64)
    ooms = np.asarray(oom_ts_ns, dtype=np.int64)
    ups = np.asarray(up_ts_ns, dtype=np.int64)
    if ooms.shape != ups.shape:
        raise ValueError(f"oom_ts_ns has {ooms.size} entries but up_ts_ns has {ups.size}")
    if ooms.size == 0:
        return np.zeros(len(ts), dtype=bool)
    order = np.argsort(ooms, kind="mergesort")
    ooms, ups = ooms[order], ups[order]
    k = np.searchsorted(ooms, ts, side="left") - 1  # the last OOM strictly before t
    return (k >= 0) & (ts <= np.where(k >= 0, ups[np.maximum(k, 0)], 0))


def censored_mask(ts_ns: np.ndarray, end_ns: int | None, horizon_s: float = DEFAULT_HORIZON_S) -> np.ndarray:
    """True for the ticks whose horizon reaches past ``end_ns`` (None: observed forever)."""
    ts = np.asarray(ts_ns, dtype=np.int64)
    if end_ns is None:
        return np.zeros(len(ts), dtype=bool)
    return ts + int(round(horizon_s * NS_PER_S)) > int(end_ns)


def lead_to_next_oom_s(ts_ns: np.ndarray, oom_ts_ns: np.ndarray) -> np.ndarray:
    """Seconds from each tick to the node's first OOM strictly after it (inf when none follows)."""
    ts = np.asarray(ts_ns, dtype=np.int64)
    ooms = np.sort(np.asarray(oom_ts_ns, dtype=np.int64))
    nxt = np.searchsorted(ooms, ts, side="right")
    out = np.full(len(ts), np.inf)
    has = nxt < len(ooms)
    out[has] = (ooms[nxt[has]] - ts[has]) / NS_PER_S
    return out


def merge_cascades(oom_ts_ns: np.ndarray, fleet: np.ndarray, cascade_s: float = DEFAULT_CASCADE_S) -> np.ndarray:
    """An event id per OOM: OOMs of one fleet each within ``cascade_s`` of the previous one are one
    event (a wave that takes GPU after GPU down counts once, however many GPUs it reaches)."""
    t = np.asarray(oom_ts_ns, dtype=np.int64)
    f = np.asarray(fleet)
    ids = np.zeros(len(t), dtype=np.int64)
    gap_ns = int(round(cascade_s * NS_PER_S))
    next_id = 0
    for name in dict.fromkeys(f.tolist()):
        rows = np.flatnonzero(f == name)
        rows = rows[np.argsort(t[rows], kind="mergesort")]
        new_event = np.r_[True, np.diff(t[rows]) > gap_ns]
        ids[rows] = next_id + np.cumsum(new_event) - 1
        next_id += int(new_event.sum())
    return ids


def weighted_auc(labels: np.ndarray, scores: np.ndarray, weights: np.ndarray) -> float:
    """AUC where tick i counts ``weights[i]`` times (ties count half); NaN with one class."""
    y = np.asarray(labels).astype(bool)
    _, group = np.unique(np.asarray(scores, dtype=np.float64), return_inverse=True)  # tied scores, ascending
    return _grouped_auc(group, y, np.asarray(weights, dtype=np.float64))


def _grouped_auc(group: np.ndarray, y: np.ndarray, w: np.ndarray) -> float:
    pos = np.bincount(group, weights=w * y)
    neg = np.bincount(group, weights=w * ~y)
    total_pos, total_neg = pos.sum(), neg.sum()
    if total_pos <= 0 or total_neg <= 0:
        return float("nan")
    below = np.cumsum(neg) - neg
    return float((pos * (below + 0.5 * neg)).sum() / (total_pos * total_neg))


def bootstrap_auc_ci(labels: np.ndarray, scores: np.ndarray, clusters: np.ndarray, *,
                     draws: int = BOOTSTRAP_DRAWS, seed: int = 0, level: float = 0.95) -> list[float] | None:
    """[low, high] of the AUC when whole clusters are resampled with replacement, positive and
    negative clusters apart (each keeps its count). ``clusters``: one id per tick, never shared
    between a positive and a negative tick. None with fewer than two clusters of either class."""
    y = np.asarray(labels).astype(bool)
    c = np.asarray(clusters, dtype=np.int64)
    _, cid = np.unique(c, return_inverse=True)
    n_clusters = int(cid.max()) + 1 if cid.size else 0
    positive_cluster = np.zeros(n_clusters, dtype=bool)
    positive_cluster[cid[y]] = True
    pos_ids, neg_ids = np.flatnonzero(positive_cluster), np.flatnonzero(~positive_cluster)
    if len(pos_ids) < 2 or len(neg_ids) < 2:
        return None
    rng = np.random.default_rng(seed)
    _, group = np.unique(np.asarray(scores, dtype=np.float64), return_inverse=True)
    values = []
    for _ in range(draws):
        times = np.bincount(rng.choice(pos_ids, len(pos_ids)), minlength=n_clusters) \
            + np.bincount(rng.choice(neg_ids, len(neg_ids)), minlength=n_clusters)
        values.append(_grouped_auc(group, y, times[cid].astype(np.float64)))
    values = np.asarray(values)
    values = values[np.isfinite(values)]
    if not values.size:
        return None
    tail = (1.0 - level) / 2.0 * 100.0
    return [float(np.percentile(values, tail)), float(np.percentile(values, 100.0 - tail))]


def _check_scores(labels: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    y = np.asarray(labels).astype(bool).ravel()
    s = np.asarray(scores, dtype=np.float64).ravel()
    if y.shape != s.shape:
        raise ValueError(f"labels has {y.size} entries but scores has {s.size}")
    if np.isnan(s).any():
        raise ValueError(f"scores contains {int(np.isnan(s).sum())} NaN values")
    return y, s


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve; NaN when only one class is present."""
    y, s = _check_scores(labels, scores)
    n_pos = int(y.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    sorted_s = s[order]
    ranks = np.empty(s.size, dtype=np.float64)
    # average rank per group of tied scores
    boundaries = np.flatnonzero(np.diff(sorted_s)) + 1
    starts = np.concatenate(([0], boundaries))
    ends = np.concatenate((boundaries, [s.size]))
    avg = (starts + ends + 1) / 2.0  # ranks are 1-based
    ranks[order] = np.repeat(avg, ends - starts)
    rank_sum = ranks[y].sum()
    return float((rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def roc_curve(labels: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(fpr, tpr, thresholds): one point per distinct score, from the strictest threshold down.

    A tick is predicted positive when score >= threshold. The first point is (0, 0) at +inf.
    """
    y, s = _check_scores(labels, scores)
    n_pos = max(int(y.sum()), 1)
    n_neg = max(int((~y).sum()), 1)
    order = np.argsort(-s, kind="mergesort")
    s_sorted = s[order]
    y_sorted = y[order]
    last_of_group = np.r_[np.flatnonzero(np.diff(s_sorted)), s.size - 1] if s.size else np.array([], int)
    tps = np.cumsum(y_sorted)[last_of_group]
    fps = np.cumsum(~y_sorted)[last_of_group]
    fpr = np.r_[0.0, fps / n_neg]
    tpr = np.r_[0.0, tps / n_pos]
    thresholds = np.r_[np.inf, s_sorted[last_of_group]]
    return fpr, tpr, thresholds


def recall_at_fpr(labels: np.ndarray, scores: np.ndarray, max_fpr: float = 0.05) -> tuple[float, float]:
    """(recall, threshold): the best true-positive rate with FPR <= max_fpr, and the threshold giving it."""
    fpr, tpr, thresholds = roc_curve(labels, scores)
    ok = fpr <= max_fpr + 1e-12
    best = int(np.flatnonzero(ok)[np.argmax(tpr[ok])])
    return float(tpr[best]), float(thresholds[best])


def threshold_for_fpr(labels: np.ndarray, scores: np.ndarray, max_fpr: float = 0.05) -> float:
    """The lowest threshold whose FPR on these (validation) ticks is <= max_fpr."""
    _, threshold = recall_at_fpr(labels, scores, max_fpr)
    if not np.isfinite(threshold):
        # even the strictest distinct score breaks the budget: fire on nothing seen so far
        y, s = _check_scores(labels, scores)
        threshold = float(np.nextafter(s.max(), np.inf)) if s.size else 1.0
    return float(threshold)


def lead_times_s(ts_ns: np.ndarray, firing: np.ndarray, oom_ts_ns: np.ndarray) -> np.ndarray:
    """Lead time in seconds of one tier for each OOM of one node (docs/ARCHITECTURE.md, "Alerts and prediction"); 0 = a miss.

    ``ts_ns`` are the node's tick times (ascending), ``firing`` whether the tier's alert was firing
    at each tick, ``oom_ts_ns`` the node's OOM times.
    """
    ts = np.asarray(ts_ns, dtype=np.int64)
    fire = np.asarray(firing, dtype=bool)
    if ts.shape != fire.shape:
        raise ValueError(f"ts_ns has {ts.size} ticks but firing has {fire.size}")
    if ts.size > 1 and np.any(np.diff(ts) < 0):
        raise ValueError("ts_ns must be ascending")
    ooms = np.sort(np.asarray(oom_ts_ns, dtype=np.int64))
    # run_start[i] = index where the unbroken firing run containing tick i begins
    idx = np.arange(ts.size)
    breaks = np.where(fire, -1, idx)
    last_break = np.maximum.accumulate(breaks) if ts.size else breaks
    run_start = last_break + 1
    leads = np.zeros(len(ooms), dtype=np.float64)
    prev_oom = np.iinfo(np.int64).min
    for k, t_oom in enumerate(ooms):
        last = int(np.searchsorted(ts, t_oom, side="left")) - 1
        if last >= 0 and fire[last] and ts[last] > prev_oom:
            first = int(run_start[last])
            first = max(first, int(np.searchsorted(ts, prev_oom, side="right")))
            leads[k] = (t_oom - ts[first]) / NS_PER_S
        prev_oom = int(t_oom)
    return leads


def isolated_ooms(oom_ts_ns: np.ndarray, isolation_s: float = DEFAULT_ISOLATION_S) -> np.ndarray:
    """Per OOM (in ascending time order), True when no earlier OOM of the node is within ``isolation_s``."""
    ooms = np.sort(np.asarray(oom_ts_ns, dtype=np.int64))
    gaps = np.diff(ooms, prepend=np.iinfo(np.int64).min // 2)
    return gaps > int(isolation_s * NS_PER_S)


def firing_episodes(firing: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs of firing ticks as (first index, last index) pairs."""
    f = np.asarray(firing, dtype=np.int8)
    edges = np.diff(np.r_[0, f, 0])
    starts = np.flatnonzero(edges == 1)
    ends = np.flatnonzero(edges == -1) - 1
    return list(zip(starts.tolist(), ends.tolist()))


def count_false_alarms(ts_ns: np.ndarray, firing: np.ndarray, oom_ts_ns: np.ndarray,
                       horizon_s: float = DEFAULT_HORIZON_S) -> tuple[int, int]:
    """(false episodes, all episodes) of one tier on one node."""
    ts = np.asarray(ts_ns, dtype=np.int64)
    ooms = np.sort(np.asarray(oom_ts_ns, dtype=np.int64))
    horizon_ns = int(round(horizon_s * NS_PER_S))
    episodes = firing_episodes(firing)
    false = 0
    for first, last in episodes:
        lo, hi = ts[first], ts[last] + horizon_ns
        k = int(np.searchsorted(ooms, lo, side="right"))
        if k >= len(ooms) or ooms[k] > hi:
            false += 1
    return false, len(episodes)


@dataclass(slots=True)
class NodeTrace:
    """What evaluation needs from one node's run: tick times, scores, tier firing, OOM times, and
    which ticks are masked (``down``, ``censored``: None = none). ``fleet`` names the GPUs that
    share a router (cascades merge within it); empty: the node is a fleet of its own. ``features``
    [L, F]: the tick features, for baselines that score them (None when not kept)."""

    node: str
    ts_ns: np.ndarray
    p_oom: np.ndarray
    firing: dict[str, np.ndarray]
    oom_ts_ns: np.ndarray
    tick_s: float = 10.0
    down: np.ndarray | None = None
    censored: np.ndarray | None = None
    fleet: str = ""
    features: np.ndarray | None = field(default=None, repr=False)

    def masks(self) -> tuple[np.ndarray, np.ndarray]:
        """(down, scored) per tick."""
        n = len(self.ts_ns)
        down = np.zeros(n, bool) if self.down is None else np.asarray(self.down, dtype=bool)
        censored = np.zeros(n, bool) if self.censored is None else np.asarray(self.censored, dtype=bool)
        if down.shape != (n,) or censored.shape != (n,):
            raise ValueError(f"node {self.node}: masks must have one entry per tick ({n})")
        return down, ~(down | censored)


@dataclass(slots=True)
class EvaluationResult:
    auc: float
    recall_at_fpr_5pct: float
    threshold_at_fpr_5pct: float
    ticks: int
    positives: int
    ooms: int
    node_hours: float
    lead_times_s: dict[str, list[float]]
    isolated: list[bool]
    false_alarms: dict[str, int]
    alarm_episodes: dict[str, int]
    roc: tuple[np.ndarray, np.ndarray] = field(repr=False, default=(np.zeros(0), np.zeros(0)))
    operating_point: dict | None = None  # tpr/fpr at the model's calibrated threshold, when given
    scored: int = -1  # ticks neither down nor censored; -1: all ticks
    down_ticks: int = 0
    censored_ticks: int = 0
    scored_hours: float = -1.0  # hours of scored ticks (the GPU-hours false alarms divide by); -1: node_hours
    events: int = 0  # independent OOM events after merging cascades
    auc_ci: list[float] | None = None
    bands: list[dict] = field(default_factory=list)

    @property
    def scored_ticks(self) -> int:
        return self.ticks if self.scored < 0 else self.scored

    def lead_time_median_s(self) -> dict[str, float]:
        return {tier: float(np.median(v)) if v else float("nan") for tier, v in self.lead_times_s.items()}

    def isolated_lead_time_median_s(self) -> dict[str, float]:
        mask = np.asarray(self.isolated, dtype=bool)
        return {tier: float(np.median(np.asarray(v)[mask])) if mask.any() else float("nan")
                for tier, v in self.lead_times_s.items()}

    def recall_by_tier(self) -> dict[str, float]:
        """Share of OOMs each tier saw coming (lead > 0)."""
        return {tier: float(np.mean(np.asarray(v) > 0)) if v else float("nan")
                for tier, v in self.lead_times_s.items()}

    def false_alarms_per_hour(self) -> dict[str, float]:
        hours = max(self.node_hours if self.scored_hours < 0 else self.scored_hours, 1e-9)
        return {tier: n / hours for tier, n in self.false_alarms.items()}

    def to_dict(self) -> dict:
        def clean(x: float) -> float | None:
            return None if x is None or not np.isfinite(x) else round(float(x), 4)

        negatives = self.scored_ticks - self.positives
        enough = min(self.positives, negatives) >= MIN_CLASS_TICKS
        per_gpu_hour = {k: clean(v) for k, v in self.false_alarms_per_hour().items()}
        return {
            "auc": clean(self.auc) if enough else None,
            "auc_ci": [clean(x) for x in self.auc_ci] if enough and self.auc_ci else None,
            "recall_at_fpr_5pct": clean(self.recall_at_fpr_5pct) if enough else None,
            "threshold_at_fpr_5pct": clean(self.threshold_at_fpr_5pct) if enough else None,
            "auc_valid": enough,
            "auc_note": None if enough else (
                f"AUC/recall withheld: {self.positives} positive and {negatives} negative ticks "
                f"(need >= {MIN_CLASS_TICKS} of each); raw AUC {clean(self.auc)}"),
            "bands": self.bands,
            "ticks": self.scored_ticks,
            "positive_ticks": self.positives,
            "negative_ticks": negatives,
            "masked_ticks": {"down": self.down_ticks, "censored": self.censored_ticks},
            "all_ticks": self.ticks,
            "ooms": self.ooms,
            "events": self.events,
            "node_hours": round(self.node_hours, 4),
            "lead_time_median_s": {k: clean(v) for k, v in self.lead_time_median_s().items()},
            "lead_time_recall": {k: clean(v) for k, v in self.recall_by_tier().items()},
            "isolated_ooms": int(np.sum(self.isolated)),
            "isolated_lead_time_median_s": {k: clean(v) for k, v in self.isolated_lead_time_median_s().items()},
            "isolated_lead_time_recall": {
                k: clean(float(np.mean(np.asarray(v)[np.asarray(self.isolated, bool)] > 0)))
                if any(self.isolated) else None for k, v in self.lead_times_s.items()},
            "false_alarms_per_gpu_hour": per_gpu_hour,
            "false_alarms_per_hour": per_gpu_hour,  # the older name of the same figure
            "alarm_episodes": dict(self.alarm_episodes),
            "at_operating_threshold": self.operating_point,
        }


def _score_summary(y: np.ndarray, s: np.ndarray, clusters: np.ndarray, draws: int) -> dict:
    """AUC, recall at FPR <= 5 % and the event-bootstrap interval of labelled scores (withheld, None,
    when either class has fewer than ``MIN_CLASS_TICKS`` ticks)."""
    positives, negatives = int(y.sum()), int(y.size - y.sum())
    out = {"positives": positives, "auc": None, "auc_ci": None, "recall_at_fpr_5pct": None}
    if min(positives, negatives) < MIN_CLASS_TICKS:
        return out
    ci = bootstrap_auc_ci(y, s, clusters, draws=draws) if draws else None
    out.update(auc=round(auc(y, s), 4), recall_at_fpr_5pct=round(recall_at_fpr(y, s, 0.05)[0], 4),
               auc_ci=None if ci is None else [round(x, 4) for x in ci])
    return out


def _clusters(traces: list[NodeTrace], labels: list[np.ndarray], cascade_s: float) -> tuple[list[np.ndarray], int]:
    """Per trace, a bootstrap cluster id per tick: a positive tick belongs to the event of the OOM
    it precedes, a negative tick to its fleet's ``NEGATIVE_BLOCK_S`` block; and the event count."""
    fleets = [tr.fleet or tr.node for tr in traces]
    fleet_index = {f: i for i, f in enumerate(dict.fromkeys(fleets))}
    sorted_ooms = [np.sort(np.asarray(tr.oom_ts_ns, np.int64)) for tr in traces]
    owner = np.concatenate([np.full(len(o), fleet_index[f]) for o, f in zip(sorted_ooms, fleets)] or [np.zeros(0, int)])
    event = merge_cascades(np.concatenate(sorted_ooms or [np.zeros(0, np.int64)]), owner, cascade_s)
    n_events = int(len(np.unique(event)))
    block_ns = int(NEGATIVE_BLOCK_S * NS_PER_S)
    out, block_keys, start = [], [], 0
    for tr, f, y, ooms in zip(traces, fleets, labels, sorted_ooms):
        ts = np.asarray(tr.ts_ns, np.int64)
        ids = np.zeros(len(ts), dtype=np.int64)
        if len(ooms):
            nxt = np.minimum(np.searchsorted(ooms, ts, side="right"), len(ooms) - 1)
            ids[y == 1] = event[start + nxt[y == 1]]
        start += len(ooms)
        block_keys.append(fleet_index[f] * (1 << 40) + ts[y == 0] // block_ns)
        out.append(ids)
    _, block_id = np.unique(np.concatenate(block_keys or [np.zeros(0, np.int64)]), return_inverse=True)
    at = 0
    for ids, y in zip(out, labels):
        k = int((y == 0).sum())
        ids[y == 0] = n_events + block_id[at:at + k]
        at += k
    return out, n_events


def evaluate_traces(traces: list[NodeTrace], tiers: tuple[str, ...] = ("threshold", "slope", "lstm"),
                    horizon_s: float = DEFAULT_HORIZON_S, threshold: float | None = None,
                    cascade_s: float = DEFAULT_CASCADE_S, bootstrap_draws: int = BOOTSTRAP_DRAWS) -> EvaluationResult:
    """Score a set of node runs: tick-level ROC of ``p_oom`` over the scored ticks, per lead band,
    with event-bootstrap intervals, and OOM-level lead times and false alarms per tier.

    ``recall_at_fpr_5pct`` picks the best threshold on these very ticks (the ROC's point); pass the
    model's calibrated ``threshold`` to also get the true/false-positive rates it really runs at.
    """
    labels, scores, keep, lead_next = [], [], [], []
    leads: dict[str, list[float]] = {t: [] for t in tiers}
    false = dict.fromkeys(tiers, 0)
    episodes = dict.fromkeys(tiers, 0)
    node_hours = scored_hours = 0.0
    ooms = n_down = n_censored = 0
    isolated: list[bool] = []
    for tr in traces:
        down, scored = tr.masks()
        labels.append(labels_for_ticks(tr.ts_ns, tr.oom_ts_ns, horizon_s))
        scores.append(np.asarray(tr.p_oom, dtype=np.float64))
        keep.append(scored)
        lead_next.append(lead_to_next_oom_s(tr.ts_ns, tr.oom_ts_ns))
        node_hours += len(tr.ts_ns) * tr.tick_s / 3600.0
        scored_hours += int(scored.sum()) * tr.tick_s / 3600.0
        n_down += int(down.sum())
        n_censored += int((~scored & ~down).sum())
        ooms += len(tr.oom_ts_ns)
        isolated.extend(isolated_ooms(tr.oom_ts_ns).tolist())
        for tier in tiers:
            fire = tr.firing.get(tier)
            if fire is None:
                raise KeyError(f"node {tr.node}: no firing series for tier {tier!r}")
            fire = np.asarray(fire, dtype=bool)
            leads[tier].extend(lead_times_s(tr.ts_ns, fire & ~down, tr.oom_ts_ns).tolist())
            f, n = count_false_alarms(tr.ts_ns, fire & scored, tr.oom_ts_ns, horizon_s)
            false[tier] += f
            episodes[tier] += n
    clusters, n_events = _clusters(traces, labels, cascade_s)
    kept = np.concatenate(keep) if keep else np.zeros(0, bool)
    n_all = int(kept.size)
    y = (np.concatenate(labels) if labels else np.zeros(0, np.uint8))[kept]
    s = (np.concatenate(scores) if scores else np.zeros(0))[kept]
    c = (np.concatenate(clusters) if clusters else np.zeros(0, np.int64))[kept]
    lead = (np.concatenate(lead_next) if lead_next else np.zeros(0))[kept]
    if y.size and 0 < y.sum() < y.size:
        area = auc(y, s)
        recall, best_threshold = recall_at_fpr(y, s, 0.05)
        fpr, tpr, _ = roc_curve(y, s)
    else:
        area, recall, best_threshold = float("nan"), float("nan"), float("nan")
        fpr, tpr = np.zeros(0), np.zeros(0)
    enough = min(int(y.sum()), int(y.size - y.sum())) >= MIN_CLASS_TICKS
    ci = bootstrap_auc_ci(y, s, c, draws=bootstrap_draws) if enough and bootstrap_draws else None
    bands = []
    for lo, hi in LEAD_BANDS_S:
        sel = (y == 0) | ((lead > lo) & (lead <= hi))
        bands.append({"band_s": [lo, hi], **_score_summary(y[sel], s[sel], c[sel], bootstrap_draws)})
    operating = None
    if threshold is not None and y.size:
        fired = s >= threshold
        operating = {"threshold": round(float(threshold), 6),
                     "tpr": round(float(fired[y == 1].mean()), 4) if y.any() else None,
                     "fpr": round(float(fired[y == 0].mean()), 4) if (~y.astype(bool)).any() else None}
    return EvaluationResult(auc=area, recall_at_fpr_5pct=recall, threshold_at_fpr_5pct=best_threshold,
                            operating_point=operating, ticks=n_all, positives=int(y.sum()), ooms=ooms,
                            node_hours=node_hours, lead_times_s=leads, isolated=isolated, false_alarms=false,
                            alarm_episodes=episodes, roc=(fpr, tpr), scored=int(y.size), down_ticks=n_down,
                            censored_ticks=n_censored, scored_hours=scored_hours, events=n_events, auc_ci=ci,
                            bands=bands)


def plot_roc(result: EvaluationResult, path: str, title: str = "") -> None:
    """ROC of the LSTM's P(OOM within 5 min), with the FPR = 5 % budget marked."""
    # matplotlib takes a second to import: only when a plot is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fpr, tpr = result.roc
    fig, ax = plt.subplots(figsize=(5.5, 5))
    ax.plot(fpr, tpr, color="tab:blue", lw=2, label=f"LSTM  AUC = {result.auc:.3f}")
    ax.plot([0, 1], [0, 1], color="grey", lw=1, ls=":", label="chance")
    ax.axvline(0.05, color="tab:red", lw=1, ls="--",
               label=f"FPR 5 %: recall {result.recall_at_fpr_5pct:.2f}")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.01)
    ax.set_xlabel("false-positive rate (ticks without an OOM in the next 5 min)")
    ax.set_ylabel("true-positive rate (ticks with an OOM in the next 5 min)")
    ax.set_title(title or f"P(OOM within 5 min): {result.ticks} ticks, {result.ooms} OOMs")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_lead_times(result: EvaluationResult, path: str, title: str = "") -> None:
    """Per-tier lead times before each OOM (one dot per OOM, misses at 0) with the medians."""
    # matplotlib takes a second to import: only when a plot is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tiers = list(result.lead_times_s)
    colours = {"threshold": "tab:orange", "slope": "tab:green", "lstm": "tab:blue"}
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    rng = np.random.default_rng(0)
    medians = result.lead_time_median_s()
    isolated = np.asarray(result.isolated, dtype=bool)
    for i, tier in enumerate(tiers):
        values = np.asarray(result.lead_times_s[tier], dtype=float) / 60.0
        if values.size:
            x = np.full(values.size, i) + rng.uniform(-0.15, 0.15, values.size)
            colour = colours.get(tier, "tab:grey")
            ax.scatter(x[~isolated], values[~isolated], s=14, alpha=0.6, color=colour)
            ax.scatter(x[isolated], values[isolated], s=40, marker="D", facecolor="none", edgecolor=colour,
                       label="isolated OOM (no crash in the 10 min before)" if i == 0 else None)
            ax.hlines(medians[tier] / 60.0, i - 0.3, i + 0.3, color="black", lw=2)
            ax.annotate(f"median {medians[tier] / 60.0:.1f} min", (i, medians[tier] / 60.0),
                        xytext=(0, 6), textcoords="offset points", ha="center", fontsize=9)
    ax.axhline(5.0, color="tab:red", lw=1, ls="--", label="5-minute target")
    ax.set_xticks(range(len(tiers)), [f"{t}\n({result.recall_by_tier()[t]:.0%} seen)" for t in tiers])
    ax.set_ylabel("lead time before OOM (minutes; 0 = missed)")
    ax.set_title(title or f"Warning lead time per tier, {result.ooms} OOMs")
    ax.legend(loc="upper right")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- the per-fleet risk forecast (kvguard.ml.fleet_risk), evaluated on its own --------------------
#
# label: a fleet tick t is positive iff any GPU of the fleet has an OOM in (t, t + horizon]; ticks
# whose horizon passes the end of the run are censored. Nothing else is masked: a fleet with one GPU
# restarting still serves, and its hazard still means something. The alarm is hazard >= threshold,
# the threshold taken at FPR <= 5 % on other fleets (the training workloads'), or on these very ticks
# when none is given (then said so: ``threshold_source``). Events, the bootstrap and lead times are
# ``evaluate_traces``'s, with the fleet as one node whose OOMs are all its GPUs'.

FLEET_TIER = "fleet_risk"


def fleet_trace(fleet: str, ts_ns: np.ndarray, hazard: np.ndarray, oom_ts_ns: np.ndarray, end_ns: int | None, *,
                tick_s: float = 10.0, horizon_s: float = DEFAULT_HORIZON_S,
                threshold: float | None = None) -> NodeTrace:
    """One fleet's hazard series as a trace: its OOMs are every GPU's (``oom_ts_ns``), ticks past
    ``end_ns`` - horizon are censored, it fires while hazard >= ``threshold`` (never without one)."""
    ts = np.asarray(ts_ns, dtype=np.int64)
    score = np.asarray(hazard, dtype=np.float64)
    firing = score >= threshold if threshold is not None else np.zeros(len(ts), bool)
    return NodeTrace(node=fleet, ts_ns=ts, p_oom=score, firing={FLEET_TIER: firing},
                     oom_ts_ns=np.sort(np.asarray(oom_ts_ns, dtype=np.int64)), tick_s=tick_s,
                     censored=censored_mask(ts, end_ns, horizon_s), fleet=fleet)


def fleet_trace_from_ticks(fleet: str, ticks_by_node: dict, oom_ts_ns: np.ndarray, end_ns: int | None, *,
                           tick_s: float = 10.0, horizon_s: float = DEFAULT_HORIZON_S, threshold: float | None = None,
                           with_down: bool = True) -> NodeTrace:
    """``fleet_trace`` of the hazard ``fleet_series`` computes from a run's ticks (node -> Tick list)."""
    risks = fleet_series(ticks_by_node, with_down=with_down)
    return fleet_trace(fleet, np.array([r.ts_ns for r in risks], np.int64), np.array([r.hazard for r in risks]),
                       oom_ts_ns, end_ns, tick_s=tick_s, horizon_s=horizon_s, threshold=threshold)


def fleet_threshold(traces: list[NodeTrace], horizon_s: float = DEFAULT_HORIZON_S, max_fpr: float = 0.05) -> float:
    """The hazard threshold at FPR <= ``max_fpr`` over the scored ticks of ``traces`` (calibration fleets)."""
    ys, ss = [], []
    for tr in traces:
        _, scored = tr.masks()
        ys.append(labels_for_ticks(tr.ts_ns, tr.oom_ts_ns, horizon_s)[scored])
        ss.append(np.asarray(tr.p_oom, np.float64)[scored])
    y = np.concatenate(ys) if ys else np.zeros(0, np.uint8)
    if not (y == 0).any():
        raise ValueError("no negative scored tick in the calibration fleets: no FPR to calibrate on")
    return threshold_for_fpr(y, np.concatenate(ss), max_fpr)


def evaluate_fleet_risk(traces: list[NodeTrace], *, threshold: float | None = None,
                        horizon_s: float = DEFAULT_HORIZON_S, bootstrap_draws: int = BOOTSTRAP_DRAWS) -> dict:
    """The fleet hazard's figures over ``traces`` (from ``fleet_trace``): AUC with its event-bootstrap
    interval, recall at FPR <= 5 %, per lead band, and the lead times and false alarms of the alarm
    hazard >= ``threshold`` (the threshold at FPR <= 5 % of these ticks when None)."""
    source = "calibration fleets"
    if threshold is None:
        try:
            threshold, source = fleet_threshold(traces, horizon_s), "these ticks (optimistic)"
        except ValueError:  # every tick is positive: no FPR to hold, so no alarm either
            threshold, source = float("inf"), "none: no negative tick"
    armed = [NodeTrace(node=tr.node, ts_ns=tr.ts_ns, p_oom=tr.p_oom, oom_ts_ns=tr.oom_ts_ns, tick_s=tr.tick_s,
                       firing={FLEET_TIER: np.asarray(tr.p_oom) >= threshold}, down=tr.down, censored=tr.censored,
                       fleet=tr.fleet)
             for tr in traces]
    out = evaluate_traces(armed, tiers=(FLEET_TIER,), horizon_s=horizon_s,
                          threshold=threshold if np.isfinite(threshold) else None,
                          bootstrap_draws=bootstrap_draws).to_dict()
    return {"fleets": len(traces), "auc": out["auc"], "auc_ci": out["auc_ci"], "auc_note": out["auc_note"],
            "recall_at_fpr_5pct": out["recall_at_fpr_5pct"],
            "threshold": round(float(threshold), 6) if np.isfinite(threshold) else None,
            "threshold_source": source, "at_threshold": out["at_operating_threshold"],
            "lead_time_median_s": out["lead_time_median_s"][FLEET_TIER],
            "lead_time_recall": out["lead_time_recall"][FLEET_TIER],
            "isolated_ooms": out["isolated_ooms"],
            "isolated_lead_time_median_s": out["isolated_lead_time_median_s"][FLEET_TIER],
            "false_alarms_per_fleet_hour": out["false_alarms_per_gpu_hour"][FLEET_TIER],
            "ooms": out["ooms"], "events": out["events"], "ticks": out["ticks"],
            "positive_ticks": out["positive_ticks"], "masked_ticks": out["masked_ticks"]["censored"],
            "bands": out["bands"]}
