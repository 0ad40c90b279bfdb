"""Public numbers the shadow engine must reproduce from a model config and a GPU, one row per number,
each with its citation; rows that cannot be reproduced say why (and that reason is itself checked: an
architecture the engine does not model must be refused naming what it lacks).

Tolerances: start-up lines 0.05 GiB (DESIGN.md section 7; most logs print 0.01 GiB), OOM allocation
sizes 0.01 GiB of the printed "Tried to allocate" (which prints two decimals), boundaries exact
(works / fails).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvguard.producers.sim.engine_args import BaselineEstimates, EngineArgs
from kvguard.producers.sim.model_config import UnsupportedArchitecture, load_model_config
from kvguard.producers.sim.profiles import ProfileError, VllmSpec, profile_from_dict
from kvguard.producers.sim.vllm.memory import WorkerMemory
from kvguard.producers.vllm import model_runner_v2 as v2
from kvguard.producers.vllm.step_memory import ModelShape, kv_cache_bytes, profile_peak_bytes, prompt_logprobs_row_bytes

GiB = 1 << 30
CONFIGS = Path(__file__).resolve().parents[3] / "data" / "model_configs"


def config(name: str):
    return load_model_config(CONFIGS / f"{name}.json")


@dataclass(frozen=True)
class Row:
    source: str  # citation
    quantity: str
    reported: float | str  # as the source prints it (GiB unless said)
    tolerance: float | None = None
    compute: object = None  # () -> the same quantity, or None when not reproduced
    not_reproduced: str = ""  # why, when compute is None
    refused_config: str = ""  # a config that must be refused naming `refused_for`
    refused_for: str = ""


def _llm_d_llama_v1() -> WorkerMemory:
    """llm-d/llm-d-benchmark config_explorer/empirical-vllm-memory-results.md: vLLM 0.11 on H100
    (79.18 GiB total, 78.57 free at start-up), Llama-3.1-8B, defaults 8192 tokens / 1024 sequences."""
    model = config("llama-3.1-8b-instruct")
    spec = VllmSpec(shape=model.shape(), non_torch_increase_bytes=int(0.13 * GiB), cublas_workspace_bytes=33 << 20,
                    model_runner="v1")
    return WorkerMemory(spec, total_bytes=int(79.18 * GiB), weights_bytes=model.weights_bytes(),
                        context_bytes=int(0.61 * GiB), gpu_memory_utilization=0.9, max_num_batched_tokens=8192,
                        max_num_seqs=1024, max_model_len=131072)


def _peak(cfg: dict, tp: int) -> float:
    return profile_peak_bytes(ModelShape.from_hf_config(cfg, tensor_parallel_size=tp), 8192, 1024) / GiB


QWEN3_32B = {"num_hidden_layers": 64, "hidden_size": 5120, "intermediate_size": 25600, "num_attention_heads": 64,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "torch_dtype": "bfloat16"}
LLAMA33_70B = {"num_hidden_layers": 80, "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
               "num_key_value_heads": 8, "vocab_size": 128256, "torch_dtype": "bfloat16"}


def _pr48641_warmup_upcast() -> float:
    """vllm PR#48641: Qwen3-8B + 7 speculative tokens, H100 defaults (8192 tokens, 1024 sequences):
    warmup_kernels' decode step, its fp32 copy of every verified row before 0.33 chunked it."""
    shape = config("qwen3-8b").shape()
    reqs = v2.warmup_num_reqs(1024, 8192, 8, 10**6, 16, 7, 40960, True)
    plans = v2.warmup_plans_v2(shape, v2.RunnerConfig(8192, 1024), v2.AttentionKernel(), reqs, 8, None, 7, None)
    return max(op.nbytes for op in plans[1].ops() if op.name == v2.TAG_SPEC + "verify_f32") / GiB


def _pr48641_chunked() -> float:
    shape = config("qwen3-8b").shape()
    plans = v2.warmup_plans_v2(shape, v2.RunnerConfig(8192, 1024), v2.AttentionKernel(), 910, 8, None, 7)
    return max(op.nbytes for op in plans[1].ops() if op.name == v2.TAG_SPEC + "verify_f32") / GiB


def _llama2_70b(util: float) -> str:
    """vllm#1298's setup: Llama-2-70B, TP 2, 2048-token sequences, on 80 GB GPUs (79.15 GiB as CUDA reports an
    80 GB A100 in vLLM's OOM messages; the thread does not print it)."""
    args = EngineArgs(str(CONFIGS / "llama-2-70b.json"), gpu_memory_gib=79.15, tensor_parallel_size=2,
                      dtype="float16", gpu_memory_utilization=util, max_model_len=2048, baseline=BaselineEstimates())
    try:
        args.profile()
    except ProfileError as e:
        return "refused: " + (e.vllm_message or e.expected)
    return "boots"


ROWS = [
    # -- start-up budget lines -------------------------------------------------------------------------------
    Row("vllm PR#10511 log (V0): 'model weights take 14.96GiB' (meta-llama/Meta-Llama-3-8B)", "weights", 14.96, 0.05,
        lambda: config("meta-llama-3-8b").weights_bytes() / GiB),
    Row("vllm PR#10511 log: total 79.22 GiB x 0.90 - weights 14.96 - non_torch 1.79 - peak 1.26", "KV cache", 53.29,
        0.05, lambda: kv_cache_bytes(int(79.22 * GiB), 0.9, int(14.96 * GiB), int(1.79 * GiB), int(1.26 * GiB)) / GiB),
    Row("vllm PR#10511 log: 'PyTorch activation peak memory takes 1.26GiB'", "peak activation", 1.26,
        not_reproduced="a V0 log: V0's sampler and profile run are not modelled (the V1 formula gives 1.261 GiB "
                       "for (8192, 256) by coincidence, test_step_memory.py)"),
    Row("llm-d-benchmark (vLLM 0.11, H100, Llama-3.1-8B): model loading 14.99 GiB", "weights", 14.99, 0.05,
        lambda: config("llama-3.1-8b-instruct").weights_bytes() / GiB),
    Row("llm-d-benchmark (vLLM 0.11, H100, Llama-3.1-8B): activation peak 4.76 GiB", "peak activation", 4.76, 0.05,
        lambda: _llm_d_llama_v1().ledger.profile_peak_bytes / GiB),
    Row("llm-d-benchmark (vLLM 0.11, H100, Llama-3.1-8B): KV cache 51.38 GiB", "KV cache", 51.38, 0.05,
        lambda: _llm_d_llama_v1().ledger.kv_cache_bytes / GiB),
    Row("llm-d-benchmark (vLLM 0.11, H100): Qwen3-32B activation peak 5.64 GiB (TP 1)", "peak activation", 5.64, 0.05,
        lambda: _peak(QWEN3_32B, 1)),
    Row("llm-d-benchmark (vLLM 0.11, H100): Llama-3.3-70B-FP8 activation peak 4.84 GiB (TP 2)", "peak activation",
        4.84, 0.05, lambda: _peak(LLAMA33_70B, 2)),
    Row("vllm#15598 log (0.7.3): 'total_gpu_memory (44.53GiB) x gpu_memory_utilization (0.98) = 43.64GiB'",
        "requested", 43.64, 0.05, lambda: math.ceil(44.53 * GiB * 0.98) / GiB),
    Row("vllm#15598 log: weights 20.64 + non-torch 0.28 + peak 1.52 + KV 21.20 close the 43.64 GiB budget",
        "KV cache", 21.20, 0.05,
        lambda: kv_cache_bytes(int(44.53 * GiB), 0.98, int(20.64 * GiB), int(0.28 * GiB), int(1.52 * GiB)) / GiB),
    Row("vllm#15598: DeepSeek-R1 weights 20.64 GiB, peak 1.52 GiB per GPU", "weights, peak", "20.64, 1.52",
        not_reproduced="a mixture of experts with multi-head latent attention: neither is modelled",
        refused_config="deepseek-v3-fields", refused_for="mixture of experts"),
    Row("vllm PR#48601 log (MRV2, H100): 'Free memory on device (77.57/79.11 GiB) ... (0.92, 72.78 GiB)'",
        "requested", 72.78, 0.05, lambda: math.ceil(79.11 * GiB * 0.92) / GiB),
    Row("vllm PR#48601 log: Qwen3.6-27B-FP8 TP4: 7.39 GiB weights, 1.54 peak, 0.6 non-torch, 2.04 CUDA graphs, "
        "63.25 KV", "budget lines", "7.39, 1.54, 0.6, 2.04, 63.25",
        not_reproduced="Qwen3.6 is a hybrid of gated-delta-net and attention layers with FP8 weights; neither is "
                       "modelled (and the 1.54 GiB predates the profile's warm-up pass)",
        refused_config="qwen3-next-fields", refused_for="linear-attention"),
    Row("vllm PR#21489 log: 'Free memory on device (177.66/178.36 GiB) ... (0.9, 160.53 GiB)'", "requested", 160.53,
        0.05, lambda: math.ceil(178.36 * GiB * 0.9) / GiB),
    Row("vllm PR#21489 log: gemma-3-4b-it 8.58 GiB weights, 9.96 peak, 0.07 non-torch, 0.65 CUDA graphs",
        "budget lines", "8.58, 9.96, 0.07, 0.65",
        not_reproduced="Gemma 3 interleaves sliding-window layers and carries a vision tower: not modelled",
        refused_config="gemma-3-4b-it-fields", refused_for="vision or audio tower"),
    Row("wtdcode/vllm-backport#34 log (0.33-era): '(22.93/23.56 GiB) ... (0.935, 22.03 GiB)' on an RTX 3090",
        "requested", 22.03, 0.05, lambda: math.ceil(23.56 * GiB * 0.935) / GiB),
    # -- OOM allocation sizes ---------------------------------------------------------------------------------
    Row("vllm PR#48641: Qwen3-8B + 7 speculative tokens 'tries to allocate 4.12 GiB and OOMs during warmup'",
        "Tried to allocate", 4.12, 0.01, _pr48641_warmup_upcast),
    Row("vllm 0.33 spec_decode/rejection_sampler.py MAX_CHUNK_BYTES = 2**30: the same copy, chunked", "chunk", 1.0,
        0.01, _pr48641_chunked),
    Row("vllm PR#52054: prompt logprobs peak = tokens x vocab x (2 B + 4 B), '~7.5 GiB' at 8192 x 152k (7.47e9 B)",
        "bytes (GB)", 7.47, 0.01, lambda: 8192 * prompt_logprobs_row_bytes(152064, 2) / 1e9),
    Row("vllm#15105: 'Tried to allocate 1.74 GiB' at logits.sort (vLLM 0.8.0)", "Tried to allocate", 1.74,
        not_reproduced="the thread's model, batch and GPU are not in the parts read"),
    Row("noonghunna/club-3090 CLIFFS.md Cliff 1: 'Tried to allocate 50.00 MiB' in FA2 varlen_fwd (Qwen3.6-27B, "
        "TurboQuant path)", "Tried to allocate", "50 MiB",
        not_reproduced="a hybrid model behind third-party patches; the padded-LSE mechanism is modelled "
                       "(--attention-lse max_seq_len) but not this model",
        refused_config="qwen3-next-fields", refused_for="linear-attention"),
    # -- works / fails boundaries -------------------------------------------------------------------------------
    Row("vllm#1298 (V0, 2023): Llama-2-70B TP2, gmu 0.90 runs", "boundary", "boots", None, lambda: _llama2_70b(0.90)),
    Row("vllm#1298: gmu 1.0 OOMs (V0 at run time); vLLM 0.33 refuses it at start-up (free memory < requested)",
        "boundary", "refused: Free memory on device", None, lambda: _llama2_70b(1.0)),
    Row("vllm#57475: Qwen3.8-27B NVFP4, gmu 0.97 boots and serves, 0.98 OOMs at capture", "boundary", "0.97 / 0.98",
        not_reproduced="hybrid linear attention and an NVFP4 KV cache: neither is modelled",
        refused_config="qwen3-next-fields", refused_for="linear-attention"),
    Row("noonghunna/club-3090 CLIFFS.md: gmu 0.93 passes a 60K prompt, 0.95 fails (Qwen3.6-27B, RTX 3090)",
        "boundary", "0.93 / 0.95", not_reproduced="the GDN prefill state (hybrid model) is not modelled",
        refused_config="qwen3-next-fields", refused_for="linear-attention"),
    Row("lm-eval#2698: DeepSeek-R1-Distill-Llama-8B loglikelihood OOMs at max_num_seqs 256, works at 4",
        "boundary", "256 / 4", not_reproduced="the GPU and vLLM version are not given"),
]


@pytest.mark.parametrize("row", ROWS, ids=[f"{i:02d}" for i in range(len(ROWS))])
def test_public_number(row: Row):
    if row.compute is None:
        assert row.not_reproduced, f"{row.source}: a row either reproduces its number or says why not"
        if row.refused_config:
            with pytest.raises(UnsupportedArchitecture, match=row.refused_for):
                config(row.refused_config)
        return
    got = row.compute()
    if isinstance(row.reported, str):
        assert str(got).startswith(row.reported), (row.source, got)
    else:
        assert got == pytest.approx(row.reported, abs=row.tolerance), (row.source, got)


def test_the_table_reproduces_more_than_it_explains_away():
    reproduced = sum(r.compute is not None for r in ROWS)
    assert reproduced >= 15 and reproduced > len(ROWS) - reproduced


def test_bundled_start_up_of_a_byo_model_prints_vllms_lines():
    lines = EngineArgs(str(CONFIGS / "llama-3.1-8b-instruct.json"), gpu="h100-80gb").profile().memory.log_lines()
    assert lines[0] == "Model loading took 14.99 GiB memory"
    assert lines[1].startswith("Available KV cache memory: ") and lines[3].startswith("GPU KV cache size: ")
    # vLLM 0.33 prints its summary last, after the graphs are captured (compile_or_warm_up_model)
    assert lines[-1].startswith("Free memory on device (78.54/79.18 GiB) on startup. Desired GPU memory utilization "
                                "is (0.92, 72.85 GiB). Actual usage is ")
    assert lines[-1].endswith(f"Current kv cache memory in use is {lines[1].split(': ')[1].removesuffix(' GiB')} GiB.")


def test_a_spec_decode_profile_loads_from_a_preset_json():
    d = EngineArgs(str(CONFIGS / "qwen3-8b.json"), gpu="h100-80gb",
                   speculative_model_config=str(CONFIGS / "qwen3-0.6b.json"), num_speculative_tokens=7).profile_dict()
    assert profile_from_dict("spec", d).vllm.draft_shape.num_layers == 28
