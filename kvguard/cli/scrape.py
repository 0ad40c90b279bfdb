"""`kvguard scrape`: an engine's metrics endpoint (vLLM's or SGLang's Prometheus /metrics, TensorRT-LLM's
/prometheus/metrics or JSON /metrics) as kvguard ticks and tier 1-2 alerts, for engines without the plugin."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import typer

from kvguard.cli.app import app
from kvguard.contracts.units import NS_PER_S

# the rules a scrape can feed: U_kv thresholds and its slope (Ψ and the fragmentation rule need F_ext)
SCRAPE_RULES = ("KVCacheUsageCritical", "KVCacheUsageHigh", "KVCacheUsageRising")


ENGINES = ("vllm", "sglang", "trtllm")


@app.command()
def scrape(
    url: str = typer.Option(..., "--url", help="The engine's metrics endpoint, e.g. http://host:8000/metrics (vLLM, "
                                               "SGLang with --enable-metrics), http://host:8000/prometheus/metrics or "
                                               "/metrics (TensorRT-LLM: Prometheus or JSON iteration stats)."),
    engine: str = typer.Option("vllm", "--engine", help="Which engine serves the endpoint: vllm, sglang or trtllm."),
    interval: str = typer.Option("5s", "--interval", help="Time between scrapes (the tick)."),
    count: int = typer.Option(None, "--count", min=1, help="Stop after this many scrapes (default: run until Ctrl-C)."),
    node: str = typer.Option(None, "--node", help="Node id prefix (default: the URL's host:port); engines become "
                                                   "<node>/engine<engine label>."),
    timeout: str = typer.Option("3s", "--timeout", help="HTTP timeout of one scrape."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line: type tick|alert|scrape_error."),
    config: Path = typer.Option(None, "--config", help="Settings file (thresholds, slope window)."),
) -> None:
    """Scrape an engine's metrics into ticks with the threshold and slope tiers on U_kv.

    Every --interval, per engine in the exposition: U_kv, preemptions,
    running/waiting requests and what else the engine exports. vLLM:
    vllm:kv_cache_usage_perc, preemptions, prefix-cache hit rate, token
    throughput, TTFT p50/p99. SGLang: sglang:num_used_tokens /
    sglang:max_total_num_tokens (else sglang:token_usage), retractions (its
    preemption), cache hit rate, new_token_ratio, the CUDA-graph flag,
    used/free/evictable tokens. TensorRT-LLM: trtllm_kv_cache_used_blocks /
    _max_blocks (else trtllm_kv_cache_utilization), paused requests, device
    memory in use; or, from the JSON /metrics, the same fields of the last
    iteration (that read empties its queue). A series the scrape reads that
    the exposition lacks is named in the tick's scrape.missing_series.

    What is missing without the plugin: no allocator state (the alloc_*
    figures, OOMs), no F_ext and no F_int (vLLM exports no free-block layout
    or token fill), hence no Ψ and no fragmentation rule; no request ids (no
    victims, so the policy cannot act on these ticks); no P(OOM) (the model
    is trained on the plugin's full features); and one sample per scrape
    instead of every engine step.
    """
    from kvguard.cli.simulate import parse_duration
    from kvguard.config.settings import ConfigError, Settings
    from kvguard.runtime.bootstrap import BootstrapError, bootstrap
    from kvguard.streams.core import StreamConfigError

    if engine not in ENGINES:
        typer.echo(f"error: --engine: expected one of {', '.join(ENGINES)}, got {engine!r}", err=True)
        raise typer.Exit(2)
    try:
        interval_s = parse_duration(interval)
        timeout_s = parse_duration(timeout)
        settings = Settings.load(config)
        # no P(OOM) on scraped ticks: the model is trained on the plugin's full features
        stream_config = bootstrap(settings, predictor=None).stream_config(tick_s=interval_s)
    except typer.BadParameter as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except (ConfigError, StreamConfigError, BootstrapError) as exc:
        typer.echo(f"config error: {exc}", err=True)
        raise typer.Exit(2) from None
    prefix = node or _host_port(url)
    scraper = Scraper(prefix, stream_config, engine=engine)
    try:
        failures = asyncio.run(_loop(url, scraper, interval_s=interval_s, timeout_s=timeout_s, count=count,
                                     as_json=as_json))
    except KeyboardInterrupt:
        failures = 0
    if failures and count is not None and failures >= count:
        raise typer.Exit(1)


# a vLLM /metrics body is tens of KB (a histogram per engine and model); the reader stops past this
MAX_EXPOSITION_BYTES = 16 * 1024 * 1024


def _host_port(url: str) -> str:
    from urllib.parse import urlparse

    parsed = urlparse(url)
    return parsed.netloc or url


async def _loop(url: str, scraper: Scraper, *, interval_s: float, timeout_s: float, count: int | None,
                as_json: bool) -> int:
    import aiohttp

    failures = done = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        next_at = time.monotonic()
        while count is None or done < count:
            ts_ns = time.time_ns()
            try:
                async with session.get(url) as response:
                    body = await response.content.read(MAX_EXPOSITION_BYTES + 1)
                    if response.status != 200:
                        raise RuntimeError(f"HTTP {response.status}")
                    if len(body) > MAX_EXPOSITION_BYTES:  # read no further: a hostile endpoint could send without end
                        raise ValueError(f"the exposition is over {MAX_EXPOSITION_BYTES} bytes: not a vLLM /metrics")
                    text = body.decode(response.charset or "utf-8", "replace")
                records = scraper.scrape(text, ts_ns)
            except Exception as exc:  # noqa: BLE001 - one failed scrape is reported, the loop goes on
                failures += 1
                records = [{"type": "scrape_error", "url": url, "ts_ns": ts_ns, "error": f"{type(exc).__name__}: {exc}"}]
            for record in records:
                _emit(record, as_json)
            done += 1
            next_at += interval_s
            if count is None or done < count:
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
    return failures


def _emit(record: dict, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(record) + "\n")
        sys.stdout.flush()
        return
    if record["type"] == "tick":
        s = record["scrape"]
        ttft = "-" if s.get("ttft_p99_s") is None else f"{s['ttft_p99_s'] * 1000:.0f}ms"
        typer.echo(f"{record['ts_s']:>14.1f}s {record['node']:<24} u_kv {record['u_kv']:.3f}  slope "
                   f"{record['slope_per_min']:+.4f}/min  running {record['requests_running']}  waiting "
                   f"{record['requests_waiting']}  preempted {record['preemptions']}  ttft p99 {ttft}")
    elif record["type"] == "alert":
        typer.echo(f"{record['ts_s']:>14.1f}s {record['node']:<24} ALERT {record['name']} {record['status']} "
                   f"[{record['severity']}, {record['tier']}] value {record['value']:.4f}")
    else:
        typer.echo(f"scrape of {record['url']} failed: {record['error']}", err=True)


class Scraper:
    """Per engine: the U_kv history for the slope, the last scrape for the deltas, the alert state."""

    def __init__(self, prefix: str, config, engine: str = "vllm") -> None:
        self.prefix = prefix
        self.config = config
        self.engine = engine
        self.history: dict[tuple[str, str], list[tuple[int, float]]] = {}
        self.last: dict[tuple[str, str], tuple[int, object]] = {}
        self.evaluators: dict[tuple[str, str], object] = {}

    def scrape(self, text: str, ts_ns: int) -> list[dict]:
        """One exposition text → a tick record per engine, then its alert records."""
        from kvguard.producers.vllm.metrics import parse_exposition, vllm_engines

        if self.engine in _READERS:  # SGLang's and TensorRT-LLM's series (vLLM's are read below)
            out: list[dict] = []
            for reading in _READERS[self.engine](text):
                out.extend(self._reading(reading, ts_ns))
            return out

        engines = vllm_engines(parse_exposition(text))
        if not any(e.kv_cache_usage is not None for e in engines.values()):
            raise ValueError("no vllm:kv_cache_usage_perc in the exposition: is this vLLM's /metrics?")
        out: list[dict] = []
        for key, em in sorted(engines.items()):
            if em.kv_cache_usage is None:
                continue
            out.extend(self._engine(key, em, ts_ns))
        return out

    def _engine(self, key, em, ts_ns: int) -> list[dict]:
        import numpy as np

        from kvguard.contracts import pressure
        from kvguard.contracts.tick import Tick
        from kvguard.producers.vllm.metrics import interval
        from kvguard.streams.metrics import least_squares_slope, tick_record

        cfg = self.config
        node = f"{self.prefix}/engine{em.engine}"
        points = self.history.setdefault(key, [])
        points.append((ts_ns, float(em.kv_cache_usage)))
        horizon = ts_ns - int(cfg.slope_window_s * NS_PER_S)
        while points and points[0][0] <= horizon:
            points.pop(0)
        pts = np.array(points, dtype=np.float64)
        slope = least_squares_slope(pts[:, 0], pts[:, 1])
        before = self.last.get(key)
        iv = interval(em, before[1] if before else None, (ts_ns - before[0]) / NS_PER_S if before else 0.0)
        self.last[key] = (ts_ns, em)
        u = float(em.kv_cache_usage)
        reserved = cfg.reserved_frac if cfg.reserved_frac is not None else 0.05
        tick = Tick(
            node=node, ts_ns=ts_ns, tick_s=cfg.tick_s, synced=True, u_kv=u, f_ext=0.0, f_int=0.0,
            psi=float(pressure.psi(u, 0.0, 1.0, 0.0, 0.0, reserved, cfg.alpha, cfg.beta)), slope_per_min=slope,
            live_units=0, cached_units=0, retained_units=0, workspace_units=0, free_units=0, largest_free_run_units=0,
            n_free_runs=0, dynamic_units=0, tokens_stored=0, util_weights=0.0, util_kv_live=0.0, util_kv_cached=0.0,
            util_workspace=0.0, util_free=0.0, util_headroom=0.0, util_reserved=0.0, reserved_frac=reserved,
            pages_per_request_p50=0.0, pages_per_request_p95=0.0, pages_per_request_p99=0.0,
            requests_running=int(em.running or 0), requests_holding_pages=int(em.running or 0), arrivals=0, finished=0,
            alloc_failures=0, alloc_fail_per_s=0.0, evicted_pages=0, evicted_requests=0, evicted_tokens=0,
            preemptions=int(iv.preemptions or 0), ooms=0, tokens_per_s=float(iv.tokens_per_s or 0.0),
            decode_tokens_per_s=float(iv.decode_tokens_per_s or 0.0), events=0,
            requests_waiting=int(em.waiting or 0))
        record = tick_record(tick)
        record["type"] = "tick"
        record["source"] = "scrape"
        record["scrape"] = {"model_name": em.model_name, "engine": em.engine, "interval_s": round(iv.seconds, 3),
                            "prefix_hit_rate": iv.prefix_hit_rate, "ttft_p50_s": iv.ttft_p50_s,
                            "ttft_p99_s": iv.ttft_p99_s, "counter_reset": iv.reset,
                            "missing": ["alloc_*", "f_ext", "f_int", "psi (no fragmentation terms)", "candidates",
                                        "p_oom"]}
        return [record, *self._alerts(key, tick)]

    def _alerts(self, key, tick) -> list[dict]:
        from kvguard.streams.alerts import AlertEvaluator, alert_record, default_rules

        evaluator = self.evaluators.get(key)
        if evaluator is None:
            rules = [r for r in default_rules(self.config.thresholds) if r.name in SCRAPE_RULES]
            evaluator = self.evaluators[key] = AlertEvaluator(rules)
        out = []
        for alert in evaluator.evaluate(tick):
            a = alert_record(alert)
            a["type"] = "alert"
            a["ts_s"] = alert.ts_ns / NS_PER_S
            out.append(a)
        return out

    def _slope(self, key, ts_ns: int, u: float) -> float:
        import numpy as np

        from kvguard.streams.metrics import least_squares_slope

        points = self.history.setdefault(key, [])
        points.append((ts_ns, u))
        horizon = ts_ns - int(self.config.slope_window_s * NS_PER_S)
        while points and points[0][0] <= horizon:
            points.pop(0)
        pts = np.array(points, dtype=np.float64)
        return least_squares_slope(pts[:, 0], pts[:, 1])

    def _reading(self, r: Reading, ts_ns: int) -> list[dict]:
        """An SGLang or TensorRT-LLM reading as a tick record (units: the engine's tokens or blocks)."""
        from kvguard.contracts import pressure
        from kvguard.contracts.tick import Tick
        from kvguard.streams.metrics import tick_record

        cfg = self.config
        key = (self.engine, r.key)
        slope = self._slope(key, ts_ns, r.u_kv)
        before = self.last.get(key)
        preempted = None
        if r.preemptions_total is not None and before is not None and before[1] is not None:
            preempted = r.preemptions_total - before[1] if r.preemptions_total >= before[1] else None
        self.last[key] = (ts_ns, r.preemptions_total)
        reserved = cfg.reserved_frac if cfg.reserved_frac is not None else 0.05
        live, cached, free, total = r.units
        tick = Tick(
            node=f"{self.prefix}/{r.node_suffix}", ts_ns=ts_ns, tick_s=cfg.tick_s, synced=True, u_kv=r.u_kv,
            f_ext=0.0, f_int=0.0, psi=float(pressure.psi(r.u_kv, 0.0, 1.0, 0.0, 0.0, reserved, cfg.alpha, cfg.beta)),
            slope_per_min=slope, live_units=live, cached_units=cached, retained_units=0, workspace_units=0,
            free_units=free, largest_free_run_units=0, n_free_runs=0, dynamic_units=total, tokens_stored=0,
            util_weights=0.0, util_kv_live=0.0, util_kv_cached=0.0, util_workspace=0.0, util_free=0.0,
            util_headroom=0.0, util_reserved=0.0, reserved_frac=reserved, pages_per_request_p50=0.0,
            pages_per_request_p95=0.0, pages_per_request_p99=0.0, requests_running=int(r.running or 0),
            requests_holding_pages=int(r.running or 0), arrivals=0, finished=0, alloc_failures=0,
            alloc_fail_per_s=0.0, evicted_pages=0, evicted_requests=0, evicted_tokens=0,
            preemptions=int(preempted or 0), ooms=0, tokens_per_s=0.0, decode_tokens_per_s=0.0, events=0,
            requests_waiting=int(r.waiting or 0))
        record = tick_record(tick)
        record["type"] = "tick"
        record["source"] = "scrape"
        record["scrape"] = {"engine": self.engine, "labels": dict(r.key), "unit": r.unit,
                            "interval_s": round((ts_ns - before[0]) / NS_PER_S, 3) if before else 0.0,
                            "counter_reset": r.preemptions_total is not None and before is not None
                            and before[1] is not None and r.preemptions_total < before[1],
                            "missing_series": r.missing, **r.extra,
                            "missing": ["alloc_*", "f_ext", "f_int", "psi (no fragmentation terms)", "candidates",
                                        "p_oom"]}
        return [record, *self._alerts(key, tick)]


@dataclass(slots=True, frozen=True)
class Reading:
    """What one scrape says of one SGLang scheduler or TensorRT-LLM engine, engine-neutral."""

    key: tuple
    node_suffix: str
    u_kv: float
    running: float | None
    waiting: float | None
    preemptions_total: float | None  # a counter (SGLang's retractions); None where the engine has none
    units: tuple[int, int, int, int]  # live, cached, free, total, in ``unit``
    unit: str
    missing: list[str]
    extra: dict


def _int(x) -> int:
    return int(x) if x is not None else 0


def _read_sglang(text: str) -> list[Reading]:
    from kvguard.producers.exposition import parse_exposition
    from kvguard.producers.sglang.metrics import read

    out = []
    for m in read(parse_exposition(text)):
        out.append(Reading(
            key=m.labels, node_suffix=m.node_suffix, u_kv=float(m.u_kv), running=m.running, waiting=m.queued,
            preemptions_total=m.retracted_total,
            units=(_int(m.kv_used_tokens if m.kv_used_tokens is not None else m.used_tokens), _int(m.kv_evictable_tokens),
                   _int(m.kv_available_tokens), _int(m.pool_tokens)),
            unit="token", missing=m.missing,
            extra={"token_usage": m.token_usage, "retractions_last_step": m.retracted_last,
                   "cache_hit_rate": m.cache_hit_rate, "new_token_ratio": m.new_token_ratio,
                   "cuda_graph": m.cuda_graph, "paused": m.paused,
                   "startup": {"kv_cache_gb": m.kv_cache_gb, "weights_gb": m.weights_gb,
                               "available_gpu_memory_gb": m.startup_free_gb}}))
    return out


def _read_trtllm(text: str) -> list[Reading]:
    from kvguard.producers.exposition import parse_exposition
    from kvguard.producers.trtllm.metrics import read_iteration_stats, read_prometheus

    stripped = text.lstrip()
    engines = read_iteration_stats(text) if stripped[:1] in ("[", "{") else read_prometheus(parse_exposition(text))
    if not engines:
        raise ValueError("no TensorRT-LLM iteration stats since the last read (the JSON /metrics empties on read; "
                         "is enable_iter_perf_stats on?)")
    out = []
    for m in engines:
        used, free, total = _int(m.used_blocks), _int(m.free_blocks), _int(m.max_blocks)
        out.append(Reading(
            key=m.labels, node_suffix=m.node_suffix, u_kv=float(m.u_kv), running=m.running, waiting=m.waiting,
            preemptions_total=None, units=(used, 0, free, total), unit="block", missing=m.missing,
            extra={"source": m.source, "prefixed_names": m.prefixed, "paused_requests": m.paused,
                   "kv_cache_hit_rate": m.hit_rate, "host_kv_utilization": m.host_utilization,
                   "tokens_per_block": m.tokens_per_block, "gpu_memory_used_bytes": m.gpu_memory_bytes,
                   "cpu_memory_bytes": m.cpu_memory_bytes, "pinned_memory_bytes": m.pinned_memory_bytes,
                   "iterations_read": m.iterations}))
    return out


_READERS = {"sglang": _read_sglang, "trtllm": _read_trtllm}
