"""The stream core: event batches in, ticks and alerts out; the same in Faust, embedded and replay.

Pure (numpy + stdlib) and deterministic in event time: the output depends only on the batches
(and their order per node), never on the clock, the batching of the transport or the worker.

Time per node advances only with that node's events. A tick with boundary ``b`` (a multiple of
``tick_s`` since the epoch of ``ts_ns``) is emitted when the node's first event at or after ``b``
arrives; it holds the state after every event before ``b``. Boundaries crossed without events in
between are emitted too (an idle GPU still ticks), up to ``max_idle_ticks`` in a row: a longer
silence skips ahead (counted in ``NodeState.skipped_ticks``). ``flush(now_ns)`` emits the ticks whose
boundary is ≤ ``now_ns`` for nodes whose events stopped.

Batches of one node must come in ``(epoch, seq)`` order: a repeated or older ``seq`` is a redelivery
and is skipped (counted), and so is a batch of an older ``epoch`` (than a confirmed one, below);
a ``seq`` gap marks the mirror unsynced until the next SNAPSHOT with state. A node's first batch
with ``seq == 0`` starts from an empty pool (synced). A newer ``epoch`` is a producer restart (its
simulated or engine clock may start over): the node starts over as if first seen, with a fresh
mirror, tick clock, slope window, feature history and predictor state, its alert timers rebased
(counted in ``NodeState.restarts``).

Hostile or broken input (``process_many``): each node's batches of one call are put in
``(epoch, seq)`` order and redeliveries dropped before anything is applied, so a duplicated batch,
or batches reordered within one call, give the ticks of the clean stream. A batch is rejected,
before any state changes, when it fails ``kvguard.wire.validate``'s checks against the
node's region, or when its epoch jumps more than ``max_epoch_jump`` past the node's (one record
with epoch 2^62 would otherwise make every later batch of the node "older", silencing it for
good). A node's epoch counts as confirmed once a second batch of it arrives: while it is not, a
batch of an older epoch is not a redelivery but a sign the newer one was bogus, and the node
starts over at the older epoch (counted in ``CoreCounters.epochs_retracted``), so a node's first
batch with epoch 2^62 cannot silence it either. A real restart is taken at its first batch.

Event time is bounded the same way: a batch whose event time runs more than ``max_ts_skew_s``
ahead of the node's clock (its newest event so far), or jumps that far inside the batch, is
rejected (a single batch far in the future would otherwise move the tick clock there, and every
later batch would look "in the past" and tick no more); the next batch continuing from the jumped
time confirms it (a GPU idle that long), and is applied. A node whose batches run more than
``max_ts_skew_s`` behind its clock twice in a row had its clock set by a bogus batch (its first,
say): its tick clock starts over at the second (``CoreCounters.clock_rebases``). A batch whose
application raises is rejected too, and its node marked unsynced (its state may be partly
applied; the next SNAPSHOT with state repairs it). Rejections are counted, logged
and listed in ``StreamCore.rejected`` (the latest call's) for the caller's DLQ. Per-node state
is capped at ``max_nodes`` (the least recently seen node is evicted first); idle nodes are
evicted by the caller's clock through ``forget`` (wall time: event time differs per node).
"""

from __future__ import annotations

import io
import json
import logging
from collections import deque
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from kvguard.contracts import pressure
from kvguard.contracts.events import F_PROMPT_LOGPROBS, EventBatch, EventKind, Geometry
from kvguard.contracts.tick import SINCE_OOM_CAP_S, Candidate, Tick
from kvguard.contracts.units import NS_PER_S
from kvguard.streams.alerts import Alert, AlertEvaluator, AlertThresholds, default_rules
from kvguard.streams.metrics import least_squares_slope, percentiles, tick_features
from kvguard.streams.mirror import AllocatorMirror
from kvguard.streams.predictor import DEFAULT_WINDOW_TICKS, FeatureHistory, Predictor, check_predictor
from kvguard.wire.validate import (
    DEFAULT_LIMITS,
    InvalidRecord,
    WireLimits,
    check_events,
    check_geometry,
    check_state,
)

log = logging.getLogger(__name__)
K = EventKind


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

    @property
    def tick_ns(self) -> int:
        return int(round(self.tick_s * NS_PER_S))

    @property
    def max_ts_skew_ns(self) -> int:
        return int(round(self.max_ts_skew_s * NS_PER_S))


_SNAPSHOT = int(K.SNAPSHOT)
_OOM = int(K.OOM)
_INT62 = 1 << 62


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

    @classmethod
    def of(cls, values: list[int]) -> "Counts":
        """From a checkpoint's list; counters added since it was written start at 0."""
        values = [int(x) for x in values]
        return cls(*(values + [0] * (len(cls._fields) - len(values))))

    @classmethod
    def zero(cls) -> "Counts":
        return cls(*([0] * len(cls._fields)))

    def since(self, mark: "Counts") -> "Counts":
        return Counts(*(a - b for a, b in zip(self, mark)))


class NodeState:
    """One GPU in the stream: its mirror, tick clock, interval counters, slope and feature history,
    and its alert rules' state."""

    def __init__(self, node: str, config: StreamConfig, *, with_predictor: bool = False):
        self.node = node
        self.config = config
        self.mirror: AllocatorMirror | None = None
        self.epoch: int | None = None
        self.epoch_confirmed = False  # a second batch of ``epoch`` came: an older epoch is a redelivery
        self.seq: int | None = None
        self.next_boundary_ns: int | None = None
        self.max_ts_ns: int | None = None
        self.slope_points: deque[tuple[int, float]] = deque()
        self.features = FeatureHistory(config.window_ticks)
        self.alerts = AlertEvaluator(default_rules(config.thresholds, with_predictor=with_predictor))
        self._mark = Counts.zero()  # cumulative counters at the last tick
        self.events_since_tick = 0
        self.duplicates = 0
        self.gaps = 0
        self.skipped_ticks = 0
        self.dropped_without_geometry = 0
        self.last_oom_ns: int | None = None  # the node's last OOM event (for ``Tick.s_since_oom``)
        self.resets = 0  # bumped whenever the mirror may have lost events: the predictor's state is stale
        self.restarts = 0  # producer restarts seen (a batch of a newer epoch)
        # the last batch off the node's clock (see the module docstring): its newest event time,
        # its seq and whether it ran ahead (+1, rejected) or behind (-1, applied)
        self.off_clock: OffClock | None = None

    # ---------------------------------------------------------------- batches
    def accept(self, batch: EventBatch, last_seq: int | None = None) -> list[Tick]:
        """Apply one batch; return the ticks whose boundaries it crossed (no predictions yet).
        ``last_seq``: the batch is several contiguous batches merged, ``batch.seq`` the first."""
        if not self._check_sequence(batch):
            return []
        if last_seq is not None and last_seq != batch.seq:
            self.seq = last_seq
            self.epoch_confirmed = True  # the merged batches after the first are of its epoch
        if self.mirror is None:
            self.dropped_without_geometry += 1
            log.warning("node %s: batch seq=%d dropped, no geometry yet", self.node, batch.seq)
            return []
        events = batch.events
        if len(events) == 0:
            return []
        ts = np.maximum.accumulate(events["ts_ns"])
        if self.max_ts_ns is not None:
            ts = np.maximum(ts, self.max_ts_ns)
        if self.next_boundary_ns is None:
            tick_ns = self.config.tick_ns
            self.next_boundary_ns = (int(ts[0]) // tick_ns + 1) * tick_ns
        snap_rows = np.flatnonzero(events["kind"] == _SNAPSHOT)
        last_snap = int(snap_rows[-1]) if snap_rows.size else -1
        ticks: list[Tick] = []
        start = 0
        while start < len(events):
            cut = int(np.searchsorted(ts, self.next_boundary_ns, side="left"))
            if cut >= len(events):
                self._apply(events, start, len(events), batch, last_snap)
                start = len(events)
                break
            self._apply(events, start, cut, batch, last_snap)
            start = cut
            ticks.extend(self._emit_until(int(ts[cut])))
        self.max_ts_ns = int(ts[-1])
        return ticks

    def _apply(self, events: np.ndarray, start: int, stop: int, batch: EventBatch, last_snap: int) -> None:
        if stop <= start:
            return
        state = batch.state if start <= last_snap < stop else None
        self.mirror.apply(events[start:stop], state)
        oom = np.flatnonzero(events["kind"][start:stop] == _OOM)
        if oom.size:
            self.last_oom_ns = int(events["ts_ns"][start + int(oom[-1])])
        self.events_since_tick += stop - start

    def _check_sequence(self, batch: EventBatch) -> bool:
        if self.epoch is not None and batch.epoch > self.epoch:
            self._restart(batch)
        elif self.epoch is not None and batch.epoch < self.epoch and not self.epoch_confirmed:
            self._restart(batch, retracted=True)
        geometry = batch.geometry
        if geometry is not None and (self.mirror is None or self.mirror.geometry != geometry):
            self.mirror = AllocatorMirror(geometry, reserved_frac=self.config.reserved_frac,
                                          alpha=self.config.alpha, beta=self.config.beta)
            self._mark = Counts.zero()
            if not (self.epoch is None and batch.seq == 0):
                self._unsynced(f"node {self.node}: new geometry at epoch {batch.epoch} seq {batch.seq}")
        first = self.epoch is None
        if not first and batch.epoch == self.epoch and batch.seq <= self.seq:
            self.duplicates += 1
            return False
        if not first and batch.epoch < self.epoch:
            self.duplicates += 1
            return False
        if self.mirror is not None:
            if first and batch.seq != 0:
                self._unsynced(f"node {self.node}: first batch seen has seq {batch.seq}")
            elif not first and batch.seq != self.seq + 1:
                self.gaps += 1
                self._unsynced(f"node {self.node}: seq gap {self.seq} -> {batch.seq}")
        self.epoch_confirmed = not first
        self.epoch, self.seq = batch.epoch, batch.seq
        return True

    def _restart(self, batch: EventBatch, *, retracted: bool = False) -> None:
        """A producer restart (a newer epoch): forget everything of the old run except the counters,
        so the batch is handled like the node's first one. The geometry is kept for a restart
        batch without one (a fresh, empty pool then; unsynced unless the batch has ``seq == 0``).
        ``retracted``: the batch's epoch is older than an unconfirmed one, taken as bogus."""
        old_epoch = self.epoch
        geometry = self.mirror.geometry if self.mirror is not None and batch.geometry is None else None
        self.mirror = None if geometry is None else AllocatorMirror(
            geometry, reserved_frac=self.config.reserved_frac, alpha=self.config.alpha, beta=self.config.beta)
        self.epoch = self.seq = None
        self.next_boundary_ns = self.max_ts_ns = None
        self.off_clock = None
        self.slope_points.clear()
        self.features = FeatureHistory(self.config.window_ticks)
        self._mark = Counts.zero()
        self.events_since_tick = 0
        self.last_oom_ns = None
        self._rebase_alert_timers()
        self.restarts += 1
        self.resets += 1  # the predictor forgets the node
        if retracted:
            log.warning("node %s: epoch %s was seen in one batch only and epoch %d goes on (seq %d): "
                        "%s taken as bogus, state starts over", self.node, old_epoch, batch.epoch, batch.seq,
                        old_epoch)
        else:
            log.warning("node %s: producer restart, epoch %s -> %d (seq %d): state starts over",
                        self.node, old_epoch, batch.epoch, batch.seq)

    def rebase_clock(self) -> None:
        """The node's tick clock was set by a bogus event time: it starts over at the next batch
        (the mirror, counters and feature history stay)."""
        log.warning("node %s: event time ran behind the node's clock (%s ns) twice: the tick clock starts over",
                    self.node, self.max_ts_ns)
        self.next_boundary_ns = self.max_ts_ns = None
        self.off_clock = None
        self.slope_points.clear()
        self._rebase_alert_timers()

    def _rebase_alert_timers(self) -> None:
        for rule_state in self.alerts.states.values():  # timers of the old clock; firing stays firing
            rule_state.pending_since = rule_state.clear_since = None

    def _unsynced(self, reason: str) -> None:
        self.mirror.mark_unsynced(reason)
        self.resets += 1

    # ---------------------------------------------------------------- ticks
    def flush(self, now_ns: int) -> list[Tick]:
        """Emit the ticks whose boundary is ≤ ``now_ns`` (for a node whose events stopped)."""
        if self.mirror is None or self.next_boundary_ns is None or now_ns < self.next_boundary_ns:
            return []
        ticks = self._emit_until(now_ns)
        self.max_ts_ns = max(self.max_ts_ns or now_ns, now_ns)
        return ticks

    def _emit_until(self, ts_ns: int) -> list[Tick]:
        """Emit every boundary ≤ ts_ns (an event at exactly a boundary belongs to the next interval)."""
        tick_ns = self.config.tick_ns
        ticks = []
        n_due = (ts_ns - self.next_boundary_ns) // tick_ns + 1
        if n_due > self.config.max_idle_ticks:
            skip = n_due - self.config.max_idle_ticks
            self.skipped_ticks += skip
            self.next_boundary_ns += skip * tick_ns
        while self.next_boundary_ns <= ts_ns:
            ticks.append(self._make_tick(self.next_boundary_ns))
            self.next_boundary_ns += tick_ns
        return ticks

    def _counters(self) -> Counts:
        m = self.mirror
        kc = m.kind_counts
        return Counts(int(kc[K.ARRIVE]), int(kc[K.FINISH]), int(kc[K.ALLOC_FAIL]), int(kc[K.EVICT]),
                      int(kc[K.PREEMPT]), int(kc[K.OOM]), int(m.step_tokens_total), int(m.decode_tokens_total),
                      int(m.evicted_tokens_total), int(m.evicted_requests_total), int(kc[K.ALLOC_RETRY]))

    def _make_tick(self, ts_ns: int) -> Tick:
        cfg = self.config
        m = self.mirror
        g = m.geometry
        pm = m.metrics()
        now = self._counters()
        d = now.since(self._mark)
        self._mark = now
        table = m.request_table()
        holding = table.pages > 0
        p50, p95, p99 = percentiles(table.pages[holding])
        self.slope_points.append((ts_ns, pm.u_kv))
        horizon = ts_ns - int(cfg.slope_window_s * NS_PER_S)
        while self.slope_points and self.slope_points[0][0] <= horizon:
            self.slope_points.popleft()
        pts = np.array(self.slope_points, dtype=np.float64)
        slope = least_squares_slope(pts[:, 0], pts[:, 1])
        total = float(g.total_bytes)
        ub = g.unit_bytes
        events = self.events_since_tick
        self.events_since_tick = 0
        # waiting queue: requests whose last lifecycle event is ARRIVE/PREEMPT and that hold no page
        waiting = int(np.count_nonzero(table.waiting & ~holding))
        # requests asking for prompt logprobs that still have prompt positions to compute (waiting, or
        # running with fewer KV tokens than their prompt): the logits vLLM's profiling run does not count
        held_tokens = table.units * g.unit_tokens
        logprobs = ((table.arrive_flags & F_PROMPT_LOGPROBS) != 0) & (table.waiting | table.running) \
            & (held_tokens < table.prompt_tokens)
        logprob_tokens = int(np.maximum(table.prompt_tokens[logprobs] - held_tokens[logprobs], 0).sum())
        since_oom = SINCE_OOM_CAP_S if self.last_oom_ns is None else min(
            SINCE_OOM_CAP_S, max(0.0, (ts_ns - self.last_oom_ns) / NS_PER_S))
        f_ext, psi = pm.f_ext, pm.psi
        if max(g.page_classes) == 1 and not m.kind_counts[K.WS_ALLOC]:
            # uniform blocks (vLLM): any free block serves any request, so the KV layer has no
            # external fragmentation; the allocator layer's is alloc_f_ext
            f_ext = 0.0
            psi = pressure.psi(pm.live_units, pm.workspace_units, m.units, 0.0, pm.f_int, m.reserved_frac,
                               cfg.alpha, cfg.beta)
        am = m.allocator.metrics()
        tick = Tick(
            node=self.node, ts_ns=ts_ns, epoch=self.epoch or 0, tick_s=cfg.tick_s, synced=m.synced,
            u_kv=pm.u_kv, f_ext=f_ext, f_int=pm.f_int, psi=psi, slope_per_min=slope,
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
            events=events,
            candidates=self._candidates(table, holding), requests_waiting=waiting, s_since_oom=since_oom,
            alloc_reserved_bytes=am.reserved_bytes, alloc_allocated_bytes=am.allocated_bytes,
            alloc_inactive_split_bytes=am.inactive_split_bytes, alloc_largest_free_block_bytes=am.largest_free_block_bytes,
            alloc_f_ext=am.f_ext, alloc_segments=am.segments, alloc_retries=d.alloc_retries,
            util_activation=am.allocated_bytes / total,
            util_reserved_unused=(am.reserved_bytes - am.allocated_bytes) / total, unit_bytes=ub,
            logprob_requests_pending=int(logprobs.sum()), logprob_prompt_tokens_pending=logprob_tokens,
        )
        self.features.push(tick_features(tick))
        if len(table.req) > 4096:
            m.forget_finished()
        return tick

    def _candidates(self, table, holding: np.ndarray) -> list[Candidate]:
        """Up to K requests holding pages: the union of the least recently active, the lowest
        priority (newest first) and the largest exclusive holders, a third of K each, so that
        every selection rule of the policy finds its best victims among them."""
        k = self.config.max_candidates
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
        unit_tokens = self.mirror.geometry.unit_tokens
        return [Candidate(req=int(table.req[r]), priority=int(table.priority[r]), units=int(table.units[r]),
                          pages=int(table.pages[r]), tokens=int(table.units[r]) * unit_tokens,
                          shared_units=int(table.shared_units[r]), prompt_tokens=int(table.prompt_tokens[r]),
                          last_ts_ns=int(table.last_ts_ns[r]))
                for r in rows.tolist()]

    # ---------------------------------------------------------------- persistence
    def to_bytes(self) -> bytes:
        """Compact, self-contained state (npz): the changelog value of the Faust table."""
        header = {
            "node": self.node, "epoch": self.epoch, "epoch_confirmed": self.epoch_confirmed, "seq": self.seq,
            "off_clock": None if self.off_clock is None else list(self.off_clock),
            "next_boundary_ns": self.next_boundary_ns, "max_ts_ns": self.max_ts_ns,
            "slope_points": list(self.slope_points), "features_count": self.features.count,
            "alerts": self.alerts.state_list(), "mark": list(self._mark),
            "events_since_tick": self.events_since_tick, "duplicates": self.duplicates,
            "gaps": self.gaps, "skipped_ticks": self.skipped_ticks,
            "dropped_without_geometry": self.dropped_without_geometry,
            "last_oom_ns": self.last_oom_ns, "resets": self.resets, "restarts": self.restarts,
            "geometry": None if self.mirror is None else self.mirror.geometry.to_dict(),
        }
        arrays = {"header": np.frombuffer(json.dumps(header).encode(), dtype=np.uint8),
                  "features": self.features.buffer}
        if self.mirror is not None:
            arrays.update({f"m_{k}": v for k, v in self.mirror.state_arrays().items()})
        buf = io.BytesIO()
        np.savez_compressed(buf, **arrays)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes, config: StreamConfig, *, with_predictor: bool = False) -> "NodeState":
        with np.load(io.BytesIO(data)) as z:
            arrays = {k: z[k] for k in z.files}
        h = json.loads(arrays["header"].tobytes().decode())
        st = cls(h["node"], config, with_predictor=with_predictor)
        st.epoch, st.seq = h["epoch"], h["seq"]
        st.epoch_confirmed = bool(h.get("epoch_confirmed", True))  # checkpoints of before: as it was
        st.off_clock = None if h.get("off_clock") is None else OffClock(*h["off_clock"])
        st.next_boundary_ns, st.max_ts_ns = h["next_boundary_ns"], h["max_ts_ns"]
        st.slope_points = deque((int(t), float(u)) for t, u in h["slope_points"])
        if arrays["features"].shape == st.features.buffer.shape:
            st.features.buffer[:] = arrays["features"]
            st.features.count = int(h["features_count"])
        st.alerts.load_state_list(h["alerts"])
        st._mark = Counts.of(h["mark"])
        st.events_since_tick = h["events_since_tick"]
        st.duplicates, st.gaps = h["duplicates"], h["gaps"]
        st.skipped_ticks, st.dropped_without_geometry = h["skipped_ticks"], h["dropped_without_geometry"]
        st.last_oom_ns, st.resets = h.get("last_oom_ns"), int(h.get("resets", 0))
        st.restarts = int(h.get("restarts", 0))
        if h["geometry"] is not None:
            st.mirror = AllocatorMirror.from_state_arrays(
                Geometry.from_dict(h["geometry"]),
                {k[2:]: v for k, v in arrays.items() if k.startswith("m_")},
                reserved_frac=config.reserved_frac, alpha=config.alpha, beta=config.beta)
        return st


class OffClock(NamedTuple):
    """A batch whose event time was more than ``max_ts_skew_s`` off its node's clock."""

    ts_ns: int  # its newest event time
    seq: int
    ahead: bool  # True: ahead (rejected); False: behind (applied)


class Rejection(NamedTuple):
    """A batch the core did not apply: ``reason`` is a DLQ reason (``invalid``, ``processing_error``)."""

    batch: EventBatch
    reason: str
    detail: str


@dataclass(slots=True)
class CoreCounters:
    batches_rejected: int = 0  # failed validation against the node's region (before any state change)
    epoch_jumps_rejected: int = 0  # epoch more than max_epoch_jump ahead of the node's
    epochs_retracted: int = 0  # an older epoch went on after one batch of a newer one: that one was bogus
    ts_jumps_rejected: int = 0  # event time more than max_ts_skew_s ahead of the node's clock, unconfirmed
    clock_rebases: int = 0  # a node's clock set by a bogus event time started over
    batches_failed: int = 0  # applying them raised; the node was marked unsynced
    duplicates_dropped: int = 0  # redeliveries dropped before they were applied
    nodes_evicted_cap: int = 0  # the least recently seen node, to stay within max_nodes
    nodes_evicted_idle: int = 0  # idle past the caller's timeout (``forget``)

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


class StreamCore:
    """Per-node stream state for every node it sees; ``process``/``process_many`` return the ticks
    and alerts the batches cause, in order per node. ``rejected`` lists the batches of the latest
    call that were not applied (for the caller's DLQ); ``take_evicted()`` the nodes evicted since
    it was last called (for the caller's own per-node bookkeeping)."""

    def __init__(self, config: StreamConfig | None = None, predictor: Predictor | None = None, *,
                 stateful: bool | None = None):
        """``stateful``: score with the predictor's ``prime``/``step``/``forget`` (one LSTM step per
        node per tick) instead of ``predict`` over full windows; None = whenever the predictor has them."""
        self.config = config or StreamConfig()
        self.predictor = predictor
        has_steps = all(callable(getattr(predictor, name, None)) for name in ("prime", "step", "forget"))
        if stateful and not has_steps:
            raise StreamConfigError("stateful", stateful, "a predictor with prime(), step() and forget()")
        self.stateful = has_steps if stateful is None else bool(stateful)
        # node -> (its NodeState, its resets) when the predictor's state was primed: a NodeState replaced
        # (restored from the changelog, partition moved back) or a reset since then means "prime again"
        self._primed: dict[str, tuple[NodeState, int]] = {}
        if predictor is not None:
            check_predictor(predictor)
            if predictor.window_ticks > self.config.window_ticks:
                raise StreamConfigError("window_ticks", self.config.window_ticks,
                                        f">= the predictor's window_ticks ({predictor.window_ticks})")
        self.nodes: dict[str, NodeState] = {}  # least recently seen first
        self.counters = CoreCounters()
        self.rejected: list[Rejection] = []
        # bounded: a caller that never takes them (a log replay) does not grow it
        self.evicted: deque[str] = deque(maxlen=max(1024, self.config.max_nodes))

    def node_state(self, node: str) -> NodeState:
        """The node's state (new if unknown), now the most recently seen; evicts the least
        recently seen nodes past ``max_nodes``."""
        st = self.nodes.pop(node, None)
        if st is None:
            st = NodeState(node, self.config, with_predictor=self.predictor is not None)
        self.nodes[node] = st
        while len(self.nodes) > self.config.max_nodes:
            self.forget(next(iter(self.nodes)), idle=False)
        return st

    def take_evicted(self) -> list[str]:
        """The nodes evicted (cap or ``forget``) since the last call."""
        evicted = list(self.evicted)
        self.evicted.clear()
        return evicted

    def forget(self, node: str, *, idle: bool = True) -> bool:
        """Drop a node's state (idle: the caller's timeout passed; else the cap). Its next batch
        starts it over (unsynced unless ``seq == 0``). False when the node was not held."""
        st = self.nodes.pop(node, None)
        if st is None:
            return False
        if self._primed.pop(node, None) is not None:
            self.predictor.forget(node)
        if idle:
            self.counters.nodes_evicted_idle += 1
        else:
            self.counters.nodes_evicted_cap += 1
        self.evicted.append(node)
        log.info("node %s: state evicted (%s)", node, "idle" if idle else f"more than {self.config.max_nodes} nodes")
        return True

    def process(self, batch: EventBatch) -> tuple[list[Tick], list[Alert]]:
        return self.process_many([batch])

    def process_many(self, batches: list[EventBatch]) -> tuple[list[Tick], list[Alert]]:
        """Apply batches in order per node; score all new ticks with the predictor in one call; run
        the rules. Contiguous batches of a node (same epoch, consecutive seq, no state before the
        last) are concatenated and applied at once, which gives the same ticks (the core does not
        depend on batching) at a fraction of the per-batch cost. Ticks come grouped by node, nodes
        in order of first appearance.

        A node's batches are first put in ``(epoch, seq)`` order, redeliveries dropped, and those
        that fail validation or jump too far in epoch rejected (``_admit``); a group whose
        application raises is rejected as well. ``self.rejected`` lists what this call rejected."""
        self.rejected = []
        by_node: dict[str, list[EventBatch]] = {}
        for batch in batches:
            by_node.setdefault(batch.node, []).append(batch)
        produced: list[tuple[NodeState, Tick, np.ndarray | None]] = []
        for node, node_batches in by_node.items():
            st = self.node_state(node)
            current = st.mirror.geometry if st.mirror is not None else None
            rebase: set[int] = set()
            for group in _contiguous_groups(self._admit(st, node_batches, rebase), current, rebase):
                if id(group[0]) in rebase:
                    st.rebase_clock()
                try:
                    ticks = self._apply_group(st, group)
                except Exception as err:  # noqa: BLE001 - one node's bad input must not stop the others
                    self._failed(st, group, err)
                    continue
                for i, tick in enumerate(ticks):
                    produced.append((st, tick, self._window(st, len(ticks) - 1 - i)))
        return self._finish(produced)

    def _apply_group(self, st: NodeState, group: list[EventBatch]) -> list[Tick]:
        """Apply contiguous batches as one. Their events are checked against the node's region
        (``check_events``) as one array first; when that fails, batch by batch, so only the bad
        ones are rejected (before any of their rows is applied)."""
        region = group[0].geometry or (st.mirror.geometry if st.mirror is not None else None)
        units = None if region is None else region.dynamic_units
        if len(group) == 1:
            events = group[0].events
        else:
            events = np.concatenate([b.events for b in group])
        try:
            check_events(events, units, self.config.limits)
        except InvalidRecord:
            ticks = []
            for b in group:
                try:
                    check_events(b.events, units, self.config.limits)
                except InvalidRecord as err:
                    self._reject(b, err.detail)
                    continue
                ticks += st.accept(b)
            return ticks
        if len(group) == 1:
            return st.accept(group[0])
        first, last = group[0], group[-1]
        merged = EventBatch(node=st.node, seq=first.seq, epoch=first.epoch, geometry=first.geometry,
                            state=last.state, events=events)
        return st.accept(merged, last_seq=last.seq)

    def _admit(self, st: NodeState, batches: list[EventBatch], rebase: set[int]) -> list[EventBatch]:
        """The node's batches to apply, in ``(epoch, seq)`` order: redeliveries (at or before the
        node's position, repeated within the call, or of an older epoch than a confirmed one) are
        dropped and counted as duplicates; batches whose geometry or state dump is impossible
        (``kvguard.wire.validate``), whose epoch jumps past ``max_epoch_jump`` or whose event time
        jumps past ``max_ts_skew_s`` unconfirmed are rejected (their events are checked per group,
        in ``_apply_group``). ``rebase`` gets the ids of batches before which the node's clock
        starts over. Nothing of the node's state changes here but its off-clock mark."""
        if len(batches) > 1:
            batches = sorted(batches, key=lambda b: (b.epoch, b.seq))
        epoch, seq, confirmed, clock, off = st.epoch, st.seq, st.epoch_confirmed, st.max_ts_ns, st.off_clock
        geometry = st.mirror.geometry if st.mirror is not None else None
        admitted = []
        for b in batches:
            older = epoch is not None and b.epoch < epoch
            if epoch is not None and ((older and confirmed) or (b.epoch == epoch and b.seq <= seq)):
                st.duplicates += 1
                self.counters.duplicates_dropped += 1
                continue
            if epoch is not None and b.epoch - epoch > self.config.max_epoch_jump:
                self.counters.epoch_jumps_rejected += 1
                self._reject(b, f"epoch {b.epoch} is {b.epoch - epoch} past the node's epoch {epoch}, more than "
                                f"streams.max_epoch_jump ({self.config.max_epoch_jump}): not taken as a restart")
                continue
            region = b.geometry or geometry
            try:
                if b.epoch > _INT62 or b.seq > _INT62:
                    raise InvalidRecord(f"epoch/seq: {b.epoch}/{b.seq}, expected at most 2^62")
                if b.geometry is not None:
                    check_geometry(b.geometry, self.config.limits)
                if b.state is not None:
                    check_state(b.state, None if region is None else region.dynamic_units, self.config.limits)
            except InvalidRecord as err:
                self._reject(b, err.detail)
                continue
            if epoch is None or b.epoch != epoch:  # first batch, restart or retraction: a new clock
                clock = off = None
            verdict, newest, off = _clock_verdict(b, clock, off, self.config.max_ts_skew_ns)
            if verdict == "reject":
                self.counters.ts_jumps_rejected += 1
                self._reject(b, f"ts_ns runs to {newest}, more than streams.max_ts_skew_s "
                                f"({self.config.max_ts_skew_s:g} s) past the node's clock ({clock} ns) or its own "
                                "earlier events: a jump of event time, until a later batch going on from it "
                                "confirms it")
                continue
            if verdict == "rebase":
                self.counters.clock_rebases += 1
                rebase.add(id(b))
                clock = None
            if older:
                self.counters.epochs_retracted += 1
            if newest is not None:
                clock = newest if clock is None else max(clock, newest)
            admitted.append(b)
            confirmed = epoch is not None and b.epoch == epoch
            epoch, seq, geometry = b.epoch, b.seq, region
        st.off_clock = off
        return admitted

    def _reject(self, batch: EventBatch, detail: str, reason: str = "invalid") -> None:
        self.counters.batches_rejected += reason == "invalid"
        self.rejected.append(Rejection(batch, reason, detail))
        log.warning("node %s: batch epoch %d seq %d rejected (%s): %s", batch.node, batch.epoch, batch.seq,
                    reason, detail)

    def _failed(self, st: NodeState, group: list[EventBatch], err: Exception) -> None:
        """Applying ``group`` raised: its batches are rejected, the node's state may be partly
        applied, so it is unsynced until its next SNAPSHOT with state."""
        self.counters.batches_failed += len(group)
        detail = f"{type(err).__name__}: {err}"
        log.error("node %s: applying seq %d..%d raised %s", st.node, group[0].seq, group[-1].seq, detail,
                  exc_info=err)
        if st.mirror is not None:
            st._unsynced(f"node {st.node}: applying a batch raised {type(err).__name__}")
        rejected = {id(r.batch) for r in self.rejected}
        for b in group:
            if id(b) not in rejected:
                self._reject(b, detail, reason="processing_error")

    def finish(self) -> tuple[list[Tick], list[Alert]]:
        """The end of the input (a log replayed to its last line): every node with events since its
        last tick gets that interval's tick now, marked ``partial``, so a node's last events (its
        OOM, say) are not lost for want of a later event."""
        produced = []
        for node in sorted(self.nodes):
            st = self.nodes[node]
            if st.events_since_tick == 0 or st.next_boundary_ns is None or st.mirror is None:
                continue
            ticks = [replace(t, partial=True) for t in st.flush(st.next_boundary_ns)]
            for i, tick in enumerate(ticks):
                produced.append((st, tick, self._window(st, len(ticks) - 1 - i)))
        return self._finish(produced)

    def flush(self, now_ns: int) -> tuple[list[Tick], list[Alert]]:
        """Emit due ticks of every node up to ``now_ns`` (event time of the caller's choosing)."""
        produced = []
        for node in sorted(self.nodes):
            st = self.nodes[node]
            ticks = st.flush(now_ns)
            for i, tick in enumerate(ticks):
                produced.append((st, tick, self._window(st, len(ticks) - 1 - i)))
        return self._finish(produced)

    def _window(self, st: NodeState, lag: int):
        """The predictor's input for the tick ``lag`` ticks before the node's newest: its full window
        (``predict``, or ``prime`` for a node without predictor state), else ``("step", features)``."""
        if self.predictor is None:
            return None
        if self.stateful:
            primed = self._primed.get(st.node)
            if primed is not None and primed[0] is st and primed[1] == st.resets:
                return ("step", st.features.window(1, lag)[0])
            if primed is not None:  # lost events (gap, new epoch/geometry) or a restored state: start over
                self.predictor.forget(st.node)
            self._primed[st.node] = (st, st.resets)
            return ("prime", st.features.window(self.predictor.window_ticks, lag))
        return st.features.window(self.predictor.window_ticks, lag)

    def _score_stateful(self, produced) -> tuple[list[float], list]:
        """Prime/step in rounds so each node advances once per call of the predictor, in tick order."""
        p_out: list[float] = [0.0] * len(produced)
        traj_out: list = [None] * len(produced)
        rounds: list[list[int]] = []
        seen: dict[str, int] = {}
        for i, (st, _, _) in enumerate(produced):
            k = seen.get(st.node, 0)
            seen[st.node] = k + 1
            if k == len(rounds):
                rounds.append([])
            rounds[k].append(i)
        for members in rounds:
            for how in ("prime", "step"):
                idx = [i for i in members if produced[i][2][0] == how]
                if not idx:
                    continue
                nodes = [produced[i][0].node for i in idx]
                x = np.stack([produced[i][2][1] for i in idx])
                p, traj = (self.predictor.prime if how == "prime" else self.predictor.step)(nodes, x)
                for j, i in enumerate(idx):
                    p_out[i], traj_out[i] = float(p[j]), traj[j]
        return p_out, traj_out

    def _finish(self, produced) -> tuple[list[Tick], list[Alert]]:
        if self.predictor is not None and produced:
            if self.stateful:
                p_oom, traj = self._score_stateful(produced)
            else:
                p_oom, traj = self.predictor.predict(np.stack([w for _, _, w in produced]))
            produced = [(st, tick.with_prediction(float(p_oom[i]), [float(x) for x in np.asarray(traj[i]).ravel()]), w)
                        for i, (st, tick, w) in enumerate(produced)]
        ticks, alerts = [], []
        for st, tick, _ in produced:
            ticks.append(tick)
            alerts.extend(st.alerts.evaluate(tick))
        return ticks, alerts


def _clock_verdict(batch: EventBatch, clock: int | None, off: OffClock | None,
                   skew_ns: int) -> tuple[str, int | None, OffClock | None]:
    """Where a batch's event time stands against its node's ``clock`` (newest event time so far):
    ``("ok" | "reject" | "rebase", its newest event time, the node's off-clock mark after it)``.
    Ahead by more than ``skew_ns`` (from the clock or inside the batch): rejected, unless it goes
    on from the last rejected batch (a later seq within ``skew_ns`` of its time). Behind by more
    than ``skew_ns``: applied (its times are clamped to the clock), and a second such batch going
    on from the first rebases the clock. Times outside 0..2^62 are left to ``check_events``."""
    ts = batch.events["ts_ns"]
    if len(ts) == 0 or int(ts.min()) < 0 or int(ts.max()) > _INT62:
        return "ok", None, off
    run = np.maximum.accumulate(ts)
    first, newest = int(run[0]), int(run[-1])
    inner = int(np.diff(run).max()) if len(run) > 1 else 0
    goes_on = off is not None and batch.seq > off.seq and abs(first - off.ts_ns) <= skew_ns and inner <= skew_ns
    if inner > skew_ns or (clock is not None and first - clock > skew_ns):
        if off is not None and off.ahead and goes_on:
            return "ok", newest, None
        return "reject", newest, OffClock(newest, batch.seq, True)
    if clock is not None and clock - newest > skew_ns:
        if off is not None and not off.ahead and goes_on:
            return "rebase", newest, None
        return "ok", newest, OffClock(newest, batch.seq, False)
    return "ok", newest, None


def _contiguous_groups(batches: list[EventBatch], geometry: Geometry | None,
                       breaks: set[int] = frozenset()) -> list[list[EventBatch]]:
    """Split one node's batches into runs that can be applied as one: each next batch continues
    the previous (same epoch, seq + 1), brings no new geometry, and no state precedes it.
    A batch whose id is in ``breaks`` starts a run."""
    groups: list[list[EventBatch]] = []
    for b in batches:
        if groups and id(b) not in breaks:
            prev = groups[-1][-1]
            known = (geometry, groups[-1][0].geometry)
            if (b.epoch == prev.epoch and b.seq == prev.seq + 1 and prev.state is None
                    and (b.geometry is None or b.geometry in known)):
                groups[-1].append(b)
                continue
        groups.append([b])
        geometry = b.geometry or geometry
    return groups
