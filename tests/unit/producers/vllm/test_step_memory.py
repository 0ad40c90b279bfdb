"""Non-KV GPU memory of a vLLM v1 worker: per-step tensors, the profiled peak and the KV budget.

Reference figures come from real vLLM start-up logs (sources in docs/NODE_MEMORY.md).
"""

import pytest

from kvguard.producers.vllm.step_memory import (
    Batch,
    GiB,
    ModelShape,
    RunnerConfig,
    kv_cache_bytes,
    profile_peak_bytes,
    round_block,
    step_allocations,
    step_plan,
    step_plan_for,
)

# meta-llama/Meta-Llama-3-8B config.json (the fields that size activations).
LLAMA3_8B_CONFIG = {
    "num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "torch_dtype": "bfloat16",
}
QWEN3_06B_CONFIG = {
    "num_hidden_layers": 28, "hidden_size": 1024, "intermediate_size": 3072,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "torch_dtype": "bfloat16",
}
QWEN3_32B_CONFIG = {
    "num_hidden_layers": 64, "hidden_size": 5120, "intermediate_size": 25600,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "torch_dtype": "bfloat16",
}
LLAMA33_70B_CONFIG = {
    "num_hidden_layers": 80, "hidden_size": 8192, "intermediate_size": 28672,
    "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
    "torch_dtype": "bfloat16",
}
EAGER = RunnerConfig(cudagraph_mode="NONE")
LLAMA = ModelShape.from_hf_config(LLAMA3_8B_CONFIG)


def sizes(shape, batch, runner=EAGER):
    return {a.name: a.nbytes for a in step_allocations(shape, batch, runner)}


def test_llama3_8b_shape_from_published_config():
    assert (LLAMA.num_layers, LLAMA.hidden_size, LLAMA.intermediate_size) == (32, 4096, 14336)
    assert (LLAMA.num_heads, LLAMA.num_kv_heads, LLAMA.head_dim) == (32, 8, 128)
    assert (LLAMA.vocab_size, LLAMA.dtype_bytes, LLAMA.padded_vocab) == (128256, 2, 128256)


def test_sampler_upcasts_logits_to_fp32_per_sequence():
    got = sizes(LLAMA, Batch.uniform(256, 1, 1000))
    assert got["logits"] == 256 * 128256 * 2  # lm_head output in the model dtype
    assert got["logits_f32"] == 256 * 128256 * 4  # Sampler.forward: logits.to(float32)


def test_layer_tensors_scale_with_scheduled_tokens():
    tokens = 3000
    got = sizes(LLAMA, Batch((1000, 2000), (1000, 5000)))
    assert got["L0.qkv"] == tokens * (4096 + 2 * 1024) * 2
    assert got["L0.attn_out"] == tokens * 4096 * 2
    assert got["L0.gate_up"] == tokens * 2 * 14336 * 2
    assert got["L0.act"] == tokens * 14336 * 2
    assert got["L31.mlp_down"] == tokens * 4096 * 2
    assert got["L0.attn_lse"] == round_block(32 * tokens * 4)  # FlashAttention softmax_lse


def test_mlp_peak_holds_residual_attention_output_gate_up_and_activation():
    n = 8192
    plan = step_plan_for(LLAMA, Batch.uniform(1, n, n), EAGER)
    assert plan.peak_bytes == n * (4096 + 4096 + 2 * 14336 + 14336) * 2


def test_peak_grows_with_scheduled_tokens():
    peaks = [step_plan_for(LLAMA, Batch.uniform(1, n, n), EAGER).peak_bytes
             for n in (512, 2048, 8192)]
    assert peaks[0] < peaks[1] < peaks[2]


def test_every_free_matches_an_alloc_and_a_step_leaves_nothing_behind():
    batch = Batch.uniform(64, 32, 4096, sampling="top_k_top_p", num_logprobs=5,
                          penalties=True, prompt_lens=(2048,) * 64, structured_output=True)
    live, names = 0, set()
    for op in step_plan_for(LLAMA, batch, EAGER).ops():
        if op.kind == "alloc":
            assert op.name not in names
            names.add(op.name)
            live += op.nbytes
        else:
            names.remove(op.name)
            live -= op.nbytes
        assert live >= 0
    assert names == set() and live == 0


def test_allocations_report_their_alloc_and_free_positions():
    allocs = step_allocations(LLAMA, Batch.uniform(4, 128, 128), EAGER)
    by_name = {a.name: a for a in allocs}
    assert by_name["L0.gate_up"].free_index < by_name["L0.mlp_down"].alloc_index
    assert by_name["L0.act"].alloc_index < by_name["L0.gate_up"].free_index
    assert by_name["embed"].free_index < by_name["logits"].alloc_index
    assert all(a.free_index is not None and a.alloc_index < a.free_index for a in allocs)


def test_decode_in_a_full_cuda_graph_allocates_only_logits_and_sampler():
    batch = Batch.uniform(256, 1, 4096)
    graph = {a.name for a in step_allocations(LLAMA, batch, RunnerConfig())}
    eager = {a.name for a in step_allocations(LLAMA, batch, EAGER)}
    assert "L0.qkv" in eager and not any(name.startswith("L") for name in graph)
    assert {"sample_hidden", "logits", "logits_f32"} <= graph


def test_piecewise_graph_runs_only_attention_eagerly():
    batch = Batch((100, 1, 1), (100, 300, 300))  # mixed prefill + decode, under capture size
    names = {a.name for a in step_allocations(LLAMA, batch, RunnerConfig())}
    assert "L0.attn_lse" in names and "L0.qkv" not in names


def test_default_capture_sizes_match_a_real_vllm_log():
    # "Profiling CUDA graph memory: PIECEWISE=51 (largest=512), FULL=35 (largest=256)" with
    # max_num_seqs 256: FULL decode graphs stop at max_num_seqs.
    sizes_ = RunnerConfig(max_num_batched_tokens=8192, max_num_seqs=256).capture_sizes
    assert (len(sizes_), sizes_[-1]) == (51, 512)
    assert len([s for s in sizes_ if s <= 256]) == 35


def test_tensor_parallel_halves_mlp_and_adds_out_of_place_all_reduce():
    tp2 = ModelShape.from_hf_config(LLAMA3_8B_CONFIG, tensor_parallel_size=2)
    got = sizes(tp2, Batch.uniform(64, 16, 1024))
    assert got["L0.gate_up"] == 1024 * 14336 * 2
    assert got["L0.mlp_down_allreduce"] == got["L0.mlp_down"] == 1024 * 4096 * 2
    assert got["logits_partial"] == 64 * (128256 // 2) * 2  # lm_head shard, before the gather
    assert got["logits"] == 64 * 128256 * 2


def test_prompt_logprobs_materialise_prompt_length_times_vocab():
    batch = Batch((8192,), (8192,), prompt_lens=(8192,), prompt_logprobs_tokens=(8191,))
    got = sizes(LLAMA, batch)
    assert got["pl_logprobs.0"] == round_block(8191 * 128256 * 4)
    assert step_plan_for(LLAMA, batch, EAGER).peak_bytes > 8191 * 128256 * 6


def test_cached_plan_is_reused():
    a = step_plan(LLAMA, EAGER, 512, 8)
    assert step_plan(LLAMA, EAGER, 512, 8) is a


@pytest.mark.parametrize("config,tp,measured_gib", [
    (LLAMA3_8B_CONFIG, 1, 4.76),  # meta-llama/Llama-3.1-8B-Instruct (same shape)
    (QWEN3_06B_CONFIG, 1, 5.56),
    (QWEN3_32B_CONFIG, 1, 5.64),
    (QWEN3_32B_CONFIG, 2, 5.64),
    (LLAMA33_70B_CONFIG, 2, 4.84),
])
def test_profile_peak_matches_vllm_0_11_measurements_on_h100(config, tp, measured_gib):
    # llm-d/llm-d-benchmark config_explorer: vLLM v0.11.0 on H100, defaults 8192 tokens and
    # 1024 seqs; the dummy sampler's sort at 1024 rows dominates the peak.
    shape = ModelShape.from_hf_config(config, tensor_parallel_size=tp)
    assert profile_peak_bytes(shape, 8192, 1024) / GiB == pytest.approx(measured_gib, abs=0.006)


@pytest.mark.parametrize("total,util,weights,non_torch,peak,kv", [
    (79.22, 0.90, 14.96, 1.79, 1.26, 53.29),  # vllm PR #10511, Meta-Llama-3-8B, TP 1
    (79.22, 0.90, 19.86, 0.16, 36.63, 14.65),  # vllm PR #12126, Llama-3.2-11B-Vision
    (79.18, 0.90, 14.99, 0.13, 4.76, 51.38),  # llm-d-benchmark, Llama-3.1-8B, vLLM 0.11
])
def test_kv_budget_reproduces_logged_figures(total, util, weights, non_torch, peak, kv):
    got = kv_cache_bytes(int(total * GiB), util, int(weights * GiB), int(non_torch * GiB),
                         int(peak * GiB))
    assert got / GiB == pytest.approx(kv, abs=0.015)  # inputs are logged to 0.01 GiB


def test_cudagraph_estimate_is_subtracted_from_the_kv_budget():
    base = kv_cache_bytes(80 * GiB, 0.9, 15 * GiB, GiB, 2 * GiB)
    assert kv_cache_bytes(80 * GiB, 0.9, 15 * GiB, GiB, 2 * GiB, GiB // 2) == base - GiB // 2


def test_bad_inputs_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ModelShape.from_hf_config(LLAMA3_8B_CONFIG, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="context_lens"):
        Batch((10,), (5,))
    with pytest.raises(ValueError, match="sampling"):
        Batch.uniform(1, 1, 1, sampling="beam")
    with pytest.raises(ValueError, match=r"at least 1 \+ d tokens"):
        Batch((3,), (10,), num_draft_tokens=(3,))  # verifying 3 drafts schedules the bonus token too
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_cache_bytes(GiB, 1.5, 0, 0, 0)
