"""The node publisher: drains event batches from a source and publishes them to the events topic.

A *source* is any callable returning ``list[EventBatch]`` (``fleet.take_batches`` bound to a clock,
or a pool's ``take_events`` wrapped into batches). The publisher never touches the pool itself.

Two loops share one bounded buffer:
- the drainer calls the source every ``flush_interval_s`` (sooner when the buffer holds
  ``max_batch_events`` events), encodes each batch once, and appends it. When the buffer passes
  ``max_buffered_batches`` or ``max_buffered_events`` (a long broker outage), the *oldest* batches
  not in flight are dropped and counted (``batches_dropped`` / ``events_dropped``); the consumer
  sees the seq gap and resynchronises on the next SNAPSHOT. Nothing is dropped before the bound;
- the sender publishes the buffer head in windows of at most ``max_in_flight`` batches, removes
  what the broker acknowledged and retries the rest with backoff, so it rides through outages
  and resumes by itself when the broker is back. (A batch that failed while a later one got
  through is sent again after it: consumers order by ``(epoch, seq)`` and drop duplicates.)

Memory is bounded by ``max_buffered_* + max_in_flight`` encoded batches.

The broker takes records up to ``max_message_bytes`` (Kafka's ``message.max.bytes``, aiokafka's
``max_request_size``: 1 MB by default). A batch that encodes larger is split into consecutive
batches that fit (``split_batch``: the state goes with the piece holding the last SNAPSHOT row);
the node's later batches are renumbered after them so its ``seq`` stays contiguous. A piece that
still cannot fit (one event, or a ``PoolState`` dump alone over the limit) is dropped and counted
(``batches_oversized``), and so is a record the broker refuses for good (a record too large for it,
``kvguard.bus.base.refused_for_good``; counted in ``batches_refused``): the consumer sees the seq gap
and resynchronises on the next SNAPSHOT. Every other failed delivery is retried, whatever the
client calls it: aiokafka marks most broker errors not ``retriable`` (``UnknownError`` included,
which Tansu answers while a wiped broker's topic is re-created), and dropping on that lost batches
a retry would have delivered. A record retried for long is bounded by the buffer: past
``max_buffered_*`` the oldest batches are dropped and counted. The drainer polls the source every
``flush_interval_s``, sooner only while the source hands over more than ``max_batch_events`` at
a time: a full buffer (a broker outage) does not make it spin.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import pairwise

import numpy as np

from kvguard.bus.base import Bus, BusClosed, refused_for_good
from kvguard.contracts.events import EventBatch, EventKind
from kvguard.wire.schemas import batch_headers, encode_batch

log = logging.getLogger(__name__)

BatchSource = Callable[[], list[EventBatch]]


@dataclass(slots=True)
class PublisherCounters:
    batches_taken: int = 0
    events_taken: int = 0
    batches_published: int = 0
    events_published: int = 0
    batches_dropped: int = 0
    events_dropped: int = 0
    publish_failures: int = 0  # sends that failed and were retried
    buffered_batches: int = 0
    buffered_events: int = 0
    batches_split: int = 0  # source batches over max_message_bytes, sent as several
    batches_oversized: int = 0  # pieces that could not be made to fit: dropped
    events_oversized: int = 0
    batches_refused: int = 0  # records the broker refused for good (a non-retriable error): dropped
    events_refused: int = 0

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(slots=True)
class _Entry:
    node: str
    value: bytes
    headers: list[tuple[str, bytes]]
    events: int
    in_flight: bool = False


class NodePublisher:
    def __init__(
        self,
        bus: Bus,
        topic: str,
        source: BatchSource,
        *,
        flush_interval_s: float = 0.5,
        max_batch_events: int = 65_536,
        max_buffered_batches: int = 10_000,
        max_buffered_events: int = 5_000_000,
        max_in_flight: int = 256,
        retry_backoff_s: tuple[float, float] = (0.05, 2.0),
        max_message_bytes: int = 1_048_576,
        packed_columns: bool = False,
    ):
        if flush_interval_s <= 0:
            raise ValueError(f"flush_interval_s must be > 0, got {flush_interval_s}")
        if max_buffered_batches <= 0 or max_buffered_events <= 0 or max_in_flight <= 0:
            raise ValueError("max_buffered_batches, max_buffered_events and max_in_flight must be > 0")
        if max_message_bytes <= _RECORD_OVERHEAD_BYTES:
            raise ValueError(f"max_message_bytes must be > {_RECORD_OVERHEAD_BYTES}, got {max_message_bytes}")
        self.bus = bus
        self.topic = topic
        self.source = source
        self.flush_interval_s = flush_interval_s
        self.max_batch_events = max_batch_events
        self.max_buffered_batches = max_buffered_batches
        self.max_buffered_events = max_buffered_events
        self.max_in_flight = max_in_flight
        self.retry_backoff_s = retry_backoff_s
        self.max_value_bytes = max_message_bytes - _RECORD_OVERHEAD_BYTES
        # packed columns (schema 1.1, kvguard.wire.fastcols): cheaper to decode; only once every worker reads 1.1
        self.packed_columns = packed_columns
        self._seq_shift: dict[str, tuple[int, int]] = {}  # node -> (epoch, seqs added by splits)
        self.counters = PublisherCounters()
        self._buffer: OrderedDict[int, _Entry] = OrderedDict()
        self._next_id = 0
        self._have_data = asyncio.Event()
        self._stopping = False

    @classmethod
    def from_settings(cls, bus: Bus, settings, source: BatchSource, **overrides) -> "NodePublisher":
        node = settings.node
        options = dict(
            flush_interval_s=node.flush_interval_s, max_batch_events=node.max_batch_events,
            max_buffered_batches=node.max_buffered_batches, max_buffered_events=node.max_buffered_events,
            max_message_bytes=settings.kafka.max_message_bytes,
        )
        options.update(overrides)
        return cls(bus, settings.topics.name("events"), source, **options)

    # buffer ----------------------------------------------------------------------------------
    def drain(self) -> int:
        """Take every batch the source has into the buffer (dropping the oldest past the bound)."""
        batches = self.source()
        for batch in batches:
            self._append(batch)
        return len(batches)

    def _append(self, batch: EventBatch) -> None:
        epoch, shift = self._seq_shift.get(batch.node, (batch.epoch, 0))
        if epoch != batch.epoch:  # a new run numbers from 0 again
            shift = 0
        if shift:
            batch = replace(batch, seq=batch.seq + shift)
        value = encode_batch(batch, packed=self.packed_columns)
        if len(value) <= self.max_value_bytes:
            self._add(batch, value)
        else:
            pieces = self._pieces(batch, value)
            shift += len(pieces) - 1
            self.counters.batches_split += 1
            log.warning("node %s: batch seq %d of %d events encodes to %d bytes, over the broker's %d: sent as %d",
                        batch.node, batch.seq, len(batch), len(value), self.max_value_bytes, len(pieces))
            for piece, piece_value in pieces:
                if piece_value is None:
                    self.counters.batches_oversized += 1
                    self.counters.events_oversized += len(piece)
                    log.error("node %s: batch seq %d (%d events) cannot fit in %d bytes: dropped", piece.node,
                              piece.seq, len(piece), self.max_value_bytes)
                    continue
                self._add(piece, piece_value)
        self._seq_shift[batch.node] = (batch.epoch, shift)

    def _pieces(self, batch: EventBatch, value: bytes) -> list[tuple[EventBatch, bytes | None]]:
        """``batch`` split until every piece fits (None: a piece that cannot be made to fit)."""
        n = len(batch)
        parts = max(2, -(-len(value) // int(self.max_value_bytes * 0.8)))
        while True:
            pieces = split_batch(batch, min(parts, max(1, n)))
            encoded = [encode_batch(p, packed=self.packed_columns) for p in pieces]
            if all(len(v) <= self.max_value_bytes for v in encoded) or parts >= n:
                return [(p, v if len(v) <= self.max_value_bytes else None) for p, v in zip(pieces, encoded)]
            parts *= 2

    def _add(self, batch: EventBatch, value: bytes) -> None:
        entry = _Entry(batch.node, value, batch_headers(batch), len(batch))
        self._buffer[self._next_id] = entry
        self._next_id += 1
        self.counters.batches_taken += 1
        self.counters.events_taken += entry.events
        self.counters.buffered_batches += 1
        self.counters.buffered_events += entry.events
        self._enforce_bound()
        self._have_data.set()

    def _enforce_bound(self) -> None:
        c = self.counters
        if c.buffered_batches <= self.max_buffered_batches and c.buffered_events <= self.max_buffered_events:
            return
        for entry_id in list(self._buffer):
            if c.buffered_batches <= self.max_buffered_batches and c.buffered_events <= self.max_buffered_events:
                break
            entry = self._buffer[entry_id]
            if entry.in_flight:
                continue
            self._remove(entry_id)
            c.batches_dropped += 1
            c.events_dropped += entry.events

    def _remove(self, entry_id: int) -> _Entry | None:
        entry = self._buffer.pop(entry_id, None)
        if entry is not None:
            self.counters.buffered_batches -= 1
            self.counters.buffered_events -= entry.events
        return entry

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    # sending ---------------------------------------------------------------------------------
    async def send_pending(self) -> bool:
        """Publish one window of the buffer head; True when every record of it was acknowledged."""
        window = [(entry_id, entry) for entry_id, entry in self._buffer.items() if not entry.in_flight]
        window = window[: self.max_in_flight]
        if not window:
            return True
        futures = []
        ok = True
        closed = False
        for entry_id, entry in window:
            try:
                future = await self.bus.publish(self.topic, entry.node, entry.value, entry.headers)
            except BusClosed:
                ok, closed = False, True
                break
            except Exception as exc:  # send buffer full, metadata timeout: retry later
                log.warning("publishing to %s failed (%s); will retry", self.topic, exc)
                self.counters.publish_failures += 1
                ok = False
                break
            entry.in_flight = True
            futures.append((entry_id, entry, future))
        results = await asyncio.gather(*(f for _, _, f in futures), return_exceptions=True)
        for (entry_id, entry, _), result in zip(futures, results):
            entry.in_flight = False
            if isinstance(result, BaseException) and refused_for_good(result):
                # the broker will never take it (MessageSizeTooLargeError): drop, do not retry forever
                self._remove(entry_id)
                self.counters.batches_refused += 1
                self.counters.events_refused += entry.events
                log.error("node %s: %s refused a batch of %d events for good (%s: %s): dropped", entry.node,
                          self.topic, entry.events, type(result).__name__, result)
            elif isinstance(result, BaseException):
                ok = False
                self.counters.publish_failures += 1
            elif self._remove(entry_id) is not None:
                self.counters.batches_published += 1
                self.counters.events_published += entry.events
        if not ok:
            self._enforce_bound()
        if closed:
            raise BusClosed(f"bus closed while publishing to {self.topic}")
        return ok

    async def flush(self, timeout_s: float | None = None) -> bool:
        """Drain the source until it returns nothing, then send until the buffer is empty (or
        ``timeout_s`` passes; then False)."""
        while self.drain():
            pass
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        backoff = self.retry_backoff_s[0]
        while self._buffer:
            if await self.send_pending():
                backoff = self.retry_backoff_s[0]
                continue
            if deadline is not None and time.monotonic() + backoff > deadline:
                return False
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.retry_backoff_s[1])
        return True

    # loops -----------------------------------------------------------------------------------
    async def run(self) -> None:
        """Drain and send until ``stop()``; then a final flush of what is buffered."""
        self._stopping = False
        drainer = asyncio.create_task(self._drain_loop())
        try:
            await self._send_loop()
        finally:
            drainer.cancel()
            await asyncio.gather(drainer, return_exceptions=True)

    def stop(self) -> None:
        self._stopping = True
        self._have_data.set()

    async def _try_start(self) -> bool:
        """The bus is not started (the broker was down when the node came up): try again."""
        try:
            await self.bus.start()
        except Exception as exc:
            log.warning("bus start failed (%s); will retry", exc)
            return False
        return True

    async def _drain_loop(self) -> None:
        while not self._stopping:
            taken = self.counters.events_taken
            self.drain()
            interval = self.flush_interval_s
            # sooner only while the source has more than a batch's worth each time; a buffer that
            # stays full (the broker is down) must not make the drainer spin
            if self.counters.events_taken - taken >= self.max_batch_events:
                interval = min(interval, 0.001)
            await asyncio.sleep(interval)

    async def _send_loop(self) -> None:
        backoff = self.retry_backoff_s[0]
        while True:
            if not self._buffer:
                if self._stopping:
                    self.drain()
                    if not self._buffer:
                        return
                    continue
                self._have_data.clear()
                await self._have_data.wait()
                continue
            try:
                ok = await self.send_pending()
            except BusClosed:
                ok = await self._try_start()
            if ok:
                backoff = self.retry_backoff_s[0]
                continue
            if self._stopping:
                return
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.retry_backoff_s[1])


_RECORD_OVERHEAD_BYTES = 2048  # key, CloudEvents headers and the record batch's framing
_SNAPSHOT = int(EventKind.SNAPSHOT)


def split_batch(batch: EventBatch, parts: int) -> list[EventBatch]:
    """``batch`` as up to ``parts`` consecutive batches (``seq``, ``seq + 1``, …) of about equal
    length. Each keeps the geometry (when the batch had one); the ``PoolState`` goes with the piece
    holding the batch's last SNAPSHOT row, as the core expects it there."""
    n = len(batch)
    bounds = sorted(set(np.linspace(0, n, max(1, parts) + 1).astype(int).tolist()))
    snapshots = np.flatnonzero(batch.events["kind"] == _SNAPSHOT)
    last_snapshot = int(snapshots[-1]) if snapshots.size else -1
    pieces = []
    for start, stop in pairwise(bounds):
        holds_state = batch.state is not None and start <= last_snapshot < stop
        pieces.append(EventBatch(node=batch.node, seq=batch.seq + len(pieces), epoch=batch.epoch,
                                 events=batch.events[start:stop], geometry=batch.geometry,
                                 state=batch.state if holds_state else None,
                                 extra=dict(batch.extra) if not pieces else {}))
    if batch.state is not None and last_snapshot < 0:  # a state without its row: keep it on the last piece
        pieces[-1].state = batch.state
    return pieces or [batch]
