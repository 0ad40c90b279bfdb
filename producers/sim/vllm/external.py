"""Memory outside vLLM's own accounting that changes after start-up: a neighbour process and a leak.

Two failure classes of ``notes/oom-classes.md`` that no request decides:

- **C4, another process on the GPU** (vllm#55827, vllm#14376, verl/OpenRLHF colocated trainers,
  NovaSky-AI/SkyRL PR#1768): vLLM sizes its budget from whole-device ``cudaMemGetInfo`` at start-up
  (``v1/worker/utils.py request_memory``); memory another process takes later is simply gone from the
  device. ``Neighbour`` is a schedule the user gives (``--neighbour 2GiB:+3GiB/h``): ``start`` bytes
  held before vLLM starts (so its free-memory refusal applies), changing at ``rate`` bytes per second
  afterwards. A neighbour can only take memory that is free on the device: vLLM's cached segments are
  not free to it, so it grows into what vLLM's caching allocator has returned, and vLLM's next segment
  request is the one that fails. Taken in ``NEIGHBOUR_GRANULE`` steps (a process allocates in
  pieces; it also keeps the allocator twin's memoised replays valid between steps).
- **C7, slow growth over hours** (vllm#1262 "within a day ... 99% and crash", vllm#8413, vllm#2345
  "no memory leak when enforce-eager=True", sglang#1132): memory that is allocated and never
  returned. ``Leak`` holds ``bytes_per_s`` of wall time, ``bytes_per_request`` per finished request
  and ``bytes_per_step`` per engine step as blocks of the caching allocator (``LEAK_GRANULE`` each,
  like tensors kept alive by a reference that is never dropped), so they also pin the segments they
  sit in. A restart of the engine process returns all of it (the "restart heals it" pattern).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

MiB, GiB = 1 << 20, 1 << 30
NEIGHBOUR_GRANULE = 20 * MiB
LEAK_GRANULE = 2 * MiB
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 10**6, "mb": 10**6, "mib": MiB,
          "g": 10**9, "gb": 10**9, "gib": GiB, "t": 10**12, "tb": 10**12, "tib": 1 << 40}
_PER = {"s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "hr": 3600.0, "d": 86400.0}
_SIZE = re.compile(r"^\s*([+-]?\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


class ScheduleError(ValueError):
    def __init__(self, flag: str, text: str, expected: str):
        self.flag, self.text, self.expected = flag, text, expected
        super().__init__(f"{flag}: expected {expected}, got {text!r}")


def parse_size(text: str, flag: str = "size") -> int:
    """'2GiB', '512MiB', '1.5GB', '4096' (bytes) -> bytes; a sign is kept."""
    m = _SIZE.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ScheduleError(flag, text, "a size like 2GiB, 512MiB or 1.5GB")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(value):
        raise ScheduleError(flag, text, "a finite size")
    return int(value)


def _rate(text: str, flag: str) -> tuple[float, str]:
    """'+3GiB/h' -> (bytes per unit, unit)."""
    size, sep, unit = text.partition("/")
    if not sep:
        raise ScheduleError(flag, text, "a rate like +3GiB/h, 1GiB/h, 4MiB/req or 1MiB/step")
    return float(parse_size(size, flag)), unit.strip().lower()


@dataclass(frozen=True, slots=True)
class Neighbour:
    start_bytes: int
    rate_bytes_per_s: float = 0.0

    def __post_init__(self) -> None:
        if self.start_bytes < 0:
            raise ScheduleError("--neighbour", str(self.start_bytes), "a size >= 0")

    def bytes_at(self, t_s: float) -> int:
        """What the neighbour wants ``t_s`` seconds after start-up: its start, changed in whole granules."""
        change = self.rate_bytes_per_s * max(0.0, t_s)
        steps = int(change / NEIGHBOUR_GRANULE)  # towards zero: a granule is taken once it is all wanted
        return max(0, self.start_bytes + steps * NEIGHBOUR_GRANULE)

    @classmethod
    def parse(cls, text: str) -> Neighbour:
        """``SIZE[:RATE]``: '2GiB', '2GiB:+3GiB/h', '10GiB:-1GiB/min'."""
        size, _, rate = text.partition(":")
        start = parse_size(size, "--neighbour")
        if not rate:
            return cls(start)
        per_unit, unit = _rate(rate, "--neighbour")
        if unit not in _PER:
            raise ScheduleError("--neighbour", text, "a rate per s, min, h or d (e.g. +3GiB/h)")
        return cls(start, per_unit / _PER[unit])


@dataclass(frozen=True, slots=True)
class Leak:
    bytes_per_s: float = 0.0
    bytes_per_request: int = 0
    bytes_per_step: int = 0

    def __post_init__(self) -> None:
        if min(self.bytes_per_s, self.bytes_per_request, self.bytes_per_step) < 0:
            raise ScheduleError("--leak", repr(self), "a growth rate >= 0 (memory that is never returned)")

    @property
    def active(self) -> bool:
        return bool(self.bytes_per_s or self.bytes_per_request or self.bytes_per_step)

    @classmethod
    def parse(cls, text: str) -> Leak:
        """'1GiB/h', '4MiB/req', '1MiB/step'; several joined by '+', e.g. '1GiB/h+1MiB/req'."""
        per_s = per_req = per_step = 0.0
        for part in text.split("+") if "/" in text else [text]:
            if not part.strip():
                continue
            amount, unit = _rate(part, "--leak")
            if unit in ("req", "request"):
                per_req += amount
            elif unit == "step":
                per_step += amount
            elif unit in _PER:
                per_s += amount / _PER[unit]
            else:
                raise ScheduleError("--leak", text, "a rate per s, min, h, d, req or step")
        return cls(per_s, int(per_req), int(per_step))
