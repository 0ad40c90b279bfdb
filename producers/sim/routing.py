"""Routers of the shadow fleet that read endpoint series (issue 29): kvguard's admission series and a
baseline doing what llm-d-router's ``utilization-detector`` does.

A router is ``(engines, request) -> index``; -1 sheds the request at the router (a retryable 429,
counted by the fleet as refused).

- ``route_by_admission`` reads what kvguard exports per endpoint (``kvguard_endpoint_admit``,
  ``kvguard_endpoint_saturation``, ``kvguard_endpoint_queue_delay_seconds``; the same three values,
  ``ShadowGate.endpoint_state``): the admit bit filters (endpoints up and admitting), least outstanding
  tokens picks among them (ties: the lowest index) — a filter then a scorer, as llm-d-router composes
  them; none admits: the least saturated one (then the lowest delay), whose gate holds or refuses.
  Engines without a gate: least outstanding tokens. (Picking the lowest expected delay among the
  admitting ones did worse on the bench: the probe's delay differences are small and not the load.)
- ``LlmdUtilizationRouter`` (llm-d-router ``pkg/epp/flowcontrol/saturationdetector/utilization``,
  defaults ``queueDepthThreshold`` 5, ``kvCacheUtilThreshold`` 0.8, read from ``vllm:num_requests_waiting``
  and ``vllm:kv_cache_usage_perc``): ``EndpointScore = max(queue / 5, kv / 0.8)``; endpoints scoring
  >= 1 are filtered (``utilization-filter``), the rest scored by the same value (queue and KV-utilization
  scorers); ``PoolSaturation`` = the mean score; when it is >= 1, sheddable requests are shed.
  llm-d's priority is an integer where < 0 is sheddable (``InferenceObjective.spec.priority``); kvguard's
  0-10 maps onto it as ``p - 5`` (5 -> 0, standard), so requests below 5 are sheddable. All endpoints
  filtered and the request not sheddable: the least scored one (``fallbackOnEmpty``).
"""

from __future__ import annotations

from kvguard.contracts.units import DEFAULT_PRIORITY

LLMD_QUEUE_DEPTH_THRESHOLD = 5
LLMD_KV_CACHE_UTIL_THRESHOLD = 0.8


def llmd_priority(priority: int | None) -> int:
    """kvguard's 0-10 as llm-d's ``InferenceObjective`` priority (< 0 sheddable): ``p - 5``."""
    return (DEFAULT_PRIORITY if priority is None else int(priority)) - DEFAULT_PRIORITY


def endpoint_series(engine) -> tuple[int, float, float] | None:
    """(admit 0/1, saturation 0-1, expected queueing delay s) of an engine with a gate, else None."""
    gate = getattr(engine, "gate", None)
    if gate is None:
        return None
    v = gate.endpoint_state()
    return (1 if v.decision == 0 else 0), v.saturation, v.delay_s


def route_by_admission(engines: list, request) -> int:
    up = [i for i, e in enumerate(engines) if e.is_up(request.arrival_ns)] or list(range(len(engines)))
    series = {i: endpoint_series(engines[i]) for i in up}
    if any(s is None for s in series.values()):
        return min(up, key=lambda i: engines[i].outstanding_tokens())
    admitting = [i for i in up if series[i][0]]
    if admitting:
        return min(admitting, key=lambda i: (engines[i].outstanding_tokens(), i))
    return min(up, key=lambda i: (series[i][1], series[i][2], i))


class LlmdUtilizationRouter:
    """See the module docstring; thresholds as llm-d-router's defaults."""

    def __init__(self, queue_depth_threshold: int = LLMD_QUEUE_DEPTH_THRESHOLD,
                 kv_cache_util_threshold: float = LLMD_KV_CACHE_UTIL_THRESHOLD):
        self.queue_depth_threshold = queue_depth_threshold
        self.kv_cache_util_threshold = kv_cache_util_threshold

    def score(self, engine) -> float:
        waiting = engine.queue_lengths()["waiting"]
        usage = engine.scheduler.usage if hasattr(engine, "scheduler") else 0.0
        return max(waiting / self.queue_depth_threshold, usage / self.kv_cache_util_threshold)

    def __call__(self, engines: list, request) -> int:
        up = [i for i, e in enumerate(engines) if e.is_up(request.arrival_ns)]
        if not up:
            return 0  # every endpoint down: it refuses (engine_restarting)
        scores = {i: self.score(engines[i]) for i in up}
        pool = sum(scores.values()) / len(scores)
        if pool >= 1.0 and llmd_priority(request.priority) < 0:
            return -1
        fit = [i for i in up if scores[i] < 1.0] or up
        return min(fit, key=lambda i: (scores[i], i))
