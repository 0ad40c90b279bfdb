"""`kvguard scrape` against a local aiohttp server that serves a real vLLM /metrics text: vLLM 0.33's own
``PrometheusStatLogger`` (vllm/v1/metrics/loggers.py) records scheduler and iteration stats into
prometheus_client, and the server returns ``generate_latest()`` as vLLM's API server does. Between
scrapes the test records rising KV usage, preemptions and TTFTs, so the ticks move and the threshold
and slope tiers fire. Needs vllm (``make venv``); not skipped without it."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest
from typer.testing import CliRunner

import kvguard.cli
import kvguard.cli.scrape  # registers the command until kvguard/cli/__init__.py imports it
from kvguard.cli.app import app
from kvguard.producers.vllm.metrics import PREEMPTIONS, TTFT, USAGE, parse_exposition, vllm_engines

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


class VllmMetrics:
    """vLLM's Prometheus logger over the conformance rig's VllmConfig; ``advance`` records one interval."""

    USAGE_STEPS = (0.50, 0.62, 0.75, 0.86, 0.93, 0.97)

    def __init__(self):
        from vllm.v1.metrics.loggers import PrometheusStatLogger

        from kvguard.producers.sim.vllm.conformance import VllmSide
        from kvguard.producers.sim.vllm.scheduler import SchedulerConfig

        side = VllmSide(SchedulerConfig(num_gpu_blocks=200, max_model_len=3000, block_size=16, max_num_seqs=8,
                                        max_num_batched_tokens=512))
        self.logger = PrometheusStatLogger(side.scheduler.vllm_config, [0])
        self.served = 0

    def advance(self) -> None:
        from vllm.v1.metrics.stats import IterationStats, PrefixCacheStats, SchedulerStats

        usage = self.USAGE_STEPS[min(self.served, len(self.USAGE_STEPS) - 1)]
        stats = SchedulerStats(num_running_reqs=4 + self.served, num_waiting_reqs=self.served, kv_cache_usage=usage,
                               prefix_cache_stats=PrefixCacheStats(requests=2, queries=1000, hits=250))
        it = IterationStats()
        it.num_preempted_reqs = self.served
        it.num_generation_tokens = 100
        it.time_to_first_tokens_iter += [0.02, 0.08, 0.3 + 0.2 * self.served]
        self.logger.record(stats, it, None, 0)
        self.served += 1

    def text(self) -> str:
        import prometheus_client

        self.advance()
        return prometheus_client.generate_latest().decode()


@pytest.fixture(scope="module")
def vllm_metrics():
    return VllmMetrics()


@pytest.fixture()
def server(vllm_metrics):
    """aiohttp on a loopback port in a thread with its own loop (the CLI runs asyncio.run itself)."""
    from aiohttp import web

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    loop = asyncio.new_event_loop()
    started = threading.Event()
    runner_box = {}

    async def metrics(_request):
        return web.Response(text=vllm_metrics.text(), content_type="text/plain")

    async def wide(_request):
        return web.Response(text=" " * 100_000 + "\n", content_type="text/plain")

    async def start():
        application = web.Application()
        application.router.add_get("/metrics", metrics)
        application.router.add_get("/wide", wide)
        runner = web.AppRunner(application)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runner_box["runner"] = runner
        started.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True)
    thread.start()
    started.wait(10)
    yield f"http://127.0.0.1:{port}/metrics"
    asyncio.run_coroutine_threadsafe(runner_box["runner"].cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_vllms_real_exposition_has_the_metrics_the_scraper_reads(vllm_metrics):
    text = vllm_metrics.text()
    engines = vllm_engines(parse_exposition(text))
    assert len(engines) == 1
    (em,) = engines.values()
    assert em.engine == "0" and em.kv_cache_usage is not None and em.running is not None and em.waiting is not None
    assert em.preemptions_total is not None and em.prefix_hits_total is not None and em.prefix_queries_total
    assert em.ttft_buckets and em.ttft_buckets[-1][1] == em.ttft_count
    for name in (USAGE, PREEMPTIONS, TTFT + "_bucket", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"):
        assert name in text, name


def test_kvguard_scrape_turns_vllm_metrics_into_ticks_and_tier_alerts(server):
    result = CliRunner().invoke(app, ["scrape", "--url", server, "--interval", "200ms", "--count", "5", "--json"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    ticks = [r for r in records if r["type"] == "tick"]
    alerts = [r for r in records if r["type"] == "alert"]
    assert len(ticks) == 5 and all(t["source"] == "scrape" and t["node"].endswith("/engine0") for t in ticks)
    usage = [t["u_kv"] for t in ticks]
    assert usage == sorted(usage) and usage[-1] > 0.90 > usage[0]
    assert ticks[-1]["slope_per_min"] > 0.05 and ticks[-1]["f_ext"] == 0.0
    assert ticks[-1]["preemptions"] > 0 and ticks[-1]["requests_waiting"] > 0
    assert ticks[-1]["scrape"]["prefix_hit_rate"] == pytest.approx(0.25)
    assert ticks[-1]["scrape"]["ttft_p99_s"] > ticks[-1]["scrape"]["ttft_p50_s"] > 0
    fired = {a["name"] for a in alerts if a["status"] == "firing"}
    assert {"KVCacheUsageCritical", "KVCacheUsageHigh", "KVCacheUsageRising"} <= fired
    assert not {a["name"] for a in alerts} & {"KVCachePressureCritical", "KVCacheOOMRisk"}  # need F_ext


def test_a_scrape_of_something_that_is_not_vllm_is_reported_not_crashed(server):
    url = server.replace("/metrics", "/nothing-here")
    result = CliRunner().invoke(app, ["scrape", "--url", url, "--interval", "100ms", "--count", "2", "--json"])
    assert result.exit_code == 1
    errors = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    assert len(errors) == 2 and all(e["type"] == "scrape_error" and "404" in e["error"] for e in errors)


def test_a_scrape_body_past_the_bound_is_refused_having_read_no_more(server, monkeypatch):
    # issue 28: readers bound what one line (here: one body) may make them hold
    monkeypatch.setattr(kvguard.cli.scrape, "MAX_EXPOSITION_BYTES", 10_000)
    url = server.replace("/metrics", "/wide")
    result = CliRunner().invoke(app, ["scrape", "--url", url, "--interval", "100ms", "--count", "1", "--json"])
    assert result.exit_code == 1
    (error,) = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    assert error["type"] == "scrape_error" and "over 10000 bytes" in error["error"]
