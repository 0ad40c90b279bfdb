"""The model, GPU and ``vllm serve`` flags ``kvguard simulate`` and ``kvguard plan`` share: declared once here,
parsed once (``engine_flag_values``, ``engine_settings``), so both commands describe the same server.

Flag names and defaults are vLLM 0.33's (``producers/sim/engine_args.py`` says where each comes from); a
bundled ``--profile`` takes the engine flags as knobs, ``--model-config`` takes them all.
"""

from __future__ import annotations

import re

import typer

MODEL_PANEL = "Model and GPU"
ENGINE_PANEL = "vLLM engine flags (vLLM 0.33's names and defaults)"

PROFILE = typer.Option(None, "--profile", help="A bundled model/GPU profile (default: the profiles file's default), "
                       "instead of --model-config.", rich_help_panel=MODEL_PANEL)
MODEL_CONFIG = typer.Option(None, "--model-config", help="A Hugging Face config.json (or its directory) of a dense "
                            "Llama/Mistral/Qwen2/Qwen3 decoder, instead of --profile.", rich_help_panel=MODEL_PANEL)
GPU = typer.Option(None, "--gpu", help="With --model-config: h100-80gb, h200, b200, a100-40gb, l40s, rtx4090, "
                   "rtx3090, rtx5090 (capacities as CUDA reports them).", rich_help_panel=MODEL_PANEL)
GPU_MEMORY_GIB = typer.Option(None, "--gpu-memory-gib", help="With --model-config: the GPU's capacity in GiB instead "
                              "of a named --gpu (default 80).", rich_help_panel=MODEL_PANEL)
TENSOR_PARALLEL_SIZE = typer.Option(1, "--tensor-parallel-size", "-tp", min=1, help="With --model-config: one "
                                    "simulated GPU is one TP rank.", rich_help_panel=MODEL_PANEL)
DTYPE = typer.Option("auto", "--dtype", help="With --model-config: auto, half, float16, bfloat16, float, float32.",
                     rich_help_panel=MODEL_PANEL)

GPU_MEMORY_UTILIZATION = typer.Option(None, "--gpu-memory-utilization", help="vLLM's share of the GPU (0.92 by "
                                      "default); the KV cache is what the profiling run leaves of it.",
                                      rich_help_panel=ENGINE_PANEL)
KV_CACHE_MEMORY_BYTES = typer.Option(None, "--kv-cache-memory-bytes", help="A fixed KV cache size (bytes, or 8G / "
                                     "8589934592 as vLLM parses it) instead of the utilization formula.",
                                     rich_help_panel=ENGINE_PANEL)
MAX_MODEL_LEN = typer.Option(None, "--max-model-len", help="The longest sequence (default: the config's; -1 fits it "
                             "to the KV cache).", rich_help_panel=ENGINE_PANEL)
MAX_NUM_SEQS = typer.Option(None, "--max-num-seqs", min=1, help="Sequences per step (the OpenAI server's default: "
                            "1024 on GPUs of >= 70 GiB other than the A100, else 256).", rich_help_panel=ENGINE_PANEL)
MAX_NUM_BATCHED_TOKENS = typer.Option(None, "--max-num-batched-tokens", min=1, help="The per-step token budget "
                                      "(the OpenAI server's default: 16384 at >= 160 GiB, 8192 at >= 70 GiB other "
                                      "than the A100, else 2048).", rich_help_panel=ENGINE_PANEL)
NUM_SPECULATIVE_TOKENS = typer.Option(None, "--num-speculative-tokens", min=1, help="Speculative decoding, "
                                      "draft_model method: drafts per step (with --speculative-model-config).",
                                      rich_help_panel=ENGINE_PANEL)
SPECULATIVE_MODEL_CONFIG = typer.Option(None, "--speculative-model-config", help="The draft model's config.json "
                                        "(same vocabulary as the target).", rich_help_panel=ENGINE_PANEL)
ALLOC_CONF = typer.Option(None, "--alloc-conf", help="PYTORCH_CUDA_ALLOC_CONF, e.g. expandable_segments:True.",
                          rich_help_panel=ENGINE_PANEL)
ENFORCE_EAGER = typer.Option(None, "--enforce-eager/--no-enforce-eager", help="No CUDA graphs, no graph estimate, no "
                             "JIT kernel warm-up.", rich_help_panel=ENGINE_PANEL)
MODEL_RUNNER = typer.Option(None, "--model-runner", help="v2 (vLLM 0.33's default) or v1 (VLLM_USE_V2_MODEL_RUNNER=0)."
                            , rich_help_panel=ENGINE_PANEL)
ATTENTION_LSE = typer.Option(None, "--attention-lse", help="FlashAttention LSE layout: total_q (vLLM 0.33), "
                             "max_seqlen_q (FA2 before Dao-AILab PR#970) or max_seq_len (padded by the context, "
                             "club-3090 'Cliff 1').", rich_help_panel=ENGINE_PANEL)
WATERMARK = typer.Option(None, "--watermark", help="Share of KV blocks kept free when admitting a waiting request "
                         "(0.0 default, [0, 1)).", rich_help_panel=ENGINE_PANEL)
SCHEDULER_RESERVE_FULL_ISL = typer.Option(None, "--scheduler-reserve-full-isl/--no-scheduler-reserve-full-isl",
                                          help="The full-sequence admission gate (on by default in 0.33).",
                                          rich_help_panel=ENGINE_PANEL)
MAX_NUM_QUEUED_REQS = typer.Option(None, "--max-num-queued-reqs", min=0, help="The 503 cap on unfinished requests.",
                                   rich_help_panel=ENGINE_PANEL)
MAX_NUM_QUEUED_TOKENS = typer.Option(None, "--max-num-queued-tokens", help="The 503 cap on the prefill token backlog "
                                     "(10k accepted).", rich_help_panel=ENGINE_PANEL)
SCHEDULING_POLICY = typer.Option(None, "--scheduling-policy", help="fcfs (default) or priority (lower value first, "
                                 "then arrival; preempts the largest).", rich_help_panel=ENGINE_PANEL)


def human_int(text: str | None, flag: str) -> int | None:
    """vLLM's ``human_readable_int``: 1k = 1000, 1K = 1024, 8G = 8 * 2**30 (no decimals with binary suffixes)."""
    if text is None:
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", text.strip())
    if m:
        number, suffix = m.groups()
        if suffix.islower():
            return int(float(number) * 10 ** (3 * "kmgt".index(suffix) + 3))
        if "." in number:
            raise typer.BadParameter(f"Decimals are not allowed with binary suffixes like {suffix}. Did you mean to "
                                     f"use {number}{suffix.lower()} instead?", param_hint=flag)
        return int(number) * 2 ** (10 * ("KMGT".index(suffix) + 1))
    try:
        return int(text)
    except ValueError:
        raise typer.BadParameter(f"expected an integer like 8589934592, 8G or 10k, got {text!r}",
                                 param_hint=flag) from None


def engine_flag_values(*, gpu_memory_utilization, max_num_batched_tokens, alloc_conf, max_model_len,
                       kv_cache_memory_bytes, watermark, max_num_seqs, max_num_queued_reqs, max_num_queued_tokens,
                       scheduling_policy, num_speculative_tokens, speculative_model_config, enforce_eager,
                       model_runner, attention_lse, scheduler_reserve_full_isl, **extra) -> dict:
    """The engine flags as ``EngineArgs`` / ``EngineKnobs`` field values (None: not given); ``extra`` are a
    command's own engine fields (``spec_acceptance_rate``)."""
    return dict(gpu_memory_utilization=gpu_memory_utilization, max_num_batched_tokens=max_num_batched_tokens,
                alloc_conf=alloc_conf, max_model_len=max_model_len,
                kv_cache_memory_bytes=human_int(kv_cache_memory_bytes, "--kv-cache-memory-bytes"),
                watermark=watermark, max_num_seqs=max_num_seqs, max_num_queued_reqs=max_num_queued_reqs,
                max_num_queued_tokens=human_int(max_num_queued_tokens, "--max-num-queued-tokens"),
                scheduling_policy=scheduling_policy, num_speculative_tokens=num_speculative_tokens,
                speculative_model_config=speculative_model_config, enforce_eager=enforce_eager,
                model_runner=model_runner, attention_lse=attention_lse,
                scheduler_reserve_full_isl=scheduler_reserve_full_isl, **extra)


def engine_settings(flags: dict, *, model_config, gpu, gpu_memory_gib, tensor_parallel_size, dtype):
    """(``EngineKnobs`` over a bundled profile, ``EngineArgs`` for your own model): the same flags either way."""
    from kvguard.producers.sim.engine_args import EngineArgs
    from kvguard.producers.sim.profiles import EngineKnobs

    given = {k: v for k, v in flags.items() if v is not None}
    if model_config is None:
        if gpu is not None or gpu_memory_gib is not None or tensor_parallel_size != 1 or dtype != "auto":
            raise typer.BadParameter("--gpu, --gpu-memory-gib, --tensor-parallel-size and --dtype need "
                                     "--model-config (a bundled --profile fixes them)", param_hint="--model-config")
        renamed = {("allocator_conf" if k == "alloc_conf" else k): v for k, v in given.items()}
        return EngineKnobs(**renamed), None
    return None, EngineArgs(model_config=model_config, gpu=gpu, gpu_memory_gib=gpu_memory_gib,
                            tensor_parallel_size=tensor_parallel_size, dtype=dtype, **given)
