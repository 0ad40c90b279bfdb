"""One GPU in the stream: its mirror, sequence and epoch, tick clock, interval bookkeeping and
alert state, and its checkpoint bytes.

Pure (numpy + stdlib). Time per node advances only with that node's events. A tick with boundary
``b`` (a multiple of ``tick_s`` since the epoch of ``ts_ns``) is emitted when the node's first event
at or after ``b`` arrives; it holds the state after every event before ``b``. Boundaries crossed
without events in between are emitted too (an idle GPU still ticks), up to ``max_idle_ticks`` in a
row: a longer silence skips ahead (counted in ``NodeState.skipped_ticks``). ``flush(now_ns)`` emits
the ticks whose boundary is ≤ ``now_ns`` for a node whose events stopped.

Batches of one node come in ``(epoch, seq)`` order (``streams.admission`` puts them so): a repeated
or older ``seq`` is a redelivery and is skipped (counted), and so is a batch of an older ``epoch``
than a confirmed one; a ``seq`` gap marks the mirror unsynced until the next SNAPSHOT with state.
A node's first batch with ``seq == 0`` starts from an empty pool (synced). A newer ``epoch`` is a
producer restart (its simulated or engine clock may start over): the node starts over as if first
seen, with a fresh mirror, tick clock, slope window, feature history and predictor state, its alert
timers rebased (counted in ``NodeState.restarts``). An older epoch than an unconfirmed one (seen in
one batch only) retracts it: the node starts over at the older epoch.

Event time never goes back on the node's clock: an event older than the newest one before it is
applied in its seq order, in the interval the clock is in. One more than ``max_ts_backwards_s``
behind (default: one tick) is marked rather than dead-lettered: it is counted in that tick's
``late_events`` (and ``NodeState.late_events``) and logged, because dropping its batch would leave
a gap in the mirror, whose state is a fold over every batch. A batch far behind the clock twice in
a row rebases the clock instead (``streams.admission``).
"""

from __future__ import annotations

import io
import json
import logging
from collections import deque

import numpy as np

from kvguard.contracts.events import EventBatch, EventKind, Geometry
from kvguard.contracts.tick import Tick
from kvguard.contracts.units import NS_PER_S
from kvguard.streams.admission import OffClock
from kvguard.streams.alerts import AlertEvaluator, default_rules
from kvguard.streams.config import StreamConfig
from kvguard.streams.metrics import least_squares_slope, tick_features
from kvguard.streams.mirror import AllocatorMirror
from kvguard.streams.predictor import FeatureHistory
from kvguard.streams.scoring import TickWindow
from kvguard.streams.tick_builder import Counts, Interval, build_tick

log = logging.getLogger(__name__)

_SNAPSHOT = int(EventKind.SNAPSHOT)
_OOM = int(EventKind.OOM)


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
        # the predictor's window of each tick made since the core last took them (``take_windows``),
        # taken when the tick is made: later ticks of the same call overwrite the ring buffer
        self.score_window_ticks = config.window_ticks if with_predictor else 0
        self.windows: list[TickWindow] = []
        self.alerts = AlertEvaluator(default_rules(config.thresholds, with_predictor=with_predictor))
        self._mark = Counts.zero()  # cumulative counters at the last tick
        self.events_since_tick = 0
        self.late_since_tick = 0  # events of the open interval that ran behind the clock (``_late``)
        self.late_events = 0  # all such events of the node
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
        late = self._late(events["ts_ns"], ts, batch)
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
                self._apply(events, start, len(events), batch, last_snap, late)
                start = len(events)
                break
            self._apply(events, start, cut, batch, last_snap, late)
            start = cut
            ticks.extend(self._emit_until(int(ts[cut])))
        self.max_ts_ns = int(ts[-1])
        return ticks

    def _apply(self, events: np.ndarray, start: int, stop: int, batch: EventBatch, last_snap: int,
               late: np.ndarray | None) -> None:
        if stop <= start:
            return
        state = batch.state if start <= last_snap < stop else None
        self.mirror.apply(events[start:stop], state)
        oom = np.flatnonzero(events["kind"][start:stop] == _OOM)
        if oom.size:
            self.last_oom_ns = int(events["ts_ns"][start + int(oom[-1])])
        self.events_since_tick += stop - start
        if late is not None:
            self.late_since_tick += int(np.count_nonzero(late[start:stop]))

    def _late(self, raw_ns: np.ndarray, clock_ns: np.ndarray, batch: EventBatch) -> np.ndarray | None:
        """Which events run more than ``max_ts_backwards_s`` behind the node's clock (its newest
        event time before them, earlier events of the batch included); None when none does. They
        are applied in order all the same, in the interval of the node's clock, and counted in that
        tick's ``late_events``: the mirror's state is a fold over every batch in seq order, so
        dropping one for its event times would leave a gap in it (the node unsynced until its next
        snapshot), a worse error than a few events counted one interval late."""
        floor_ns = int(clock_ns[-1]) - self.config.max_ts_backwards_ns
        if int(raw_ns.min()) >= floor_ns:  # none behind even the newest clock: the usual batch, no arrays
            return None
        late = raw_ns < clock_ns - self.config.max_ts_backwards_ns
        if not late.any():
            return None
        n = int(np.count_nonzero(late))
        self.late_events += n
        log.warning("node %s: %d event(s) of batch epoch %d seq %d run up to %.3f s behind the node's clock, more "
                    "than streams.max_ts_backwards_s: applied in order, counted in the open tick's late_events",
                    self.node, n, batch.epoch, batch.seq, int((clock_ns - raw_ns).max()) / NS_PER_S)
        return late

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
                self.mark_unsynced(f"node {self.node}: new geometry at epoch {batch.epoch} seq {batch.seq}")
        first = self.epoch is None
        if not first and batch.epoch == self.epoch and batch.seq <= self.seq:
            self.duplicates += 1
            return False
        if not first and batch.epoch < self.epoch:
            self.duplicates += 1
            return False
        if self.mirror is not None:
            if first and batch.seq != 0:
                self.mark_unsynced(f"node {self.node}: first batch seen has seq {batch.seq}")
            elif not first and batch.seq != self.seq + 1:
                self.gaps += 1
                self.mark_unsynced(f"node {self.node}: seq gap {self.seq} -> {batch.seq}")
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
        self.events_since_tick = self.late_since_tick = 0
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

    def mark_unsynced(self, reason: str) -> None:
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

    def _make_tick(self, ts_ns: int) -> Tick:
        """The tick at boundary ``ts_ns`` (``tick_builder.build_tick``); closes the interval: the
        counts' mark, the slope window, the feature history and the tick's predictor window move on."""
        m = self.mirror
        pm = m.metrics()
        now = Counts.of_mirror(m)
        counts = now.since(self._mark)
        self._mark = now
        table = m.request_table()
        slope = self._slope(ts_ns, pm.u_kv)
        interval = Interval(counts, self.events_since_tick, slope, self.last_oom_ns, self.late_since_tick)
        self.events_since_tick = self.late_since_tick = 0
        tick = build_tick(self.node, self.epoch or 0, ts_ns, m, table, interval, self.config, synced=m.synced)
        self.features.push(tick_features(tick))
        if self.score_window_ticks:
            self.windows.append(self._tick_window(ts_ns))
        if len(table.req) > 4096:
            m.forget_finished()
        return tick

    def _slope(self, ts_ns: int, u_kv: float) -> float:
        """U_kv's least-squares slope per minute over the trailing ``slope_window_s``, this tick included."""
        self.slope_points.append((ts_ns, u_kv))
        horizon = ts_ns - int(self.config.slope_window_s * NS_PER_S)
        while self.slope_points and self.slope_points[0][0] <= horizon:
            self.slope_points.popleft()
        pts = np.array(self.slope_points, dtype=np.float64)
        return least_squares_slope(pts[:, 0], pts[:, 1])

    def _tick_window(self, ts_ns: int) -> TickWindow:
        """The predictor's input for the tick just made: the last ``score_window_ticks`` feature
        vectors, ending at it. A window that cannot be built (an empty history) is None: that
        tick gets no P(OOM)."""
        try:
            window = self.features.window(self.score_window_ticks)
        except ValueError as err:
            log.warning("node %s: no feature window for the tick at %d ns (%s): no P(OOM) for it", self.node,
                        ts_ns, err)
            window = None
        return TickWindow(window, self.resets)

    def take_windows(self) -> list[TickWindow]:
        """The windows of the ticks made since the last call, in tick order; the list is cleared."""
        windows, self.windows = self.windows, []
        return windows

    # ---------------------------------------------------------------- persistence
    def to_bytes(self) -> bytes:
        """Compact, self-contained state (npz): the changelog value of the Faust table."""
        header = {
            "node": self.node, "epoch": self.epoch, "epoch_confirmed": self.epoch_confirmed, "seq": self.seq,
            "off_clock": None if self.off_clock is None else list(self.off_clock),
            "next_boundary_ns": self.next_boundary_ns, "max_ts_ns": self.max_ts_ns,
            "slope_points": list(self.slope_points), "features_count": self.features.count,
            "alerts": self.alerts.state_list(), "mark": list(self._mark),
            "events_since_tick": self.events_since_tick, "late_since_tick": self.late_since_tick,
            "late_events": self.late_events, "duplicates": self.duplicates,
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
    def from_bytes(cls, data: bytes, config: StreamConfig, *, with_predictor: bool = False) -> NodeState:
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
        st.late_since_tick, st.late_events = int(h.get("late_since_tick", 0)), int(h.get("late_events", 0))
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
