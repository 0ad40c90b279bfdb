"""`vllm bench serve` in the shadow engine (producers.sim.bench_serve): its random dataset, arrival
schedule, closed-loop client and metrics, as vLLM 0.33's benchmarks define them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from kvguard.cli.app import app
from kvguard.contracts.units import NS_PER_S
from kvguard.producers.sim.bench_serve import (
    BenchArgsError,
    ClosedLoopClient,
    RandomDataset,
    random_workload,
    send_times_s,
)
from kvguard.producers.sim.engine_args import EngineArgs
from kvguard.producers.sim.fleet import Fleet

CONFIGS = Path(__file__).resolve().parents[3] / "data" / "model_configs"
QWEN = str(CONFIGS / "qwen3-0.6b.json")


def test_lengths_are_integer_uniform_on_vllms_bounds_with_the_special_tokens_taken_out():
    d = RandomDataset(num_prompts=2000, input_len=1024, output_len=128, range_ratio=0.25, seed=0)
    assert d.bounds() == (767, 1279, 96, 160)  # real input 1023: BOS excluded, as get_sampling_params
    prompts, outputs = d.lengths()
    assert prompts.min() >= 768 and prompts.max() <= 1280  # the server adds the BOS back
    assert outputs.min() >= 96 and outputs.max() <= 160 and len(set(outputs.tolist())) > 50
    rng = np.random.default_rng(0)  # the same draws, in the same order, as RandomDataset.sample
    assert np.array_equal(prompts - 1, rng.integers(767, 1280, size=2000))
    assert np.array_equal(outputs, rng.integers(96, 161, size=2000))
    fixed = RandomDataset(num_prompts=3, input_len=1024, output_len=128, prefix_len=100, seed=0)
    assert fixed.lengths()[0].tolist() == [1124] * 3


def test_bad_ratios_and_tiny_inputs_are_refused_with_vllms_words():
    with pytest.raises(BenchArgsError, match=r"input_range_ratio must be in \[0, 1\)"):
        RandomDataset(range_ratio=1.0)
    with pytest.raises(BenchArgsError, match="--random-input-len is too small"):
        RandomDataset(input_len=1, prefix_len=0)


def test_arrivals_are_gamma_and_end_at_n_over_rate():
    times = send_times_s(100, 4.0, 0.5, seed=7)
    assert times[-1] == pytest.approx(25.0) and np.all(np.diff(times) >= 0)
    gaps = np.random.RandomState(7).gamma(shape=0.5, scale=1 / (4.0 * 0.5), size=100)
    assert np.allclose(times, np.cumsum(gaps) * 25.0 / gaps.sum())
    assert np.array_equal(send_times_s(5, math.inf, 1.0, 0), np.zeros(5))
    assert np.allclose(send_times_s(4, 2.0, math.inf, 0), [0.5, 1.0, 1.5, 2.0])
    with pytest.raises(BenchArgsError, match="burstiness"):
        send_times_s(3, 1.0, 0.0, 0)


def _fleet(**flags):
    profile = EngineArgs(QWEN, gpu="rtx4090", max_model_len=4096, **flags).profile()
    return Fleet(1, profile)


def test_the_closed_loop_keeps_at_most_n_in_flight_and_sends_on_each_finish():
    wl = random_workload(RandomDataset(num_prompts=40, input_len=200, output_len=60, seed=1, num_special_tokens=0))
    fleet = _fleet()
    client = ClosedLoopClient(fleet, wl, max_concurrency=4)
    client.run(cap_ns=3600 * NS_PER_S)
    m = client.metrics()
    assert m["completed"] == 40 and m["failed"] == 0 and m["max_concurrent_requests"] == 4
    sends, ends = sorted(client.sent.values()), sorted(end for end, _ in client.done.values())
    assert sends[:4] == [0, 0, 0, 0]
    assert all(s in ends for s in sends[4:])  # every later send happens at a finish
    assert m["total_output_tokens"] == sum(r.max_output_tokens for r in wl.requests)
    assert 0 < m["median_itl_ms"] <= m["p99_itl_ms"] and m["mean_ttft_ms"] > 0
    assert m["request_throughput"] == pytest.approx(40 / m["duration"], rel=1e-3)


def test_a_503_frees_the_clients_slot_and_counts_as_failed():
    wl = random_workload(RandomDataset(num_prompts=30, input_len=200, output_len=40, seed=2, num_special_tokens=0))
    fleet = _fleet(max_num_queued_reqs=2)
    client = ClosedLoopClient(fleet, wl, max_concurrency=6)
    client.run(cap_ns=3600 * NS_PER_S)
    m = client.metrics()
    assert m["failed"] > 0 and m["completed"] + m["failed"] == 30
    assert fleet.engines[0].rejected_by_reason["max_num_queued_reqs"] == m["failed"]


def test_simulate_reruns_a_vllm_bench_serve_command_line():
    args = ["simulate", "--model-config", QWEN, "--gpu", "rtx4090", "--max-model-len", "4096",
            "--workload", "random", "--random-input-len", "300", "--random-output-len", "200",
            "--random-range-ratio", "0.25", "--num-prompts", "40", "--max-concurrency", "8", "--ignore-eos",
            "--seed", "3", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    b = out["bench"]
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "mean_ttft_ms",
                "median_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_tpot_ms",
                "completed", "failed", "preemptions", "kv_token_capacity"):
        assert key in b, key
    assert b["completed"] == 40 and b["max_concurrency"] == 8 and b["kv_token_capacity"] == out["kv_token_capacity"]
    table = CliRunner().invoke(app, args[:-1])
    assert "Serving Benchmark Result" in table.output and "Output token throughput (tok/s):" in table.output


LLAMA = str(CONFIGS / "llama-3.1-8b-instruct.json")
ISSUE_21 = ["simulate", "--model-config", LLAMA, "--gpu-memory-gib", "80", "--workload", "random",
            "--random-input-len", "2000", "--random-output-len", "3000", "--random-range-ratio", "0.25",
            "--ignore-eos", "--kv-cache-memory-bytes", "8589934592", "--json"]


def test_issue_21s_benchmark_is_refused_as_vllm_refuses_it_without_a_max_model_len():
    """8 GiB of KV holds 65,520 tokens; Llama-3.1-8B derives 131,072: vLLM 0.33 refuses to start."""
    result = CliRunner().invoke(app, ISSUE_21 + ["--num-prompts", "10", "--max-concurrency", "4"])
    assert result.exit_code == 2
    assert "the estimated maximum model length is 65520" in " ".join(result.output.split())


def test_the_watermark_lowers_preemptions_in_issue_21s_closed_loop():
    """The same closed loop at 96 in flight (120 prompts instead of 300, to keep the test short)."""
    preemptions = {}
    for wm in ("0", "0.05"):
        result = CliRunner().invoke(app, ISSUE_21 + ["--num-prompts", "120", "--max-concurrency", "96",
                                                     "--max-model-len", "32768", "--watermark", wm])
        assert result.exit_code == 0, result.output
        b = json.loads(result.stdout.strip().splitlines()[-1])["bench"]
        assert b["kv_token_capacity"] == 65536 and b["completed"] == 120
        preemptions[wm] = b["preemptions"]
    assert preemptions["0"] > preemptions["0.05"] > 0


def test_the_prefill_backlog_cap_refuses_with_a_retryable_503():
    """AsyncLLM.check_admission: refused while the prompt tokens of requests without a first token are at
    or over max_num_queued_tokens (the arriving request's own tokens are not added)."""
    from kvguard.producers.sim.vllm.engine import RETRYABLE_REASONS, VllmEngine
    from kvguard.producers.sim.workloads import Request

    engine = VllmEngine(EngineArgs(QWEN, gpu="rtx4090", max_model_len=4096, max_num_queued_tokens=3000).profile())
    for i, prompt in enumerate((2000, 900, 500, 100)):
        engine.submit(Request(i, 0, prompt, 20))
    engine.advance(1)  # backlogs seen by the four arrivals: 0, 2000, 2900 (< 3000: admitted), 3400 (refused)
    assert engine.rejected_by_reason == {"max_num_queued_tokens": 1}
    assert "max_num_queued_tokens" in RETRYABLE_REASONS
    engine.advance(60 * NS_PER_S)
    assert engine.completed == 3
