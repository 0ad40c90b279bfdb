"""The stream core's configuration: ``StreamConfig`` and its checks, each naming the field it refuses.

Pure; ``kvguard.runtime.mapping.stream_config`` maps the settings onto it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvguard.contracts import pressure
from kvguard.contracts.units import NS_PER_S
from kvguard.streams.alerts import AlertThresholds
from kvguard.streams.predictor import DEFAULT_WINDOW_TICKS
from kvguard.wire.validate import DEFAULT_LIMITS, WireLimits


class StreamConfigError(ValueError):
    def __init__(self, field_name: str, value, expected: str):
        super().__init__(f"stream config field {field_name!r} = {value!r}: expected {expected}")
        self.field_name = field_name


@dataclass(slots=True, frozen=True)
class StreamConfig:
    """Everything the core needs; ``kvguard.runtime.mapping.stream_config`` maps the settings onto it."""

    tick_s: float = 10.0
    slope_window_s: float = 300.0
    alpha: float = pressure.ALPHA
    beta: float = pressure.BETA
    reserved_frac: float | None = None  # None: the geometry's
    thresholds: AlertThresholds = field(default_factory=AlertThresholds)
    max_candidates: int = 32
    window_ticks: int = DEFAULT_WINDOW_TICKS
    max_idle_ticks: int = 360
    # a newer epoch more than this far ahead of the node's is rejected, not taken as a restart;
    # 2^61 lets a seed epoch (0, 1, …) move on to a wall-clock one (time.time_ns())
    max_epoch_jump: int = 1 << 61
    # how far one node's event time may jump past its clock before a second batch confirms it; above
    # the producers' snapshot interval (an idle GPU still sends one a minute) and max_idle_ticks' span
    max_ts_skew_s: float = 3600.0
    # how far an event may run behind its node's clock (its newest event time so far) and still count
    # as in order; further behind, it is applied all the same and counted in the open tick's
    # late_events. None: one tick (an unmarked event then lands at most one tick late)
    max_ts_backwards_s: float | None = None
    max_nodes: int = 10_000  # per-node states held; past it the least recently seen is evicted
    limits: WireLimits = DEFAULT_LIMITS

    def __post_init__(self) -> None:
        if not self.tick_s > 0:
            raise StreamConfigError("tick_s", self.tick_s, "a positive number of seconds")
        if not self.slope_window_s >= self.tick_s:
            raise StreamConfigError("slope_window_s", self.slope_window_s, ">= tick_s")
        if self.reserved_frac is not None and not 0 <= self.reserved_frac < 1:
            raise StreamConfigError("reserved_frac", self.reserved_frac, "a fraction in [0, 1)")
        if self.max_candidates < 0:
            raise StreamConfigError("max_candidates", self.max_candidates, ">= 0")
        if self.window_ticks <= 0:
            raise StreamConfigError("window_ticks", self.window_ticks, "> 0")
        if self.max_idle_ticks <= 0:
            raise StreamConfigError("max_idle_ticks", self.max_idle_ticks, "> 0")
        if self.max_epoch_jump < 1:
            raise StreamConfigError("max_epoch_jump", self.max_epoch_jump, ">= 1")
        if self.max_nodes < 1:
            raise StreamConfigError("max_nodes", self.max_nodes, ">= 1")
        if not self.max_ts_skew_s >= self.tick_s:
            raise StreamConfigError("max_ts_skew_s", self.max_ts_skew_s, ">= tick_s")
        if self.max_ts_backwards_s is not None and not 0 <= self.max_ts_backwards_s <= self.max_ts_skew_s:
            raise StreamConfigError("max_ts_backwards_s", self.max_ts_backwards_s,
                                    "a number of seconds in [0, max_ts_skew_s], or None for one tick")

    @property
    def tick_ns(self) -> int:
        return int(round(self.tick_s * NS_PER_S))

    @property
    def max_ts_skew_ns(self) -> int:
        return int(round(self.max_ts_skew_s * NS_PER_S))

    @property
    def max_ts_backwards_ns(self) -> int:
        if self.max_ts_backwards_s is None:
            return self.tick_ns
        return int(round(self.max_ts_backwards_s * NS_PER_S))
