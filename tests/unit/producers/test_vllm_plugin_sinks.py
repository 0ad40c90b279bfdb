"""Where the vLLM plugin's batches go (``producers.vllm.plugin``): the node publisher on its own thread
(over the in-process bus here; Kafka in a pod), an event log, or nowhere; and which one the
environment selects. No vLLM needed: the sinks take plain ``EventBatch`` es."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from kvguard.bus.inproc import InprocBus
from kvguard.config.settings import Settings
from kvguard.contracts.events import EventBatch, EventKind, empty_events
from kvguard.producers.sinks import DiscardSink, EventLogSink, KafkaSink, make_sink
from kvguard.producers.vllm.plugin import PluginConfig
from kvguard.producers.vllm.translator import geometry_for_blocks
from kvguard.wire.eventlog import read_event_log
from kvguard.wire.schemas import decode_batch

GEOMETRY = geometry_for_blocks(101, 16, 1024)


def batch(seq: int) -> EventBatch:
    events = empty_events(2)
    events["kind"] = [int(EventKind.ARRIVE), int(EventKind.STEP)]
    events["ts_ns"] = [seq * 1000 + 1, seq * 1000 + 2]
    events["req"] = [seq + 1, -1]
    return EventBatch(node="n/gpu0", seq=seq, events=events, epoch=7, geometry=GEOMETRY if seq == 0 else None)


def test_the_kafka_sink_publishes_through_the_node_publisher_on_its_own_thread():
    settings = Settings.from_dict({"node": {"flush_interval_s": 0.01}})
    bus = InprocBus.from_settings(settings)
    sink = KafkaSink(settings, bus=bus)
    for seq in range(3):
        sink.publish(batch(seq))  # the engine thread's whole share: a deque append
    deadline = time.monotonic() + 5
    while sink.counters.get("batches_published", 0) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    records = asyncio.run_coroutine_threadsafe(_read(bus, settings), sink._loop).result(5)
    sink.close()
    decoded = [decode_batch(r.value) for r in records]
    assert [b.seq for b in decoded] == [0, 1, 2] and decoded[0].geometry == GEOMETRY
    assert all(r.key == b"n/gpu0" for r in records)
    assert np.array_equal(decoded[2].events["req"], [3, -1])


async def _read(bus, settings):
    sub = bus.subscribe([settings.topics.name("events")], "reader")
    return await sub.getmany(timeout_s=0)


def test_the_event_log_sink_writes_a_log_metrics_and_rca_read(tmp_path):
    sink = EventLogSink(str(tmp_path / "e.jsonl.gz"), {"nodes": ["n/gpu0"]})
    for seq in range(2):
        sink.publish(batch(seq))
    sink.close()
    meta, batches = read_event_log(tmp_path / "e.jsonl.gz")
    assert meta == {"nodes": ["n/gpu0"]} and [b.seq for b in batches] == [0, 1]


def test_the_environment_picks_the_sink():
    assert PluginConfig.from_env({}).bootstrap is None
    assert PluginConfig.from_env({"KVGUARD_BOOTSTRAP": "k:9092"}).bootstrap == "k:9092"
    assert PluginConfig.from_env({"KVGUARD_KAFKA__BOOTSTRAP": "k2:9092"}).bootstrap == "k2:9092"
    assert PluginConfig.from_env({"KVGUARD_CONFIG": "/etc/kvguard.toml"}).bootstrap == "settings"
    assert PluginConfig.from_env({"KVGUARD_NODE__NODE_ID": "a/b"}).node_id == "a/b"
    assert isinstance(make_sink(None, None, "n"), DiscardSink)
    assert isinstance(make_sink(None, "/tmp/x.jsonl.gz", "n"), EventLogSink)
