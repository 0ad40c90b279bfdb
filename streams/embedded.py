"""The embedded stream runner: the same ``StreamCore`` over an event log file or a bus subscription.

Two shells, no logic of their own:
- ``run_event_log(path, config)`` replays a ``kvguard.wire.eventlog`` file (``kvguard metrics``, RCA);
- ``StreamsService(bus, settings)`` consumes ``kvguard.events`` from any ``kvguard.bus`` carrier
  (the in-process bus of the embedded default, or Kafka), decodes with ``kvguard.wire.schemas`` (bad
  records go to the DLQ), runs the core and publishes ticks to ``kvguard.metrics`` and alerts to
  ``kvguard.alerts`` keyed by node. It commits a poll's offsets only after every output of that poll
  is acknowledged (at-least-once; the core skips redelivered batches by ``seq``). Batches the core
  rejects (impossible contents, an epoch jump) or whose application raises go to the DLQ with the
  reason, counted and logged; the poll is committed past them. Nodes without batches for
  ``streams.node_idle_timeout_s`` of wall time are evicted from the core.

Records are built by ``kvguard.streams.outputs`` for every publishing path (this service, the
Faust app, the embedded demo loop), so all carry byte-identical records with the same ids.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvguard.bus.dlq import RecordDecoder
from kvguard.bus.idle import IdleSweep
from kvguard.contracts.tick import Tick
from kvguard.streams.alerts import Alert
from kvguard.streams.core import StreamConfig, StreamCore
from kvguard.streams.outputs import output_records
from kvguard.streams.predictor import Predictor
from kvguard.wire.eventlog import SkippedBatch, read_event_log

log = logging.getLogger(__name__)


def run_event_log(path, config: StreamConfig | None = None, predictor: Predictor | None = None, *,
                  chunk_batches: int = 64, flush_ns: int | None = None, finish: bool = False,
                  on_invalid: Callable[[SkippedBatch], None] | None = None,
                  ) -> Iterator[tuple[list[Tick], list[Alert]]]:
    """Replay an event log through a fresh core, yielding (ticks, alerts) per chunk of batches.
    ``flush_ns``: finally emit every node's ticks up to that event time; ``finish``: finally emit
    each node's last, partial tick (``StreamCore.finish``). ``on_invalid``: a batch line that is no
    valid batch, and a batch the core rejects, are handed to it (``SkippedBatch``) and the replay goes
    on, as the worker dead-letters them; without it an invalid line raises ``EventLogError``."""
    core = StreamCore(config, predictor)
    _, batches = read_event_log(path, on_invalid=on_invalid)
    chunk = []

    def process(chunk):
        out = core.process_many(chunk)
        if on_invalid is not None:
            for r in core.rejected:
                on_invalid(SkippedBatch(str(path), 0, r.batch.node, int(r.batch.epoch), int(r.batch.seq),
                                        f"{r.reason}: {r.detail}"))
        return out

    for batch in batches:
        chunk.append(batch)
        if len(chunk) >= chunk_batches:
            yield process(chunk)
            chunk = []
    if chunk:
        yield process(chunk)
    if flush_ns is not None:
        yield core.flush(flush_ns)
    if finish:
        yield core.finish()


@dataclass(slots=True)
class ServiceCounters:
    polls: int = 0
    batches: int = 0
    events: int = 0
    ticks: int = 0
    alerts: int = 0
    rejected: int = 0  # batches the core did not apply (dead-lettered)
    errors: int = 0  # polls whose processing raised outside the core's per-batch isolation
    nodes_evicted_idle: int = 0

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


class StreamsService:
    """The core behind a bus subscription (embedded mode, or Kafka without Faust)."""

    def __init__(self, bus, settings, predictor: Predictor | None = None, *, config: StreamConfig,
                 group: str = "kvguard-streams", max_records: int = 500):
        """``config``: the core's (the composition root's, ``Graph.stream_config``)."""
        self.bus = bus
        self.settings = settings
        self.core = StreamCore(config, predictor)
        self.group = group
        self.max_records = max_records
        self.topics = {k: settings.topics.name(k) for k in ("events", "metrics", "alerts", "dlq")}
        self.decoder = RecordDecoder(bus, self.topics["dlq"], component="streams", group=group,
                                     limits=self.core.config.limits)
        self.counters = ServiceCounters()
        self.idle_sweep = IdleSweep(settings.streams.node_idle_timeout_s, now_s=time.monotonic())
        self._stopping = asyncio.Event()

    def stop(self) -> None:
        self._stopping.set()

    async def run(self, *, idle_timeout_s: float | None = None) -> None:
        """Consume until ``stop()`` (or until nothing arrived for ``idle_timeout_s``)."""
        sub = self.bus.subscribe([self.topics["events"]], self.group)
        idle = 0.0
        try:
            while not self._stopping.is_set():
                records = await sub.getmany(self.max_records, timeout_s=0.2)
                if not records:
                    idle += 0.2
                    if idle_timeout_s is not None and idle >= idle_timeout_s:
                        return
                    continue
                idle = 0.0
                await self.handle(records)
                await sub.commit()
        finally:
            await sub.close()

    async def handle(self, records) -> tuple[list[Tick], list[Alert]]:
        """Decode, process, publish; returns what was published."""
        batches, record_of = [], {}
        for record in records:
            batch = await self.decoder.decode_batch(record)
            if batch is not None:
                batches.append(batch)
                record_of[id(batch)] = record
        self.counters.polls += 1
        try:
            ticks, alerts = self.core.process_many(batches)
        except Exception as err:  # noqa: BLE001 - past the core's per-batch isolation (e.g. the predictor)
            self.counters.errors += 1
            for batch in batches:
                await self.decoder.handler_failed(record_of[id(batch)], err)
            return [], []
        for rejection in self.core.rejected:
            self.counters.rejected += 1
            await self.decoder.dead_letter(record_of[id(rejection.batch)], rejection.reason, rejection.detail)
        applied = len(batches) - len(self.core.rejected)
        self.counters.batches += applied
        self.counters.events += sum(len(b) for b in batches) - sum(len(r.batch) for r in self.core.rejected)
        self._note_seen(batches)
        futures = [await self.bus.publish(self.topics[r.kind], r.key, r.value, r.headers)
                   for r in output_records(ticks, alerts)]
        if futures:
            await asyncio.gather(*futures)
        self.counters.ticks += len(ticks)
        self.counters.alerts += len(alerts)
        return ticks, alerts

    def _note_seen(self, batches) -> None:
        now = time.monotonic()
        for batch in batches:
            self.idle_sweep.seen(batch.node, now)
        for node in self.core.take_evicted():  # by the core's cap
            self.idle_sweep.forget(node)
        if self.idle_sweep.due(now):
            self.evict_idle(now)

    def evict_idle(self, now_s: float) -> list[str]:
        """Evict nodes without batches for ``streams.node_idle_timeout_s`` at monotonic ``now_s``."""
        idle = self.idle_sweep.sweep(now_s)
        for node in idle:
            if self.core.forget(node):
                self.counters.nodes_evicted_idle += 1
        self.core.take_evicted()
        return idle
