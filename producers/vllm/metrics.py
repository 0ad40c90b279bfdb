"""vLLM's Prometheus ``/metrics`` text, parsed into per-engine figures (``kvguard scrape``). Pure: stdlib only.

Names as vLLM 0.33 defines them (``vllm/v1/metrics/loggers.py``, ``PrometheusStatLogger``; the
``prometheus_client`` exposition adds ``_total`` to counters and ``_bucket``/``_sum``/``_count`` to
histograms), labelled ``model_name`` and ``engine``:

=====================================  =========  ==============================================
``vllm:kv_cache_usage_perc``           gauge      KV blocks in use / usable blocks (0..1): U_kv
``vllm:num_requests_running``          gauge      requests in the running batch
``vllm:num_requests_waiting``          gauge      waiting (queued, preempted, deferred) requests
``vllm:num_preemptions_total``         counter    preemptions since start
``vllm:prefix_cache_queries_total``    counter    prompt tokens looked up in the prefix cache
``vllm:prefix_cache_hits_total``       counter    of those, tokens found
``vllm:prompt_tokens_total``           counter    prefill tokens processed
``vllm:generation_tokens_total``       counter    tokens generated
``vllm:time_to_first_token_seconds``   histogram  TTFT of finished prefills
=====================================  =========  ==============================================

What a scrape cannot give, compared with the plugin: no allocator state (``alloc_*``), no F_ext or
F_int (vLLM exports no free-block layout or token fill), no request ids (no victims for the
policy), and only a sample every scrape interval instead of every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvguard.producers.exposition import MetricsParseError, Sample, histogram_quantile, parse_exposition, value_of

__all__ = [
    "EngineMetrics",
    "Interval",
    "MetricsParseError",
    "Sample",
    "histogram_quantile",
    "interval",
    "parse_exposition",
    "vllm_engines",
]

USAGE = "vllm:kv_cache_usage_perc"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PREEMPTIONS = "vllm:num_preemptions_total"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
TTFT = "vllm:time_to_first_token_seconds"
ENGINE_LABELS = ("model_name", "engine")

@dataclass(slots=True)
class EngineMetrics:
    """One vLLM engine's figures in one scrape (None: the exposition lacks the metric)."""

    model_name: str
    engine: str
    kv_cache_usage: float | None = None
    running: float | None = None
    waiting: float | None = None
    preemptions_total: float | None = None
    prefix_queries_total: float | None = None
    prefix_hits_total: float | None = None
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    ttft_buckets: list[tuple[float, float]] = field(default_factory=list)  # (le, cumulative count), sorted
    ttft_sum: float | None = None
    ttft_count: float | None = None

    @property
    def key(self) -> tuple[str, str]:
        return self.model_name, self.engine


_SCALARS = {USAGE: "kv_cache_usage", RUNNING: "running", WAITING: "waiting", PREEMPTIONS: "preemptions_total",
            PREFIX_QUERIES: "prefix_queries_total", PREFIX_HITS: "prefix_hits_total",
            PROMPT_TOKENS: "prompt_tokens_total", GENERATION_TOKENS: "generation_tokens_total"}


def vllm_engines(samples: list[Sample]) -> dict[tuple[str, str], EngineMetrics]:
    """The vLLM figures per (model_name, engine) label pair."""
    engines: dict[tuple[str, str], EngineMetrics] = {}

    def engine_of(s: Sample) -> EngineMetrics:
        key = (s.label("model_name"), s.label("engine", "0"))
        if key not in engines:
            engines[key] = EngineMetrics(*key)
        return engines[key]

    for s in samples:
        attr = _SCALARS.get(s.name)
        if attr is not None:
            em = engine_of(s)
            setattr(em, attr, (getattr(em, attr) or 0.0) + s.value)  # summed over extra labels, if any
        elif s.name == TTFT + "_bucket":
            engine_of(s).ttft_buckets.append((value_of(s.label("le", "+Inf")), s.value))
        elif s.name == TTFT + "_sum":
            engine_of(s).ttft_sum = s.value
        elif s.name == TTFT + "_count":
            engine_of(s).ttft_count = s.value
    for em in engines.values():
        em.ttft_buckets.sort()
    return engines


def _delta(now: float | None, before: float | None) -> float | None:
    if now is None:
        return None
    if before is None or now < before:  # first scrape, or the counter reset (engine restart)
        return None
    return now - before


@dataclass(slots=True, frozen=True)
class Interval:
    """What happened between two scrapes of one engine (None where a counter is missing or reset)."""

    seconds: float
    preemptions: float | None
    prefix_hit_rate: float | None
    tokens_per_s: float | None
    decode_tokens_per_s: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    reset: bool


def interval(now: EngineMetrics, before: EngineMetrics | None, seconds: float) -> Interval:
    """Rates and quantiles over the interval (TTFT from the bucket deltas)."""
    b = before
    preempt = _delta(now.preemptions_total, b.preemptions_total if b else None)
    queries = _delta(now.prefix_queries_total, b.prefix_queries_total if b else None)
    hits = _delta(now.prefix_hits_total, b.prefix_hits_total if b else None)
    prompt = _delta(now.prompt_tokens_total, b.prompt_tokens_total if b else None)
    gen = _delta(now.generation_tokens_total, b.generation_tokens_total if b else None)
    reset = b is not None and any(
        x is not None and y is not None and x < y for x, y in
        ((now.preemptions_total, b.preemptions_total), (now.generation_tokens_total, b.generation_tokens_total)))
    buckets = now.ttft_buckets
    if b is not None and b.ttft_buckets and len(b.ttft_buckets) == len(buckets) and not reset:
        buckets = [(le, c - c0) for (le, c), (_, c0) in zip(now.ttft_buckets, b.ttft_buckets)]
    elif b is not None and not reset:
        buckets = now.ttft_buckets
    per_s = 1.0 / seconds if seconds > 0 else 0.0
    return Interval(
        seconds=seconds, preemptions=preempt,
        prefix_hit_rate=(hits / queries) if (hits is not None and queries) else None,
        tokens_per_s=((prompt or 0.0) + gen) * per_s if gen is not None else None,
        decode_tokens_per_s=gen * per_s if gen is not None else None,
        ttft_p50_s=histogram_quantile(0.5, buckets), ttft_p99_s=histogram_quantile(0.99, buckets), reset=reset)
