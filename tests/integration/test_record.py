"""`kvguard record` captures a fleet's events topic from a real broker into an event log that the
offline tools read: the same batches, in per-node order, filtered by node."""

import asyncio

from kvguard.bus.kafka import KafkaBus
from kvguard.runtime.record import record_events
from kvguard.streams.core import StreamCore
from kvguard.wire.eventlog import read_event_log, write_event_log
from kvguard.wire.schemas import batch_headers, encode_batch
from tests.integration.bus_helpers import fleet_event_log


def ticks_of(batches) -> list:
    ticks, _ = StreamCore().process_many(list(batches))
    return [(t.node, t.ts_ns, t.u_kv, t.ooms) for t in ticks]


async def publish(settings, batches) -> None:
    bus = KafkaBus(settings)
    await bus.start()
    try:
        futures = [await bus.publish(settings.topics.name("events"), b.node, encode_batch(b), batch_headers(b))
                   for b in batches]
        await asyncio.gather(*futures)
    finally:
        await bus.stop()


async def record(settings, path, **kwargs):
    bus = KafkaBus(settings)
    await bus.start()
    try:
        return await record_events(bus, settings, path, idle_timeout_s=2.0, max_wall_s=60, **kwargs)
    finally:
        await bus.stop()


def test_record_captures_the_events_topic_for_the_offline_tools(kafka_settings, tmp_path):
    batches = fleet_event_log(n_gpus=3, seconds=60)
    asyncio.run(publish(kafka_settings, batches))

    path = tmp_path / "fleet.jsonl.gz"
    summary = asyncio.run(record(kafka_settings, path))
    _, recorded = read_event_log(path)
    recorded = list(recorded)
    assert summary.batches == len(batches) == len(recorded)
    assert summary.nodes == sorted({b.node for b in batches})
    for node in summary.nodes:  # per-node order is the producer's
        assert [b.seq for b in recorded if b.node == node] == [b.seq for b in batches if b.node == node]
    direct = tmp_path / "direct.jsonl.gz"
    write_event_log(direct, batches, {})
    assert sorted(ticks_of(recorded)) == sorted(ticks_of(read_event_log(direct)[1]))

    one = summary.nodes[0]
    only = asyncio.run(record(kafka_settings, tmp_path / "one.jsonl.gz", nodes={one}))
    assert only.nodes == [one] and only.skipped_node == len(batches) - only.batches > 0
    late = asyncio.run(record(kafka_settings, tmp_path / "none.jsonl.gz", since_ms=2**62))
    assert late.batches == 0 and late.skipped_time == len(batches)
