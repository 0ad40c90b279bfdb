"""`vllm serve` flags over your own model and GPU (producers.sim.engine_args): vLLM 0.33's defaults, its
accounting, and its refusals with its own words."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvguard.producers.sim.engine_args import EngineArgs
from kvguard.producers.sim.gpus import GPUS
from kvguard.producers.sim.profiles import ProfileError

GiB = 1 << 30
CONFIGS = Path(__file__).resolve().parents[3] / "data" / "model_configs"
LLAMA = str(CONFIGS / "llama-3.1-8b-instruct.json")
QWEN = str(CONFIGS / "qwen3-0.6b.json")


def test_defaults_are_vllm_033s_for_the_device():
    h100 = EngineArgs(LLAMA, gpu="h100-80gb").profile()
    assert h100.geometry.gpu_memory_utilization == 0.92 and h100.vllm.model_runner == "v2"
    assert (h100.max_batched_tokens, h100.max_num_seqs, h100.max_model_len) == (8192, 1024, 131072)
    small = EngineArgs(QWEN, gpu="rtx4090", max_model_len=8192).profile()
    assert (small.max_batched_tokens, small.max_num_seqs) == (2048, 256)
    a100 = EngineArgs(QWEN, gpu="a100-40gb", max_model_len=8192).profile()
    assert (a100.max_batched_tokens, a100.max_num_seqs) == (2048, 256)
    assert EngineArgs(QWEN, gpu="b200", max_model_len=8192).profile().max_batched_tokens == 16384


def test_the_kv_budget_is_033s_formula():
    """requested = ceil(total * 0.92); KV = requested - (init free - free after profiling)
    - (peak - allocated after) - CUDA-graph estimate (gpu_worker.determine_available_memory)."""
    p = EngineArgs(LLAMA, gpu="h100-80gb").profile()
    m = p.memory
    assert m.requested_bytes == -(-GPUS["h100-80gb"].total_bytes * 92 // 100)
    assert m.kv_cache_bytes == m.requested_bytes - m.total_consumed_bytes - m.profile_peak_bytes - m.cudagraph_bytes
    assert m.weights_bytes < m.total_consumed_bytes < m.weights_bytes + 1 * GiB  # + runner buffers, non-torch
    assert m.num_gpu_blocks == m.kv_cache_bytes // m.block_bytes
    assert m.kv_token_capacity == int(m.num_gpu_blocks / (131072 // 16) * 131072)
    assert any(line.startswith("GPU KV cache size: ") for line in m.log_lines())


def test_kv_cache_memory_bytes_replaces_the_formula_and_must_hold_max_model_len():
    with pytest.raises(ProfileError) as info:
        EngineArgs(LLAMA, gpu_memory_gib=80, kv_cache_memory_bytes=8 * GiB).profile()
    assert "To serve at least one request with the model's max seq len (131072), (16.0 GiB KV cache is needed" in \
        str(info.value) and "the estimated maximum model length is 65520" in str(info.value)
    fixed = EngineArgs(LLAMA, gpu_memory_gib=80, kv_cache_memory_bytes=8 * GiB, max_model_len=32768).profile()
    assert fixed.memory.kv_cache_bytes == 8 * GiB and fixed.memory.num_gpu_blocks == 4096
    fitted = EngineArgs(LLAMA, gpu_memory_gib=80, kv_cache_memory_bytes=8 * GiB, max_model_len=-1).profile()
    assert fitted.max_model_len == 65520  # --max-model-len -1: auto-fit


def test_refusals_are_vllms_own_words():
    cases = [
        (dict(max_model_len=200_000), "User-specified max_model_len (200000) is greater than the derived "
                                      "max_model_len (max_position_embeddings=131072"),
        (dict(tensor_parallel_size=5), "Total number of attention heads (32) must be divisible by tensor parallel "
                                       "size (5)."),
        (dict(max_num_batched_tokens=64, max_num_seqs=128), "max_num_batched_tokens (64) must be greater than or "
                                                           "equal to max_num_seqs (128)."),
        (dict(num_speculative_tokens=3), "num_speculative_tokens was provided but without speculative model."),
        (dict(speculative_model_config=QWEN), "A speculative model was provided, but `num_speculative_tokens` "
                                              "was not provided"),
        (dict(speculative_model_config=QWEN, num_speculative_tokens=3), "Target and draft model should have the "
                                                                       "same vocabulary size. Target model "
                                                                       "vocab_size=128256. Draft model "
                                                                       "vocab_size=151936."),
    ]
    for flags, text in cases:
        with pytest.raises(ProfileError) as info:
            EngineArgs(LLAMA, gpu="h100-80gb", **flags).profile()
        assert text in str(info.value), (flags, str(info.value))


def test_free_memory_below_the_requested_budget_is_refused_at_start_up():
    from kvguard.producers.sim.engine_args import BaselineEstimates

    crowded = EngineArgs(QWEN, gpu="rtx4090", max_model_len=8192, gpu_memory_utilization=0.99,
                         baseline=BaselineEstimates(context_gib=1.0))
    with pytest.raises(ProfileError, match=r"Free memory on device cuda:0 \(22\.5/23\.52 GiB\) on startup is less "
                                           r"than desired GPU memory utilization \(0\.99, 23\.28 GiB\)"):
        crowded.profile()  # the context (1 GiB) and the cuBLAS workspaces (9.1 MiB) are taken before the snapshot


def test_enforce_eager_drops_the_graph_estimate_and_the_warmup():
    eager = EngineArgs(LLAMA, gpu="h100-80gb", enforce_eager=True).profile()
    graphs = EngineArgs(LLAMA, gpu="h100-80gb").profile()
    assert eager.memory.cudagraph_bytes == 0 and eager.memory.warmup_reqs == 0
    assert eager.memory.kv_cache_bytes - graphs.memory.kv_cache_bytes == graphs.memory.cudagraph_bytes


def test_a_draft_model_shares_the_kv_pool_and_its_weights_are_in_the_budget():
    target = str(CONFIGS / "qwen3-8b.json")
    plain = EngineArgs(target, gpu="h100-80gb").profile()
    spec = EngineArgs(target, gpu="h100-80gb", speculative_model_config=QWEN, num_speculative_tokens=4).profile()
    # kv_cache_planning: draft layers join the target's group, so a block holds both models' layers
    assert spec.memory.block_bytes == plain.memory.block_bytes + 16 * 2 * 28 * 8 * 128 * 2
    assert spec.memory.total_consumed_bytes - plain.memory.total_consumed_bytes > 1.0 * GiB  # the 0.6B draft
    assert spec.memory.num_gpu_blocks < plain.memory.num_gpu_blocks


def test_a_named_gpu_or_a_capacity_not_both():
    with pytest.raises(ProfileError, match="either --gpu or --gpu-memory-gib"):
        EngineArgs(QWEN, gpu="h200", gpu_memory_gib=100).profile()
    with pytest.raises(ProfileError, match="unknown GPU 'h300'"):
        EngineArgs(QWEN, gpu="h300").profile()
