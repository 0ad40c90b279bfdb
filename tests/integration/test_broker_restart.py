"""The broker restarted while a stream worker consumes (issue 15): the node publisher holds its
batches through the outage and sends them after it; downstream, the stream core applies each
batch once (a resent one is dropped as a redelivery), so its ticks are those of the clean
stream. The memory-only test broker starts over empty, its offsets from 0: a consumer whose
position lies inside the re-sent records skips those before it. Such a loss is detected, never
silent: each run of missing batches is a seq gap of its node, counted, the mirror unsynced (so is
a batch the publisher re-sent after a later one).
A broker that keeps its log (any real one) loses nothing.

Issue 28: a broker that comes back without its topics (re-created a moment later) loses no batch
of the publisher; a Faust worker lives through a broker that lost its data and resyncs."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvguard.bus.kafka import KafkaBus
from kvguard.producers.publisher import NodePublisher
from kvguard.streams.core import StreamCore
from kvguard.wire.schemas import decode_batch
from tests.integration.bus_helpers import fleet_event_log
from tests.integration.test_publisher import TOPIC, FeedSource, broker_settings, wait_for

pytestmark = pytest.mark.integration


class Worker:
    """A stream worker's loop over the events topic: records in, the core's ticks out."""

    def __init__(self, subscription):
        self.subscription = subscription
        self.core = StreamCore()
        self.ticks = []
        self.seen: dict[str, set[int]] = {}  # node -> seqs received

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                records = await self.subscription.getmany(1000, 0.2)
            except Exception:  # noqa: BLE001 - the broker is down: a worker retries, it does not die
                await asyncio.sleep(0.1)
                continue
            batches = [decode_batch(r.value) for r in records]
            for b in batches:
                self.seen.setdefault(b.node, set()).add(b.seq)
            if batches:
                self.ticks += self.core.process_many(batches)[0]

    def reached(self, last_seq: dict[str, int]) -> bool:
        nodes = self.core.nodes
        return all(node in nodes and nodes[node].seq == seq for node, seq in last_seq.items())


def tick_keys(ticks) -> list[dict]:
    return sorted((t.to_dict() for t in ticks), key=lambda d: (d["node"], d["ts_ns"]))


def missing_runs(seen: set[int], last: int) -> int:
    """Runs of consecutive seqs in 0..last that never arrived."""
    missing = sorted(set(range(last + 1)) - seen)
    return sum(1 for i, seq in enumerate(missing) if i == 0 or missing[i - 1] != seq - 1)


async def test_a_broker_restart_loses_and_duplicates_nothing_downstream_or_says_so(tansu_broker):
    broker = tansu_broker()
    broker.create_topics({TOPIC: 3})
    settings = broker_settings(broker.bootstrap)
    batches = fleet_event_log(n_gpus=2, seconds=90, step_s=5)
    third = len(batches) // 3
    before, during, after = batches[:third], batches[third:2 * third], batches[2 * third:]
    last_seq = {b.node: b.seq for b in batches}
    clean = StreamCore()
    expected = clean.process_many(list(batches))[0]

    bus = KafkaBus(settings)
    await bus.start()
    worker = Worker(bus.subscribe([TOPIC], "worker"))
    stop = asyncio.Event()
    consuming = asyncio.create_task(worker.run(stop))
    source = FeedSource()
    publisher = NodePublisher(bus, TOPIC, source, flush_interval_s=0.02, retry_backoff_s=(0.05, 0.5))
    publishing = asyncio.create_task(publisher.run())
    try:
        source.feed(before)
        await wait_for(lambda: worker.reached({b.node: b.seq for b in before}), "the worker to apply the first batches")

        broker.stop()
        source.feed(during)
        await wait_for(lambda: publisher.counters.publish_failures > 0, "a failed publish while the broker is down")
        assert publisher.buffered > 0  # held, not lost

        broker.start()  # same port, empty storage: the topic is re-created, its offsets start over
        source.feed(after)
        await wait_for(lambda: not source.pending and publisher.buffered == 0, "the backlog to drain")
        await wait_for(lambda: worker.reached(last_seq), "the worker to reach every node's last batch")
    finally:
        publisher.stop()
        await asyncio.wait_for(publishing, 30)
        stop.set()
        await asyncio.wait_for(consuming, 30)
        await bus.stop()

    assert publisher.counters.batches_dropped == 0
    keys = [(t.node, t.ts_ns) for t in worker.ticks]
    assert len(keys) == len(set(keys))  # no tick twice downstream (a re-sent batch is dropped)
    nodes = worker.core.nodes
    for node, seq in last_seq.items():  # every loss counted (a batch re-sent after a later one is one too)
        assert nodes[node].gaps >= missing_runs(worker.seen.get(node, set()), seq), node
    if not any(st.gaps for st in nodes.values()):
        assert tick_keys(worker.ticks) == tick_keys(expected)  # and none: the clean stream's ticks
    assert worker.core.counters.batches_rejected == 0 and worker.core.counters.batches_failed == 0


async def test_a_broker_that_comes_back_without_its_topics_loses_no_batch(tansu_broker):
    """A wiped broker whose topic an operator creates again (`kvguard topics create`) while the node
    publishes: Tansu takes sends to the missing topic, then answers them with UNKNOWN_SERVER_ERROR
    (code -1) for a second or two after the creation, which aiokafka marks not retriable. The
    publisher retries it (only a record too large for the broker is refused for good), so every
    batch sent once the topic exists arrives. (What Tansu acknowledged for the missing topic it
    sometimes keeps and sometimes not: a broker's loss, which the stream sees as a seq gap.)"""
    broker = tansu_broker()
    broker.create_topics({TOPIC: 3})
    settings = broker_settings(broker.bootstrap)
    batches = fleet_event_log(n_gpus=2, seconds=90, step_s=5)
    third = len(batches) // 3
    bus = KafkaBus(settings)
    await bus.start()
    source = FeedSource()
    publisher = NodePublisher(bus, TOPIC, source, flush_interval_s=0.02, retry_backoff_s=(0.05, 0.5))
    publishing = asyncio.create_task(publisher.run())
    try:
        source.feed(batches[:third])
        await wait_for(lambda: not source.pending and publisher.buffered == 0, "the first third to be delivered")
        broker.stop()
        topics, broker.topics = broker.topics, {}
        broker.start()  # empty, and without the topic
        source.feed(batches[third:2 * third])
        await wait_for(lambda: not source.pending and publisher.buffered == 0, "sends to the missing topic")
        broker.create_topics(topics)  # the operator provisions it again
        source.feed(batches[2 * third:])
        await wait_for(lambda: not source.pending and publisher.buffered == 0, "the backlog to drain")
        wanted = {(b.node, b.seq) for b in batches[2 * third:]}
        reader = bus.subscribe([TOPIC], "after")
        got: set = set()

        async def read_more() -> None:
            got.update((b.node, b.seq) for b in map(decode_batch, (r.value for r in await reader.getmany(1000, 0.5))))

        deadline = asyncio.get_running_loop().time() + 90
        while not wanted <= got and asyncio.get_running_loop().time() < deadline:
            await read_more()
    finally:
        publisher.stop()
        await asyncio.wait_for(publishing, 30)
        await bus.stop()
    assert publisher.counters.batches_refused == 0 and publisher.counters.batches_dropped == 0
    assert wanted <= got, f"{len(wanted - got)} of {len(wanted)} batches sent once the topic existed are missing"


# what a tick takes from the node's mirror, which its next snapshot makes right again after lost batches
MIRROR_FIELDS = ("u_kv", "f_ext", "f_int", "psi", "free_units", "largest_free_run_units", "n_free_runs",
                 "live_units", "cached_units", "dynamic_units")


def private_settings(broker, app_id: str):
    """Settings on a private broker, every topic the worker needs remembered by the rig, so a
    restart of the memory-only broker comes back with them (as a re-provisioned cluster would)."""
    from kvguard.config.settings import TOPIC_KINDS, Settings
    from kvguard.streams.app import internal_topics
    from tests.conftest import fast_group_options

    settings = Settings(kafka={"bootstrap": broker.bootstrap, "client_id": "restart-test", **fast_group_options()},
                        topics={"prefix": "r.", **{kind: {"partitions": 3} for kind in TOPIC_KINDS}})
    topics = {name: spec.partitions for name, spec in settings.topics.all().items()}
    topics.update({name: partitions for name, (partitions, _) in internal_topics(settings, app_id).items()})
    broker.create_topics(topics)
    return settings


async def test_the_worker_lives_through_a_broker_that_lost_its_data_and_resyncs(tansu_broker, tmp_path):
    """A stream worker that once recovered from its changelog, then the broker loses everything
    (memory-only Tansu restarted): Faust would stop it with ConsistencyError. It logs the loss,
    rebuilds its offsets and checkpoints, and every node's ticks go on to its last one. A node whose
    state came back from a checkpoint older than its last batch has lost batches: its ticks are
    marked unsynced until its next snapshot, and every tick marked synced shows the clean run's
    memory."""
    import uuid

    from tests.integration.streams_helpers import (
        OutputReader,
        WorkerProcess,
        expected_records,
        publish_batches,
        shadow_log,
    )

    broker = tansu_broker()
    app = f"kvg-{uuid.uuid4().hex[:8]}"
    settings = private_settings(broker, app)
    batches = shadow_log(n_gpus=3, seconds=150)
    third = len(batches) // 3
    expected, _ = expected_records(batches)
    last_ts = {}
    for node, ts in expected:
        last_ts[node] = max(ts, last_ts.get(node, 0))
    worker = WorkerProcess(settings, app, tmp_path, checkpoint_every_ticks=2)
    try:
        async with OutputReader(settings, "before") as out:
            await publish_batches(settings, batches[:third])
            worker.start()
            first = len(expected_records(batches[:third])[0])
            await out.until(lambda o: len(o.of("metrics")) >= first, what="the first ticks")
            await asyncio.sleep(4)  # past Faust's commit interval: the changelog holds checkpoints
            worker.kill()
            worker.start()  # recovers from the changelog: it has read offsets the broker will lose
            await publish_batches(settings, batches[third:2 * third])
            second = expected_records(batches[:2 * third])[0]
            await out.until(lambda o: set(second) <= {(d["node"], d["ts_ns"]) for d in map(json.loads, (
                r.value for r in o.of("metrics")))}, what="the restored worker's ticks")
            assert "restored from the changelog" in worker.log_text()
        broker.stop()
        broker.start()  # same port, nothing kept: every topic empty, every offset from 0
        await publish_batches(settings, batches[2 * third:])
        async with OutputReader(settings, "after") as out:
            await out.until(lambda o: {json.loads(r.value)["node"]: json.loads(r.value)["ts_ns"]
                                       for r in o.of("metrics")} == last_ts, limit_s=90,
                            what="every node's last tick after the broker lost its data")
        ticks = [json.loads(r.value) for r in out.of("metrics")]
    finally:
        alive = worker.proc is not None and worker.proc.poll() is None
        log_text = worker.log_text()
        worker.stop()
    assert alive, log_text[-3000:]
    assert "ConsistencyError" not in log_text and "started over" in log_text
    assert {t["node"]: max(u["ts_ns"] for u in ticks if u["node"] == t["node"]) for t in ticks} == last_ts
    for t in ticks:  # a tick that says synced shows the node's memory as the clean run does
        if t["synced"]:
            want = expected[(t["node"], t["ts_ns"])]
            assert {f: t[f] for f in MIRROR_FIELDS} == {f: want[f] for f in MIRROR_FIELDS}, (t["node"], t["ts_ns"])
