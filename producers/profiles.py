"""Model/GPU profiles: the data in ``profiles.json`` as typed values.

A profile fixes one GPU's memory ledger (-> ``Geometry``), its scheduler limits and the step-time
model ``step_s = a + b*prefill_tokens + c*decode_seqs``. Numbers and their sources live in the JSON,
so a new model or GPU is a data change, not a code change.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

from kvguard.contracts.events import Geometry


class ProfileError(ValueError):
    """A profile is unknown or one of its fields is missing or invalid."""

    def __init__(self, name: str, field: str, expected: str):
        self.name, self.field, self.expected = name, field, expected
        super().__init__(f"profile {name!r}: field {field!r}: expected {expected}")


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

    @property
    def unit_tokens(self) -> int:
        return self.geometry.unit_tokens

    @property
    def capacity_tokens(self) -> int:
        return self.geometry.dynamic_units * self.geometry.unit_tokens

    def step_seconds(self, prefill_tokens: int, decode_seqs: int) -> float:
        return self.step_base_s + self.step_prefill_token_s * prefill_tokens + self.step_decode_seq_s * decode_seqs

    def workspace_units(self, batched_tokens: int) -> int:
        """Units of the contiguous workspace buffer one step with ``batched_tokens`` needs."""
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


@lru_cache(maxsize=4)
def _load(path: str | None) -> dict:
    if path is None:
        text = resources.files("kvguard.producers").joinpath("profiles.json").read_text()
    else:
        text = Path(path).read_text()
    return json.loads(text)


def default_profile_name() -> str:
    return _load(None)["default"]


def profile_names(path: str | None = None) -> list[str]:
    return sorted(_load(path)["profiles"])


def load_profile(name: str | None = None, path: str | None = None) -> Profile:
    """The named profile (default: the file's ``default``) from ``profiles.json`` or ``path``."""
    data = _load(path)
    name = name or data["default"]
    if name not in data["profiles"]:
        raise ProfileError(name, "name", f"one of {sorted(data['profiles'])}")
    return profile_from_dict(name, data["profiles"][name])
