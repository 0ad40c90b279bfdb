"""One GPU's profile as typed values: its memory ledger (``Geometry``), scheduler limits, step-time model.

``Profile`` is what every engine of the shadow fleet is built from. It names its engine kind
(``engine``); the kind's parser in the registry (``producers.sim.registry``) turns a JSON object of
``profiles.json`` into one (``producers.sim.profiles`` is the catalogue that reads the file). The
step-time model is ``step_s = a + b*prefill_tokens + c*decode_seqs``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvguard.contracts.events import Geometry
from kvguard.producers.vllm.step_memory import ModelShape


class ProfileError(ValueError):
    """A profile is unknown or one of its fields is missing or invalid."""

    def __init__(self, name: str, field: str, expected: str, vllm_message: str | None = None):
        self.name, self.field, self.expected, self.vllm_message = name, field, expected, vllm_message
        if vllm_message:  # a combination vLLM itself refuses: its reason, verbatim
            super().__init__(f"profile {name!r}: field {field!r}: vLLM refuses to start: {vllm_message}")
        else:
            super().__init__(f"profile {name!r}: field {field!r}: expected {expected}")

    def __reduce__(self):  # crosses process pools (the static sweep) with its fields
        return type(self), (self.name, self.field, self.expected, self.vllm_message)


@dataclass(slots=True, frozen=True)
class VllmSpec:
    """The ``vllm`` section of a vLLM-engine profile: what sizes the worker's non-KV memory and what
    the scheduler is configured with (vLLM 0.33 option names in the comments)."""

    shape: ModelShape  # from the section's Hugging Face ``hf_config`` and ``tensor_parallel_size``
    block_size: int = 16  # --block-size
    non_torch_increase_bytes: int = 0  # non-torch growth during profiling (NCCL, cuBLAS handles)
    cudagraph_bytes: int = 0  # CUDA-graph pool: subtracted as the estimate, then held after capture
    cublas_workspace_bytes: int = 0  # cuBLAS + cuBLASLt workspace made at the profile's first GEMM
    sampling: str = "top_p"  # the sampler path every request takes (model generation_config)
    cudagraph_mode: str = "FULL_AND_PIECEWISE"  # --compilation-config cudagraph_mode
    allocator_conf: str = ""  # PYTORCH_CUDA_ALLOC_CONF
    policy: str = "fcfs"  # --scheduling-policy
    enable_prefix_caching: bool = True
    scheduler_reserve_full_isl: bool = True
    watermark: float = 0.0
    long_prefill_token_threshold: int = 0
    model_runner: str = "v2"  # VLLM_USE_V2_MODEL_RUNNER: 0.33 runs Model Runner V2 unless set to 0 ("v1")
    enforce_eager: bool = False  # --enforce-eager: no CUDA graphs, no graph estimate, no JIT kernel warm-up
    kv_cache_memory_bytes: int = 0  # --kv-cache-memory-bytes (0: the utilization formula, as vLLM's truthiness test)
    attention_version: int = 3  # FlashAttention 3 on Hopper, 2 elsewhere
    num_sms: int = 132
    attention_lse: str = "total_q"  # model_runner_v2.LSE_LAYOUTS
    num_speculative_tokens: int = 0  # --speculative-config num_speculative_tokens (draft_model method)
    draft_shape: ModelShape | None = None  # the draft model (--speculative-config model)
    draft_weights_bytes: int = 0
    rejection_chunk_bytes: int = 1 << 30  # 0.33's MAX_CHUNK_BYTES; 0: one chunk (vLLM before PR#48641)
    spec_acceptance_rate: float = 0.7  # per draft token; not a vLLM setting: the workload's (kvguard's model)
    max_num_queued_reqs: int = 0  # --max-num-queued-reqs (0: no cap)
    max_num_queued_tokens: int = 0  # --max-num-queued-tokens (0: no cap)
    auto_fit_max_model_len: bool = False  # --max-model-len -1: fit max_model_len to the KV cache


@dataclass(slots=True, frozen=True)
class Profile:
    name: str
    description: str
    geometry: Geometry
    # bytes of the step's activation workspace per batched token held in the KV pool (0: none there,
    # as on the vLLM engine, whose activations live in the caching allocator)
    activation_bytes_per_token: int
    max_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    step_base_s: float
    step_prefill_token_s: float
    step_decode_seq_s: float
    swap_capacity_bytes: int
    host_bandwidth_bytes_per_s: float
    engine: str  # the engine kind that runs it (a key of producers.sim.registry.KINDS)
    vllm: VllmSpec | None = None
    memory: object | None = None  # vLLM engine: the measured ``sim.vllm.memory.MemoryLedger`` (SGLang: its ledger)
    sglang: object | None = None  # SGLang engine: ``sim.sglang.profile.SglangSpec``

    @property
    def unit_tokens(self) -> int:
        return self.geometry.unit_tokens

    @property
    def capacity_tokens(self) -> int:
        return self.geometry.dynamic_units * self.geometry.unit_tokens

    def step_seconds(self, prefill_tokens: int, decode_seqs: int) -> float:
        return self.step_base_s + self.step_prefill_token_s * prefill_tokens + self.step_decode_seq_s * decode_seqs

    def workspace_units(self, batched_tokens: int) -> int:
        """Units of the contiguous workspace buffer one step with ``batched_tokens`` needs in the KV
        pool (0 when the profile's activations are not in the pool)."""
        if not self.activation_bytes_per_token:
            return 0
        return max(1, -(-batched_tokens * self.activation_bytes_per_token // self.geometry.unit_bytes))

    @property
    def swap_capacity_units(self) -> int:
        return self.swap_capacity_bytes // self.geometry.unit_bytes


@dataclass(slots=True, frozen=True)
class EngineKnobs:
    """The start-up settings an operator passes to ``vllm serve`` that change memory or scheduling,
    applied over a profile whose engine kind takes them (None: the profile's value). A profile with
    knobs is re-measured: its KV block count follows from the profiling run under the new settings,
    as in vLLM.

    - ``gpu_memory_utilization``: ``--gpu-memory-utilization`` (vLLM 0.33's default 0.92);
    - ``max_num_batched_tokens`` / ``max_num_seqs``: ``--max-num-batched-tokens`` / ``--max-num-seqs``;
    - ``allocator_conf``: ``PYTORCH_CUDA_ALLOC_CONF`` (e.g. ``expandable_segments:True``);
    - ``watermark``: the share of KV blocks kept free when a waiting request is admitted;
    - the rest with vLLM's flag names (``max_model_len``, ``kv_cache_memory_bytes``, ``enforce_eager``,
      ``scheduling_policy``, the queue caps, ``num_speculative_tokens`` with ``speculative_model_config``,
      ``scheduler_reserve_full_isl``), ``model_runner`` (``VLLM_USE_V2_MODEL_RUNNER``) and kvguard's
      own ``attention_lse``, ``rejection_chunk_bytes`` and ``spec_acceptance_rate`` (``VllmSpec``).
    """

    gpu_memory_utilization: float | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    allocator_conf: str | None = None
    watermark: float | None = None
    max_model_len: int | None = None
    kv_cache_memory_bytes: int | None = None
    enforce_eager: bool | None = None
    model_runner: str | None = None
    scheduling_policy: str | None = None
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    attention_lse: str | None = None
    num_speculative_tokens: int | None = None
    speculative_model_config: str | None = None
    rejection_chunk_bytes: int | None = None
    spec_acceptance_rate: float | None = None
    scheduler_reserve_full_isl: bool | None = None

    def is_default(self) -> bool:
        return all(getattr(self, f) is None for f in self.__slots__)

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__slots__ if getattr(self, f) is not None}

    def label(self) -> str:
        """A short suffix naming the knobs, e.g. ``util0.95+mnbt1024``."""
        short = {"gpu_memory_utilization": "util", "max_num_batched_tokens": "mnbt", "max_num_seqs": "seqs",
                 "allocator_conf": "alloc=", "watermark": "wm", "max_model_len": "len", "kv_cache_memory_bytes": "kv",
                 "enforce_eager": "eager", "model_runner": "runner", "scheduling_policy": "policy=",
                 "max_num_queued_reqs": "qreqs", "max_num_queued_tokens": "qtok", "attention_lse": "lse=",
                 "num_speculative_tokens": "spec", "speculative_model_config": "draft=",
                 "rejection_chunk_bytes": "chunk", "spec_acceptance_rate": "accept",
                 "scheduler_reserve_full_isl": "fullisl"}
        return "+".join(f"{short[k]}{v if v != '' else 'default'}" for k, v in self.to_dict().items())
