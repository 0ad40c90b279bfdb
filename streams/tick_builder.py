"""Building a ``Tick`` from a node's mirror: its levels at the boundary, the interval's counts and
the victim candidates the policy picks from.

Pure (numpy + stdlib). ``build_tick`` reads the mirror and changes nothing; the node's own
bookkeeping (the interval's mark, the slope window, the feature history) is ``NodeState``'s.

Every tick is inside its wire contract (``kvguard.wire.schemas.MetricTick`` with
``kvguard.wire.validate.check_tick_values``): U_kv, F_ext and F_int are fractions in [0, 1] even
while the mirror is unsynced (its values are best effort then, and the tick says so with
``synced`` False), and Ψ is computed from the fractions the tick carries.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kvguard.contracts import pressure
from kvguard.contracts.events import F_PROMPT_LOGPROBS, EventKind
from kvguard.contracts.tick import SINCE_OOM_CAP_S, Candidate, Tick
from kvguard.contracts.units import NS_PER_S
from kvguard.streams.config import StreamConfig
from kvguard.streams.metrics import percentiles
from kvguard.streams.mirror import AllocatorMirror, RequestTable

K = EventKind


class Counts(NamedTuple):
    """Cumulative event counts of one node's mirror; a tick reports the difference to the last tick's."""

    arrivals: int
    finished: int
    alloc_failures: int
    evicted_pages: int
    preemptions: int
    ooms: int
    step_tokens: int
    decode_tokens: int
    evicted_tokens: int
    evicted_requests: int
    alloc_retries: int
    governed: int = 0  # GOVERN rows: steps the step governor shrank, requests it refused
    never_fits: int = 0  # requests the step governor refused at arrival (Outcome.NEVER_FITS)

    @classmethod
    def of(cls, values: list[int]) -> Counts:
        """From a checkpoint's list; counters added since it was written start at 0."""
        values = [int(x) for x in values]
        return cls(*(values + [0] * (len(cls._fields) - len(values))))

    @classmethod
    def zero(cls) -> Counts:
        return cls(*([0] * len(cls._fields)))

    @classmethod
    def of_mirror(cls, m: AllocatorMirror) -> Counts:
        kc = m.kind_counts
        return cls(int(kc[K.ARRIVE]), int(kc[K.FINISH]), int(kc[K.ALLOC_FAIL]), int(kc[K.EVICT]),
                   int(kc[K.PREEMPT]), int(kc[K.OOM]), int(m.step_tokens_total), int(m.decode_tokens_total),
                   int(m.evicted_tokens_total), int(m.evicted_requests_total), int(kc[K.ALLOC_RETRY]),
                   int(kc[K.GOVERN]), int(m.never_fits_total))

    def since(self, mark: Counts) -> Counts:
        return Counts(*(a - b for a, b in zip(self, mark)))


class Interval(NamedTuple):
    """What the node's bookkeeping knows of the interval ending at the tick."""

    counts: Counts  # event counts in the interval
    events: int  # events applied in it
    slope_per_min: float  # U_kv's least-squares slope over the slope window
    last_oom_ns: int | None  # the node's last OOM before the boundary
    late_events: int = 0  # events applied in it that ran behind the node's clock (``NodeState._late``)


def build_tick(node: str, epoch: int, ts_ns: int, m: AllocatorMirror, table: RequestTable, interval: Interval,
               cfg: StreamConfig, *, synced: bool) -> Tick:
    """The tick at boundary ``ts_ns`` from the mirror's state and the interval's counts."""
    g = m.geometry
    pm = m.metrics()
    d = interval.counts
    holding = table.pages > 0
    p50, p95, p99 = percentiles(table.pages[holding])
    total = float(g.total_bytes)
    ub = g.unit_bytes
    # waiting queue: requests whose last lifecycle event is ARRIVE/PREEMPT and that hold no page
    waiting = int(np.count_nonzero(table.waiting & ~holding))
    # requests asking for prompt logprobs that still have prompt positions to compute (waiting, or
    # running with fewer KV tokens than their prompt): the logits vLLM's profiling run does not count
    held_tokens = table.units * g.unit_tokens
    logprobs = ((table.arrive_flags & F_PROMPT_LOGPROBS) != 0) & (table.waiting | table.running) \
        & (held_tokens < table.prompt_tokens)
    logprob_tokens = int(np.maximum(table.prompt_tokens[logprobs] - held_tokens[logprobs], 0).sum())
    since_oom = SINCE_OOM_CAP_S if interval.last_oom_ns is None else min(
        SINCE_OOM_CAP_S, max(0.0, (ts_ns - interval.last_oom_ns) / NS_PER_S))
    u_kv, f_ext, f_int, psi = _fraction(pm.u_kv), _fraction(pm.f_ext), _fraction(pm.f_int), pm.psi
    if max(g.page_classes) == 1 and not m.kind_counts[K.WS_ALLOC]:
        # uniform blocks (vLLM): any free block serves any request, so the KV layer has no
        # external fragmentation; the allocator layer's is alloc_f_ext
        f_ext = 0.0
    if (f_ext, f_int) != (pm.f_ext, pm.f_int):
        psi = pressure.psi(pm.live_units, pm.workspace_units, m.units, f_ext, f_int, m.reserved_frac,
                           cfg.alpha, cfg.beta)
    am = m.allocator.metrics()
    return Tick(
        node=node, ts_ns=ts_ns, epoch=epoch, tick_s=cfg.tick_s, synced=synced,
        u_kv=u_kv, f_ext=f_ext, f_int=f_int, psi=psi, slope_per_min=interval.slope_per_min,
        live_units=pm.live_units, cached_units=pm.cached_units, retained_units=pm.retained_units,
        workspace_units=pm.workspace_units, free_units=pm.free_units,
        largest_free_run_units=pm.largest_free_run, n_free_runs=pm.n_free_runs,
        dynamic_units=m.units, tokens_stored=pm.tokens_stored,
        util_weights=(g.weights_bytes + g.context_bytes) / total,
        util_kv_live=pm.live_units * ub / total,
        util_kv_cached=(pm.cached_units + pm.retained_units) * ub / total,
        util_workspace=pm.workspace_units * ub / total,
        util_free=pm.free_units * ub / total,
        util_headroom=max(0.0, total - g.weights_bytes - g.context_bytes - m.units * ub) / total,
        util_reserved=m.reserved_frac * m.units * ub / total, reserved_frac=m.reserved_frac,
        pages_per_request_p50=p50, pages_per_request_p95=p95, pages_per_request_p99=p99,
        requests_running=int(table.running.sum()), requests_holding_pages=int(holding.sum()),
        arrivals=d.arrivals, finished=d.finished, alloc_failures=d.alloc_failures,
        alloc_fail_per_s=d.alloc_failures / cfg.tick_s, evicted_pages=d.evicted_pages,
        evicted_requests=d.evicted_requests, evicted_tokens=d.evicted_tokens, preemptions=d.preemptions,
        ooms=d.ooms, tokens_per_s=d.step_tokens / cfg.tick_s, decode_tokens_per_s=d.decode_tokens / cfg.tick_s,
        events=interval.events,
        candidates=candidates(table, holding, cfg.max_candidates, g.unit_tokens), requests_waiting=waiting,
        s_since_oom=since_oom,
        alloc_reserved_bytes=am.reserved_bytes, alloc_allocated_bytes=am.allocated_bytes,
        alloc_inactive_split_bytes=am.inactive_split_bytes, alloc_largest_free_block_bytes=am.largest_free_block_bytes,
        alloc_f_ext=am.f_ext, alloc_segments=am.segments, alloc_retries=d.alloc_retries,
        governed=d.governed, never_fits=d.never_fits,
        util_activation=am.allocated_bytes / total,
        util_reserved_unused=(am.reserved_bytes - am.allocated_bytes) / total, unit_bytes=ub,
        logprob_requests_pending=int(logprobs.sum()), logprob_prompt_tokens_pending=logprob_tokens,
        late_events=interval.late_events, **_endpoint(m),
    )


def _endpoint(m: AllocatorMirror) -> dict:
    """The router series from the newest ADMISSION state row (``req`` -1): cls 0 admits, ``size`` the
    saturation in 1/1000, ``aux`` the delay in ms; nothing when the node wrote none."""
    state = getattr(m, "endpoint_state", None)
    if state is None:
        return {}
    decision, saturation_permille, delay_ms = state
    return {"endpoint_admit": 1 if decision == 0 else 0,
            "endpoint_saturation": min(1.0, max(0.0, saturation_permille / 1000.0)),
            "endpoint_queue_delay_s": max(0.0, delay_ms / 1000.0)}


def _fraction(value: float) -> float:
    """``value`` within [0, 1]. The mirror's fractions leave it only while it is unsynced (a
    missed event can leave more tokens than live slots, or overlapping runs): the tick then says
    ``synced`` False and carries the nearest value inside its contract (``MetricTick``), which
    consumers refuse otherwise."""
    return min(1.0, max(0.0, value))


def candidates(table: RequestTable, holding: np.ndarray, k: int, unit_tokens: int) -> list[Candidate]:
    """Up to ``k`` requests holding pages: the union of the least recently active, the lowest
    priority (newest first) and the largest exclusive holders, a third of ``k`` each, so that
    every selection rule of the policy finds its best victims among them."""
    rows = np.flatnonzero(holding)
    if k == 0 or rows.size == 0:
        return []
    if rows.size > k:
        third = max(1, k // 3)
        lru = rows[np.lexsort((table.req[rows], table.last_ts_ns[rows]))]
        prio = rows[np.lexsort((-table.arrival_ns[rows], table.priority[rows]))]
        big = rows[np.lexsort((table.req[rows], -(table.units[rows] - table.shared_units[rows])))]
        chosen: dict[int, None] = {}
        for ranked in (lru, prio, big):
            for r in ranked[:third].tolist():
                chosen[r] = None
        for r in lru.tolist():
            if len(chosen) >= k:
                break
            chosen[r] = None
        rows = np.array(sorted(chosen), dtype=np.int64)
    rows = rows[np.lexsort((table.req[rows], table.last_ts_ns[rows]))]
    return [Candidate(req=int(table.req[r]), priority=int(table.priority[r]), units=int(table.units[r]),
                      pages=int(table.pages[r]), tokens=int(table.units[r]) * unit_tokens,
                      shared_units=int(table.shared_units[r]), prompt_tokens=int(table.prompt_tokens[r]),
                      last_ts_ns=int(table.last_ts_ns[r]))
            for r in rows.tolist()]
