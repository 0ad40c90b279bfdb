"""Tick metrics: the per-GPU record the stream emits every tick of event time, and its feature vector.

Pure (numpy + stdlib). ``Tick`` (defined in ``kvguard.contracts.tick``, the one tick type between
the stream and the policy) carries every metric of docs/ARCHITECTURE.md "Metrics"; ``tick_features``
turns a tick into the fixed-length vector the tier-3 predictor reads (``FEATURE_NAMES`` names its columns; training
data must be built with this same function).
"""

from __future__ import annotations

import numpy as np

from kvguard.contracts.tick import Tick
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
    "request_pages_p50_frac",
    "request_pages_p99_frac",
    "log_requests_running",
    "log_arrivals",
    "log_alloc_fail_per_s",
    "log_evicted_pages",
    "log_preemptions",
    "token_turnover",
    "decode_token_frac",
    "log_requests_waiting",
    # the caching allocator (issue 13's new inputs): its fragmentation, the activation share of M, the
    # reserved but unallocated share of M, and release-and-retry events in the tick
    "alloc_f_ext",
    "util_activation",
    "util_reserved_unused",
    "log_alloc_retries",
    # admission inputs: prompt positions still to compute for requests asking for prompt logprobs
    "log_logprob_prompt_tokens_pending",
    "log_logprob_requests_pending",
)


def tick_features(tick: Tick) -> np.ndarray:
    """The predictor's feature vector for one tick (float32, order of ``FEATURE_NAMES``).

    Every size is relative to the GPU, so one model reads a 24 GB and an 80 GB GPU alike: memory
    as fractions of D (``dynamic_units``), pages held per request over D, throughput as the
    tick's processed tokens over processed plus stored tokens (``token_turnover``: how much of
    what the KV cache holds this tick's work replaced) and its decode share. Counts go through
    log1p so no feature dwarfs the rest. The caching allocator's state comes as its F_ext and as
    shares of the device memory M (activations allocated, reserved but unallocated).

    Crash history is not an input: the OOM count and the time since the last OOM would teach a
    model that a GPU which crashed is about to crash again (the labels, read back). It stays on
    the tick (``ooms``, ``s_since_oom``) for the policy and the evaluation.
    """
    d = max(tick.dynamic_units, 1)
    processed = max(tick.tokens_per_s, 0.0) * tick.tick_s
    decoded = max(tick.decode_tokens_per_s, 0.0) * tick.tick_s
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
            tick.pages_per_request_p50 / d,
            tick.pages_per_request_p99 / d,
            np.log1p(tick.requests_running),
            np.log1p(tick.arrivals),
            np.log1p(tick.alloc_fail_per_s),
            np.log1p(tick.evicted_pages),
            np.log1p(tick.preemptions),
            processed / (processed + max(tick.tokens_stored, 0)) if processed > 0 else 0.0,
            decoded / processed if processed > 0 else 0.0,
            np.log1p(tick.requests_waiting),
            tick.alloc_f_ext,
            tick.util_activation,
            tick.util_reserved_unused,
            np.log1p(tick.alloc_retries),
            np.log1p(tick.logprob_prompt_tokens_pending),
            np.log1p(tick.logprob_requests_pending),
        ],
        dtype=np.float32,
    )
