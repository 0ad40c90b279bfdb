"""`kvguard scrape --engine sglang|trtllm` against a local aiohttp server that serves each engine's real
metric text, changing between scrapes so the ticks move and the threshold and slope tiers fire.

- SGLang: its own collector renders the text (tests/integration/sglang_metrics_render.py runs SGLang
  0.5.23's ``SchedulerMetricsCollector`` in a subprocess, as its server's ``/metrics`` renders it);
- TensorRT-LLM: the fixtures of tests/data/trtllm (names from its source at pinned commits, see the
  README there), with the KV and request values changed between scrapes.

A series the scrape reads that is missing or renamed is reported by name. Needs sglang
(``make venv``); not skipped without it.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

import kvguard.cli
import kvguard.cli.scrape  # noqa: F401 - until kvguard/cli/__init__.py imports it
from kvguard.cli.app import app
from kvguard.producers.exposition import parse_exposition
from kvguard.producers.sglang.metrics import EXPECTED as SGLANG_SERIES
from kvguard.producers.sglang.metrics import read as read_sglang
from kvguard.producers.trtllm.metrics import read_iteration_stats, read_prometheus

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "data" / "trtllm"
POOL = 15427
USAGE = (0.50, 0.62, 0.75, 0.86, 0.93, 0.97)


def sglang_texts() -> list[str]:
    moments = []
    for i, u in enumerate(USAGE):
        used = int(POOL * u)
        evictable = 300
        moments.append({"num_running_reqs": 4 + i, "num_queue_reqs": i, "token_usage": round(u, 2),
                        "full_token_usage": u, "num_used_tokens": used, "kv_used_tokens": used,
                        "kv_available_tokens": POOL - used - evictable, "kv_evictable_tokens": evictable,
                        "cache_hit_rate": 0.25, "new_token_ratio": 0.7 - 0.05 * i, "retracted": i})
    spec = {"constants": {"max_total_num_tokens": POOL, "page_size": 1, "context_len": 32768,
                          "weight_memory_usage_gb": 14.96, "kv_cache_memory_usage_gb": 1.88,
                          "startup_available_gpu_memory_gb": 8.43}, "moments": moments}
    proc = subprocess.run([sys.executable, str(HERE / "sglang_metrics_render.py")], input=json.dumps(spec),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def sglang_expositions():
    return sglang_texts()


def trtllm_prometheus_texts() -> list[str]:
    base = (DATA / "prometheus_050f80def8df.txt").read_text()
    out = []
    for i, u in enumerate(USAGE):
        used = int(1000 * u)
        text = base
        for name, value in (("kv_cache_utilization", used / 1000), ("kv_cache_used_blocks", used),
                            ("kv_cache_free_blocks", 1000 - used), ("num_requests_waiting", i),
                            ("num_paused_requests", i // 2)):
            text = re.sub(rf"^(trtllm_{name}\{{[^}}]*\}}) \S+$", rf"\g<1> {float(value)}", text, flags=re.MULTILINE)
        out.append(text)
    return out


def trtllm_json_texts() -> list[str]:
    base = json.loads((DATA / "iteration_stats_0434755f.json").read_text())[0]
    out = []
    for i, u in enumerate(USAGE):
        stats = []
        for k in range(3):  # three iterations since the last read; the last one counts
            it = json.loads(json.dumps(base))
            it["iter"] = 154 + 3 * i + k
            used = int(101256 * (u - 0.01 * (2 - k)))
            it["kvCacheStats"].update(usedNumBlocks=used, freeNumBlocks=101256 - used)
            it["numQueuedRequests"] = i
            it["inflightBatchingStats"]["numPausedRequests"] = i // 2
            stats.append(it)
        out.append(json.dumps(stats))
    return out


class Serve:
    """aiohttp on a loopback port in a thread with its own loop; serves ``texts`` one per request
    (the last one again once they run out)."""

    def __init__(self, texts: list[str], content_type: str = "text/plain"):
        self.texts, self.content_type, self.served = texts, content_type, 0

    def __enter__(self) -> str:
        from aiohttp import web

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        async def metrics(_request):
            text = self.texts[min(self.served, len(self.texts) - 1)]
            self.served += 1
            return web.Response(text=text, content_type=self.content_type)

        async def start():
            application = web.Application()
            application.router.add_get("/metrics", metrics)
            self.runner = web.AppRunner(application)
            await self.runner.setup()
            await web.TCPSite(self.runner, "127.0.0.1", port).start()
            started.set()

        self.thread = threading.Thread(target=lambda: (self.loop.run_until_complete(start()), self.loop.run_forever()),
                                       daemon=True)
        self.thread.start()
        started.wait(10)
        return f"http://127.0.0.1:{port}/metrics"

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def scrape(url: str, engine: str, count: int = 6) -> tuple[list[dict], list[dict], int]:
    result = CliRunner().invoke(app, ["scrape", "--url", url, "--engine", engine, "--interval", "200ms", "--count",
                                      str(count), "--json"])
    records = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    return ([r for r in records if r["type"] == "tick"], [r for r in records if r["type"] == "alert"],
            result.exit_code)


def assert_tiers_fire(ticks: list[dict], alerts: list[dict]) -> None:
    usage = [t["u_kv"] for t in ticks]
    assert usage == sorted(usage) and usage[-1] > 0.90 > usage[0], usage
    assert ticks[-1]["slope_per_min"] > 0.05 and ticks[-1]["f_ext"] == 0.0
    fired = {a["name"] for a in alerts if a["status"] == "firing"}
    assert {"KVCacheUsageCritical", "KVCacheUsageHigh", "KVCacheUsageRising"} <= fired, fired
    assert not {a["name"] for a in alerts} & {"KVCachePressureCritical", "KVCacheOOMRisk"}  # need F_ext


# -- SGLang --------------------------------------------------------------------------------------


def test_sglangs_own_exposition_has_every_series_the_scrape_reads(sglang_expositions):
    (m,) = read_sglang(parse_exposition(sglang_expositions[-1]))
    assert m.missing == [] and set(SGLANG_SERIES) <= m.seen
    assert m.pool_tokens == POOL and m.used_tokens == int(POOL * USAGE[-1]) and m.u_kv == pytest.approx(USAGE[-1],
                                                                                                         abs=1e-4)
    assert m.retracted_total == sum(range(len(USAGE))) and m.cache_hit_rate == 0.25 and m.cuda_graph is not None
    assert dict(m.labels) == {"model_name": "meta-llama/Llama-3.1-8B-Instruct", "engine_type": "unified",
                              "tp_rank": "0", "pp_rank": "0"}


def test_kvguard_scrape_turns_sglang_metrics_into_ticks_and_tier_alerts(sglang_expositions):
    with Serve(sglang_expositions) as url:
        ticks, alerts, code = scrape(url, "sglang")
    assert code == 0 and len(ticks) == 6 and all(t["node"].endswith("/tp0") for t in ticks)
    assert_tiers_fire(ticks, alerts)
    last = ticks[-1]
    assert last["preemptions"] == 5 and last["requests_waiting"] == 5 and last["requests_running"] == 9
    assert (last["live_units"], last["cached_units"], last["dynamic_units"]) == (int(POOL * 0.97), 300, POOL)
    s = last["scrape"]
    assert s["engine"] == "sglang" and s["unit"] == "token" and s["missing_series"] == []
    assert s["new_token_ratio"] == pytest.approx(0.45) and s["startup"]["kv_cache_gb"] == pytest.approx(1.88)


def test_a_missing_or_renamed_sglang_series_is_reported_by_name(sglang_expositions):
    renamed = [t.replace("sglang:num_retracted_requests_total", "sglang:retractions_total")
               .replace("sglang:new_token_ratio", "sglang:new_token_ratio_renamed") for t in sglang_expositions]
    with Serve(renamed) as url:
        ticks, _, code = scrape(url, "sglang", count=2)
    assert code == 0 and ticks[-1]["scrape"]["missing_series"] == ["sglang:num_retracted_requests_total",
                                                                     "sglang:new_token_ratio"]
    no_kv = [re.sub(r"^sglang:(token_usage|num_used_tokens)\{.*$", "", t, flags=re.MULTILINE) for t in sglang_expositions]
    with Serve(no_kv) as url:
        result = CliRunner().invoke(app, ["scrape", "--url", url, "--engine", "sglang", "--interval", "100ms",
                                          "--count", "1", "--json"])
    errors = [json.loads(x) for x in result.output.splitlines() if x.startswith("{")]
    assert result.exit_code == 1 and "sglang:token_usage" in errors[0]["error"] and "sglang:num_used_tokens" in \
        errors[0]["error"]


# -- TensorRT-LLM --------------------------------------------------------------------------------


def test_the_trtllm_fixtures_have_every_series_the_scrape_reads():
    (m,) = read_prometheus(parse_exposition((DATA / "prometheus_050f80def8df.txt").read_text()))
    assert m.missing == [] and m.u_kv == 0.6 and m.paused == 1 and m.gpu_memory_bytes == 4e9
    assert dict(m.labels)["pid"] == "4242" and m.prefixed
    (j,) = read_iteration_stats((DATA / "iteration_stats_0434755f.json").read_text())
    assert j.missing == [] and j.u_kv == pytest.approx(3 / 101256) and j.gpu_memory_bytes == 76665782272
    assert read_iteration_stats("[]") == []


def test_kvguard_scrape_turns_trtllm_prometheus_metrics_into_ticks_and_tier_alerts():
    with Serve(trtllm_prometheus_texts()) as url:
        ticks, alerts, code = scrape(url, "trtllm")
    assert code == 0 and len(ticks) == 6 and ticks[-1]["node"].endswith("/pid4242")
    assert_tiers_fire(ticks, alerts)
    s = ticks[-1]["scrape"]
    assert s["source"] == "prometheus" and s["missing_series"] == [] and s["paused_requests"] == 2
    assert s["gpu_memory_used_bytes"] == 4e9 and ticks[-1]["dynamic_units"] == 1000 and s["unit"] == "block"


def test_kvguard_scrape_reads_trtllm_json_iteration_stats_and_says_when_none_came():
    texts = trtllm_json_texts() + ["[]"]
    with Serve(texts, content_type="application/json") as url:
        ticks, alerts, code = scrape(url, "trtllm", count=7)
    assert len(ticks) == 6 and code == 0  # one scrape of seven failed: not all
    assert_tiers_fire(ticks, alerts)
    s = ticks[-1]["scrape"]
    assert s["source"] == "iteration_stats" and s["iterations_read"] == 3 and s["missing_series"] == []
    assert ticks[-1]["u_kv"] == pytest.approx(int(101256 * 0.97) / 101256)


def test_unprefixed_trtllm_names_are_read_and_a_dropped_series_is_named():
    text = trtllm_prometheus_texts()[-1].replace("trtllm_", "")
    text = re.sub(r"^num_paused_requests\{.*$", "", text, flags=re.MULTILINE)
    (m,) = read_prometheus(parse_exposition(text))
    assert not m.prefixed and m.u_kv == pytest.approx(0.97) and m.missing == ["num_paused_requests"]
