"""The node publisher rides through a broker outage with bounded memory and resumes by itself."""

from __future__ import annotations

import asyncio
import time

from kvguard.bus.kafka import KafkaBus
from kvguard.config.settings import Settings
from kvguard.producers.publisher import NodePublisher
from kvguard.wire.schemas import decode_batch
from tests.conftest import fast_group_options
from tests.integration.bus_helpers import consume, fleet_event_log

TOPIC = "kvguard.events"


def broker_settings(bootstrap: str) -> Settings:
    return Settings(kafka={
        "bootstrap": bootstrap, "client_id": "publisher-test", "request_timeout_ms": 2000,
        "send_buffer_timeout_s": 1.0, "producer_options": {"retry_backoff_ms": 50}, **fast_group_options(),
    })


class FeedSource:
    """A source the test feeds by hand (``feed``), as a pool would fill between drains."""

    def __init__(self):
        self.pending = []

    def feed(self, batches):
        self.pending.extend(batches)

    def __call__(self):
        out, self.pending = self.pending, []
        return out


async def wait_for(condition, what: str, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what} after {limit_s} s")
        await asyncio.sleep(0.05)


async def test_publisher_survives_broker_stop_and_restart(tansu_broker):
    broker = tansu_broker()
    broker.create_topics({TOPIC: 3})
    settings = broker_settings(broker.bootstrap)
    batches = fleet_event_log(n_gpus=2, seconds=90, step_s=5)
    third = len(batches) // 3
    before, during, after = batches[:third], batches[third:2 * third], batches[2 * third:]

    bus = KafkaBus(settings)
    await bus.start()
    source = FeedSource()
    publisher = NodePublisher(bus, TOPIC, source, flush_interval_s=0.02, retry_backoff_s=(0.05, 0.5))
    running = asyncio.create_task(publisher.run())
    try:
        source.feed(before)
        await wait_for(lambda: publisher.counters.batches_published == len(before), "the first batches")

        broker.stop()
        source.feed(during)
        await wait_for(lambda: publisher.counters.publish_failures > 0, "a failed publish while the broker is down")
        assert publisher.buffered > 0  # held, not lost

        broker.start()  # same port; the rig re-creates the topic (memory storage starts empty)
        source.feed(after)
        await wait_for(lambda: not source.pending and publisher.buffered == 0, "the backlog to drain")
    finally:
        publisher.stop()
        await asyncio.wait_for(running, 30)
    assert publisher.counters.batches_dropped == 0
    assert publisher.counters.batches_published >= len(batches)

    # everything sent since the outage began is on the restarted broker, each node in order
    sub = bus.subscribe([TOPIC], "after-restart")
    wanted = {(b.node, b.seq) for b in during + after}
    got: dict[str, list[int]] = {}
    records = []
    deadline = time.monotonic() + 60
    while not wanted <= {(n, s) for n, seqs in got.items() for s in seqs}:
        assert time.monotonic() < deadline, f"missing {sorted(wanted - {(n, s) for n, v in got.items() for s in v})[:5]}"
        for record in await sub.getmany(1000, 0.5):
            batch = decode_batch(record.value)
            got.setdefault(batch.node, []).append(batch.seq)
            records.append(record)
    for node, seqs in got.items():
        unique_in_order = list(dict.fromkeys(seqs))  # duplicates of a retried batch are allowed
        assert unique_in_order == sorted(unique_in_order), f"{node} out of order: {seqs}"
    await bus.stop()


async def test_outage_buffer_is_bounded_and_drops_only_the_oldest(tansu_broker):
    broker = tansu_broker()
    broker.create_topics({TOPIC: 3})
    broker.stop()  # the node comes up while the broker is down
    settings = broker_settings(broker.bootstrap)
    batches = fleet_event_log(n_gpus=1, seconds=120, step_s=5)
    bound = 5
    assert len(batches) > bound

    bus = KafkaBus(settings)  # not started: the publisher keeps trying
    source = FeedSource()
    publisher = NodePublisher(bus, TOPIC, source, flush_interval_s=0.02, max_buffered_batches=bound,
                              retry_backoff_s=(0.05, 0.2))
    running = asyncio.create_task(publisher.run())
    try:
        source.feed(batches)
        await wait_for(lambda: publisher.counters.batches_taken == len(batches), "the source to be drained")
        assert publisher.buffered == bound
        assert publisher.counters.batches_dropped == len(batches) - bound
        assert publisher.counters.events_dropped == sum(len(b) for b in batches[:-bound])

        broker.start()
        await wait_for(lambda: publisher.buffered == 0, "the bounded backlog to drain")
    finally:
        publisher.stop()
        await asyncio.wait_for(running, 30)

    sub = bus.subscribe([TOPIC], "bounded")
    records = await consume(sub, bound)
    assert sorted(decode_batch(r.value).seq for r in records) == [b.seq for b in batches[-bound:]]
    await bus.stop()


async def test_kafka_send_buffer_is_bounded_with_backpressure_and_a_drop_counter(tansu_broker):
    from kvguard.bus.base import SendBufferFull, publish_and_wait

    broker = tansu_broker()
    broker.create_topics({TOPIC: 1})
    settings = broker_settings(broker.bootstrap)
    settings.kafka.send_buffer_records = 2
    settings.kafka.send_buffer_timeout_s = 0.2
    bus = KafkaBus(settings)
    await bus.start()
    try:
        await publish_and_wait(bus, TOPIC, "n", b"first")  # metadata known from here on
        broker.stop()
        pending = [await bus.publish(TOPIC, "n", b"held-%d" % i) for i in range(2)]
        assert bus.in_flight == 2
        try:
            await bus.publish(TOPIC, "n", b"refused")
        except SendBufferFull as exc:
            assert "2/2" in str(exc)
        else:
            raise AssertionError("publish past the send buffer bound was accepted")
        assert bus.counters.dropped == 1
        broker.start()
        for future in pending:  # delivered after the restart, or failed and counted: never silent
            try:
                await future
            except Exception:
                pass
        assert bus.in_flight == 0
        c = bus.counters
        assert c.published == 3 and c.delivered + c.delivery_failed == 3
    finally:
        await bus.stop()
