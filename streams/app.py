"""The Faust app: ``StreamCore`` behind ``kvguard.events``, per-node state in a changelog-backed table.

``build_app(settings)`` builds everything (nothing at import time, no module-level app): one agent
reads raw event-batch records, decodes them with ``kvguard.wire.schemas`` (undecodable ones go to
``kvguard.dlq`` with the reason; the worker lives on), runs the core, and publishes ticks to
``kvguard.metrics`` and alerts to ``kvguard.alerts`` keyed by node, with the same record bytes as the
embedded runner (``kvguard.streams.outputs``).

State and recovery. A node's full ``NodeState`` is ~10-40 KB, too much to write per batch, so the
table ``<app_id>-state`` holds one key per node, ``C|<node>``: the events offset of the node's last
applied batch (8 bytes) followed by ``NodeState.to_bytes()``, written at the node's first batch
and then every ``checkpoint_every_ticks`` of its ticks. The events topic itself is the log between
checkpoints: a worker that meets a node it has no memory of (startup, a partition moved to it)
loads the checkpoint; the node's next batch then shows a seq gap, and the worker reads the
node's batches between the checkpoint's offset and that record back from the topic
(``FetchBack``: a short-lived group-less consumer) and applies them. Their ticks are sent again:
duplicates within at-least-once, identical bytes.

The same gap fill covers the consumer itself: faust-streaming 0.15 can drop a record whose
delivery is cancelled while the flow is suspended during recovery, and still mark it read (seen on
Tansu at worker start). Any seq gap is read back once; only batches the topic does not hold stay
missing, and the core then marks the node unsynced until the next snapshot.

Tansu 0.6 reports a partition's end offset as the base offset of its last record batch + 1, so
Faust's table recovery misses the tail of the last batch; each round of checkpoints is therefore
sealed with a one-record batch (``StreamsWorker.seal``).

Hostile input: records are decoded with the semantic checks of ``kvguard.wire.validate`` and their
key must name their node; the core rejects batches that do not fit the node's region or jump too
far in epoch. Every record is handled on its own: one that fails those checks, or whose handling
raises, goes to ``kvguard.dlq`` with the reason (counted, logged) and the chunk goes on, so its
offset is committed past it and the rest of the chunk is produced. That holds for a record with a
null value (a tombstone: reason ``tombstone``, counted in ``counters.tombstones``), an empty one
and one of any size (the DLQ record is bounded, ``DlqRecord.of``); dead-lettering never raises,
so no record can crash the agent and lose the ticks of the chunk it was in. Per-node state is bounded:
the core evicts the least recently seen node past ``streams.max_nodes``, and the worker evicts
nodes without batches for ``streams.node_idle_timeout_s`` of wall time; an evicted node's
checkpoint is deleted from the table (a tombstone on the changelog), so its next batch starts it
over.

A broker that loses its data (a memory-only broker restarted, a cluster rebuilt) starts every
partition over at offset 0 while the worker runs. Faust's own check would stop the worker (its
``ConsistencyError``: the changelog's end below what the process read); it is off, since the
memory store holds only what this process read and wrote. The worker sees the loss on the events
log instead (a node's new batch at or below the offset of its last applied one, which cannot
happen on a broker that keeps its log), logs it, and rebuilds what referred to the old log
(``StreamsWorker.rebuild_offsets``): offsets are dropped, checkpoints are written again at the
nodes' next batches, and a node whose batches were lost, or whose state came back from an older
checkpoint, is unsynced until its next SNAPSHOT.

Idle nodes. A tick is emitted when the node's next batch crosses its boundary, so the last
interval of a node that stops sending (a dying GPU, its OOM in that interval) would wait for a
batch that never comes. A Faust timer (``StreamsWorker.flush_idle``) publishes that pending tick,
marked ``partial`` (``StreamCore.finish``), for each node without batches for
``streams.idle_flush_s`` of wall time (default: two ticks), once the worker has handled every
record its events partition holds (so consumer lag is not taken for silence). The flush is final
for that boundary: a later batch of the node starts the next interval, and the node's checkpoint
is written so a restored worker agrees. The timer also runs the idle-eviction sweep, which a
worker without records would otherwise never reach.

Ordering: outputs are sent as they are made; before a checkpoint is written every output sent so
far is awaited (a checkpoint never gets ahead of the ticks its batches produced), and Faust flushes
the producer before it commits offsets. Records are handled in chunks of up to ``max_records``.

Latency (docs/ARCHITECTURE.md, "Targets": event → command executed, p99 ≤ 500 ms). A tick leaves as soon as the chunk
holding its batch is handled: the ticks are sent before any checkpoint wait, which only delays the
next chunk. What bounds the hop is how long a record waits to be fetched and chunked: Faust's
consumer fetch wait (Faust hardcodes 1500 ms; Tansu 0.6 holds a fetch that long even when records
arrive meanwhile: docs/RESULTS.md, "Figures moved from module docstrings") is set from ``kafka.fetch_max_wait_ms`` (or
``kafka.consumer_options``), the chunk wait from ``streams.chunk_max_wait_s``, and the output
producer's linger from ``kafka.linger_ms``.

Topics Faust needs that Tansu will not auto-create are created by ``ensure_topics`` before the
worker starts: kvguard's topics, the table changelog (as many partitions as the events topic;
time retention, or compaction on request: see ``internal_topics``) and Faust's
``<app_id>-__assignor-__leader`` (1 partition).
"""

from __future__ import annotations

import asyncio
import logging
import struct
import tempfile
import time
from dataclasses import dataclass

from kvguard.bus.idle import IdleSweep
from kvguard.streams.core import NodeState, StreamConfig, StreamCore
from kvguard.streams.outputs import output_records
from kvguard.streams.predictor import Predictor
from kvguard.wire.schemas import DecodeError, DlqRecord, decode_batch, dlq_key, make_headers
from kvguard.wire.validate import InvalidRecord, check_key

log = logging.getLogger(__name__)

DEFAULT_APP_ID = "kvguard-streams"
_OFFSET = struct.Struct("<q")
_SEAL_KEY = b"S|"
TABLE_NAME = "state"


def changelog_topic_name(app_id: str) -> str:
    return f"{app_id}-{TABLE_NAME}-changelog"


def leader_topic_name(app_id: str) -> str:
    return f"{app_id}-__assignor-__leader"


def internal_topics(settings, app_id: str = DEFAULT_APP_ID, *,
                    compact_changelog: bool = False) -> dict[str, tuple[int, dict[str, str]]]:
    """Faust's own topics: name -> (partitions, topic configs).

    The changelog is not compacted by default: on Tansu 0.6 a compacted topic lost live keys (a
    partition holding two nodes' checkpoints kept only one of them), so it uses time retention
    (the events topic's) instead. On Kafka, ``compact_changelog=True`` keeps it bounded by key.
    """
    events = settings.topics.events
    policy = ({"cleanup.policy": "compact"} if compact_changelog
              else {"cleanup.policy": "delete", "retention.ms": str(events.retention_ms)})
    return {
        changelog_topic_name(app_id): (events.partitions, policy),
        leader_topic_name(app_id): (1, {}),
    }


async def ensure_topics(settings, app_id: str = DEFAULT_APP_ID, *, compact_changelog: bool = False) -> dict[str, str]:
    """Create kvguard's topics and Faust's internal ones (idempotent); ``{name: created|exists}``."""
    # aiokafka's admin client only when topics are created
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    from kvguard.bus.kafka import client_kwargs, create_topics

    result = await create_topics(settings, settings.topics.all())
    admin = AIOKafkaAdminClient(**client_kwargs(settings.kafka))
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        internal = internal_topics(settings, app_id, compact_changelog=compact_changelog)
        wanted = [NewTopic(name, num_partitions=n, replication_factor=1, topic_configs=configs)
                  for name, (n, configs) in internal.items() if name not in existing]
        for name in internal:
            result[name] = "exists" if name in existing else "created"
        if wanted:
            response = await admin.create_topics(wanted)
            for item in response.topic_errors:
                name, code = item[0], item[1]
                if code not in (0, 36):  # 36: TOPIC_ALREADY_EXISTS
                    raise RuntimeError(f"creating Faust topic {name!r} on {settings.kafka.bootstrap} "
                                       f"failed: error {code}")
    finally:
        await admin.close()
    return result


async def broker_reachable(settings) -> None:
    """Connect an admin client to ``kafka.bootstrap`` and close it; raises what aiokafka raises when
    no broker answers, so the worker can say so in one line before Faust starts (Faust would log
    its own traceback)."""
    # aiokafka's admin client only when the worker checks its broker
    from aiokafka.admin import AIOKafkaAdminClient

    from kvguard.bus.kafka import client_kwargs

    admin = AIOKafkaAdminClient(**client_kwargs(settings.kafka))
    await admin.start()
    await admin.close()


@dataclass(slots=True)
class WorkerCounters:
    records: int = 0
    batches: int = 0
    events: int = 0
    duplicates: int = 0
    ticks: int = 0
    alerts: int = 0
    dead_lettered: int = 0
    tombstones: int = 0  # records with a null value (dead-lettered as "tombstone")
    checkpoints: int = 0
    nodes_restored: int = 0
    nodes_dropped: int = 0
    gap_fills: int = 0
    log_rebuilds: int = 0  # events partitions that started over under the worker (a broker lost its data)
    rejected: int = 0  # batches the core did not apply (dead-lettered)
    errors: int = 0  # records whose handling raised (dead-lettered)
    nodes_evicted: int = 0  # by the core's cap or the idle timeout (checkpoint deleted)
    dlq_failed: int = 0
    idle_flushes: int = 0  # partial ticks published for nodes idle past streams.idle_flush_s
    flushes_deferred: int = 0  # idle nodes not flushed yet: their partition held records not yet handled
    flush_errors: int = 0  # idle-flush rounds that raised (logged; the timer goes on)

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


def _node_key(prefix: bytes, node: str, *rest) -> bytes:
    return b"|".join([prefix, node.encode(), *(str(x).encode() for x in rest)])


class StreamsWorker:
    """The agent's logic, kept apart from Faust's decorators so it reads (and tests) plainly."""

    def __init__(self, settings, config: StreamConfig, predictor: Predictor | None, *, table, metrics_topic,
                 alerts_topic, dlq_topic, checkpoint_every_ticks: int = 6, app_id: str = DEFAULT_APP_ID,
                 fetch_back=None, highwater=None, clock=time.monotonic):
        """``highwater(partition)``: the events partition's high watermark as last fetched (None
        when unknown); the idle flush waits for the worker to reach it. ``clock``: wall seconds
        (monotonic) for the idle timeouts."""
        if checkpoint_every_ticks <= 0:
            raise ValueError(f"checkpoint_every_ticks must be > 0, got {checkpoint_every_ticks}")
        self.settings = settings
        self.core = StreamCore(config, predictor)
        self.table = table
        self.metrics_topic = metrics_topic
        self.alerts_topic = alerts_topic
        self.dlq_topic = dlq_topic
        self.checkpoint_every_ticks = checkpoint_every_ticks
        self.app_id = app_id
        self.partition_of: dict[str, int] = {}
        self.ticks_since_checkpoint: dict[str, int] = {}
        self.last_offset: dict[str, int] = {}  # events offset of each node's last applied batch
        self.events_topic = settings.topics.name("events")
        self.fetch_back = fetch_back or FetchBack(settings)
        self.checkpointed: set[str] = set()
        self.in_flight: list = []
        self.counters = WorkerCounters()
        self.clock = clock
        self.idle_sweep = IdleSweep(settings.streams.node_idle_timeout_s, now_s=clock())
        self.idle_flush_s = idle_flush_s(settings, config)
        self.highwater = highwater
        self.handled_offset: dict[int, int] = {}  # events partition -> offset of the last record handled
        # the agent and the flush timer share the core: one holds it across its awaits at a time
        self._busy = asyncio.Lock()

    async def handle(self, events) -> None:
        """Process a chunk of consumed events: apply every batch, send the outputs, and write the
        checkpoints that fell due once every output sent so far is on the broker."""
        async with self._busy:
            await self._handle(events)

    async def _handle(self, events) -> None:
        ticks, alerts = [], []
        due: dict[str, int] = {}  # node -> partition, checkpoints to write after this chunk
        for event in events:
            message = event.message
            value = event.value
            self.counters.records += 1
            self.handled_offset[message.partition] = message.offset
            headers = _header_pairs(message.headers)
            try:
                batch = decode_batch(value, headers, limits=self.core.config.limits)
                check_key(message.key, batch.node)
            except DecodeError as exc:
                await self.dead_letter(message, value, headers, exc.reason, exc.detail)
                continue
            except InvalidRecord as exc:
                await self.dead_letter(message, value, headers, "invalid", exc.detail)
                continue
            except Exception as err:  # a decoder bug must not stop the worker either
                self.counters.errors += 1
                log.error("decoding %s/%d@%d raised %s: %s; dead-lettered, going on", message.topic,
                          message.partition, message.offset, type(err).__name__, err, exc_info=err)
                await self.dead_letter(message, value, headers, "processing_error",
                                       f"decoding raised {type(err).__name__}: {err}")
                continue
            try:
                await self._handle_batch(batch, message, value, headers, ticks, alerts, due)
            except Exception as err:  # one poison record must not stop the worker
                self.counters.errors += 1
                log.error("handling %s/%d@%d raised %s: %s; dead-lettered, going on", message.topic,
                          message.partition, message.offset, type(err).__name__, err, exc_info=err)
                await self.dead_letter(message, value, headers, "processing_error", f"{type(err).__name__}: {err}")
            await self._drop_evicted(due)
        if self.idle_sweep.due(self.clock()):
            await self.evict_idle(self.clock(), due)
        await self._send(ticks, alerts, due)

    async def _send(self, ticks, alerts, due: dict[str, int]) -> None:
        await self.publish(ticks, alerts)
        if due:  # a checkpoint must never get ahead of the outputs its batches produced
            await self.wait_outputs()
            # a partition revoked during the wait took its nodes away: their next owner has the table
            due = {node: p for node, p in due.items() if node in self.core.nodes and node in self.last_offset}
            await asyncio.gather(*(self.checkpoint(node, partition) for node, partition in due.items()))
            await self.seal(set(due.values()))

    async def flush_idle(self, now_s: float) -> list[str]:
        """Publish the pending partial tick of each node without batches for ``idle_flush_s`` at
        monotonic ``now_s`` (and checkpoint it), then run the idle-eviction sweep when due.
        Returns the nodes flushed. Called by the app's timer."""
        async with self._busy:
            ticks, alerts = finish_nodes(self.core, self._idle_pending(now_s))
            due = {t.node: self.partition_of[t.node] for t in ticks if t.node in self.partition_of}
            self.counters.idle_flushes += len(ticks)
            if self.idle_sweep.due(now_s):
                await self.evict_idle(now_s, due)
            await self._send(ticks, alerts, due)
        if ticks:
            log.info("idle flush: partial ticks of %d node(s) without batches for %g s", len(ticks), self.idle_flush_s)
        return [t.node for t in ticks]

    def _idle_pending(self, now_s: float) -> list[str]:
        """Nodes idle for ``idle_flush_s`` with events since their last tick, whose partition the
        worker has handled up to its high watermark."""
        nodes = []
        for node in self.idle_sweep.silent_for(now_s, self.idle_flush_s):
            st = self.core.nodes.get(node)
            if st is None or st.events_since_tick == 0:
                continue
            if not self._caught_up(self.partition_of.get(node)):
                self.counters.flushes_deferred += 1
                continue
            nodes.append(node)
        return nodes

    def _caught_up(self, partition: int | None) -> bool:
        """No record of ``partition`` is waiting to be handled (as far as the consumer knows)."""
        if partition is None or self.highwater is None:
            return True
        try:
            end = self.highwater(partition)
        except Exception as err:  # noqa: BLE001 - no fetch state (not assigned yet): nothing known to wait for
            log.debug("no high watermark for partition %d: %s", partition, err)
            return True
        return end is None or self.handled_offset.get(partition, -1) + 1 >= end

    async def _handle_batch(self, batch, message, value, headers, ticks, alerts, due) -> None:
        node = batch.node
        moved = self.partition_of.get(node, message.partition) != message.partition  # the topic was resized
        self.partition_of[node] = message.partition
        self.idle_sweep.seen(node, self.clock())
        st = self.core.nodes.get(node)
        if st is None:
            st = self.restore(node)
        if not moved and self._log_went_back(st, batch, message.offset):
            self.rebuild_offsets(message.partition, node, batch, message.offset)
        if self._missed_batches(st, batch):
            await self._fill_gap(node, st, batch, message, ticks, alerts, due)
        duplicates = st.duplicates
        new_ticks, new_alerts = self.core.process(batch)
        for rejection in self.core.rejected:
            self.counters.rejected += 1
            await self.dead_letter(message, value, headers, rejection.reason, rejection.detail)
        if self.core.rejected:
            return
        if st.duplicates != duplicates:
            self.counters.duplicates += 1
            return
        self.counters.batches += 1
        self.counters.events += len(batch)
        ticks += new_ticks
        alerts += new_alerts
        self._applied(node, message.partition, message.offset, len(new_ticks), due)

    async def _drop_evicted(self, due: dict[str, int]) -> None:
        """Forget the worker's bookkeeping of nodes the core evicted, and delete their checkpoints."""
        for node in self.core.take_evicted():
            partition = self.partition_of.pop(node, None)
            self.idle_sweep.forget(node)
            self.last_offset.pop(node, None)
            self.ticks_since_checkpoint.pop(node, None)
            due.pop(node, None)
            self.counters.nodes_evicted += 1
            if node in self.checkpointed:
                self.checkpointed.discard(node)
                key = _node_key(b"C", node)
                self.table.data.pop(key, None)
                if partition is not None:
                    await self.table.send_changelog(partition, key, None, value_serializer="raw")

    async def evict_idle(self, now_s: float, due: dict[str, int] | None = None) -> list[str]:
        """Evict nodes without batches for ``streams.node_idle_timeout_s`` at monotonic ``now_s``."""
        idle = self.idle_sweep.sweep(now_s)
        for node in idle:
            self.core.forget(node)
        await self._drop_evicted({} if due is None else due)
        return idle

    async def publish(self, ticks, alerts) -> None:
        """Send outputs; delivery is awaited before the next checkpoint (and Faust flushes the
        producer before it commits offsets), not per chunk."""
        topics = {"metrics": self.metrics_topic, "alerts": self.alerts_topic}
        for r in output_records(ticks, alerts):
            self.in_flight.append(await topics[r.kind].send(key=r.key.encode(), value=r.value, headers=r.headers))
        self.in_flight = [f for f in self.in_flight if not f.done()]
        self.counters.ticks += len(ticks)
        self.counters.alerts += len(alerts)

    async def wait_outputs(self) -> None:
        if self.in_flight:
            await asyncio.gather(*self.in_flight)
            self.in_flight = []

    def checkpoint(self, node: str, partition: int):
        """``C|<node>`` = the events offset of the node's last applied batch (8 bytes) + its state.
        Returns the changelog send's future."""
        value = _OFFSET.pack(self.last_offset[node]) + self.core.nodes[node].to_bytes()
        self.table.data[_node_key(b"C", node)] = value
        self.checkpointed.add(node)
        self.ticks_since_checkpoint[node] = 0
        self.counters.checkpoints += 1
        log.debug("checkpoint %s seq %s offset %d -> changelog partition %d", node, self.core.nodes[node].seq,
                  self.last_offset[node], partition)
        # the changelog partition of the record that caused it (chunks have no single "current event")
        return self.table.send_changelog(partition, _node_key(b"C", node), value)

    async def seal(self, partitions: set[int]) -> None:
        """End each written changelog partition with a one-record batch (a tombstone).

        Tansu 0.6 answers ListOffsets(latest) with the base offset of the partition's last
        record batch + 1, not its last offset + 1, and Faust's table recovery reads only up to
        that: checkpoints sharing the last batch would be skipped. Sent after the checkpoints
        are delivered, the tombstone is a batch of its own, so every checkpoint precedes the end
        offset the broker reports."""
        await asyncio.gather(*(self.table.send_changelog(p, _SEAL_KEY, None, value_serializer="raw")
                               for p in sorted(partitions)))

    def _applied(self, node: str, partition: int, offset: int, n_ticks: int, due: dict[str, int]) -> None:
        self.last_offset[node] = offset
        n = self.ticks_since_checkpoint[node] = self.ticks_since_checkpoint.get(node, 0) + n_ticks
        if n >= self.checkpoint_every_ticks or node not in self.checkpointed:
            due[node] = partition

    def _log_went_back(self, st: NodeState, batch, offset: int) -> bool:
        """A batch new to its node at or below the offset of the node's last applied batch.

        A partition's offsets only grow on a broker that keeps its log, and a node's batches grow
        with them (one partition, in order); a redelivery comes back with its old seq. A new seq at
        an old offset means the events log started over: the broker lost its data (a memory-only
        broker restarted, a cluster rebuilt)."""
        last = self.last_offset.get(batch.node)
        if last is None or offset > last or st.epoch is None:
            return False
        return batch.epoch > st.epoch or (batch.epoch == st.epoch and batch.seq > st.seq)

    def rebuild_offsets(self, partition: int, node: str, batch, offset: int) -> list[str]:
        """The broker lost events partition ``partition`` (``_log_went_back``): the offsets the worker
        holds for its nodes, and the checkpoints that carry them, refer to a log that is gone.

        The nodes keep the state they have (it is what their batches made, none of it is wrong);
        their offsets are dropped, so no gap is read back from the new log, and their checkpoints
        are written again, with offsets of the new log, at their next batch. A node whose batches
        were lost with the broker shows a seq gap and is unsynced until its next SNAPSHOT (the
        core's resync), and so is a node this worker holds only in an old checkpoint. Returns the
        nodes of the partition."""
        nodes = [n for n, p in self.partition_of.items() if p == partition]
        for other in nodes:
            self.last_offset.pop(other, None)
            self.checkpointed.discard(other)
            self.ticks_since_checkpoint[other] = 0
        self.counters.log_rebuilds += 1
        log.warning("events partition %d started over: node %s's batch epoch %d seq %d is at offset %d, at or "
                    "below its last applied batch's. The broker lost its data (a memory-only or rebuilt broker): "
                    "the offsets and checkpoints of %d node(s) of the partition are rebuilt from their next batches, "
                    "and a node whose batches were lost resyncs from its next snapshot",
                    partition, node, batch.epoch, batch.seq, offset, len(nodes))
        return nodes

    def _missed_batches(self, st: NodeState, batch) -> bool:
        """Batches of this node missing before ``batch`` that the events topic may still hold."""
        return (st.epoch is not None and batch.epoch == st.epoch and batch.seq > st.seq + 1
                and batch.node in self.last_offset)

    async def _fill_gap(self, node: str, st: NodeState, batch, message, ticks, alerts, due) -> None:
        """Read the node's missing batches back from the events topic (between its last applied
        offset and this record) and apply them, outputs included. What the topic does not hold
        stays a gap: the core then marks the node unsynced."""
        start = self.last_offset[node] + 1
        records = await self.fetch_back(self.events_topic, message.partition, start, message.offset)
        self.counters.gap_fills += 1
        found = 0
        for offset, value in records:
            try:
                missing = decode_batch(value)
            except DecodeError:
                continue  # the main path dead-letters it
            if missing.node != node or missing.epoch != batch.epoch or not st.seq < missing.seq < batch.seq:
                continue
            new_ticks, new_alerts = self.core.process(missing)
            if self.core.rejected:
                continue
            ticks += new_ticks
            alerts += new_alerts
            found += 1
            self.counters.batches += 1
            self.counters.events += len(missing)
            self._applied(node, message.partition, offset, len(new_ticks), due)
        log.warning("node %s: seq gap before seq %d; read %d missing batches back from %s/%d offsets %d..%d",
                    node, batch.seq, found, self.events_topic, message.partition, start, message.offset - 1)

    def restore(self, node: str) -> NodeState:
        """Rebuild a node from its checkpoint. Its batches after the checkpoint's offset are read
        back when its next batch shows the seq gap (``_fill_gap``)."""
        core = self.core
        checkpoint = self.table.get(_node_key(b"C", node))
        if checkpoint is not None:
            (offset,) = _OFFSET.unpack_from(checkpoint)
            core.nodes[node] = NodeState.from_bytes(checkpoint[_OFFSET.size:], core.config,
                                                    with_predictor=core.predictor is not None)
            self.last_offset[node] = offset
            self.checkpointed.add(node)
            self.counters.nodes_restored += 1
            log.info("node %s restored from the changelog (checkpoint at offset %d, seq %s)",
                     node, offset, core.nodes[node].seq)
        self.ticks_since_checkpoint[node] = 0
        return core.node_state(node)

    def drop_partitions(self, partitions: set[int]) -> None:
        """Forget nodes of revoked partitions: their next owner continues from the table."""
        for node in [n for n, p in self.partition_of.items() if p in partitions]:
            self.core.nodes.pop(node, None)
            self.partition_of.pop(node, None)
            self.last_offset.pop(node, None)
            self.checkpointed.discard(node)
            self.ticks_since_checkpoint.pop(node, None)
            self.idle_sweep.forget(node)
            self.counters.nodes_dropped += 1

    async def dead_letter(self, message, value: bytes | None, headers, reason: str, detail: str) -> None:
        """Send one record to the DLQ, bounded (``DlqRecord.of``); never raises: a failure is
        counted and logged, so no record can stop the agent."""
        self.counters.dead_lettered += 1
        if reason == "tombstone":
            self.counters.tombstones += 1
        log.warning("dead-lettered %s/%d@%d: %s: %s", message.topic, message.partition, message.offset,
                    reason, detail[:300])
        try:
            record = DlqRecord.of(reason=reason, detail=detail, topic=message.topic, partition=message.partition,
                                  offset=message.offset, key=message.key, value=value, headers=headers,
                                  group=self.app_id, component="streams", dead_lettered_at_ns=time.time_ns())
            fut = await self.dlq_topic.send(
                key=dlq_key(message.key), value=record.to_bytes(),
                headers=make_headers("dlq", "kvguard-streams",
                                     record_id=f"{message.topic}/{message.partition}/{message.offset}"))
            await fut
        except Exception as exc:  # noqa: BLE001 - a DLQ outage must not stop the worker: count it and go on
            self.counters.dlq_failed += 1
            log.error("could not dead-letter %s/%d@%d (%s): %s", message.topic, message.partition,
                      message.offset, reason, exc)


def idle_flush_s(settings, config: StreamConfig) -> float:
    """Wall seconds without batches after which a node's pending tick is flushed:
    ``streams.idle_flush_s``, else two ticks."""
    value = settings.streams.idle_flush_s
    return 2 * config.tick_s if value is None else float(value)


def finish_nodes(core: StreamCore, nodes: list[str]) -> tuple[list, list]:
    """``core.finish()`` for ``nodes`` only: their pending ticks, marked partial; others untouched.

    ``StreamCore.finish`` covers every node it holds and reads them from ``core.nodes`` alone, so
    it runs over a map of just these nodes; the full map (its recency order too) is put back."""
    if not nodes:
        return [], []
    held = core.nodes
    core.nodes = {node: held[node] for node in nodes if node in held}
    try:
        return core.finish()
    finally:
        core.nodes = held


class FetchBack:
    """Reads a range of one events partition with a short-lived, group-less aiokafka consumer.

    Faust's own consumer is not used for this: its ``seek`` touches the aiokafka consumer from
    outside its thread (and stalled the fetcher in tests), and seeking would re-deliver records
    the agent has already handled.
    """

    def __init__(self, settings, timeout_s: float = 30.0):
        self.settings = settings
        self.timeout_s = timeout_s

    async def __call__(self, topic: str, partition: int, start: int, stop: int) -> list[tuple[int, bytes]]:
        """(offset, value) of the records at offsets [start, stop)."""
        # aiokafka only when a gap is read back from the events topic
        from aiokafka import AIOKafkaConsumer, TopicPartition

        from kvguard.bus.kafka import client_kwargs

        if stop <= start:
            return []
        consumer = AIOKafkaConsumer(group_id=None, enable_auto_commit=False, **client_kwargs(self.settings.kafka))
        await consumer.start()
        try:
            tp = TopicPartition(topic, partition)
            consumer.assign([tp])
            consumer.seek(tp, start)
            out: list[tuple[int, bytes]] = []
            deadline = time.monotonic() + self.timeout_s
            position = start
            while position < stop and time.monotonic() < deadline:
                got = await consumer.getmany(tp, timeout_ms=500, max_records=stop - position)
                for record in got.get(tp, []):
                    if record.offset >= stop:
                        break
                    out.append((record.offset, record.value))
                    position = record.offset + 1
            return out
        finally:
            await consumer.stop()


def _header_pairs(headers) -> list[tuple[str, bytes]]:
    if not headers:
        return []
    items = headers.items() if isinstance(headers, dict) else headers
    return [(k if isinstance(k, str) else k.decode(), bytes(v) if v is not None else b"") for k, v in items]


def fetch_max_wait_ms(settings) -> int:
    """How long the worker's consumer lets a fetch wait at the broker for data:
    ``kafka.consumer_options["fetch_max_wait_ms"]`` when given (it wins over the fields, as for
    every kvguard consumer), else ``kafka.fetch_max_wait_ms``."""
    value = settings.kafka.consumer_options.get("fetch_max_wait_ms", settings.kafka.fetch_max_wait_ms)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"kafka.consumer_options.fetch_max_wait_ms: must be an int > 0, got {value!r}")
    return value


def _app_class(wait_ms: int):
    """``faust.App`` whose Kafka consumer lets fetches wait at most ``wait_ms`` at the broker.

    Faust 0.15's aiokafka driver builds its consumer with ``fetch_max_wait_ms=1500`` and no
    setting for it. On a broker that holds a fetch for the full wait before returning records
    that arrived meanwhile (Tansu 0.6), that wait is added to the decision latency (docs/ARCHITECTURE.md, "Targets")."""
    # faust takes a second to import and patches the event loop: only when the worker builds its app
    import faust
    from faust.transport.drivers import aiokafka as driver

    class ConsumerThread(driver.AIOKafkaConsumerThread):
        def _create_worker_consumer(self, transport):
            consumer = super()._create_worker_consumer(transport)
            # read by AIOKafkaConsumer.start() when it builds its fetcher; not started yet here
            consumer._fetch_max_wait_ms = wait_ms
            return consumer

    class Consumer(driver.Consumer):
        def _new_consumer_thread(self):
            return ConsumerThread(self, loop=self.loop, beacon=self.beacon)

    class Transport(driver.Transport):
        pass

    Transport.Consumer = Consumer

    class App(faust.App):
        def _new_transport(self):
            return Transport(self.conf.broker_consumer, self)

    return App


def build_app(settings, *, config: StreamConfig, predictor: Predictor | None = None, app_id: str = DEFAULT_APP_ID,
              datadir: str | None = None, checkpoint_every_ticks: int = 6, max_records: int | None = None,
              max_wait_s: float | None = None):
    """A configured Faust app and its ``StreamsWorker`` over the core's ``config`` (the composition
    root's, ``Graph.stream_config``). Connects to nothing until started.
    The agent handles up to ``max_records`` records at a time, waiting at most ``max_wait_s``
    (default ``streams.chunk_max_records`` / ``streams.chunk_max_wait_s``); outputs go out with
    the producer linger of ``kafka.linger_ms``. A timer flushes idle nodes (``StreamsWorker.flush_idle``)."""
    # faust only when the worker builds its app (see _app_class)
    from faust.types import TP

    kafka = settings.kafka
    max_records = settings.streams.chunk_max_records if max_records is None else max_records
    max_wait_s = settings.streams.chunk_max_wait_s if max_wait_s is None else max_wait_s
    events_partitions = settings.topics.events.partitions
    app = _app_class(fetch_max_wait_ms(settings))(
        app_id,
        broker=[f"kafka://{host.strip()}" for host in kafka.bootstrap.split(",")],
        broker_client_id=kafka.client_id,
        broker_credentials=_credentials(kafka),
        store="memory://",
        datadir=datadir or tempfile.mkdtemp(prefix=f"{app_id}-"),
        topic_partitions=events_partitions,
        topic_allow_declare=False,
        topic_disable_leader=False,
        table_standby_replicas=0,
        consumer_auto_offset_reset="earliest",
        broker_session_timeout=kafka.session_timeout_ms / 1000,
        broker_heartbeat_interval=kafka.heartbeat_interval_ms / 1000,
        broker_request_timeout=kafka.request_timeout_ms / 1000,
        web_enabled=False,
        stream_wait_empty=False,
        producer_linger=kafka.linger_ms / 1000,
        processing_guarantee="at_least_once",
        # Faust's check compares the changelog offsets this process read with the changelog's end on
        # the broker and crashes the worker when a broker that lost its data reports a lower end. It
        # guards a RocksDB store outliving its topic; the memory store lives and dies with the process,
        # so the table it holds is what the process read and wrote. The worker sees the loss itself,
        # on the events log, and rebuilds its offsets and checkpoints (StreamsWorker.rebuild_offsets).
        recovery_consistency_check=False,
    )
    raw = {"key_type": bytes, "value_type": bytes, "key_serializer": "raw", "value_serializer": "raw"}
    events = app.topic(settings.topics.name("events"), partitions=events_partitions, **raw)
    metrics = app.topic(settings.topics.name("metrics"), **raw)
    alerts = app.topic(settings.topics.name("alerts"), **raw)
    dlq = app.topic(settings.topics.name("dlq"), **raw)
    table = app.Table(TABLE_NAME, default=None, partitions=events_partitions, key_type=bytes, value_type=bytes)
    events_name = events.get_topic_name()
    worker = StreamsWorker(settings, config, predictor, table=table, metrics_topic=metrics, alerts_topic=alerts, dlq_topic=dlq,
                           checkpoint_every_ticks=checkpoint_every_ticks, app_id=app_id,
                           highwater=lambda partition: app.consumer.highwater(TP(events_name, partition)))

    @app.agent(events, name="kvguard-streams-events")
    async def process_events(stream):
        async for chunk in stream.take_events(max_records, within=max_wait_s):
            await worker.handle(chunk)

    # a quarter of the idle interval: a node is flushed within 1.25 idle intervals of its last batch
    flush_every_s = max(0.05, worker.idle_flush_s / 4)

    @app.timer(flush_every_s, name="kvguard-streams-idle-flush")
    async def flush_idle_nodes() -> None:
        try:
            await worker.flush_idle(worker.clock())
        except Exception as err:  # noqa: BLE001 - a failed round (broker away) must not stop the timer or the worker
            worker.counters.flush_errors += 1
            log.error("idle flush raised %s: %s; next round in %g s", type(err).__name__, err, flush_every_s,
                      exc_info=err)

    @app.on_partitions_revoked.connect
    async def on_revoked(sender, revoked, **kwargs) -> None:
        worker.drop_partitions({tp.partition for tp in revoked if tp.topic == events_name})

    @app.on_partitions_assigned.connect
    async def on_assigned(sender, assigned, **kwargs) -> None:
        mine = sorted(tp.partition for tp in assigned if tp.topic == events_name)
        log.info("kvguard-streams assigned %s partitions %s", events_name, mine)

    app.kvguard_worker = worker
    return app, worker


def _credentials(kafka):
    """Faust credentials from kvguard's Kafka settings (None for PLAINTEXT)."""
    if kafka.security_protocol == "PLAINTEXT":
        return None
    # faust and aiokafka's TLS helpers only when the worker builds its app
    import faust

    ssl_context = None
    if kafka.security_protocol in ("SSL", "SASL_SSL"):
        from aiokafka.helpers import create_ssl_context

        ssl_context = create_ssl_context(cafile=kafka.ssl_cafile, certfile=kafka.ssl_certfile,
                                         keyfile=kafka.ssl_keyfile)
    if kafka.security_protocol.startswith("SASL"):
        return faust.SASLCredentials(username=kafka.sasl_username, password=kafka.sasl_password,
                                     mechanism=kafka.sasl_mechanism or "PLAIN", ssl_context=ssl_context)
    return faust.SSLCredentials(ssl_context)
