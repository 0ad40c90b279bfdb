"""TensorRT-LLM's serving telemetry read into per-engine figures: its Prometheus series and the JSON
iteration stats of ``trtllm-serve``'s ``/metrics``. Pure: stdlib only.

Prometheus (``GET /prometheus/metrics``; ``return_perf_metrics: true``): ``tensorrt_llm/metrics/collector.py``
at commit 050f80def8df (``TRTLLM_COMMIT_FOLLOWED``) prefixes every name with ``trtllm_`` and labels
them ``model_name, engine_type`` (both "undefined" as ``trtllm-serve`` builds the collector); gauges
carry a ``pid`` label too (multiprocess mode ``all``). Older builds name the same series without the
prefix (Dynamo adds it for TRT-LLM 1.1.0rc5): both are read, and the record says which.

=======================================  =======  ========================================================
``trtllm_kv_cache_utilization``          gauge    usedNumBlocks / maxNumBlocks: U_kv
``trtllm_kv_cache_max_blocks`` / ``_free_blocks`` / ``_used_blocks`` / ``_tokens_per_block``   gauges
``trtllm_kv_cache_hit_rate``             gauge    kvCacheStats.cacheHitRate
``trtllm_kv_cache_host_utilization``     gauge    the secondary (host) pool's used / max blocks
``trtllm_gpu_memory_usage_bytes``        gauge    gpuMemUsage: device-wide used bytes (``mem_get_info``,
                                                  every process on the GPU, PyTorch backend)
``trtllm_cpu_memory_usage_bytes`` / ``trtllm_pinned_memory_usage_bytes``  gauges (0 on the PyTorch backend)
``trtllm_num_requests_running`` / ``_waiting``  gauges  numActiveRequests / numQueuedRequests
``trtllm_num_paused_requests``           gauge    inflightBatchingStats.numPausedRequests: requests the
                                                  capacity scheduler paused for KV (TRT-LLM's preemption)
=======================================  =======  ========================================================

JSON iteration stats (``GET /metrics``; ``enable_iter_perf_stats: true`` on the PyTorch backend): a
list of per-iteration objects with the field names of ``cpp/tensorrt_llm/executor/jsonSerialization.cpp``
(``IterationStats``: ``iter``, ``numActiveRequests``, ``numQueuedRequests``, ``gpuMemUsage``,
``cpuMemUsage``, ``pinnedMemUsage``, ``kvCacheStats{maxNumBlocks, freeNumBlocks, usedNumBlocks,
tokensPerBlock, cacheHitRate, ...}``, ``inflightBatchingStats{numPausedRequests, ...}``). The read
empties the server's queue: each scrape gets the iterations since the last one (none: no reading).

What neither gives: no per-request ids (no victims), no allocator layout (F_ext, F_int), and the
device memory gauge is the whole GPU's, not this engine's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from kvguard.producers.exposition import Sample

TRTLLM_COMMIT_FOLLOWED = "050f80def8df236e326949c8bd9dee10fd896a83"
PREFIX = "trtllm_"
SERIES = {
    "kv_cache_utilization": "utilization", "kv_cache_max_blocks": "max_blocks", "kv_cache_free_blocks": "free_blocks",
    "kv_cache_used_blocks": "used_blocks", "kv_cache_tokens_per_block": "tokens_per_block",
    "kv_cache_hit_rate": "hit_rate", "kv_cache_host_utilization": "host_utilization",
    "gpu_memory_usage_bytes": "gpu_memory_bytes", "cpu_memory_usage_bytes": "cpu_memory_bytes",
    "pinned_memory_usage_bytes": "pinned_memory_bytes", "num_requests_running": "running",
    "num_requests_waiting": "waiting", "num_paused_requests": "paused",
}
EXPECTED = ("kv_cache_utilization", "kv_cache_max_blocks", "kv_cache_used_blocks", "kv_cache_tokens_per_block",
            "gpu_memory_usage_bytes", "num_requests_running", "num_requests_waiting", "num_paused_requests")
IDENTITY = ("model_name", "engine_type", "pid")
ITERATION_FIELDS = ("kvCacheStats.maxNumBlocks", "kvCacheStats.usedNumBlocks", "kvCacheStats.tokensPerBlock",
                    "gpuMemUsage", "numActiveRequests", "numQueuedRequests", "inflightBatchingStats.numPausedRequests")


class NotTrtllm(ValueError):
    """The text is neither TRT-LLM's Prometheus exposition nor its JSON iteration stats."""


@dataclass(slots=True)
class TrtllmMetrics:
    """One TRT-LLM engine's figures in one read (None: absent)."""

    labels: tuple[tuple[str, str], ...]
    source: str  # "prometheus" | "iteration_stats"
    utilization: float | None = None
    max_blocks: float | None = None
    free_blocks: float | None = None
    used_blocks: float | None = None
    tokens_per_block: float | None = None
    hit_rate: float | None = None
    host_utilization: float | None = None
    gpu_memory_bytes: float | None = None
    cpu_memory_bytes: float | None = None
    pinned_memory_bytes: float | None = None
    running: float | None = None
    waiting: float | None = None
    paused: float | None = None
    iterations: int = 0
    prefixed: bool = True
    seen: set[str] = field(default_factory=set)

    @property
    def u_kv(self) -> float | None:
        if self.used_blocks is not None and self.max_blocks:
            return self.used_blocks / self.max_blocks
        return self.utilization

    @property
    def node_suffix(self) -> str:
        pid = dict(self.labels).get("pid")
        return f"pid{pid}" if pid else "engine"

    @property
    def missing(self) -> list[str]:
        """The series (or JSON fields) the scrape reads that this read lacked, by their names."""
        if self.source == "iteration_stats":
            return [f for f in ITERATION_FIELDS if f not in self.seen]
        return [(PREFIX if self.prefixed else "") + n for n in EXPECTED if n not in self.seen]


def read_prometheus(samples: list[Sample]) -> list[TrtllmMetrics]:
    """The engines in a ``/prometheus/metrics`` exposition; raises ``NotTrtllm`` naming the series."""
    engines: dict[tuple, TrtllmMetrics] = {}
    for s in samples:
        prefixed = s.name.startswith(PREFIX)
        short = s.name[len(PREFIX):] if prefixed else s.name
        attr = SERIES.get(short)
        if attr is None:
            continue
        labels = dict(s.labels)
        key = tuple((k, labels[k]) for k in IDENTITY if k in labels)
        m = engines.get((key, prefixed))
        if m is None:
            m = engines[(key, prefixed)] = TrtllmMetrics(key, "prometheus", prefixed=prefixed)
        setattr(m, attr, s.value)
        m.seen.add(short)
    out = _merge_pids([m for m in engines.values()])
    if not any(m.u_kv is not None for m in out):
        raise NotTrtllm(f"no {PREFIX}kv_cache_utilization (or {PREFIX}kv_cache_used_blocks with _max_blocks) in the "
                        "exposition: is this TRT-LLM's /prometheus/metrics (return_perf_metrics: true)?")
    return [m for m in out if m.u_kv is not None]


def _merge_pids(engines: list[TrtllmMetrics]) -> list[TrtllmMetrics]:
    """Gauges carry the pid of the process that set them, counters none: one engine per
    (model, engine type), its gauges from the pid that reported KV (the serving process)."""
    groups: dict[tuple, list[TrtllmMetrics]] = {}
    for m in engines:
        base = tuple((k, v) for k, v in m.labels if k != "pid")
        groups.setdefault((base, m.prefixed), []).append(m)
    out = []
    for (base, prefixed), members in sorted(groups.items()):
        kv = [m for m in members if m.u_kv is not None] or members
        for m in kv:
            for other in members:
                if other is m:
                    continue
                for attr in SERIES.values():
                    if getattr(m, attr) is None and getattr(other, attr) is not None:
                        setattr(m, attr, getattr(other, attr))
                m.seen |= other.seen
            out.append(m)
    return out


def _number(obj: dict, key: str) -> float | None:
    v = obj.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def read_iteration_stats(text: str) -> list[TrtllmMetrics]:
    """The latest iteration of a ``/metrics`` JSON read (an empty list: none since the last read)."""
    try:
        stats = json.loads(text)
    except json.JSONDecodeError as e:
        raise NotTrtllm(f"not JSON ({e.msg} at {e.pos})") from None
    if isinstance(stats, dict):
        stats = [stats]
    if not isinstance(stats, list) or not all(isinstance(x, dict) for x in stats):
        raise NotTrtllm("expected a JSON list of iteration stats objects")
    if not stats:
        return []
    last = max(stats, key=lambda x: (x.get("iter", -1) if isinstance(x.get("iter"), int) else -1))
    kv = last.get("kvCacheStats") if isinstance(last.get("kvCacheStats"), dict) else {}
    ifb = last.get("inflightBatchingStats") if isinstance(last.get("inflightBatchingStats"), dict) else {}
    if not kv and "numActiveRequests" not in last:
        raise NotTrtllm("no kvCacheStats and no numActiveRequests: is this trtllm-serve's /metrics "
                        "(enable_iter_perf_stats: true)?")
    m = TrtllmMetrics((), "iteration_stats", iterations=len(stats))
    fields = {"max_blocks": (kv, "maxNumBlocks", "kvCacheStats.maxNumBlocks"),
              "free_blocks": (kv, "freeNumBlocks", "kvCacheStats.freeNumBlocks"),
              "used_blocks": (kv, "usedNumBlocks", "kvCacheStats.usedNumBlocks"),
              "tokens_per_block": (kv, "tokensPerBlock", "kvCacheStats.tokensPerBlock"),
              "hit_rate": (kv, "cacheHitRate", "kvCacheStats.cacheHitRate"),
              "gpu_memory_bytes": (last, "gpuMemUsage", "gpuMemUsage"),
              "cpu_memory_bytes": (last, "cpuMemUsage", "cpuMemUsage"),
              "pinned_memory_bytes": (last, "pinnedMemUsage", "pinnedMemUsage"),
              "running": (last, "numActiveRequests", "numActiveRequests"),
              "waiting": (last, "numQueuedRequests", "numQueuedRequests"),
              "paused": (ifb, "numPausedRequests", "inflightBatchingStats.numPausedRequests")}
    for attr, (obj, key, name) in fields.items():
        value = _number(obj, key)
        setattr(m, attr, value)
        if value is not None:
            m.seen.add(name)
    return [m] if m.u_kv is not None else []
