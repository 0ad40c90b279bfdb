"""A policy guard that restarts a leaking GPU before its growth OOM: drain, finish, restart.

Class C7 of ``notes/oom-classes.md`` (memory that grows over hours until a crash; vllm#1262 "within
a day ... 99% and crash", vllm#8413, sglang#1132) is "healed" by a restart: the threads' users
restart the server by hand, after the crash. This guard does it before, at a moment it picks:

1. **arm**: the tier-3 trend model says P(OOM within 5 min) >= ``p_threshold`` on ``confirm_ticks``
   ticks in a row, and what grows is the engine's own memory (the allocator's reserved share outside
   the KV pool, ``util_activation + util_reserved_unused``, rose by at least ``min_growth`` over the
   last ``growth_window_s``): a restart returns a leak, not a neighbour's memory (C4, where a restart
   may even be refused by vLLM's free-memory check), so a neighbour does not arm it;
2. **drain**: the node leaves the router (as a drained pod fails its readiness probe), at most
   ``max_draining`` nodes at once so the fleet keeps its capacity, and never a node that came up less
   than ``min_up_s`` ago (it holds no leak yet); with a ``capacity`` it waits until the growth line
   reaches it within ``drain_tte_s`` (each restart as late as is safe: fewer restarts);
3. **restart**: once the node's tick shows nothing running and nothing waiting (the engine checks
   again and refuses otherwise: no request is lost), the worker restarts; the node is back on the
   router when it is up. A drain that has not emptied after ``drain_timeout_s`` is given up (the
   node goes back on the router; counted) and not tried again for as long.

Self-contained: per-node state in ``NodeDrain``, counters in ``DrainCounters``, decisions as
``DrainAction`` values the caller applies (the simulator's ``VllmEngine.draining`` /
``planned_restart``; a deployment's router and process manager). Pure: the standard library.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field

from kvguard.contracts.tick import Tick
from kvguard.contracts.units import NS_PER_S

DRAIN, RESTART, UNDRAIN = "drain", "restart", "undrain"
IDLE, DRAINING, RESTARTING = "idle", "draining", "restarting"


@dataclass(slots=True, frozen=True)
class DrainRestartConfig:
    p_threshold: float = 0.5  # the shipped trend model's calibrated threshold (its metadata)
    confirm_ticks: int = 3
    min_growth: float = 0.005  # rise of the reserved share outside the KV pool over growth_window_s
    growth_window_s: float = 900.0
    max_draining: int = 1
    min_up_s: float = 600.0
    drain_timeout_s: float = 600.0
    # the restart's moment: with ``capacity`` (the reserved share outside KV at which growth OOMs happen,
    # ``kvguard.ml.trend_eval.exhaustion_level``) the drain waits until the least-squares line through the
    # growth window reaches it within ``drain_tte_s`` (enough to drain and restart); None: drain at once
    capacity: float | None = None
    drain_tte_s: float = 180.0

    def __post_init__(self) -> None:
        if not 0.0 < self.p_threshold <= 1.0:
            raise ValueError(f"p_threshold: expected a probability in (0, 1], got {self.p_threshold}")
        if self.confirm_ticks < 1 or self.max_draining < 1:
            raise ValueError("confirm_ticks and max_draining: expected >= 1")


@dataclass(slots=True, frozen=True)
class DrainAction:
    kind: str  # DRAIN, RESTART, UNDRAIN
    node: str
    ts_ns: int
    reason: str


@dataclass(slots=True)
class NodeDrain:
    state: str = IDLE
    since_ns: int = 0
    hot_ticks: int = 0
    up_since_ns: int = 0
    retry_after_ns: int = 0  # after a drain given up: no new drain before this
    reserved: deque = field(default_factory=deque)  # (ts_ns, non-KV reserved share of M)


@dataclass(slots=True)
class DrainCounters:
    armed: int = 0
    drains: int = 0
    restarts: int = 0
    restart_refused: int = 0  # the tick said drained, the engine did not (a request still there)
    given_up: int = 0
    held_by_fleet: int = 0  # armed while max_draining nodes were already out
    not_growth: int = 0  # P(OOM) high but the engine's own memory is not growing (no restart helps)
    not_yet: int = 0  # armed, but the growth line reaches the capacity later than drain_tte_s

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def _time_to(points, capacity: float) -> float:
    """Seconds until the least-squares line through ``points`` (ts_ns, value) reaches ``capacity``
    (inf when it is not rising; 0 when it is there)."""
    n = len(points)
    if n < 3:
        return float("inf")
    ts = [t / NS_PER_S for t, _ in points]
    ys = [v for _, v in points]
    tm, ym = sum(ts) / n, sum(ys) / n
    sxx = sum((t - tm) ** 2 for t in ts)
    if sxx <= 0:
        return float("inf")
    b = sum((t - tm) * (y - ym) for t, y in zip(ts, ys)) / sxx
    now = ym + b * (ts[-1] - tm)
    if now >= capacity:
        return 0.0
    return (capacity - now) / b if b > 0 else float("inf")


class DrainRestartGuard:
    """Per-node drain-and-restart decisions from ticks (``observe``) and the caller's outcome of a
    restart (``restarted``)."""

    name = "drain_restart"

    def __init__(self, config: DrainRestartConfig = DrainRestartConfig()):
        self.config = config
        self.nodes: dict[str, NodeDrain] = {}
        self.counters = DrainCounters()

    def state(self, node: str) -> str:
        return self.nodes[node].state if node in self.nodes else IDLE

    def _growth(self, st: NodeDrain, tick: Tick) -> float:
        window_ns = int(self.config.growth_window_s * NS_PER_S)
        st.reserved.append((tick.ts_ns, tick.util_activation + tick.util_reserved_unused))
        while st.reserved and st.reserved[0][0] < tick.ts_ns - window_ns:
            st.reserved.popleft()
        return st.reserved[-1][1] - min(v for _, v in st.reserved)

    def observe(self, tick: Tick) -> list[DrainAction]:
        """The actions this tick calls for (at most one, for the tick's node)."""
        cfg = self.config
        st = self.nodes.setdefault(tick.node, NodeDrain(up_since_ns=tick.ts_ns))
        if tick.ooms:  # it crashed anyway: its memory is new again
            st.reserved.clear()
            st.up_since_ns = tick.ts_ns
            st.hot_ticks = 0
            if st.state == DRAINING:
                st.state = IDLE
                return [DrainAction(UNDRAIN, tick.node, tick.ts_ns, "crashed while draining")]
        growth = self._growth(st, tick)
        if st.state == RESTARTING:
            if tick.requests_running or tick.u_kv or tick.arrivals:  # serving again
                st.state, st.up_since_ns, st.hot_ticks = IDLE, tick.ts_ns, 0
                st.reserved.clear()
            return []
        if st.state == DRAINING:
            if tick.requests_running == 0 and tick.requests_waiting == 0:
                return [DrainAction(RESTART, tick.node, tick.ts_ns, "drained")]
            if tick.ts_ns - st.since_ns >= cfg.drain_timeout_s * NS_PER_S:
                st.state, st.hot_ticks = IDLE, 0
                st.retry_after_ns = tick.ts_ns + int(cfg.drain_timeout_s * NS_PER_S)
                self.counters.given_up += 1
                return [DrainAction(UNDRAIN, tick.node, tick.ts_ns, f"not drained in {cfg.drain_timeout_s:g} s")]
            return []
        p = tick.p_oom
        st.hot_ticks = st.hot_ticks + 1 if p is not None and p >= cfg.p_threshold else 0
        if st.hot_ticks < cfg.confirm_ticks:
            return []
        if tick.ts_ns - st.up_since_ns < cfg.min_up_s * NS_PER_S or tick.ts_ns < st.retry_after_ns:
            return []
        if growth < cfg.min_growth:
            self.counters.not_growth += 1
            return []
        if cfg.capacity is not None:
            tte = _time_to(st.reserved, cfg.capacity)
            if tte > cfg.drain_tte_s:
                self.counters.not_yet += 1
                return []
        self.counters.armed += 1
        if sum(1 for s in self.nodes.values() if s.state in (DRAINING, RESTARTING)) >= cfg.max_draining:
            self.counters.held_by_fleet += 1
            return []
        st.state, st.since_ns = DRAINING, tick.ts_ns
        self.counters.drains += 1
        return [DrainAction(DRAIN, tick.node, tick.ts_ns,
                            f"P(OOM in 5 min) {p:.2f} >= {cfg.p_threshold:.2f}, reserved outside KV +{growth:.3f} of M "
                            f"in {cfg.growth_window_s:g} s")]

    def restarted(self, node: str, ts_ns: int, ok: bool) -> None:
        """The caller's outcome of a RESTART action."""
        st = self.nodes[node]
        if ok:
            st.state, st.since_ns = RESTARTING, ts_ns
            st.reserved.clear()
            self.counters.restarts += 1
        else:
            self.counters.restart_refused += 1

    def forget(self, node: str) -> None:
        self.nodes.pop(node, None)
