"""Tick metrics: the per-GPU record the stream emits every tick of event time, and its feature vector.

Pure (numpy + stdlib). ``Tick`` (defined in ``kvguard.contracts.tick``, the one tick type between
the stream and the policy) carries every metric of docs/ARCHITECTURE.md "Metrics"; ``tick_features``
turns a tick into the fixed-length vector the tier-3 predictor reads (``FEATURE_NAMES`` names its columns; training
data must be built with this same function).
"""

from __future__ import annotations

import numpy as np

from kvguard.contracts.tick import SINCE_OOM_CAP_S, Tick
from kvguard.contracts.units import NS_PER_S

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
