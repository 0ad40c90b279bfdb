"""The stream core: event batches in, ticks and alerts out; the same in Faust, embedded and replay.

Pure (numpy + stdlib) and deterministic in event time: the output depends only on the batches
(and their order per node), never on the clock, the batching of the transport or the worker.

``StreamCore`` holds a ``NodeState`` per node (``streams.node_state``: its mirror, sequence and
epoch, tick clock and checkpoint bytes) and runs each call in four steps, each in its own module:
a node's batches are admitted (``streams.admission``: order, redeliveries, impossible contents,
jumps of epoch or event time, then runs that can be applied as one), applied by the node state,
whose ticks ``streams.tick_builder`` builds from the mirror, and scored by the predictor
(``streams.scoring``) before the alert rules run. ``streams.config`` is the configuration.

Hostile or broken input: a batch is rejected, before any state changes, when admission refuses it
or its events fail ``kvguard.wire.validate``'s checks against the node's region. A batch whose
application raises is rejected too, and its node marked unsynced (its state may be partly
applied; the next SNAPSHOT with state repairs it). Rejections are counted, logged and listed in
``StreamCore.rejected`` (the latest call's) for the caller's DLQ. A tick whose scoring fails goes
out without P(OOM) (``CoreCounters.ticks_unscored``). Per-node state is capped at ``max_nodes``
(the least recently seen node is evicted first); idle nodes are evicted by the caller's clock
through ``forget`` (wall time: event time differs per node).

The core's API also names the config it takes and the node states it holds: ``StreamConfig``,
``StreamConfigError`` and ``NodeState`` are importable from here (their homes are
``streams.config`` and ``streams.node_state``).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

from kvguard.contracts.events import EventBatch
from kvguard.contracts.tick import Tick
from kvguard.streams.admission import admit, contiguous_groups
from kvguard.streams.alerts import Alert
from kvguard.streams.config import StreamConfig, StreamConfigError
from kvguard.streams.node_state import NodeState
from kvguard.streams.predictor import Predictor, check_predictor
from kvguard.streams.scoring import Scorer, Scoring
from kvguard.wire.validate import InvalidRecord, check_events

__all__ = ["CoreCounters", "NodeState", "Rejection", "StreamConfig", "StreamConfigError", "StreamCore"]

log = logging.getLogger(__name__)


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
    ticks_unscored: int = 0  # a predictor runs but the tick got no P(OOM): no window, or its node's scoring failed
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
        self.scorer: Scorer | None = None
        if predictor is not None:
            check_predictor(predictor)
            if predictor.window_ticks > self.config.window_ticks:
                raise StreamConfigError("window_ticks", self.config.window_ticks,
                                        f">= the predictor's window_ticks ({predictor.window_ticks})")
            self.scorer = Scorer(predictor, stateful=self.stateful)
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
        # also for a state restored by the caller (``NodeState.from_bytes``): windows as long as the model reads
        st.score_window_ticks = 0 if self.predictor is None else int(self.predictor.window_ticks)
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
        if self.scorer is not None:
            self.scorer.forget(node)
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

        A node's batches are first admitted (``streams.admission.admit``: put in ``(epoch, seq)``
        order, redeliveries dropped, those that fail validation or jump too far in epoch or event
        time rejected); a group whose application raises is rejected as well. ``self.rejected``
        lists what this call rejected."""
        self.rejected = []
        by_node: dict[str, list[EventBatch]] = {}
        for batch in batches:
            by_node.setdefault(batch.node, []).append(batch)
        produced: list[Scoring] = []
        for node, node_batches in by_node.items():
            st = self.node_state(node)
            current = st.mirror.geometry if st.mirror is not None else None
            admitted = self._admit(st, node_batches)
            for group in contiguous_groups(admitted.batches, current, admitted.rebase):
                if id(group[0]) in admitted.rebase:
                    st.rebase_clock()
                try:
                    ticks = self._apply_group(st, group)
                except Exception as err:  # noqa: BLE001 - one node's bad input must not stop the others
                    st.take_windows()
                    self._failed(st, group, err)
                    continue
                produced += self._pair(st, ticks)
        return self._finish(produced)

    def _admit(self, st: NodeState, batches: list[EventBatch]):
        """``admit`` the node's batches; count, reject and mark what it found."""
        admitted = admit(st, batches, self.config)
        st.duplicates += admitted.duplicates
        st.off_clock = admitted.off_clock
        c = self.counters
        c.duplicates_dropped += admitted.duplicates
        c.epoch_jumps_rejected += admitted.epoch_jumps
        c.ts_jumps_rejected += admitted.ts_jumps
        c.clock_rebases += admitted.clock_rebases
        c.epochs_retracted += admitted.epochs_retracted
        for batch, detail in admitted.rejected:
            self._reject(batch, detail)
        return admitted

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
            st.mark_unsynced(f"node {st.node}: applying a batch raised {type(err).__name__}")
        rejected = {id(r.batch) for r in self.rejected}
        for b in group:
            if id(b) not in rejected:
                self._reject(b, detail, reason="processing_error")

    def finish(self) -> tuple[list[Tick], list[Alert]]:
        """The end of the input (a log replayed to its last line): every node with events since its
        last tick gets that interval's tick now, marked ``partial``, so a node's last events (its
        OOM, say) are not lost for want of a later event."""
        produced: list[Scoring] = []
        for node in sorted(self.nodes):
            st = self.nodes[node]
            if st.events_since_tick == 0 or st.next_boundary_ns is None or st.mirror is None:
                continue
            ticks = [replace(t, partial=True) for t in st.flush(st.next_boundary_ns)]
            produced += self._pair(st, ticks)
        return self._finish(produced)

    def flush(self, now_ns: int) -> tuple[list[Tick], list[Alert]]:
        """Emit due ticks of every node up to ``now_ns`` (event time of the caller's choosing)."""
        produced: list[Scoring] = []
        for node in sorted(self.nodes):
            st = self.nodes[node]
            produced += self._pair(st, st.flush(now_ns))
        return self._finish(produced)

    def _pair(self, st: NodeState, ticks: list[Tick]) -> list[Scoring]:
        if self.scorer is None:
            return [Scoring(st, tick, None) for tick in ticks]
        return self.scorer.pair(st, ticks)

    def _finish(self, produced: list[Scoring]) -> tuple[list[Tick], list[Alert]]:
        """Score the call's ticks, then run each node's alert rules over its ticks in order."""
        if self.scorer is not None and produced:
            scores = self.scorer.score(produced)
            for i, (st, tick, _) in enumerate(produced):
                if scores[i] is None:
                    self.counters.ticks_unscored += 1
                else:
                    produced[i] = Scoring(st, tick.with_prediction(*scores[i]), None)
        ticks, alerts = [], []
        for st, tick, _ in produced:
            ticks.append(tick)
            alerts.extend(st.alerts.evaluate(tick))
        return ticks, alerts
