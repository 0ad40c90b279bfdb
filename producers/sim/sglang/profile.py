"""The SGLang engine's profiles: the ``sglang`` section of a ``profiles.json`` object, its pool sized.

A profile with ``"engine": "sglang"`` has the device ledger (``total_bytes``, ``weights_bytes``,
``context_bytes``), the step-time model, and an ``sglang`` section with the model's Hugging Face
config and ``sglang.launch_server``'s flags that size memory or scheduling (their names without the
dashes): ``mem_fraction_static`` (absent: SGLang's default for the device), ``page_size``,
``max_running_requests``, ``max_total_tokens``, ``chunked_prefill_size`` (-1: off; absent: SGLang's
default for the device), ``max_prefill_tokens``, ``schedule_conservativeness``, ``context_length``,
and ``cuda_graph_reserve_mb`` (only to derive the default ``mem_fraction_static``). The pool is
sized as SGLang sizes it (``producers.sim.sglang.memory``); the geometry has one unit per page.

The functions here take the signatures of the engine registry's entries
(``producers.sim.registry``): ``sglang_profile(name, d, engine)`` and ``sglang_prompt_cap_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvguard.contracts.events import Geometry
from kvguard.producers.sim.profile import Profile, ProfileError
from kvguard.producers.sim.sglang import memory
from kvguard.producers.sim.sglang.scheduler import SchedulerConfig
from kvguard.producers.vllm.step_memory import ModelShape

_INT = ("total_bytes", "weights_bytes", "context_bytes")
_FLOAT = ("step_base_s", "step_prefill_token_s", "step_decode_seq_s")
_SECTION = {"page_size": int, "max_running_requests": int, "max_total_tokens": int, "chunked_prefill_size": int,
            "max_prefill_tokens": int, "context_length": int, "mem_fraction_static": float,
            "schedule_conservativeness": float, "cuda_graph_reserve_mb": float, "tensor_parallel_size": int}


@dataclass(slots=True, frozen=True)
class SglangSpec:
    """The ``sglang`` section, resolved (SGLang 0.5.23 flag names in the comments)."""

    shape: ModelShape
    page_size: int  # --page-size (1 on CUDA by default)
    max_total_num_tokens: int  # the sized pool
    max_running_requests: int  # --max-running-requests, or the derived default
    chunked_prefill_size: int | None  # --chunked-prefill-size (None: -1, off)
    max_prefill_tokens: int  # --max-prefill-tokens (16384)
    schedule_conservativeness: float  # --schedule-conservativeness (1.0)
    context_len: int  # --context-length, or the model's max_position_embeddings

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(max_total_num_tokens=self.max_total_num_tokens, page_size=self.page_size,
                               max_running_requests=self.max_running_requests,
                               max_prefill_tokens=self.max_prefill_tokens,
                               chunked_prefill_size=self.chunked_prefill_size,
                               schedule_conservativeness=self.schedule_conservativeness, context_len=self.context_len)


def _profile_error(name: str, field: str, expected: str) -> ProfileError:
    return ProfileError(name, field, expected)


def _section(name: str, section) -> dict:
    if not isinstance(section, dict) or not isinstance(section.get("hf_config"), dict):
        raise _profile_error(name, "sglang.hf_config", "a Hugging Face config.json object")
    values = {}
    for key, kind in _SECTION.items():
        if key not in section:
            continue
        value = section[key]
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or isinstance(value, int))
        if not ok or (value <= 0 and not (key == "chunked_prefill_size" and value == -1)):
            raise _profile_error(name, f"sglang.{key}", f"a positive {'integer' if kind is int else 'number'}, "
                                                         f"got {value!r}")
        values[key] = kind(value)
    return values


def sglang_profile(name: str, d: dict, engine: str = "sglang"):
    """A profile whose KV pool SGLang's start-up sizes (``ProfileError`` names a bad field)."""
    for f in _INT + _FLOAT + ("sglang",):
        if f not in d:
            raise _profile_error(name, f, "present")
    for f in _INT:
        if not isinstance(d[f], int) or d[f] <= 0:
            raise _profile_error(name, f, f"a positive integer, got {d[f]!r}")
    section = d["sglang"]
    values = _section(name, section)
    try:
        shape = ModelShape.from_hf_config(section["hf_config"], tensor_parallel_size=values.get("tensor_parallel_size", 1))
    except (KeyError, TypeError, ValueError) as e:
        raise _profile_error(name, "sglang.hf_config", f"the Llama-style fields of a config.json ({e})") from None
    page = values.get("page_size", 1)
    context_len = values.get("context_length", int(section["hf_config"].get("max_position_embeddings", 32768)))
    chunk = values.get("chunked_prefill_size", "auto")
    try:
        ledger = memory.size_pool(shape, total_bytes=d["total_bytes"], weights_bytes=d["weights_bytes"],
                                  context_bytes=d["context_bytes"], page_size=page, context_len=context_len,
                                  mem_fraction_static=values.get("mem_fraction_static"),
                                  max_total_tokens=values.get("max_total_tokens"),
                                  max_running_requests=values.get("max_running_requests"),
                                  chunked_prefill_size=None if chunk == -1 else chunk,
                                  cuda_graph_reserve_mb=values.get("cuda_graph_reserve_mb", 0.0))
        spec = SglangSpec(shape=shape, page_size=page, max_total_num_tokens=ledger.max_total_num_tokens,
                          max_running_requests=ledger.max_running_requests,
                          chunked_prefill_size=ledger.chunked_prefill_size,
                          max_prefill_tokens=values.get("max_prefill_tokens", 16384),
                          schedule_conservativeness=values.get("schedule_conservativeness", 1.0),
                          context_len=context_len)
        spec.scheduler_config()
    except memory.StartupRefused as e:
        raise _profile_error(name, e.field, e.expected) from None
    except ValueError as e:
        raise _profile_error(name, "sglang", f"settings SGLang accepts ({e})") from None
    kv_bytes_per_token = ledger.cell_bytes
    geometry = Geometry(
        total_bytes=d["total_bytes"], weights_bytes=d["weights_bytes"], context_bytes=d["context_bytes"],
        gpu_memory_utilization=ledger.mem_fraction_static, unit_tokens=page, kv_bytes_per_token=kv_bytes_per_token,
        dynamic_units=ledger.max_total_num_tokens // page, page_classes=(1,),
        reserved_frac=float(d.get("reserved_frac", 0.05)))
    return Profile(
        name=name, description=str(d.get("description", "")), geometry=geometry, activation_bytes_per_token=0,
        max_batched_tokens=ledger.chunked_prefill_size or spec.max_prefill_tokens,
        max_num_seqs=ledger.max_running_requests, max_model_len=context_len,
        step_base_s=float(d["step_base_s"]), step_prefill_token_s=float(d["step_prefill_token_s"]),
        step_decode_seq_s=float(d["step_decode_seq_s"]), swap_capacity_bytes=0,
        host_bandwidth_bytes_per_s=float(d.get("host_bandwidth_bytes_per_s", 25e9)), engine=engine, memory=ledger,
        sglang=spec)


def sglang_prompt_cap_tokens(profile) -> int | None:
    """SGLang refuses prompts of ``max_req_input_len`` tokens or more at arrival: no cap (None)."""
    return None
