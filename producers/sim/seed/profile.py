"""The seed engine's profiles: a ledger the JSON states directly, two page classes, a workspace in the pool.

Registered for its engine kind in ``producers.sim.registry`` (the only module that imports this
quarantined room).
"""

from __future__ import annotations

import math

from kvguard.contracts.events import Geometry
from kvguard.producers.sim.profile import Profile, ProfileError

_FIELDS_INT = ("total_bytes", "weights_bytes", "context_bytes", "unit_tokens", "kv_bytes_per_token",
               "activation_bytes_per_token", "max_batched_tokens", "max_num_seqs", "max_model_len",
               "swap_capacity_bytes")
_FIELDS_FLOAT = ("gpu_memory_utilization", "step_base_s", "step_prefill_token_s", "step_decode_seq_s",
                 "host_bandwidth_bytes_per_s")


def seed_profile(name: str, d: dict, engine: str) -> Profile:
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
        host_bandwidth_bytes_per_s=float(d["host_bandwidth_bytes_per_s"]), engine=engine,
    )


def seed_prompt_cap_tokens(profile: Profile) -> int | None:
    """The seed engine caps prompts that could never fit one GPU's KV region (the workload notes say so)."""
    return min(profile.max_model_len - 1024, int(profile.capacity_tokens * 0.6))
