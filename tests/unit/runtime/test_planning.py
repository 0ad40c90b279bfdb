"""`kvguard plan` against the shadow engine and against public start-up budgets.

- the longest prompt with prompt_logprobs that plan says fits is where the shadow engine's own first step
  OOMs: one token more OOMs there, that many does not (each bundled vLLM profile; the V1 runner, since Model
  Runner V2 chunks prompt logprobs at 1,024 positions and never OOMs on them — also checked);
- public budgets from a model config and a GPU within 0.05 GiB (llm-d's vLLM 0.11 measurements, vLLM PR #10511);
- --from-log reproduces every sample log's budget exactly (tests/data/vllm_startup_logs/README.md).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvguard.producers.sim.engine_args import BaselineEstimates, EngineArgs
from kvguard.producers.sim.profile import EngineKnobs
from kvguard.producers.sim.profiles import load_profile
from kvguard.producers.sim.registry import make_engine
from kvguard.producers.sim.vllm.engine import VllmEngineConfig
from kvguard.producers.sim.workloads import Request
from kvguard.runtime.planning import PlanError, plan_server
from tests.unit.ops.test_startup_log import LOGS, PRINTED

GiB = 1 << 30
CONFIGS = Path(__file__).resolve().parents[2] / "data" / "model_configs"
STAND_IN = str(CONFIGS / "qwen3-0.6b.json")  # a small dense model whose steps are asked about a log's budget


def classes(report: dict) -> dict:
    return {c["name"]: c for c in report["classes"]}


def engine_ooms(profile, prompt_tokens: int) -> dict:
    """One request asking for prompt logprobs on a fresh shadow engine, without the governor."""
    engine = make_engine(profile, "n/gpu0", config=VllmEngineConfig(prompt_logprobs_frac=1.0))
    engine.submit(Request(req_id=1, arrival_ns=0, prompt_tokens=prompt_tokens, max_output_tokens=4))
    engine.advance(10**9)
    return dict(engine.ooms_by_cause)


@pytest.mark.parametrize("name, knobs", [
    ("llama3-8b-24gb-vllm", EngineKnobs(model_runner="v1", max_num_batched_tokens=8192)),
    ("llama3-70b-tp8-80gb-vllm", EngineKnobs(model_runner="v1", gpu_memory_utilization=0.97)),
])
def test_the_longest_prompt_with_prompt_logprobs_is_where_the_shadow_engine_ooms(name, knobs):
    report = plan_server(profile_name=name, knobs=knobs, what_if=None, search=False)
    limit = classes(report)["prompt_logprobs"]
    assert not limit["unlimited"], "the setting must put the limit below the token budget for the test to say much"
    assert engine_ooms(load_profile(name, knobs=knobs), limit["limit"]) == {}
    assert engine_ooms(load_profile(name, knobs=knobs), limit["limit"] + 1) == {"allocator:prompt_logprobs": 1}


@pytest.mark.parametrize("name", ["llama3-8b-24gb-vllm", "llama3-70b-tp8-80gb-vllm"])
def test_model_runner_v2_never_ooms_on_prompt_logprobs_and_plan_says_so(name):
    knobs = EngineKnobs(model_runner="v2", max_num_batched_tokens=8192)
    limit = classes(plan_server(profile_name=name, knobs=knobs, what_if=None, search=False))["prompt_logprobs"]
    assert limit["unlimited"] and limit["limit"] == 8192
    assert engine_ooms(load_profile(name, knobs=knobs), 8192) == {}  # the largest chunk a step computes


def test_llm_d_vllm_0_11_budget_from_the_config_and_the_gpu():
    """llm-d/llm-d-benchmark config_explorer/empirical-vllm-memory-results.md: Llama-3.1-8B on an H100, vLLM 0.11
    (V1 runner, defaults 8192 tokens / 1024 sequences, utilization 0.9): weights 14.99, activation 4.76,
    non-torch 0.13, KV cache 51.38 GiB. vLLM 0.11 did not yet subtract a CUDA-graph estimate, which
    --enforce-eager zeroes in the model."""
    args = EngineArgs(str(CONFIGS / "llama-3.1-8b-instruct.json"), gpu="h100-80gb", gpu_memory_utilization=0.9,
                      model_runner="v1", enforce_eager=True, max_num_seqs=1024, max_num_batched_tokens=8192)
    r = plan_server(engine_args=args, what_if=None, search=False)
    assert r["refused"] is None
    assert (r["consumed_bytes"] - int(0.13 * GiB)) / GiB == pytest.approx(14.99, abs=0.05)
    assert r["peak_activation_bytes"] / GiB == pytest.approx(4.76, abs=0.05)
    assert r["kv_cache_bytes"] / GiB == pytest.approx(51.38, abs=0.05)
    assert r["total_bytes"] / GiB == pytest.approx(79.18, abs=0.005)


def test_vllm_pr10511_budget_from_the_config_and_the_gpu():
    """vllm PR #10511 (V0): `vllm serve meta-llama/Meta-Llama-3-8B` on 79.22 GiB at 0.90: weights 14.96, non-torch
    1.79, activation peak 1.26, KV cache 53.29 GiB. The non-torch figure is the log's (no config fixes it); the
    peak is the V1 formula at V0's 256 sequences (the coincidence tests/unit/producers/vllm names)."""
    args = EngineArgs(str(CONFIGS / "meta-llama-3-8b.json"), gpu_memory_gib=79.22, gpu_memory_utilization=0.9,
                      model_runner="v1", enforce_eager=True, max_num_seqs=256, max_num_batched_tokens=8192,
                      baseline=BaselineEstimates(non_torch_increase_gib=1.79))
    r = plan_server(engine_args=args, what_if=None, search=False)
    assert (r["consumed_bytes"] - int(1.79 * GiB)) / GiB == pytest.approx(14.96, abs=0.05)
    assert r["peak_activation_bytes"] / GiB == pytest.approx(1.26, abs=0.05)
    assert r["kv_cache_bytes"] / GiB == pytest.approx(53.29, abs=0.05)


_REPORTED = {"total": "total_bytes", "init_free": "init_free_bytes", "requested": "requested_bytes",
             "consumed": "consumed_bytes", "peak": "peak_activation_bytes", "graphs": "cudagraph_bytes",
             "kv": "kv_cache_bytes"}


def from_log(name: str, **flags) -> dict:
    args = EngineArgs(STAND_IN, max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=4096, **flags)
    return plan_server(engine_args=args, flags={"max_model_len": 4096, **flags}, log_text=(LOGS / name).read_text(),
                       what_if=None, search=False)


@pytest.mark.parametrize("name", sorted(PRINTED))
def test_from_log_reproduces_every_sample_budget_exactly(name):
    report = from_log(name)
    printed = PRINTED[name]
    for key, field in _REPORTED.items():
        if key in printed:
            assert round(report[field] / GiB, 2) == printed[key], (name, key)
    for key, field in (("utilization", "gpu_memory_utilization"), ("tokens", "kv_cache_tokens"),
                       ("blocks", "num_gpu_blocks"), ("concurrency", "max_concurrency")):
        if key in printed:
            assert report[field] == printed[key], (name, key)
    assert report["log_format"] == printed["format"] and report["source"] == "log"


def test_a_log_whose_server_had_no_kv_cache_is_refused_with_vllms_reason():
    report = from_log("vllm-12095.log")  # "the rest of the memory reserved for KV Cache is -0.00GiB"
    assert report["refused"].startswith("No available memory for the cache blocks.")
    assert report["classes"] == []


def test_a_logged_budget_moved_to_another_utilization_moves_the_kv_cache_by_the_requested_share():
    report = plan_server(engine_args=EngineArgs(STAND_IN, max_num_seqs=256, max_num_batched_tokens=2048,
                                                max_model_len=4096),
                         flags={"max_model_len": 4096}, log_text=(LOGS / "golite-qwen3.8-27b.log").read_text(),
                         what_if=(0.85, 0.9), search=False)
    total, kv = report["total_bytes"], report["kv_cache_bytes"]
    rows = {r["startup"]["gpu_memory_utilization"]: r["startup"] for r in report["what_if"]}
    for u in (0.85, 0.9):
        shift = math.ceil(total * u) - math.ceil(total * 0.92)
        assert rows[u]["kv_cache_bytes"] == kv + shift
        assert rows[u]["consumed_bytes"] == report["consumed_bytes"]
    assert rows[0.85]["headroom_bytes"] > rows[0.9]["headroom_bytes"] > report["headroom_bytes"]


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_planning_a_shadow_server_from_its_own_log_gives_the_same_limits(runner):
    knobs = EngineKnobs(model_runner=runner, max_num_batched_tokens=8192)
    model = plan_server(profile_name="llama3-8b-24gb-vllm", knobs=knobs, what_if=None, search=False)
    logged = plan_server(profile_name="llama3-8b-24gb-vllm", knobs=knobs, flags={"model_runner": runner},
                         log_text="\n".join(model["log_lines"]), what_if=None, search=False)
    assert logged["log_format"] == ("vllm-0.33" if runner == "v2" else "vllm-0.10")
    for name, c in classes(model).items():
        other = classes(logged)[name]
        if c["limit"] is None:
            assert other["limit"] is None
        else:  # the log prints two decimals of GiB: a few MiB either way
            assert other["limit"] == pytest.approx(c["limit"], rel=0.01), name
    assert logged["headroom_bytes"] == pytest.approx(model["headroom_bytes"], abs=16 << 20)


def test_from_log_refuses_flags_the_log_contradicts():
    with pytest.raises(PlanError, match="ran at gpu_memory_utilization 0.97"):
        from_log("servedeck-boot-097.log", gpu_memory_utilization=0.9)
    with pytest.raises(PlanError, match="before Model Runner V2"):
        from_log("vllm-15598.log", model_runner="v2")
    with pytest.raises(PlanError, match="the log's device has 94.97 GiB"):
        from_log("servedeck-boot-097.log", gpu="h100-80gb")
