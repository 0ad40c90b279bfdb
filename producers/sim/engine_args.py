"""``vllm serve`` flags over a user's model config and GPU: the profile the shadow engine runs.

Flag names and defaults are vLLM 0.33's (``vllm/engine/arg_utils.py``, ``vllm/config/*.py``), and a
combination vLLM refuses is refused with vLLM's own text (``ProfileError.vllm_message``):

- ``--gpu-memory-utilization`` 0.92 (``config/cache.py``), ``--block-size`` 16, ``--watermark`` 0.0
  in [0, 1), ``--scheduling-policy`` fcfs, ``--enforce-eager`` off, ``--kv-cache-memory-bytes`` unset
  (0 is unset too: vLLM tests its truthiness), ``--max-num-queued-reqs``/``--max-num-queued-tokens``
  unset;
- ``--max-num-batched-tokens`` / ``--max-num-seqs``: the OpenAI server's defaults by device
  (``get_batch_defaults``): 16384/1024 at >= 160 GiB, 8192/1024 at >= 70 GiB unless the device is an
  A100, else 2048/256; then ``max_num_batched_tokens <= max_num_seqs * max_model_len`` and
  ``max_num_seqs <= max_num_batched_tokens`` for values left unset;
- ``--max-model-len``: derived from the config (``model_config.ModelConfig.derived_max_model_len``);
  a larger value is refused unless ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` (not modelled);
- ``--dtype`` auto/half/float16/bfloat16/float/float32 (``model_config.DTYPE_CHOICES``);
- ``--tensor-parallel-size``: one simulated GPU is one TP rank: heads, KV heads, MLP and vocabulary
  shards as vLLM's layers split them (``model_config.ModelConfig.weights_bytes``).

What vLLM measures but a config cannot give is an input with a cited default (``BaselineEstimates``):
the CUDA context and NCCL baseline and the non-torch growth (llm-d/llm-d-benchmark
``config_explorer/empirical-vllm-memory-results.md``: 0.61 / 0.13 GiB at TP 1, 1.54 / 0.55 GiB at
TP 2, vLLM 0.11 on H100) and the CUDA-graph pool (the same page: 0.10-0.39 GiB for small models, 0.6 GiB
for Llama-3.3-70B; 0.39 GiB is taken). The step-time model is a roofline estimate from the GPU's
bandwidth and FLOP/s: it sets throughput, not memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvguard.producers.sim.gpus import Gpu, custom_gpu, gpu_by_name
from kvguard.producers.sim.model_config import ModelConfig, load_model_config
from kvguard.producers.sim.profiles import Profile, ProfileError, profile_from_dict
from kvguard.producers.sim.vllm.profile import draft_section

GiB = 1 << 30
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92  # vllm/config/cache.py: Field(default=0.92, gt=0, le=1)


@dataclass(frozen=True, slots=True)
class BaselineEstimates:
    """Bytes vLLM measures at start-up that no config fixes (module docstring)."""

    context_gib: float | None = None  # CUDA context + NCCL, before the snapshot
    non_torch_increase_gib: float | None = None
    cudagraph_gib: float = 0.39

    def context_bytes(self, tp: int) -> int:
        gib = self.context_gib if self.context_gib is not None else (0.61 if tp == 1 else 1.54)
        return int(gib * GiB)

    def non_torch_bytes(self, tp: int) -> int:
        gib = self.non_torch_increase_gib if self.non_torch_increase_gib is not None else (0.13 if tp == 1 else 0.55)
        return int(gib * GiB)


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """The ``vllm serve`` flags the shadow engine honours (vLLM's names; None: vLLM's default)."""

    model_config: str
    gpu: str | None = None
    gpu_memory_gib: float | None = None
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    max_model_len: int | None = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    watermark: float = 0.0
    scheduling_policy: str = "fcfs"
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    num_speculative_tokens: int | None = None
    speculative_model_config: str | None = None
    spec_acceptance_rate: float = 0.7  # not a vLLM flag: how often the workload's drafts are accepted
    alloc_conf: str = ""
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    scheduler_reserve_full_isl: bool = True
    # kvguard's own knobs (no vLLM flag): the runner (VLLM_USE_V2_MODEL_RUNNER), the attention LSE layout
    model_runner: str = "v2"
    attention_lse: str = "total_q"
    sampling: str = "top_p"
    baseline: BaselineEstimates = BaselineEstimates()

    def resolve_gpu(self) -> Gpu:
        if self.gpu and self.gpu_memory_gib is not None:
            raise ProfileError(self.name, "gpu", "either --gpu or --gpu-memory-gib, not both")
        if self.gpu:
            try:
                return gpu_by_name(self.gpu)
            except ValueError as e:
                raise ProfileError(self.name, "gpu", str(e)) from None
        try:
            return custom_gpu(self.gpu_memory_gib if self.gpu_memory_gib is not None else 80.0)
        except ValueError as e:
            raise ProfileError(self.name, "gpu_memory_gib", str(e)) from None

    @property
    def name(self) -> str:
        return f"byo:{self.model_config}"

    def batch_defaults(self, gpu: Gpu) -> tuple[int, int]:
        """``get_batch_defaults`` for the OpenAI server (``UsageContext.OPENAI_API_SERVER``)."""
        if gpu.total_bytes >= 160 * GiB:
            return 16384, 1024
        if gpu.total_bytes >= 70 * GiB and not gpu.is_a100:
            return 8192, 1024
        return 2048, 256

    def profile_dict(self, model: ModelConfig | None = None) -> dict:
        """The profile (``profiles.json`` schema, engine "vllm") these flags describe."""
        model = model or load_model_config(self.model_config)
        gpu = self.resolve_gpu()
        tp = self.tensor_parallel_size
        if tp < 1:
            raise ProfileError(self.name, "tensor_parallel_size", f"a positive integer, got {tp}")
        heads = int(model.hf_config["num_attention_heads"])
        if heads % tp:
            raise ProfileError(self.name, "tensor_parallel_size", "a divisor of the attention heads",
                               f"Total number of attention heads ({heads}) must be divisible by tensor parallel "
                               f"size ({tp}).")
        try:
            dtype = model.dtype_name(self.dtype)
        except ValueError as e:
            raise ProfileError(self.name, "dtype", str(e), str(e)) from None
        derived, key = model.derived_max_model_len
        auto_fit = self.max_model_len == -1  # vLLM: -1 fits max_model_len to the KV cache after profiling
        max_model_len = derived if auto_fit or self.max_model_len is None else self.max_model_len
        if max_model_len < 1:
            raise ProfileError(self.name, "max_model_len", f"a positive length or -1, got {self.max_model_len}")
        if max_model_len > derived:
            raise ProfileError(self.name, "max_model_len", f"at most {derived}", (
                f"User-specified max_model_len ({max_model_len}) is greater than the derived max_model_len ({key}="
                f"{derived} or model_max_length=None in model's config.json). To allow overriding this maximum, set "
                f"the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. VLLM_ALLOW_LONG_MAX_MODEL_LEN must be used with extreme "
                f"caution. If the model uses relative position encoding (RoPE), positions exceeding "
                f"derived_max_model_len lead to nan. If the model uses absolute position encoding, positions "
                f"exceeding derived_max_model_len will cause a CUDA array out-of-bounds error."))
        mnbt, seqs = self.batch_defaults(gpu)
        if self.max_num_batched_tokens is None:
            mnbt = min(mnbt, (self.max_num_seqs or seqs) * max_model_len)
        else:
            mnbt = self.max_num_batched_tokens
        seqs = self.max_num_seqs if self.max_num_seqs is not None else min(seqs, mnbt)
        if mnbt < seqs:
            raise ProfileError(self.name, "max_num_batched_tokens", f">= max_num_seqs ({seqs})",
                               f"max_num_batched_tokens ({mnbt}) must be greater than or equal to max_num_seqs "
                               f"({seqs}).")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ProfileError(self.name, "gpu_memory_utilization", "in (0, 1] (Field(gt=0, le=1))")
        if not 0 <= self.watermark < 1:
            raise ProfileError(self.name, "watermark", "in [0, 1) (Field(ge=0.0, lt=1.0))")
        weights = model.weights_bytes(tensor_parallel_size=tp, dtype=self.dtype)
        shape = model.shape(tensor_parallel_size=tp, dtype=self.dtype)
        section = {"hf_config": {**model.hf_config, "torch_dtype": dtype}, "tensor_parallel_size": tp,
                   "block_size": self.block_size, "non_torch_increase_bytes": self.baseline.non_torch_bytes(tp),
                   "cudagraph_bytes": 0 if self.enforce_eager else int(self.baseline.cudagraph_gib * GiB),
                   "cublas_workspace_bytes": gpu.cublas_workspace_bytes, "sampling": self.sampling,
                   "allocator_conf": self.alloc_conf, "policy": self.scheduling_policy,
                   "enable_prefix_caching": self.enable_prefix_caching,
                   "scheduler_reserve_full_isl": self.scheduler_reserve_full_isl, "watermark": self.watermark,
                   "model_runner": self.model_runner, "enforce_eager": self.enforce_eager,
                   "kv_cache_memory_bytes": self.kv_cache_memory_bytes or 0,
                   "attention_version": gpu.flash_attention_version, "num_sms": gpu.num_sms,
                   "attention_lse": self.attention_lse, "max_num_queued_reqs": self.max_num_queued_reqs or 0,
                   "max_num_queued_tokens": self.max_num_queued_tokens or 0, "auto_fit_max_model_len": auto_fit}
        if self.speculative_model_config is not None:
            if not self.num_speculative_tokens:
                raise ProfileError(self.name, "num_speculative_tokens", "a count with the draft model",
                                   "A speculative model was provided, but `num_speculative_tokens` was not provided")
            section.update(draft_section(self.speculative_model_config, section, self.name))
            section["num_speculative_tokens"] = self.num_speculative_tokens
            section["spec_acceptance_rate"] = self.spec_acceptance_rate
        elif self.num_speculative_tokens:
            raise ProfileError(self.name, "speculative_model_config", "a draft model config",
                               "num_speculative_tokens was provided but without speculative model.")
        params_per_rank = weights / shape.dtype_bytes
        per_token_kv = 2 * shape.num_layers * shape.kv_heads_per_rank * shape.head_dim * shape.dtype_bytes
        return {
            "engine": "vllm", "model": model.path, "gpu": f"{gpu.name} ({gpu.source})",
            "description": f"{model.architecture} from {model.path} on {gpu.name}, TP {tp}, vLLM 0.33 flags",
            "total_bytes": gpu.total_bytes, "weights_bytes": weights,
            "context_bytes": self.baseline.context_bytes(tp), "gpu_memory_utilization": self.gpu_memory_utilization,
            "max_batched_tokens": mnbt, "max_num_seqs": seqs, "max_model_len": max_model_len,
            # roofline step time: one pass over the weights at memory bandwidth plus launch overhead, 2 FLOPs
            # per parameter per prefill token at half of dense peak, one context of KV read per decode sequence
            "step_base_s": weights / gpu.bandwidth_bytes_per_s + 0.002,
            "step_prefill_token_s": 2 * params_per_rank / (0.5 * gpu.dense_bf16_flops),
            "step_decode_seq_s": 1024 * per_token_kv / gpu.bandwidth_bytes_per_s + 2e-5,
            "host_bandwidth_bytes_per_s": 25e9, "vllm": section,
        }

    def profile(self, model: ModelConfig | None = None) -> Profile:
        return profile_from_dict(self.name, self.profile_dict(model))
