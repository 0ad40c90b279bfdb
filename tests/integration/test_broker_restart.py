"""The broker restarted while a stream worker consumes (issue 15): the node publisher holds its
batches through the outage and sends them after it; downstream, the stream core applies each
batch once (a resent one is dropped as a redelivery), so its ticks are those of the clean
stream. The memory-only test broker starts over empty, its offsets from 0: a consumer whose
position lies inside the re-sent records skips those before it. Such a loss is detected, never
silent: each run of missing batches is a seq gap of its node, counted, the mirror unsynced (so is
a batch the publisher re-sent after a later one).
A broker that keeps its log (any real one) loses nothing."""

from __future__ import annotations

import asyncio

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
