"""Settings of the caching-allocator twin: ``PYTORCH_CUDA_ALLOC_CONF`` as a frozen value, and the size rules.

The keys, limits and defaults follow PyTorch's ``c10/core/AllocatorConfig.cpp`` (the
``AcceleratorAllocatorConfig`` that ``CUDAAllocatorConfig`` delegates to) and the size constants and
rounding of ``c10/cuda/CUDACachingAllocator.cpp``; see ``caching_allocator.py`` for the commits read.
Unknown keys are skipped, as the real parser does (``skipKey``), so a real setting string always parses.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

K_MIN_BLOCK_SIZE = 512  # every size is rounded to a multiple of 512 bytes
K_SMALL_SIZE = 1 << 20  # largest "small" request: 1 MiB
K_SMALL_BUFFER = 2 << 20  # small requests are packed into 2 MiB segments
K_MIN_LARGE_ALLOC = 10 << 20  # requests between 1 and 10 MiB get a 20 MiB segment
K_LARGE_BUFFER = 20 << 20
K_ROUND_LARGE = 2 << 20  # larger segments are rounded up to 2 MiB
SIZE_MAX = (1 << 64) - 1  # max_split_size when unset: no block is "oversize"
ROUNDUP_INTERVALS = 16  # roundup_power2_divisions has one entry per power of two from 1 MiB to 64 GiB
_MB = 1 << 20

_TOKEN = re.compile(r"\s*([\[\]:,]|[^\[\]:,\s]+)")


class ConfigError(ValueError):
    """A setting string or value PyTorch would reject; the message names the key and the allowed range."""


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


@dataclass(slots=True, frozen=True)
class AllocatorConfig:
    """The allocator settings that change placement, in bytes.

    ``roundup_power2_divisions`` holds one division count per size interval [2^k MiB, 2^(k+1) MiB),
    k = 0..15 (sizes under 2 MiB use entry 0, sizes of 32 GiB and more use entry 15), like the real
    vector; an int means the same count everywhere. ``per_process_memory_fraction`` < 1 caps what the
    allocator may reserve at that fraction of the device total and arms ``garbage_collection_threshold``
    (in PyTorch the collector only runs when a fraction is set).
    """

    max_split_size_bytes: int = SIZE_MAX
    max_non_split_rounding_bytes: int = K_LARGE_BUFFER
    roundup_power2_divisions: tuple[int, ...] | int = (0,) * ROUNDUP_INTERVALS
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    per_process_memory_fraction: float = 1.0

    def __post_init__(self) -> None:
        divisions = self.roundup_power2_divisions
        if isinstance(divisions, int):
            divisions = (divisions,) * ROUNDUP_INTERVALS
        divisions = tuple(int(d) for d in divisions)
        if len(divisions) != ROUNDUP_INTERVALS or any(d != 0 and not _is_power_of_two(d) for d in divisions):
            raise ConfigError(f"roundup_power2_divisions: expected {ROUNDUP_INTERVALS} entries, each 0 or a "
                              f"power of two, got {self.roundup_power2_divisions!r}")
        object.__setattr__(self, "roundup_power2_divisions", divisions)
        if self.max_split_size_bytes != SIZE_MAX and self.max_split_size_bytes < K_LARGE_BUFFER:
            raise ConfigError(f"max_split_size_bytes: must be >= {K_LARGE_BUFFER} (20 MiB) or SIZE_MAX, "
                              f"got {self.max_split_size_bytes}")
        if self.max_non_split_rounding_bytes < K_LARGE_BUFFER:
            raise ConfigError(f"max_non_split_rounding_bytes: must be >= {K_LARGE_BUFFER} (20 MiB), "
                              f"got {self.max_non_split_rounding_bytes}")
        if not 0.0 <= self.garbage_collection_threshold < 1.0:
            raise ConfigError(f"garbage_collection_threshold: expected 0 (off) or a value in (0, 1), "
                              f"got {self.garbage_collection_threshold}")
        if not 0.0 <= self.per_process_memory_fraction <= 1.0:
            raise ConfigError(f"per_process_memory_fraction: expected a value in [0, 1], "
                              f"got {self.per_process_memory_fraction}")

    # ---- the size rules of CUDACachingAllocator.cpp ------------------------------------------
    def divisions_for(self, size: int) -> int:
        """roundup_power2_divisions(size): the entry of the power-of-two interval holding ``size``."""
        log_size = size.bit_length() - 1
        index = log_size - 20 if log_size > 20 else 0
        return self.roundup_power2_divisions[min(index, ROUNDUP_INTERVALS - 1)]

    def round_size(self, size: int) -> int:
        """The block size a request of ``size`` bytes occupies (round_size)."""
        if size < K_MIN_BLOCK_SIZE:
            return K_MIN_BLOCK_SIZE
        divisions = self.divisions_for(size)
        if divisions > 1 and size > K_MIN_BLOCK_SIZE * divisions:
            return roundup_power2_next_division(size, divisions)
        return -(-size // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE

    # ---- the PYTORCH_CUDA_ALLOC_CONF string -------------------------------------------------
    @classmethod
    def from_string(cls, setting: str) -> AllocatorConfig:
        """Parse ``PYTORCH_CUDA_ALLOC_CONF`` syntax, e.g. ``"expandable_segments:True,max_split_size_mb:128"``."""
        tokens = _TOKEN.findall(setting)
        values: dict = {}
        i = 0
        while i < len(tokens):
            key = tokens[i]
            if key == ",":
                i += 1
                continue
            if i + 2 >= len(tokens) or tokens[i + 1] != ":":
                raise ConfigError(f"{setting!r}: expected 'key:value' at {key!r}")
            value, i = _parse_value(tokens, i + 2, setting)
            if key in _KEYS:
                name, convert = _KEYS[key]
                values[name] = convert(value, key)
        return cls(**values)

    def to_string(self) -> str:
        """This config as a ``PYTORCH_CUDA_ALLOC_CONF`` string (only the keys that differ from the default)."""
        parts = []
        if self.max_split_size_bytes != SIZE_MAX:
            parts.append(f"max_split_size_mb:{self.max_split_size_bytes // _MB}")
        if self.max_non_split_rounding_bytes != K_LARGE_BUFFER:
            parts.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding_bytes // _MB}")
        if any(self.roundup_power2_divisions):
            entries = ",".join(f"{1 << k}:{d}" for k, d in enumerate(self.roundup_power2_divisions))
            parts.append(f"roundup_power2_divisions:[{entries}]")
        if self.garbage_collection_threshold:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold}")
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.per_process_memory_fraction != 1.0:
            parts.append(f"per_process_memory_fraction:{self.per_process_memory_fraction}")
        return ",".join(parts)


def roundup_power2_next_division(size: int, divisions: int) -> int:
    """Round ``size`` up to the next of ``divisions`` equal steps between two powers of two."""
    if _is_power_of_two(size):
        return size
    power2_floor = 1 << (size.bit_length() - 1)
    step = power2_floor >> (divisions.bit_length() - 1)
    if step == 0:
        return power2_floor << 1
    floor = size & ~(step - 1)
    return size if floor == size else floor + step


def get_allocation_size(size: int) -> int:
    """The segment size cudaMalloc is asked for when no cached block fits a block of ``size`` bytes."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


def format_size(size: int) -> str:
    """PyTorch's format_size: '512 bytes', '2.50 KiB', '20.00 MiB', '1.25 GiB' (boundaries inclusive)."""
    if size <= 1024:
        return f"{size} bytes"
    if size <= 1 << 20:
        return f"{size / 1024:.2f} KiB"
    if size <= 1 << 30:
        return f"{size / (1 << 20):.2f} MiB"
    return f"{size / (1 << 30):.2f} GiB"


def _parse_value(tokens: list[str], i: int, setting: str):
    if i >= len(tokens):
        raise ConfigError(f"{setting!r}: a key has no value")
    if tokens[i] != "[":
        return tokens[i], i + 1
    items = []
    i += 1
    while i < len(tokens) and tokens[i] != "]":
        if tokens[i] == ",":
            i += 1
            continue
        if i + 2 >= len(tokens) or tokens[i + 1] != ":":
            raise ConfigError(f"{setting!r}: expected 'boundary:value' inside [...] at {tokens[i]!r}")
        items.append((tokens[i], tokens[i + 2]))
        i += 3
    if i >= len(tokens):
        raise ConfigError(f"{setting!r}: missing ']'")
    return items, i + 1


def _to_int(value, key: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected an integer, got {value!r}") from None


def _to_float(value, key: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected a number, got {value!r}") from None


def _to_bool(value, key: str) -> bool:
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ConfigError(f"{key}: expected True or False, got {value!r}")


def _mb(value, key: str) -> int:
    return min(_to_int(value, key), SIZE_MAX // _MB) * _MB


def _divisions(value, key: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        return (_to_int(value, key),) * ROUNDUP_INTERVALS
    divisions = [0] * ROUNDUP_INTERVALS
    first, last_index = True, 0
    for boundary, count in value:
        count = _to_int(count, key)
        if boundary == ">":
            divisions[last_index + 1:] = [count] * (ROUNDUP_INTERVALS - last_index - 1)
            continue
        boundary_mb = _to_int(boundary, key)
        if not _is_power_of_two(boundary_mb):
            raise ConfigError(f"{key}: interval boundaries are powers of two (MiB), got {boundary}")
        index = min(boundary_mb.bit_length() - 1, ROUNDUP_INTERVALS - 1)
        if first:
            divisions[:index] = [count] * index
            first = False
        divisions[index] = count
        last_index = index
    return tuple(divisions)


_KEYS = {
    "max_split_size_mb": ("max_split_size_bytes", _mb),
    "max_non_split_rounding_mb": ("max_non_split_rounding_bytes", _mb),
    "roundup_power2_divisions": ("roundup_power2_divisions", _divisions),
    "garbage_collection_threshold": ("garbage_collection_threshold", _to_float),
    "expandable_segments": ("expandable_segments", _to_bool),
    "per_process_memory_fraction": ("per_process_memory_fraction", _to_float),
}
