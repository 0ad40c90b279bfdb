"""SGLang's Prometheus ``/metrics`` (``--enable-metrics``) read into per-scheduler figures. Pure: stdlib only.

Names as SGLang 0.5.23 declares them (``sglang/srt/observability/metrics_collector.py``,
``SchedulerMetricsCollector``; before 0.5.10 ``sglang/srt/metrics/collector.py``), labelled
``model_name, engine_type, tp_rank, pp_rank, moe_ep_rank`` (plus ``dp_rank`` with data parallelism,
``priority`` with priority scheduling: the total is ``priority=""``). The server renders them through
``prometheus_client``'s multiprocess collector in ``mostrecent`` mode: no ``pid`` label, and a series
never set is absent.

======================================  ========  =====================================================
``sglang:token_usage``                  gauge     (pool - free - evictable) / pool, rounded to 2 places
``sglang:num_used_tokens``              gauge     pool - free - evictable (tokens)
``sglang:max_total_num_tokens``         gauge     the pool (tokens; 0.5.8+, set once at start-up)
``sglang:kv_used_tokens`` / ``_available_tokens`` / ``_evictable_tokens``  gauges (0.5.11+)
``sglang:num_running_reqs``             gauge     requests in the running batch
``sglang:num_queue_reqs``               gauge     waiting requests
``sglang:num_retracted_requests_total`` counter   retractions (SGLang's preemption; 0.5.8+)
``sglang:num_retracted_reqs``           gauge     retractions of the last decode step
``sglang:cache_hit_rate``               gauge     prefix-cache hit rate of the last prefill batch
``sglang:new_token_ratio``              gauge     the admission's decode estimate (0.5.8+)
``sglang:is_cuda_graph``                gauge     whether the last batch ran in a CUDA graph
``sglang:num_paused_reqs``              gauge     paused by an async weight sync
``sglang:kv_cache_memory_usage_gb`` / ``weight_memory_usage_gb`` / ``startup_available_gpu_memory_gb``
                                        gauges    the start-up budget (constants)
======================================  ========  =====================================================

U_kv: ``num_used_tokens / max_total_num_tokens`` when both are there (exact), else ``token_usage``
(rounded); radix-cached tokens nobody holds count as free, as SGLang counts them. The gauges are
refreshed at every prefill batch but only every ``--decode-log-interval`` (40) decode steps, so a
scrape may be 40 decode steps old.

What a scrape cannot give, compared with the node plugin (``producers.sglang.plugin``): no
allocator state, no F_ext (pages are uniform) and no F_int, no request ids (no victims), one sample
per scrape.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvguard.producers.exposition import Sample

TOKEN_USAGE = "sglang:token_usage"
USED = "sglang:num_used_tokens"
POOL = "sglang:max_total_num_tokens"
KV_USED, KV_AVAILABLE, KV_EVICTABLE = "sglang:kv_used_tokens", "sglang:kv_available_tokens", "sglang:kv_evictable_tokens"
RUNNING, QUEUED = "sglang:num_running_reqs", "sglang:num_queue_reqs"
RETRACTED_TOTAL, RETRACTED_LAST = "sglang:num_retracted_requests_total", "sglang:num_retracted_reqs"
CACHE_HIT_RATE, NEW_TOKEN_RATIO = "sglang:cache_hit_rate", "sglang:new_token_ratio"
CUDA_GRAPH, PAUSED = "sglang:is_cuda_graph", "sglang:num_paused_reqs"
KV_CACHE_GB, WEIGHTS_GB = "sglang:kv_cache_memory_usage_gb", "sglang:weight_memory_usage_gb"
STARTUP_FREE_GB = "sglang:startup_available_gpu_memory_gb"

# read by the scrape, in the order a report lists what is missing
EXPECTED = (TOKEN_USAGE, USED, POOL, KV_USED, KV_AVAILABLE, KV_EVICTABLE, RUNNING, QUEUED, RETRACTED_TOTAL,
            CACHE_HIT_RATE, NEW_TOKEN_RATIO, CUDA_GRAPH)
_FIELDS = {TOKEN_USAGE: "token_usage", USED: "used_tokens", POOL: "pool_tokens", KV_USED: "kv_used_tokens",
           KV_AVAILABLE: "kv_available_tokens", KV_EVICTABLE: "kv_evictable_tokens", RUNNING: "running",
           QUEUED: "queued", RETRACTED_TOTAL: "retracted_total", RETRACTED_LAST: "retracted_last",
           CACHE_HIT_RATE: "cache_hit_rate", NEW_TOKEN_RATIO: "new_token_ratio", CUDA_GRAPH: "cuda_graph",
           PAUSED: "paused", KV_CACHE_GB: "kv_cache_gb", WEIGHTS_GB: "weights_gb", STARTUP_FREE_GB: "startup_free_gb"}
IDENTITY = ("model_name", "engine_type", "dp_rank", "tp_rank", "pp_rank")


class NotSglang(ValueError):
    """The exposition has none of SGLang's KV series; says which it looked for."""


@dataclass(slots=True)
class SchedulerMetrics:
    """One SGLang scheduler's figures in one scrape (None: the exposition lacks the series)."""

    labels: tuple[tuple[str, str], ...]
    token_usage: float | None = None
    used_tokens: float | None = None
    pool_tokens: float | None = None
    kv_used_tokens: float | None = None
    kv_available_tokens: float | None = None
    kv_evictable_tokens: float | None = None
    running: float | None = None
    queued: float | None = None
    retracted_total: float | None = None
    retracted_last: float | None = None
    cache_hit_rate: float | None = None
    new_token_ratio: float | None = None
    cuda_graph: float | None = None
    paused: float | None = None
    kv_cache_gb: float | None = None
    weights_gb: float | None = None
    startup_free_gb: float | None = None
    seen: set[str] = field(default_factory=set)

    @property
    def node_suffix(self) -> str:
        d = dict(self.labels)
        parts = [f"dp{d['dp_rank']}"] if d.get("dp_rank") else []
        parts.append(f"tp{d.get('tp_rank', '0')}")
        if d.get("pp_rank", "0") != "0":
            parts.append(f"pp{d['pp_rank']}")
        return "-".join(parts)

    @property
    def u_kv(self) -> float | None:
        if self.used_tokens is not None and self.pool_tokens:
            return self.used_tokens / self.pool_tokens
        return self.token_usage

    @property
    def missing(self) -> list[str]:
        return [name for name in EXPECTED if name not in self.seen]


def sglang_schedulers(samples: list[Sample]) -> dict[tuple[tuple[str, str], ...], SchedulerMetrics]:
    """SGLang's figures per scheduler (label set ``IDENTITY``); priority-labelled series count their
    ``priority=""`` total only."""
    out: dict[tuple[tuple[str, str], ...], SchedulerMetrics] = {}
    for s in samples:
        attr = _FIELDS.get(s.name)
        if attr is None or s.label("priority", "") != "":
            continue
        labels = dict(s.labels)
        key = tuple((k, labels[k]) for k in IDENTITY if k in labels)
        m = out.get(key)
        if m is None:
            m = out[key] = SchedulerMetrics(key)
        setattr(m, attr, s.value)
        m.seen.add(s.name)
    return out


def read(samples: list[Sample]) -> list[SchedulerMetrics]:
    """The schedulers with a KV reading; raises ``NotSglang`` naming the series when none has one."""
    schedulers = [m for m in sglang_schedulers(samples).values() if m.u_kv is not None]
    if not schedulers:
        raise NotSglang(f"no {TOKEN_USAGE} and no {USED} with {POOL} in the exposition: is this SGLang's /metrics "
                        "(started with --enable-metrics)?")
    return sorted(schedulers, key=lambda m: m.labels)
