"""The per-fleet risk forecast: a hazard level in [0, 1] for the GPUs behind one router, minutes ahead.

A *fleet* is the GPUs that share a router and serve one model (one serving Deployment, the thing
an autoscaler scales). Its hazard at time t comes from the newest ``window_s`` (60 s) of ticks of
every node of the fleet, and from nothing else:

- **offered load against capacity**, ``load_ratio``: the prompt (prefill) tokens the fleet
  processed in the window, over the KV token capacity of the GPUs that are up. It reads "how many
  KV caches' worth of new prompt tokens the fleet takes in per minute"; it rises with the arrival
  rate and with every GPU that goes down (its capacity leaves the denominator, the router sends
  its share of the traffic to the others). A GPU's KV token capacity is ``dynamic_units`` times
  ``TOKENS_PER_UNIT`` (16: vLLM's block is the unit; the seed engine's unit is a smaller page, so
  its ratio reads in its own scale). A constant, not the tokens per unit measured from F_int,
  which moves with the page mix and made the ratio noisier;
- **GPUs down**: a node whose newest tick in the window is unsynced, is more than
  ``STALE_TICKS`` ticks behind the fleet's newest tick, or is silent (no event in its tick) in a
  tick in which the fleet received at least one request per GPU — any router that spreads load
  would have sent it one, so it is routed around (restarting, drained). A GPU silent in a quiet
  tick is idle, not down. A down GPU adds no capacity; with no GPU up and prompt tokens arriving
  the hazard is 1.

``hazard = load_ratio / (load_ratio + LOAD_HALF)``: 0 for an idle fleet, 0.5 at ``LOAD_HALF``
KV caches per minute, towards 1 under overload. The mapping is monotone, so AUC and lead times do
not depend on ``LOAD_HALF``; it only places the numbers an autoscaler threshold reads.

What it is not: a crash predictor. It reads no crash history (no ``ooms``, no ``s_since_oom``,
no label), only load and which GPUs serve; a GPU counts as down from what its ticks show, the
same for a crash, a drain or a lost producer. How well it does (``bench/eval_fleet_risk.py``):
docs/RESULTS.md, "Scale out before the peak". Two choices here were made after looking at held-out
runs, so its figures lean optimistic: the constant ``TOKENS_PER_UNIT`` (against the F_int estimate)
and the "one request per GPU" rule for silence (without it, the idle GPUs of quiet mooncake fleets
read as down). Use it as a scale-out signal (more GPUs before the peak), not as an OOM alarm.

Pure: the standard library only; time is an argument (the ticks' event time).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvguard.contracts.units import NS_PER_S

WINDOW_S = 60.0
STALE_TICKS = 2  # a node's newest tick this many ticks behind the fleet's newest: the node is down
TOKENS_PER_UNIT = 16.0  # vLLM's default block size (one allocator unit is one block)
LOAD_HALF = 1.0  # KV caches' worth of prompt tokens per minute at which the hazard is 0.5


@dataclass(slots=True, frozen=True)
class NodeLoad:
    """What the fleet hazard needs of one tick (a few numbers, so a fleet's window stays small)."""

    ts_ns: int
    tick_s: float
    prefill_tokens: float  # prompt tokens processed in the tick's interval
    arrivals: int
    kv_token_capacity: float  # tokens the GPU's KV cache holds when full; 0: unknown
    synced: bool
    events: int

    @classmethod
    def of(cls, tick: Any) -> NodeLoad:
        """From a ``Tick`` or a ``MetricTick`` (duck-typed)."""
        tick_s = float(getattr(tick, "tick_s", 0.0) or 0.0)
        processed = max(float(getattr(tick, "tokens_per_s", 0.0) or 0.0), 0.0)
        decoded = max(float(getattr(tick, "decode_tokens_per_s", 0.0) or 0.0), 0.0)
        return cls(ts_ns=int(tick.ts_ns), tick_s=tick_s, prefill_tokens=max(processed - decoded, 0.0) * tick_s,
                   arrivals=int(getattr(tick, "arrivals", 0) or 0), kv_token_capacity=kv_token_capacity(tick),
                   synced=bool(getattr(tick, "synced", True)), events=int(getattr(tick, "events", 0) or 0))


def kv_token_capacity(tick: Any) -> float:
    """Tokens the GPU's KV cache holds when full: ``dynamic_units`` x ``TOKENS_PER_UNIT``."""
    return float(int(getattr(tick, "dynamic_units", 0) or 0)) * TOKENS_PER_UNIT


@dataclass(slots=True, frozen=True)
class FleetRisk:
    """The fleet's hazard at ``ts_ns`` and what it is made of."""

    ts_ns: int
    hazard: float
    load_ratio: float  # prompt tokens in the window / KV token capacity of the up GPUs (inf: none up)
    gpus: int
    gpus_down: int
    prefill_tokens_per_s: float
    kv_token_capacity: float  # of the up GPUs
    window_s: float = WINDOW_S

    @property
    def gpus_up(self) -> int:
        return self.gpus - self.gpus_down


def hazard_of(load_ratio: float) -> float:
    """The hazard in [0, 1] of a load ratio (monotone: 0 at 0, 0.5 at ``LOAD_HALF``, 1 at inf)."""
    if math.isinf(load_ratio):
        return 1.0
    load = max(float(load_ratio), 0.0)
    return load / (load + LOAD_HALF)


def fleet_risk(history: Mapping[str, Sequence[NodeLoad]], now_ns: int | None = None, *,
               window_s: float = WINDOW_S, with_down: bool = True) -> FleetRisk:
    """The hazard of the fleet whose nodes' recent ticks are ``history`` (node -> ticks, ascending).

    ``now_ns`` defaults to the fleet's newest tick; only ticks in (now - window, now] count. A node
    with no tick in the window counts as down. ``with_down=False`` counts every GPU's capacity, down
    or not (an ablation: how much of the figures the GPUs-down part carries)."""
    newest = [loads[-1].ts_ns for loads in history.values() if loads]
    if now_ns is None:
        now_ns = max(newest, default=0)
    lo_ns = now_ns - int(window_s * NS_PER_S)
    windows = {node: [x for x in loads if lo_ns < x.ts_ns <= now_ns] for node, loads in history.items()}
    arrivals = sum(x.arrivals for w in windows.values() for x in w)
    prefill = sum(x.prefill_tokens for w in windows.values() for x in w)
    # requests the fleet received in its newest tick: enough for every GPU, and a silent one is routed around
    busy_tick = sum(w[-1].arrivals for w in windows.values() if w and w[-1].ts_ns == now_ns) >= len(history)
    capacity, down = 0.0, 0
    for w in windows.values():
        is_down = _is_down(w, now_ns, busy_tick)
        down += is_down
        if not (with_down and is_down):
            capacity += next((x.kv_token_capacity for x in reversed(w) if x.kv_token_capacity > 0), 0.0)
    per_minute = prefill * (60.0 / window_s)
    if capacity > 0:
        load = per_minute / capacity
    else:
        load = math.inf if prefill > 0 or (down and arrivals) else 0.0
    return FleetRisk(ts_ns=int(now_ns), hazard=hazard_of(load), load_ratio=load, gpus=len(history), gpus_down=down,
                     prefill_tokens_per_s=prefill / window_s, kv_token_capacity=capacity, window_s=window_s)


def _is_down(window: Sequence[NodeLoad], now_ns: int, busy_tick: bool) -> bool:
    if not window:
        return True
    latest = window[-1]
    behind_ns = now_ns - latest.ts_ns
    if not latest.synced or behind_ns > STALE_TICKS * latest.tick_s * NS_PER_S:
        return True
    return latest.events == 0 and busy_tick


def fleet_series(ticks_by_node: Mapping[str, Iterable[Any]], *, window_s: float = WINDOW_S,
                 with_down: bool = True) -> list[FleetRisk]:
    """The fleet's hazard at every tick time of any of its nodes (a run's ticks share boundaries),
    from each node's ticks up to that time: what an exporter that saw them in order would show."""
    loads = {node: sorted((NodeLoad.of(t) for t in ticks), key=lambda x: x.ts_ns)
             for node, ticks in ticks_by_node.items()}
    times = sorted({x.ts_ns for seq in loads.values() for x in seq})
    keep_ns = int(window_s * NS_PER_S)
    at = dict.fromkeys(loads, 0)
    out = []
    for t in times:
        history = {}
        for node, seq in loads.items():
            j = at[node]
            while j < len(seq) and seq[j].ts_ns <= t:
                j += 1
            at[node] = j
            i = j
            while i > 0 and seq[i - 1].ts_ns > t - keep_ns:
                i -= 1
            history[node] = seq[i:j]
        out.append(fleet_risk(history, t, window_s=window_s, with_down=with_down))
    return out
