"""The vLLM engine's profiles: its JSON section parsed, its ledger measured, the operator's knobs applied.

A vLLM-engine profile's ledger is *measured* the way vLLM measures it: the model config in the
profile's ``vllm`` section sizes a profiling step that runs through the caching-allocator twin, and
the KV block count follows (``producers.sim.vllm.memory``). Such a profile's geometry has one unit
per KV block (``unit_tokens`` = ``block_size``, one page class), and no activation workspace in the
KV pool (``activation_bytes_per_token`` 0: activations live in the caching allocator). Registered
for its engine kind in ``producers.sim.registry``.
"""

from __future__ import annotations

from kvguard.contracts.events import Geometry
from kvguard.producers.sim.model_config import ModelConfigError, UnsupportedArchitecture, load_model_config
from kvguard.producers.sim.profile import EngineKnobs, Profile, ProfileError, VllmSpec
from kvguard.producers.sim.torch_allocator.caching_allocator import AllocatorConfig
from kvguard.producers.sim.vllm import memory as vllm_engine_memory
from kvguard.producers.sim.vllm.scheduler import SchedulerConfig
from kvguard.producers.vllm.step_memory import SAMPLING_MODES, ModelShape, RunnerConfig

_VLLM_INT = ("total_bytes", "weights_bytes", "context_bytes", "max_batched_tokens", "max_num_seqs", "max_model_len")
_VLLM_FLOAT = ("gpu_memory_utilization", "step_base_s", "step_prefill_token_s", "step_decode_seq_s",
               "host_bandwidth_bytes_per_s")
_VLLM_SECTION = {"block_size": int, "non_torch_increase_bytes": int, "cudagraph_bytes": int,
                 "cublas_workspace_bytes": int, "sampling": str, "cudagraph_mode": str, "allocator_conf": str,
                 "policy": str, "enable_prefix_caching": bool, "scheduler_reserve_full_isl": bool,
                 "watermark": float, "long_prefill_token_threshold": int, "model_runner": str, "enforce_eager": bool,
                 "kv_cache_memory_bytes": int, "attention_version": int, "num_sms": int, "attention_lse": str,
                 "num_speculative_tokens": int, "draft_weights_bytes": int, "rejection_chunk_bytes": int,
                 "spec_acceptance_rate": float, "max_num_queued_reqs": int, "max_num_queued_tokens": int,
                 "auto_fit_max_model_len": bool}
_CHOICES = {"model_runner": ("v1", "v2"), "attention_version": (2, 3),
            "attention_lse": ("total_q", "max_seqlen_q", "max_seq_len")}


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
    for key, choices in _CHOICES.items():
        if key in values and values[key] not in choices:
            raise ProfileError(name, f"vllm.{key}", f"one of {list(choices)}, got {values[key]!r}")
    if "draft_hf_config" in section:
        if not values.get("num_speculative_tokens"):
            raise ProfileError(name, "vllm.num_speculative_tokens", "a count with the draft model",
                               "A speculative model was provided, but `num_speculative_tokens` was not provided")
        try:
            values["draft_shape"] = ModelShape.from_hf_config(section["draft_hf_config"],
                                                              tensor_parallel_size=shape.tensor_parallel_size,
                                                              dtype=section.get("draft_dtype"))
        except (KeyError, TypeError, ValueError) as e:
            raise ProfileError(name, "vllm.draft_hf_config",
                               f"the Llama-style fields step_memory reads ({e})") from None
    elif values.get("num_speculative_tokens"):
        raise ProfileError(name, "vllm.draft_hf_config", "a draft model with num_speculative_tokens",
                           "num_speculative_tokens was provided but without speculative model.")
    return VllmSpec(shape=shape, **values)


def vllm_spec_of(name: str, d: dict) -> VllmSpec:
    """The ``vllm`` section of a profile's JSON object as a ``VllmSpec``, without measuring its start-up."""
    if "vllm" not in d:
        raise ProfileError(name, "vllm", "present")
    return _vllm_spec(name, d["vllm"])


def vllm_profile(name: str, d: dict, engine: str) -> Profile:
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
    if spec.num_speculative_tokens and d["max_batched_tokens"] <= spec.num_speculative_tokens:
        raise ProfileError(name, "max_batched_tokens", "more than num_speculative_tokens", (
            "VllmConfig does not have enough slots to schedule a token and support the speculative decoding "
            f"settings. Got max_num_batched_tokens={d['max_batched_tokens']} and "
            f"num_lookahead_tokens={spec.num_speculative_tokens}."))
    try:  # the scheduler's own checks (batch limits, policy), before anything is sized
        SchedulerConfig(num_gpu_blocks=1 << 40, max_model_len=d["max_model_len"], block_size=spec.block_size,
                        max_num_seqs=d["max_num_seqs"], max_num_batched_tokens=d["max_batched_tokens"],
                        policy=spec.policy, long_prefill_token_threshold=spec.long_prefill_token_threshold,
                        num_lookahead_tokens=spec.num_speculative_tokens)
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
        raise ProfileError(name, e.field, e.expected, e.vllm_message) from None
    if "kv_bytes_per_token" in d and d["kv_bytes_per_token"] != ledger.kv_bytes_per_token:
        raise ProfileError(name, "kv_bytes_per_token", f"{ledger.kv_bytes_per_token} (2 x layers x KV heads per "
                           f"rank x head_dim x dtype bytes of vllm.hf_config), got {d['kv_bytes_per_token']!r}")
    if ledger.max_model_len and ledger.max_model_len != d["max_model_len"]:  # --max-model-len -1, fitted
        d = {**d, "max_model_len": ledger.max_model_len}
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
        host_bandwidth_bytes_per_s=float(d["host_bandwidth_bytes_per_s"]), engine=engine, vllm=spec, memory=ledger,
    )


def apply_vllm_knobs(knobs: EngineKnobs, d: dict) -> dict:
    """``d`` (a vLLM profile's JSON object) with ``vllm serve``'s knobs set."""
    out = dict(d)
    section = dict(d["vllm"])
    if knobs.gpu_memory_utilization is not None:
        out["gpu_memory_utilization"] = knobs.gpu_memory_utilization
    if knobs.max_num_batched_tokens is not None:
        out["max_batched_tokens"] = knobs.max_num_batched_tokens
    if knobs.max_num_seqs is not None:
        out["max_num_seqs"] = knobs.max_num_seqs
    if knobs.allocator_conf is not None:
        section["allocator_conf"] = knobs.allocator_conf
    if knobs.watermark is not None:
        section["watermark"] = knobs.watermark
    if knobs.max_model_len is not None:
        out["max_model_len"] = knobs.max_model_len
    for knob, key in (("kv_cache_memory_bytes", "kv_cache_memory_bytes"), ("enforce_eager", "enforce_eager"),
                      ("model_runner", "model_runner"), ("scheduling_policy", "policy"),
                      ("max_num_queued_reqs", "max_num_queued_reqs"),
                      ("max_num_queued_tokens", "max_num_queued_tokens"), ("attention_lse", "attention_lse"),
                      ("num_speculative_tokens", "num_speculative_tokens"),
                      ("rejection_chunk_bytes", "rejection_chunk_bytes"),
                      ("spec_acceptance_rate", "spec_acceptance_rate"),
                      ("scheduler_reserve_full_isl", "scheduler_reserve_full_isl")):
        if getattr(knobs, knob) is not None:
            section[key] = getattr(knobs, knob)
    if knobs.speculative_model_config is not None:
        section.update(draft_section(knobs.speculative_model_config, section))
    out["vllm"] = section
    return out


def draft_section(path: str, section: dict, name: str = "<profile>") -> dict:
    """The ``vllm`` section's draft fields from a draft model's config.json (``--speculative-config``
    ``{"method": "draft_model", "model": ...}``): its shape and weights at the target's TP, after vLLM's
    vocabulary check (``config/speculative.py verify_equal_vocab_size_if_draft_model``)."""
    try:
        draft = load_model_config(path)
    except (ModelConfigError, UnsupportedArchitecture) as e:
        raise ProfileError(name, "speculative_model_config", f"a dense draft model config ({e})") from None
    target_vocab = int(section["hf_config"]["vocab_size"])
    draft_vocab = int(draft.hf_config["vocab_size"])
    if target_vocab != draft_vocab:
        raise ProfileError(name, "speculative_model_config", "a draft with the target's vocabulary", (
            f"Target and draft model should have the same vocabulary size. Target model vocab_size={target_vocab}. "
            f"Draft model vocab_size={draft_vocab}. Using models with different tokenizers can cause out-of-bounds "
            f"errors during speculative decoding."))
    tp = int(section.get("tensor_parallel_size", 1))
    weights = draft.weights_bytes(tensor_parallel_size=tp, dtype=section.get("draft_dtype", "auto"))
    return {"draft_hf_config": draft.hf_config, "draft_weights_bytes": weights}


def vllm_prompt_cap_tokens(profile: Profile) -> int | None:
    """The vLLM engine takes prompts as they come and rejects those over ``max_model_len``, as vLLM's
    input processor does: no cap (None)."""
    return None
