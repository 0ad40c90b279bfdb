"""vLLM's start-up memory lines, read back: every sample is a real server's log (tests/data/vllm_startup_logs/
README.md names each source), and each figure it prints must come back exactly as printed."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvguard.ops.startup_log import StartupLogError, parse_startup_log
from kvguard.producers.sim.engine_args import EngineArgs

LOGS = Path(__file__).resolve().parents[2] / "data" / "vllm_startup_logs"
CONFIGS = Path(__file__).resolve().parents[2] / "data" / "model_configs"
GiB = 1 << 30

# the figures each log prints (GiB as printed; None: the log does not print it). For the older lines "consumed"
# is their weights + non-torch, the sum the 0.33 line calls consumed memory.
PRINTED = {
    "servedeck-boot-097.log": dict(format="vllm-0.33", total=94.97, init_free=94.41, utilization=0.97, requested=92.12,
                                   consumed=81.7, peak=1.78, graphs=0.28, kv=8.64, tokens=315_039, concurrency=1.20,
                                   max_model_len=262_144),
    "servedeck-boot-098.log": dict(format="vllm-0.33", total=94.97, init_free=94.41, utilization=0.98, requested=93.07,
                                   consumed=81.7, peak=1.78, graphs=0.66, kv=9.59, tokens=350_043, concurrency=1.34,
                                   max_model_len=262_144),
    "golite-qwen3.8-27b.log": dict(format="vllm-0.33", total=15.51, init_free=15.28, utilization=0.92, requested=14.27,
                                   consumed=10.47, peak=0.79, graphs=0.04, kv=3.01, tokens=172_032, concurrency=1.00,
                                   max_model_len=172_032, estimate=0.06, loading=10.24),
    "vllm-pr25683.log": dict(format="vllm-0.10", total=178.35, init_free=176.17, utilization=0.9, requested=160.52,
                             consumed=71.75, weights=60.79, non_torch=10.96, peak=13.33, graphs=-9.96, kv=75.44),
    "vllm-15598.log": dict(format="vllm-v0", total=44.53, utilization=0.98, requested=43.64, consumed=20.92,
                           weights=20.64, non_torch=0.28, peak=1.52, kv=21.20),
    "vllm-11251.log": dict(format="vllm-v0", total=15.77, utilization=0.90, requested=14.20, consumed=7.90, weights=7.51,
                           non_torch=0.39, peak=2.53, kv=3.76, blocks=3852, concurrency=1.54, max_model_len=40_000),
    "vllm-15039.log": dict(format="vllm-v0", total=79.33, utilization=0.89, requested=70.60, consumed=33.23,
                           weights=32.95, non_torch=0.28, peak=1.30, kv=36.07, blocks=29_547, concurrency=3.61,
                           max_model_len=131_072),
    "vllm-pr10511.log": dict(format="vllm-v0", total=79.22, utilization=0.90, requested=71.29, consumed=16.75,
                             weights=14.96, non_torch=1.79, peak=1.26, kv=53.29),
    "vllm-pr12126.log": dict(format="vllm-v0", total=79.22, utilization=0.90, requested=71.29, consumed=20.02,
                             weights=19.86, non_torch=0.16, peak=36.63, kv=14.65, blocks=6001),
    "vllm-12095.log": dict(format="vllm-v0", total=8.00, utilization=0.90, requested=7.20, consumed=0.11, weights=0.07,
                           non_torch=0.04, peak=7.09, kv=0.0, blocks=0, concurrency=0.0, max_model_len=448),
    "vllm-15340.log": dict(format="vllm-v0", total=23.58, utilization=0.94, requested=22.29, consumed=18.53,
                           weights=18.38, non_torch=0.15, peak=0.79, kv=2.96),
}
_GIB_FIELDS = {"total": "total_bytes", "init_free": "init_free_bytes", "requested": "requested_bytes",
               "consumed": "consumed_bytes", "weights": "weights_bytes", "non_torch": "non_torch_bytes",
               "peak": "peak_activation_bytes", "graphs": "cudagraph_bytes", "kv": "kv_cache_bytes",
               "estimate": "cudagraph_estimate_bytes", "loading": "model_loading_bytes"}
_OTHER = {"utilization": "gpu_memory_utilization", "tokens": "kv_cache_tokens", "blocks": "num_gpu_blocks",
          "concurrency": "max_concurrency", "max_model_len": "max_model_len", "format": "format"}


def printed_as(budget, key):
    value = getattr(budget, {**_GIB_FIELDS, **_OTHER}[key])
    return round(value / GiB, 2) if key in _GIB_FIELDS and value is not None else value


@pytest.mark.parametrize("name", sorted(PRINTED))
def test_every_figure_a_real_log_prints_comes_back_exactly(name):
    budget = parse_startup_log((LOGS / name).read_text())
    for key, figure in PRINTED[name].items():
        assert printed_as(budget, key) == figure, (name, key)
    # and nothing is made up: a figure the log does not print stays None
    for key in set(_GIB_FIELDS) - set(PRINTED[name]):
        assert printed_as(budget, key) is None, (name, key)


@pytest.mark.parametrize("name", sorted(PRINTED))
def test_each_budget_closes_on_the_requested_share(name):
    """vLLM's own arithmetic: consumed + peak + KV = requested (the 0.33 peak holds the graph estimate; the older
    lines' consumed is weights + non-torch), to the printed two decimals (each of three terms rounds by 0.005)."""
    b = parse_startup_log((LOGS / name).read_text())
    assert (b.consumed_bytes + b.peak_activation_bytes + b.kv_cache_bytes) / GiB == pytest.approx(
        b.requested_bytes / GiB, abs=0.016)


def test_a_log_without_a_budget_line_says_what_it_found():
    with pytest.raises(StartupLogError, match="no start-up budget line.*available_kv, kv_tokens"):
        parse_startup_log((LOGS / "vllm-21348.log").read_text())
    with pytest.raises(StartupLogError, match="nothing vLLM prints about memory"):
        parse_startup_log("INFO hello\n")


def test_a_refusal_in_the_log_is_kept_verbatim():
    text = ("ERROR 01-01 00:00:00 core.py] ValueError: No available memory for the cache blocks. Try increasing "
            "`gpu_memory_utilization` when initializing the engine.\n" + (LOGS / "vllm-12095.log").read_text())
    assert parse_startup_log(text).refused.startswith("No available memory for the cache blocks. Try increasing")


def test_the_last_boot_in_a_file_wins():
    both = (LOGS / "servedeck-boot-097.log").read_text() + (LOGS / "servedeck-boot-098.log").read_text()
    b = parse_startup_log(both)
    assert (b.gpu_memory_utilization, round(b.kv_cache_bytes / GiB, 2), b.kv_cache_tokens) == (0.98, 9.59, 350_043)


@pytest.mark.parametrize("runner, fmt", [("v2", "vllm-0.33"), ("v1", "vllm-0.10")])
def test_the_shadow_engines_own_start_up_lines_read_back_as_its_ledger(runner, fmt):
    """The shadow engine prints what vLLM would (``MemoryLedger.log_lines``); reading them back gives its ledger to the
    printed two decimals, so ``kvguard plan --from-log`` of a shadow server is that server."""
    ledger = EngineArgs(str(CONFIGS / "llama-3.1-8b-instruct.json"), gpu="h100-80gb", model_runner=runner).profile().memory
    b = parse_startup_log("\n".join(ledger.log_lines()))
    assert b.format == fmt
    gib = lambda n: round(n / GiB, 2)  # noqa: E731
    assert gib(b.kv_cache_bytes) == gib(ledger.kv_cache_bytes)
    assert gib(b.peak_activation_bytes) == gib(ledger.peak_activation_bytes)
    assert gib(b.consumed_bytes) == pytest.approx(gib(ledger.total_consumed_bytes), abs=0.011)
    assert (b.kv_cache_tokens, b.max_model_len) == (ledger.kv_token_capacity, ledger.max_model_len)
