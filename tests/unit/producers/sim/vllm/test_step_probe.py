"""The step probe behind `kvguard plan`: the engine's own arguments for a step, a copy per question, and a
worker rebuilt from a logged budget that reproduces it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvguard.producers.sim.engine_args import EngineArgs
from kvguard.producers.sim.vllm.memory import StartupRefused
from kvguard.producers.sim.vllm.step_probe import (
    ServerBudget,
    StepProbe,
    run_step_arguments,
    worker_for,
    worker_from_budget,
)
from kvguard.producers.vllm.step_memory import Batch

CONFIGS = Path(__file__).resolve().parents[4] / "data" / "model_configs"
GiB = 1 << 30


def test_the_arguments_are_the_ones_the_engine_passes_for_the_same_step():
    # VllmEngine._step: the longest query and context only for mixed steps or more than 256 decodes; the logits
    # rows when speculating; the batch only when prompt logprobs need it
    spec = Batch((8,) * 300, (900,) * 300, num_draft_tokens=(7,) * 300)
    assert run_step_arguments(spec, v2=True, num_speculative_tokens=7) == (
        (2400, 300, None), {"max_query_len": 8, "max_seq_len": 900, "num_logits": 2400})
    decode = Batch.uniform(64, 1, 500)
    assert run_step_arguments(decode, v2=True, num_speculative_tokens=0) == (
        (64, 64, None), {"max_query_len": 1, "max_seq_len": 0, "num_logits": 0})
    prompt = Batch((3000,), (3000,), prompt_lens=(3000,), prompt_logprobs_tokens=(3000,))
    assert run_step_arguments(prompt, v2=False, num_speculative_tokens=0) == ((3000, 1, prompt), {})
    logprobs = Batch.uniform(8, 1, 10, num_logprobs=5)
    assert run_step_arguments(logprobs, v2=False, num_speculative_tokens=0)[0][2] is logprobs


def test_each_question_runs_on_its_own_copy_of_the_started_worker():
    profile = EngineArgs(str(CONFIGS / "qwen3-0.6b.json"), gpu="rtx4090", max_model_len=8192,
                         model_runner="v1").profile()
    worker = worker_for(profile)
    probe = StepProbe(worker)
    before = worker.stats()
    huge = Batch((8191,), (8191,), prompt_lens=(8191,), prompt_logprobs_tokens=(8191,))
    small = Batch((100,), (100,), prompt_lens=(100,), prompt_logprobs_tokens=(100,))
    assert probe.slack_bytes(huge) is None and probe.fits(small)
    assert probe.slack_bytes(small) < probe.headroom_bytes
    assert worker.stats() == before  # the worker itself never ran a step
    assert worker.ledger == profile.memory  # the engine's own start-up


@pytest.mark.parametrize("runner", ["v2", "v1"])
def test_a_worker_rebuilt_from_a_budget_reproduces_it(runner):
    profile = EngineArgs(str(CONFIGS / "llama-3.1-8b-instruct.json"), gpu="h100-80gb", model_runner=runner).profile()
    ledger = profile.memory
    budget = ServerBudget(total_bytes=ledger.total_bytes, gpu_memory_utilization=ledger.gpu_memory_utilization,
                          consumed_bytes=ledger.total_consumed_bytes,
                          non_torch_bytes=0 if runner == "v2" else ledger.non_torch_increase_bytes,
                          kv_cache_bytes=ledger.kv_cache_bytes, cudagraph_bytes=ledger.cudagraph_bytes,
                          init_free_bytes=ledger.init_free_bytes, buffers_in_consumed=runner == "v2")
    rebuilt = worker_from_budget(profile.vllm, budget, max_num_batched_tokens=profile.max_batched_tokens,
                                 max_num_seqs=profile.max_num_seqs, max_model_len=profile.max_model_len)
    assert rebuilt.ledger.init_free_bytes == ledger.init_free_bytes
    assert rebuilt.ledger.total_consumed_bytes == ledger.total_consumed_bytes
    assert rebuilt.ledger.kv_cache_bytes == ledger.kv_cache_bytes and rebuilt.ledger.kv_cache_memory_fixed
    assert StepProbe(rebuilt).headroom_bytes == pytest.approx(StepProbe(worker_for(profile)).headroom_bytes,
                                                              abs=32 << 20)


def test_a_budget_vllm_would_refuse_is_refused_with_its_message():
    profile = EngineArgs(str(CONFIGS / "qwen3-0.6b.json"), gpu="rtx4090", max_model_len=8192).profile()
    budget = ServerBudget(total_bytes=profile.geometry.total_bytes, gpu_memory_utilization=0.9,
                          consumed_bytes=2 * GiB, non_torch_bytes=0, kv_cache_bytes=0, cudagraph_bytes=0,
                          init_free_bytes=profile.geometry.total_bytes - GiB)
    with pytest.raises(StartupRefused, match="No available memory for the cache blocks"):
        worker_from_budget(profile.vllm, budget, max_num_batched_tokens=2048, max_num_seqs=256, max_model_len=8192)
