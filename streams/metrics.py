"""Tick metrics: the per-GPU record the stream emits every tick of event time, and its feature vector.

Pure (numpy + stdlib). ``Tick`` carries every metric of docs/ARCHITECTURE.md "Metrics"; ``tick_features`` turns a tick into
the fixed-length vector the tier-3 predictor reads (``FEATURE_NAMES`` names its columns; training
data must be built with this same function).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import numpy as np

from kvguard.contracts.units import NS_PER_S

SINCE_OOM_CAP_S = 1800.0  # "time since the last OOM" saturates here (also: no OOM seen yet)


@dataclass(slots=True, frozen=True)
class Candidate:
    """A request the policy may evict. ``units`` counts every page it references; ``shared_units``
    the part other requests also reference (not freed by evicting it). ``tokens`` is the KV token
    capacity of its pages (an upper bound of the tokens it holds, exact to within one page)."""

    req: int
    priority: int
    units: int
    pages: int
    tokens: int
    shared_units: int
    prompt_tokens: int
    last_ts_ns: int


@dataclass(slots=True)
class Tick:
    """One GPU's metrics at ``ts_ns`` (a tick boundary), covering events in [ts_ns - tick, ts_ns).

    Levels (u_kv … free_units) are the state right before ``ts_ns``; counts and rates cover the
    interval. ``util_*`` split the device memory M (fractions of M; they sum to 1):
    weights+context, KV live, KV cached (cached + retained pages), workspace, free units of D,
    and the headroom outside D (M·(1−u)). ``reserved_frac`` is the share of D Ψ treats as reserved
    (``util_reserved`` the same as a fraction of M; it overlaps the free units, not in the sum).
    ``synced`` is False while the mirror may have missed events (values are best effort then).
    """

    node: str
    ts_ns: int
    tick_s: float
    synced: bool
    u_kv: float
    f_ext: float
    f_int: float
    psi: float
    slope_per_min: float
    live_units: int
    cached_units: int
    retained_units: int
    workspace_units: int
    free_units: int
    largest_free_run_units: int
    n_free_runs: int
    dynamic_units: int
    tokens_stored: int
    util_weights: float
    util_kv_live: float
    util_kv_cached: float
    util_workspace: float
    util_free: float
    util_headroom: float
    util_reserved: float
    reserved_frac: float
    pages_per_request_p50: float
    pages_per_request_p95: float
    pages_per_request_p99: float
    requests_running: int
    requests_holding_pages: int
    arrivals: int
    finished: int
    alloc_failures: int
    alloc_fail_per_s: float
    evicted_pages: int
    evicted_requests: int
    evicted_tokens: int
    preemptions: int
    ooms: int
    tokens_per_s: float
    decode_tokens_per_s: float
    events: int
    p_oom: float | None = None
    u_kv_forecast: list[float] | None = None
    candidates: list[Candidate] = field(default_factory=list)
    requests_waiting: int = 0  # arrived, not admitted (or preempted back), not finished, at ts_ns
    s_since_oom: float = SINCE_OOM_CAP_S  # seconds since the node's last OOM before ts_ns, capped
    epoch: int = 0  # the producer run the tick belongs to: ts_ns orders ticks only within one epoch

    @property
    def ts_s(self) -> float:
        return self.ts_ns / NS_PER_S

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ts_s"] = self.ts_s
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Tick":
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in d.items() if k in names}
        values["candidates"] = [Candidate(**c) for c in d.get("candidates", [])]
        if values.get("u_kv_forecast") is not None:
            values["u_kv_forecast"] = [float(x) for x in values["u_kv_forecast"]]
        return cls(**values)


WIRE_SCHEMA = "1.0"


def tick_record(tick: Tick) -> dict:
    """The tick as a ``kvguard.metrics`` record (``kvguard.wire.schemas.MetricTick`` plus every Tick
    field; readers ignore what they do not know). ``utilization`` splits device memory M."""
    d = tick.to_dict()
    d["schema"] = WIRE_SCHEMA
    d["utilization"] = {
        "weights": tick.util_weights, "kv_live": tick.util_kv_live, "kv_cached": tick.util_kv_cached,
        "workspace": tick.util_workspace, "free": tick.util_free, "headroom": tick.util_headroom,
        "reserved": tick.util_reserved,
    }
    return d


def least_squares_slope(ts_ns: np.ndarray, values: np.ndarray) -> float:
    """Slope of ``values`` over time by least squares, per minute; 0.0 with fewer than 2 points."""
    if len(ts_ns) < 2:
        return 0.0
    t = (np.asarray(ts_ns, dtype=np.float64) - float(ts_ns[-1])) / (60 * NS_PER_S)
    y = np.asarray(values, dtype=np.float64)
    t_mean = t.mean()
    denom = float(((t - t_mean) ** 2).sum())
    if denom == 0.0:
        return 0.0
    return float(((t - t_mean) * (y - y.mean())).sum() / denom)


def percentiles(values: np.ndarray, qs=(50, 95, 99)) -> tuple[float, ...]:
    """Linear-interpolated percentiles; zeros for an empty input."""
    if len(values) == 0:
        return tuple(0.0 for _ in qs)
    return tuple(float(x) for x in np.percentile(values, qs))


FEATURE_NAMES: tuple[str, ...] = (
    "u_kv",
    "f_ext",
    "f_int",
    "psi",
    "slope_per_min",
    "kv_cached_frac",
    "workspace_frac",
    "free_frac",
    "largest_free_run_frac",
    "log_n_free_runs",
    "log_pages_per_request_p50",
    "log_pages_per_request_p99",
    "log_requests_running",
    "log_arrivals",
    "log_alloc_fail_per_s",
    "log_evicted_pages",
    "log_preemptions",
    "ooms",
    "log_tokens_per_s",
    "log_decode_tokens_per_s",
    "log_requests_waiting",
    "since_oom_frac",
)


def tick_features(tick: Tick) -> np.ndarray:
    """The predictor's feature vector for one tick (float32, order of ``FEATURE_NAMES``).

    Fractions stay in [0, 1]-ish; counts and rates go through log1p so no feature dwarfs the rest.
    ``since_oom_frac`` is the time since the node's last OOM over ``SINCE_OOM_CAP_S`` (1 = calm for
    at least that long, or no OOM seen).
    """
    d = max(tick.dynamic_units, 1)
    return np.array(
        [
            tick.u_kv,
            tick.f_ext,
            tick.f_int,
            tick.psi,
            tick.slope_per_min,
            (tick.cached_units + tick.retained_units) / d,
            tick.workspace_units / d,
            tick.free_units / d,
            tick.largest_free_run_units / d,
            np.log1p(tick.n_free_runs),
            np.log1p(tick.pages_per_request_p50),
            np.log1p(tick.pages_per_request_p99),
            np.log1p(tick.requests_running),
            np.log1p(tick.arrivals),
            np.log1p(tick.alloc_fail_per_s),
            np.log1p(tick.evicted_pages),
            np.log1p(tick.preemptions),
            float(tick.ooms > 0),
            np.log1p(tick.tokens_per_s),
            np.log1p(tick.decode_tokens_per_s),
            np.log1p(tick.requests_waiting),
            min(max(tick.s_since_oom, 0.0), SINCE_OOM_CAP_S) / SINCE_OOM_CAP_S,
        ],
        dtype=np.float32,
    )
