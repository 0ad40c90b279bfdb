"""Model/GPU profiles: the data in ``profiles.json`` as typed values.

A profile fixes one GPU's memory ledger (-> ``Geometry``), its scheduler limits and the step-time
model ``step_s = a + b*prefill_tokens + c*decode_seqs``. Numbers and their sources live in the JSON,
so a new model or GPU is a data change, not a code change.

A profile names the engine that runs it (``engine``): ``"seed"`` (the default when absent) is the
seed's ``producers.sim.seed.engine.Engine`` over a paged pool whose ledger the JSON states directly;
``"vllm"`` is ``producers.sim.vllm.engine.VllmEngine``, whose ledger is *measured* the way vLLM measures
it: the model config in the profile's ``vllm`` section sizes a profiling step that runs through the
caching-allocator twin, and the KV block count follows (``producers.sim.vllm.memory``). Such a
profile's geometry has one unit per KV block (``unit_tokens`` = ``block_size``, one page class).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

from kvguard.contracts.events import Geometry
from kvguard.producers.sim.torch_allocator.caching_allocator import AllocatorConfig
from kvguard.producers.sim.vllm import memory as vllm_engine_memory
from kvguard.producers.sim.vllm.scheduler import SchedulerConfig
from kvguard.producers.vllm.step_memory import SAMPLING_MODES, ModelShape, RunnerConfig

ENGINES = ("seed", "vllm", "sglang")


class ProfileError(ValueError):
    """A profile is unknown or one of its fields is missing or invalid."""

    def __init__(self, name: str, field: str, expected: str):
        self.name, self.field, self.expected = name, field, expected
        super().__init__(f"profile {name!r}: field {field!r}: expected {expected}")

    def __reduce__(self):  # crosses process pools (the static sweep) with its fields
        return type(self), (self.name, self.field, self.expected)


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


@dataclass(slots=True, frozen=True)
class Profile:
    name: str
    description: str
    geometry: Geometry
    activation_bytes_per_token: int
    max_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    step_base_s: float
    step_prefill_token_s: float
    step_decode_seq_s: float
    swap_capacity_bytes: int
    host_bandwidth_bytes_per_s: float
    engine: str = "seed"
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
        """Units of the contiguous workspace buffer one step with ``batched_tokens`` needs (0 for the
        vLLM engine: its activations live in the caching allocator, outside the KV blocks)."""
        if not self.activation_bytes_per_token:
            return 0
        return max(1, -(-batched_tokens * self.activation_bytes_per_token // self.geometry.unit_bytes))

    @property
    def swap_capacity_units(self) -> int:
        return self.swap_capacity_bytes // self.geometry.unit_bytes


_FIELDS_INT = ("total_bytes", "weights_bytes", "context_bytes", "unit_tokens", "kv_bytes_per_token",
               "activation_bytes_per_token", "max_batched_tokens", "max_num_seqs", "max_model_len",
               "swap_capacity_bytes")
_FIELDS_FLOAT = ("gpu_memory_utilization", "step_base_s", "step_prefill_token_s", "step_decode_seq_s",
                 "host_bandwidth_bytes_per_s")


def profile_from_dict(name: str, d: dict) -> Profile:
    engine = d.get("engine", "seed")
    if engine not in ENGINES:
        raise ProfileError(name, "engine", f"one of {list(ENGINES)}, got {engine!r}")
    if engine == "vllm":
        return _vllm_profile(name, d)
    if engine == "sglang":
        # an import cycle: the SGLang profile parser builds this module's Profile
        from kvguard.producers.sim.sglang.profile import sglang_profile

        return sglang_profile(name, d, engine)
    for f in _FIELDS_INT + _FIELDS_FLOAT + ("page_class_tokens",):
        if f not in d:
            raise ProfileError(name, f, "present")
    ints = {f: d[f] for f in _FIELDS_INT}
    for f, v in ints.items():
        if not isinstance(v, int) or v <= 0:
            raise ProfileError(name, f, f"a positive integer, got {v!r}")
    unit_tokens = ints["unit_tokens"]
    classes = []
    for t in d["page_class_tokens"]:
        units, rem = divmod(int(t), unit_tokens)
        if rem or units <= 0 or units & (units - 1):
            raise ProfileError(name, "page_class_tokens",
                               f"power-of-two multiples of unit_tokens={unit_tokens}, got {t!r}")
        classes.append(units)
    if not classes:
        raise ProfileError(name, "page_class_tokens", "at least one page class")
    u = float(d["gpu_memory_utilization"])
    if not 0 < u <= 1:
        raise ProfileError(name, "gpu_memory_utilization", f"in (0, 1], got {u}")
    unit_bytes = unit_tokens * ints["kv_bytes_per_token"]
    dynamic_bytes = math.floor(ints["total_bytes"] * u) - ints["weights_bytes"] - ints["context_bytes"]
    if dynamic_bytes < unit_bytes * max(classes):
        raise ProfileError(name, "weights_bytes", "weights + context to leave room for KV pages (D <= 0)")
    geometry = Geometry(
        total_bytes=ints["total_bytes"], weights_bytes=ints["weights_bytes"], context_bytes=ints["context_bytes"],
        gpu_memory_utilization=u, unit_tokens=unit_tokens, kv_bytes_per_token=ints["kv_bytes_per_token"],
        dynamic_units=dynamic_bytes // unit_bytes, page_classes=tuple(sorted(classes)),
        reserved_frac=float(d.get("reserved_frac", 0.05)),
    )
    return Profile(
        name=name, description=str(d.get("description", "")), geometry=geometry,
        activation_bytes_per_token=ints["activation_bytes_per_token"],
        max_batched_tokens=ints["max_batched_tokens"], max_num_seqs=ints["max_num_seqs"],
        max_model_len=ints["max_model_len"], step_base_s=float(d["step_base_s"]),
        step_prefill_token_s=float(d["step_prefill_token_s"]), step_decode_seq_s=float(d["step_decode_seq_s"]),
        swap_capacity_bytes=ints["swap_capacity_bytes"],
        host_bandwidth_bytes_per_s=float(d["host_bandwidth_bytes_per_s"]),
    )


_VLLM_INT = ("total_bytes", "weights_bytes", "context_bytes", "max_batched_tokens", "max_num_seqs", "max_model_len")
_VLLM_FLOAT = ("gpu_memory_utilization", "step_base_s", "step_prefill_token_s", "step_decode_seq_s",
               "host_bandwidth_bytes_per_s")
_VLLM_SECTION = {"block_size": int, "non_torch_increase_bytes": int, "cudagraph_bytes": int,
                 "cublas_workspace_bytes": int, "sampling": str, "cudagraph_mode": str, "allocator_conf": str,
                 "policy": str, "enable_prefix_caching": bool, "scheduler_reserve_full_isl": bool,
                 "watermark": float, "long_prefill_token_threshold": int}


_SECTION_TYPES = {int: "a non-negative integer", bool: "a boolean", str: "a string", float: "a number in [0, 1)"}


def _is(value, kind) -> bool:
    if kind is bool or kind is str:
        return isinstance(value, kind)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return value >= 0 and (kind is not int or isinstance(value, int)) and (kind is not float or value < 1)


def _vllm_spec(name: str, section) -> VllmSpec:
    if not isinstance(section, dict) or not isinstance(section.get("hf_config"), dict):
        raise ProfileError(name, "vllm.hf_config", "a Hugging Face config.json object")
    try:
        shape = ModelShape.from_hf_config(section["hf_config"],
                                          tensor_parallel_size=int(section.get("tensor_parallel_size", 1)))
    except (KeyError, TypeError, ValueError) as e:
        raise ProfileError(name, "vllm.hf_config", f"the Llama-style fields step_memory reads ({e})") from None
    values = {}
    for key, kind in _VLLM_SECTION.items():
        if key in section:
            value = section[key]
            expected = _SECTION_TYPES[kind]
            if not _is(value, kind):
                raise ProfileError(name, f"vllm.{key}", f"{expected}, got {value!r}")
            values[key] = kind(value)
    if values.get("block_size", 16) <= 0:
        raise ProfileError(name, "vllm.block_size", "a positive integer")
    if values.get("sampling", "top_p") not in SAMPLING_MODES:
        raise ProfileError(name, "vllm.sampling", f"one of {list(SAMPLING_MODES)}")
    return VllmSpec(shape=shape, **values)


def _vllm_profile(name: str, d: dict) -> Profile:
    """A vLLM-engine profile: the geometry comes from the measured start-up ledger."""
    for f in _VLLM_INT + _VLLM_FLOAT + ("vllm",):
        if f not in d:
            raise ProfileError(name, f, "present")
    for f in _VLLM_INT:
        if not isinstance(d[f], int) or d[f] <= 0:
            raise ProfileError(name, f, f"a positive integer, got {d[f]!r}")
    u = float(d["gpu_memory_utilization"])
    if not 0 < u <= 1:
        raise ProfileError(name, "gpu_memory_utilization", f"in (0, 1], got {u}")
    spec = _vllm_spec(name, d["vllm"])
    try:  # the scheduler's own checks (batch limits, policy), before anything is sized
        SchedulerConfig(num_gpu_blocks=1 << 40, max_model_len=d["max_model_len"], block_size=spec.block_size,
                        max_num_seqs=d["max_num_seqs"], max_num_batched_tokens=d["max_batched_tokens"],
                        policy=spec.policy, long_prefill_token_threshold=spec.long_prefill_token_threshold)
        RunnerConfig(max_num_batched_tokens=d["max_batched_tokens"], max_num_seqs=d["max_num_seqs"],
                     cudagraph_mode=spec.cudagraph_mode)
        AllocatorConfig.from_string(spec.allocator_conf)
    except ValueError as e:
        raise ProfileError(name, "vllm", f"settings vLLM accepts ({e})") from None
    try:
        ledger = vllm_engine_memory.measure_ledger(
            spec, total_bytes=d["total_bytes"], weights_bytes=d["weights_bytes"], context_bytes=d["context_bytes"],
            gpu_memory_utilization=u, max_num_batched_tokens=d["max_batched_tokens"],
            max_num_seqs=d["max_num_seqs"], max_model_len=d["max_model_len"])
    except vllm_engine_memory.StartupRefused as e:
        raise ProfileError(name, e.field, e.expected) from None
    if "kv_bytes_per_token" in d and d["kv_bytes_per_token"] != ledger.kv_bytes_per_token:
        raise ProfileError(name, "kv_bytes_per_token", f"{ledger.kv_bytes_per_token} (2 x layers x KV heads per "
                           f"rank x head_dim x dtype bytes of vllm.hf_config), got {d['kv_bytes_per_token']!r}")
    geometry = Geometry(
        total_bytes=d["total_bytes"], weights_bytes=d["weights_bytes"], context_bytes=d["context_bytes"],
        gpu_memory_utilization=u, unit_tokens=spec.block_size, kv_bytes_per_token=ledger.kv_bytes_per_token,
        dynamic_units=ledger.num_gpu_blocks - 1, page_classes=(1,), reserved_frac=float(d.get("reserved_frac", 0.05)),
    )
    return Profile(
        name=name, description=str(d.get("description", "")), geometry=geometry, activation_bytes_per_token=0,
        max_batched_tokens=d["max_batched_tokens"], max_num_seqs=d["max_num_seqs"], max_model_len=d["max_model_len"],
        step_base_s=float(d["step_base_s"]), step_prefill_token_s=float(d["step_prefill_token_s"]),
        step_decode_seq_s=float(d["step_decode_seq_s"]), swap_capacity_bytes=0,
        host_bandwidth_bytes_per_s=float(d["host_bandwidth_bytes_per_s"]), engine="vllm", vllm=spec, memory=ledger,
    )


@lru_cache(maxsize=4)
def _load(path: str | None) -> dict:
    if path is None:
        text = resources.files("kvguard.producers.sim").joinpath("profiles.json").read_text()
    else:
        text = Path(path).read_text()
    return json.loads(text)


def default_profile_name(engine: str | None = None) -> str:
    """The catalogue's default profile, or its default for the engine kind ``engine``."""
    data = _load(None)
    if engine is None:
        return data["default"]
    by_engine = data.get("default_by_engine", {})
    if engine not in by_engine:
        raise ProfileError(engine, "engine", f"one of {sorted(by_engine)} (the kinds the catalogue has a default for)")
    return by_engine[engine]


def profile_names(path: str | None = None) -> list[str]:
    return sorted(_load(path)["profiles"])


def prompt_cap_tokens(profile: Profile) -> int | None:
    """The longest prompt a run feeds the engine (``kvguard simulate``, the demo and the ML dataset share
    this rule): the seed engine caps prompts that could never fit one GPU's KV region (said in the
    workload notes); the vLLM engine takes them as they are and rejects those over ``max_model_len``,
    as vLLM does (None)."""
    if profile.engine in ("vllm", "sglang"):
        return None
    return min(profile.max_model_len - 1024, int(profile.capacity_tokens * 0.6))


@dataclass(slots=True, frozen=True)
class EngineKnobs:
    """The start-up settings an operator passes to ``vllm serve`` that change memory or scheduling,
    applied over a vLLM profile (None: the profile's value). A profile with knobs is re-measured:
    its KV block count follows from the profiling run under the new settings, as in vLLM.

    - ``gpu_memory_utilization``: ``--gpu-memory-utilization`` (vLLM default 0.9);
    - ``max_num_batched_tokens`` / ``max_num_seqs``: ``--max-num-batched-tokens`` / ``--max-num-seqs``;
    - ``allocator_conf``: ``PYTORCH_CUDA_ALLOC_CONF`` (e.g. ``expandable_segments:True``);
    - ``watermark``: the share of KV blocks kept free when a waiting request is admitted.
    """

    gpu_memory_utilization: float | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    allocator_conf: str | None = None
    watermark: float | None = None

    def is_default(self) -> bool:
        return all(getattr(self, f) is None for f in self.__slots__)

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__slots__ if getattr(self, f) is not None}

    def label(self) -> str:
        """A short suffix naming the knobs, e.g. ``util0.95+mnbt1024``."""
        short = {"gpu_memory_utilization": "util", "max_num_batched_tokens": "mnbt", "max_num_seqs": "seqs",
                 "allocator_conf": "alloc=", "watermark": "wm"}
        return "+".join(f"{short[k]}{v if v != '' else 'default'}" for k, v in self.to_dict().items())

    def apply(self, name: str, d: dict) -> dict:
        """``d`` (a profile's JSON object) with these knobs set; only vLLM-engine profiles take them."""
        if self.is_default():
            return d
        if d.get("engine", "seed") != "vllm":
            raise ProfileError(name, "engine", f"'vllm' to take engine knobs {self.to_dict()}")
        out = dict(d)
        section = dict(d["vllm"])
        if self.gpu_memory_utilization is not None:
            out["gpu_memory_utilization"] = self.gpu_memory_utilization
        if self.max_num_batched_tokens is not None:
            out["max_batched_tokens"] = self.max_num_batched_tokens
        if self.max_num_seqs is not None:
            out["max_num_seqs"] = self.max_num_seqs
        if self.allocator_conf is not None:
            section["allocator_conf"] = self.allocator_conf
        if self.watermark is not None:
            section["watermark"] = self.watermark
        out["vllm"] = section
        return out


def load_profile(name: str | None = None, path: str | None = None, knobs: EngineKnobs | None = None) -> Profile:
    """The named profile (default: the file's ``default``) from ``profiles.json`` or ``path``, with
    ``knobs`` applied (the profile's name then ends in ``@`` and the knobs' label)."""
    data = _load(path)
    name = name or data["default"]
    if name not in data["profiles"]:
        raise ProfileError(name, "name", f"one of {sorted(data['profiles'])}")
    if knobs is None or knobs.is_default():
        return profile_from_dict(name, data["profiles"][name])
    return profile_from_dict(f"{name}@{knobs.label()}", knobs.apply(name, data["profiles"][name]))
