"""The node publisher splits batches too large for the broker, drops what can never be sent
instead of retrying it forever, and its drainer does not spin while the broker is down (issue 15)."""

import asyncio
import time

import numpy as np
import orjson
import pytest

from kvguard.bus.inproc import InprocBus
from kvguard.config.settings import Settings
from kvguard.contracts.events import EVENT_DTYPE, EventBatch, EventKind
from kvguard.producers.publisher import NodePublisher
from kvguard.streams.core import StreamCore
from kvguard.wire.schemas import decode_batch
from tests.unit.streams.test_stream_hostile import two_node_stream

TOPIC = "kvguard.events"


def one_source(batches):
    pending = [list(batches)]

    def source():
        return pending.pop() if pending else []

    return source


async def published(bus, n=10**6) -> list:
    return await bus.subscribe([TOPIC], "reader").getmany(max_records=n, timeout_s=0)


def merged_node_a() -> list[EventBatch]:
    """Node a's stream as three batches, the middle one large (with a state dump in it)."""
    a = [b for b in two_node_stream() if b.node == "a"]
    middle = a[1:-1]
    events = np.concatenate([b.events for b in middle])
    state = next((b.state for b in reversed(middle) if b.state is not None), None)
    big = EventBatch(node="a", seq=1, events=events, epoch=0, state=state)
    return [a[0], big, EventBatch(node="a", seq=2, events=a[-1].events)]


@pytest.mark.parametrize("packed", [False, True])
async def test_an_oversized_batch_is_split_to_fit_and_gives_the_same_ticks(packed):
    batches = merged_node_a()
    bus = InprocBus(auto_create=True)
    publisher = NodePublisher(bus, TOPIC, one_source(batches), max_message_bytes=2048 + 12_000, packed_columns=packed)
    assert await publisher.flush(timeout_s=5)
    records = await published(bus)
    assert all(len(r.value) <= 12_000 for r in records)
    wire = [decode_batch(r.value) for r in records]
    assert all(("colsb" in orjson.loads(r.value)) == packed for r in records)
    assert [b.seq for b in wire] == list(range(len(wire))) and len(wire) > len(batches)
    assert sum(len(b) for b in wire) == sum(len(b) for b in batches)
    assert publisher.counters.batches_split == 1 and publisher.counters.batches_oversized == 0
    direct, split = StreamCore(), StreamCore()
    want = [t.to_dict() for t in direct.process_many(batches)[0]]
    got = [t.to_dict() for b in wire for t in split.process(b)[0]]
    assert got == want and split.nodes["a"].gaps == 0


async def test_a_200k_event_batch_goes_out_under_kafka_s_one_megabyte():
    events = np.zeros(200_000, dtype=EVENT_DTYPE)
    events["ts_ns"] = np.arange(200_000) * 1_000
    events["kind"] = int(EventKind.STEP)
    events["size"] = 7
    bus = InprocBus(auto_create=True)
    publisher = NodePublisher.from_settings(bus, Settings(), one_source([EventBatch("n", 0, events)]))
    assert await publisher.flush(timeout_s=10)
    records = await published(bus)
    assert len(records) > 1 and max(len(r.value) for r in records) <= 1_048_576 - 2048
    assert sum(len(decode_batch(r.value)) for r in records) == 200_000


def test_a_piece_that_cannot_fit_is_dropped_and_counted():
    from kvguard.producers.publisher import split_batch

    batch = merged_node_a()[1]
    pieces = split_batch(batch, 3)
    assert [p.seq for p in pieces] == [1, 2, 3] and sum(len(p) for p in pieces) == len(batch)
    assert sum(p.state is not None for p in pieces) == (batch.state is not None)
    publisher = NodePublisher(InprocBus(auto_create=True), TOPIC, one_source([batch]), max_message_bytes=2048 + 200)
    publisher.drain()
    assert publisher.counters.batches_oversized > 0 and publisher.counters.events_oversized > 0


class RefusingBus:
    """A broker that refuses one record (aiokafka's MessageSizeTooLargeError unless ``error`` says
    otherwise) ``times`` times, then takes it; counts how often it was asked."""

    def __init__(self, refuse: bytes, error=None, times: int = 10**9):
        self.inner = InprocBus(auto_create=True)
        self.refuse = refuse
        self.error = error
        self.times = times
        self.attempts = 0

    async def publish(self, topic, key, value, headers=()):
        from aiokafka.errors import MessageSizeTooLargeError

        if value == self.refuse and self.attempts < self.times:
            self.attempts += 1
            future = asyncio.get_running_loop().create_future()
            future.set_exception(self.error or MessageSizeTooLargeError("the broker's message.max.bytes is smaller"))
            return future
        return await self.inner.publish(topic, key, value, headers)


async def test_a_record_the_broker_refuses_for_good_is_dropped_not_retried_forever():
    from kvguard.wire.schemas import encode_batch

    batches = [b for b in two_node_stream() if b.node == "a"][:3]
    bus = RefusingBus(encode_batch(batches[1]))
    publisher = NodePublisher(bus, TOPIC, one_source(batches))
    assert await publisher.flush(timeout_s=3), "flush must finish: nothing left to retry"
    assert bus.attempts == 1 and publisher.counters.batches_refused == 1
    assert publisher.buffered == 0 and len(await bus.inner.subscribe([TOPIC], "r").getmany(timeout_s=0)) == 2


@pytest.mark.parametrize("error", ["UnknownError", "KafkaTimeoutError", "NotLeaderForPartitionError",
                                   "UnknownTopicOrPartitionError", "BrokerNotAvailableError"])
async def test_a_failure_that_may_pass_is_retried_even_when_aiokafka_calls_it_not_retriable(error):
    # a wiped Tansu answers sends with UnknownError (-1) while its topic is re-created (issue 28)
    import aiokafka.errors

    from kvguard.wire.schemas import encode_batch

    batches = [b for b in two_node_stream() if b.node == "a"][:3]
    bus = RefusingBus(encode_batch(batches[1]), error=getattr(aiokafka.errors, error)(), times=3)
    publisher = NodePublisher(bus, TOPIC, one_source(batches), retry_backoff_s=(0.01, 0.02))
    assert await publisher.flush(timeout_s=5)
    assert bus.attempts == 3 and publisher.counters.batches_refused == 0 and publisher.counters.publish_failures == 3
    assert len(await bus.inner.subscribe([TOPIC], "r").getmany(timeout_s=0)) == 3


class DownBus:
    async def publish(self, topic, key, value, headers=()):
        future = asyncio.get_running_loop().create_future()
        future.set_exception(ConnectionError("broker down"))
        return future

    async def start(self):
        raise ConnectionError("broker down")


async def test_the_drainer_does_not_spin_while_the_broker_is_down():
    calls = {"n": 0}
    events = np.zeros(50, dtype=EVENT_DTYPE)
    events["kind"] = int(EventKind.STEP)

    def source():
        calls["n"] += 1
        return [EventBatch("n", calls["n"] - 1, events)] if calls["n"] == 1 else []

    publisher = NodePublisher(DownBus(), TOPIC, source, flush_interval_s=0.1, max_batch_events=10,
                              retry_backoff_s=(0.05, 0.05))
    task = asyncio.create_task(publisher.run())
    started = time.monotonic()
    await asyncio.sleep(0.5)
    publisher.stop()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    elapsed = time.monotonic() - started
    assert calls["n"] <= elapsed / 0.1 + 3, f"the source was polled {calls['n']} times in {elapsed:.2f} s"


def test_the_message_limit_comes_from_settings():
    settings = Settings.load(env={"KVGUARD_KAFKA__MAX_MESSAGE_BYTES": "500000"})
    publisher = NodePublisher.from_settings(InprocBus(auto_create=True), settings, list)
    assert publisher.max_value_bytes == 500_000 - 2048
    with pytest.raises(ValueError, match="max_message_bytes"):
        NodePublisher(InprocBus(auto_create=True), TOPIC, list, max_message_bytes=100)
