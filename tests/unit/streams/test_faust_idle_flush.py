"""The Faust worker flushes idle nodes: a node that stops sending still gets its last (partial)
tick published once it has been silent for ``streams.idle_flush_s`` of wall time (issue 16).
No broker: the worker's logic with small working fakes and a hand-driven clock."""

import orjson
import pytest

from kvguard.config.settings import ConfigError, Settings
from kvguard.runtime.mapping import stream_config
from kvguard.streams.app import StreamsWorker, idle_flush_s
from kvguard.streams.core import NodeState, StreamConfig, StreamCore
from kvguard.streams.outputs import encode_tick
from kvguard.wire.schemas import batch_headers, encode_batch
from tests.unit.runtime.test_hostile_services import FakeTable, FakeTopic  # the worker's small working fakes
from tests.unit.streams.test_stream_hostile import two_node_stream

IDLE_S = 5.0


class Message:
    def __init__(self, offset, batch):
        self.topic, self.partition, self.offset = "kvguard.events", 0, offset
        self.key, self.value, self.headers = batch.node.encode(), encode_batch(batch), batch_headers(batch)


class Event:
    def __init__(self, message):
        self.message, self.value = message, message.value


class Clock:
    def __init__(self):
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def make_worker(clock: Clock, highwater=None) -> StreamsWorker:
    settings = Settings.load(env={"KVGUARD_STREAMS__IDLE_FLUSH_S": str(IDLE_S)})

    async def no_fetch_back(*args):
        return []

    return StreamsWorker(settings, stream_config(settings), None, table=FakeTable(),
                         metrics_topic=FakeTopic(), alerts_topic=FakeTopic(), dlq_topic=FakeTopic(),
                         fetch_back=no_fetch_back, highwater=highwater, clock=clock)


class Feed:
    """Hands batches to the worker one record at a time, each at the next events offset."""

    def __init__(self, worker: StreamsWorker):
        self.worker = worker
        self.offset = 0

    async def __call__(self, batches) -> None:
        for batch in batches:
            await self.worker.handle([Event(Message(self.offset, batch))])
            self.offset += 1


def published(worker: StreamsWorker) -> list[dict]:
    return [orjson.loads(value) for _, value in worker.metrics_topic.sent]


def split_a_stops():
    """Node "a" stops a third of the way in; node "b" goes on to its end."""
    stream = two_node_stream()
    a = [b for b in stream if b.node == "a"]
    b = [x for x in stream if x.node == "b"]
    return a[: len(a) // 3], b


async def test_a_node_that_stops_sending_gets_its_last_partial_tick_once_idle():
    a_sent, b_all = split_a_stops()
    clock = Clock()
    worker = make_worker(clock)
    feed = Feed(worker)
    await feed(a_sent)
    clock.now_s += 1
    await feed(b_all[: len(b_all) // 2])
    assert await worker.flush_idle(clock.now_s) == []  # nobody silent for IDLE_S yet
    before = len(published(worker))

    clock.now_s += IDLE_S  # "a" is silent past the interval; "b" sent a second later
    await feed(b_all[len(b_all) // 2:])
    clock.now_s += 0.5
    assert await worker.flush_idle(clock.now_s) == ["a"]

    reference = StreamCore(StreamConfig())
    reference.process_many(a_sent)
    (want,), _ = reference.finish()
    flushed = [t for t in published(worker)[before:] if t["node"] == "a"]
    assert [t["partial"] for t in flushed] == [True]
    assert flushed[0] == orjson.loads(encode_tick(want))  # the interval's state, as a log replay has it
    assert worker.counters.idle_flushes == 1
    # the flush moved the node on, and its checkpoint says so (a restored worker agrees)
    state = NodeState.from_bytes(worker.table.data[b"C|a"][8:], worker.core.config)
    assert state.events_since_tick == 0 and state.next_boundary_ns == want.ts_ns + worker.core.config.tick_ns

    clock.now_s += 10 * IDLE_S  # nothing pending any more: flushed once, not on every timer round
    assert "a" not in await worker.flush_idle(clock.now_s)


async def test_the_flush_leaves_nodes_that_keep_sending_as_an_uninterrupted_run_has_them():
    a_sent, b_all = split_a_stops()
    clock = Clock()
    worker = make_worker(clock)
    feed = Feed(worker)
    await feed(a_sent)
    for batch in b_all:
        clock.now_s += IDLE_S / 4
        await feed([batch])
        await worker.flush_idle(clock.now_s)
    reference = StreamCore(StreamConfig())
    want = [orjson.loads(encode_tick(t)) for t in reference.process_many(b_all)[0]]
    got = [t for t in published(worker) if t["node"] == "b"]
    assert got == want and not any(t["partial"] for t in got)
    assert [t["partial"] for t in published(worker) if t["node"] == "a"][-1] is True


async def test_the_flush_waits_while_the_partition_holds_records_not_yet_handled():
    a_sent, _ = split_a_stops()
    clock = Clock()
    end = {"offset": len(a_sent) + 3}  # three more records on the partition than the worker has handled
    worker = make_worker(clock, highwater=lambda partition: end["offset"])
    await Feed(worker)(a_sent)
    clock.now_s += 2 * IDLE_S
    assert await worker.flush_idle(clock.now_s) == []  # lag is not silence
    assert worker.counters.flushes_deferred == 1
    end["offset"] = len(a_sent)
    assert await worker.flush_idle(clock.now_s) == ["a"]


async def test_a_flushed_node_that_resumes_goes_on_with_the_next_interval():
    stream = [b for b in two_node_stream() if b.node == "a"]
    first, rest = stream[: len(stream) // 3], stream[len(stream) // 3:]
    clock = Clock()
    worker = make_worker(clock)
    feed = Feed(worker)
    await feed(first)
    clock.now_s += 2 * IDLE_S
    assert await worker.flush_idle(clock.now_s) == ["a"]
    await feed(rest)
    ticks = published(worker)
    stamps = [t["ts_ns"] for t in ticks]
    assert stamps == sorted(set(stamps))  # every tick id (node, ts_ns) once: consumers' dedup stays safe
    assert [t["partial"] for t in ticks].count(True) == 1


def test_idle_flush_defaults_to_two_ticks_and_must_be_positive():
    settings = Settings.load(env={"KVGUARD_STREAMS__TICK_S": "3"})
    assert idle_flush_s(settings, stream_config(settings)) == 6
    with pytest.raises(ConfigError, match=r"streams.idle_flush_s: must be > 0 \(from env KVGUARD_STREAMS__IDLE_FLUSH_S\)"):
        Settings.load(env={"KVGUARD_STREAMS__IDLE_FLUSH_S": "0"})
