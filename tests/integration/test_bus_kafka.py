"""The event bus end to end on a real broker (Tansu via ``kafka_bootstrap``) and in process."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from kvguard.bus.base import partition_for_key, publish_and_wait
from kvguard.bus.dlq import RecordDecoder
from kvguard.bus.inproc import InprocBus
from kvguard.bus.kafka import KafkaBus, create_topics
from kvguard.producers.publisher import NodePublisher
from kvguard.wire.schemas import batch_headers, decode, decode_batch, encode_batch
from tests.integration.bus_helpers import batch_source, consume, drain_quietly, fleet_event_log


@pytest.fixture(params=["kafka", "inproc"])
async def bus(request, kafka_settings):
    if request.param == "kafka":
        carrier = KafkaBus(kafka_settings)
    else:
        carrier = InprocBus.from_settings(kafka_settings)
    await carrier.start()
    yield carrier
    await carrier.stop()


async def test_node_event_log_arrives_complete_and_in_per_node_order(bus, kafka_settings):
    batches = fleet_event_log(n_gpus=3, seconds=60)
    nodes = {b.node for b in batches}
    assert len(nodes) == 3
    topic = kafka_settings.topics.name("events")
    source = batch_source(batches)
    publisher = NodePublisher(bus, topic, source, flush_interval_s=0.01)
    running = asyncio.create_task(publisher.run())
    while source.remaining or publisher.buffered:
        await asyncio.sleep(0.02)
    publisher.stop()
    await asyncio.wait_for(running, 60)
    assert publisher.counters.batches_published == len(batches)
    assert publisher.counters.batches_dropped == 0

    sub = bus.subscribe([topic], "streams")
    records = await consume(sub, len(batches))
    received: dict[str, list[tuple[int, int]]] = {}
    for record in records:
        batch = decode_batch(record.value, record.headers)
        assert record.key == batch.node.encode()
        assert record.partition == partition_for_key(record.key, 3)
        received.setdefault(batch.node, []).append((batch.epoch, batch.seq))
    expected = {node: [(b.epoch, b.seq) for b in batches if b.node == node] for node in nodes}
    assert received == expected
    total_events = sum(len(decode_batch(r.value).events) for r in records)
    assert total_events == sum(len(b) for b in batches)
    assert await drain_quietly(sub, 0.5) == []
    await sub.close()


async def test_bad_records_go_to_the_dlq_with_reasons_and_the_consumer_keeps_going(bus, kafka_settings):
    batches = fleet_event_log(n_gpus=1, seconds=20)[:3]
    topic, dlq_topic = kafka_settings.topics.name("events"), kafka_settings.topics.name("dlq")
    good = [encode_batch(b) for b in batches]
    future_major = orjson.loads(good[1])
    future_major["schema"] = "2.0"
    malformed = b"\x00not json{"
    plan = [good[0], malformed, orjson.dumps(future_major), good[2]]
    for value in plan:
        await publish_and_wait(bus, topic, "sim-0/gpu0", value, batch_headers(batches[0]))

    decoder = RecordDecoder(bus, dlq_topic, component="test", group="streams")
    sub = bus.subscribe([topic], "streams")
    decoded = []
    for record in await consume(sub, 4):
        batch = await decoder.decode_batch(record)
        if batch is not None:
            decoded.append(batch.seq)
        await record.commit()
    assert decoded == [batches[0].seq, batches[2].seq]
    assert decoder.counters.as_dict() == {
        "received": 4, "decoded": 2, "dead_lettered": {"malformed": 1, "unknown_major": 1},
        "dead_lettered_total": 2, "dlq_failed": 0,
    }

    dlq_sub = bus.subscribe([dlq_topic], "dlq-reader")
    dead = [decode("dlq", r.value, r.headers) for r in await consume(dlq_sub, 2)]
    assert sorted(d.reason for d in dead) == ["malformed", "unknown_major"]
    by_reason = {d.reason: d for d in dead}
    assert by_reason["malformed"].value == malformed
    assert orjson.loads(by_reason["unknown_major"].value)["schema"] == "2.0"
    assert all(d.topic == topic and d.key == b"sim-0/gpu0" for d in dead)
    await sub.close()
    await dlq_sub.close()


async def test_consumer_restart_resumes_from_committed_offsets_without_loss(bus, kafka_settings):
    batches = fleet_event_log(n_gpus=3, seconds=40)
    topic = kafka_settings.topics.name("events")
    for batch in batches:
        await publish_and_wait(bus, topic, batch.node, encode_batch(batch), batch_headers(batch))
    all_ids = {(b.node, b.seq) for b in batches}

    first = bus.subscribe([topic], "resume")
    seen = await consume(first, len(batches) // 2)
    committed = set()
    for record in seen[: len(batches) // 2]:
        await record.commit()
    # a record counts as committed when a record at or after it on its partition was committed
    high = {}
    for record in seen[: len(batches) // 2]:
        high[record.partition] = max(high.get(record.partition, -1), record.offset)
    for record in seen:
        if record.offset <= high.get(record.partition, -1):
            b = decode_batch(record.value)
            committed.add((b.node, b.seq))
    await first.close()

    second = bus.subscribe([topic], "resume")
    rest = await consume(second, len(all_ids - committed))
    rest_ids = {(b.node, b.seq) for b in (decode_batch(r.value) for r in rest)}
    assert rest_ids | committed == all_ids  # nothing lost
    assert not rest_ids & committed  # committed records are not delivered again
    assert await drain_quietly(second, 0.5) == []
    await second.close()


async def test_topic_creation_is_idempotent(kafka_settings):
    result = await create_topics(kafka_settings)
    assert set(result) == set(kafka_settings.topics.all())
    assert set(result.values()) == {"exists"}


def test_topics_create_command_provisions_every_topic_idempotently(kafka_bootstrap, topic_prefix):
    import json

    from typer.testing import CliRunner

    from kvguard.cli import app

    runner = CliRunner()
    args = ["topics", "create", "--bootstrap", kafka_bootstrap, "--prefix", topic_prefix, "--json"]
    first = runner.invoke(app, args, env={"KVGUARD_TOPICS__EVENTS__PARTITIONS": "4"})
    assert first.exit_code == 0, first.output
    report = json.loads(first.stdout)
    assert report["bootstrap"] == kafka_bootstrap
    assert {name: t["status"] for name, t in report["topics"].items()} == {
        f"{topic_prefix}{kind}": "created" for kind in ("events", "metrics", "alerts", "commands", "acks", "dlq")
    }
    assert report["topics"][f"{topic_prefix}events"]["partitions"] == 4
    assert report["topics"][f"{topic_prefix}events"]["actual_partitions"] == 4
    again = runner.invoke(app, args)  # the events topic now differs from the default 12: a warning
    assert again.exit_code == 0, again.output
    assert {t["status"] for t in json.loads(again.stdout)["topics"].values()} == {"exists"}
    assert f"{topic_prefix}events exists with 4 partitions, configured 12" in again.stderr


def test_topics_create_names_the_unreachable_broker():
    from typer.testing import CliRunner

    from kvguard.cli import app
    from kvguard.testing.rigs import free_port

    bootstrap = f"127.0.0.1:{free_port()}"
    result = CliRunner().invoke(app, ["topics", "create", "--bootstrap", bootstrap])
    assert result.exit_code == 1
    assert bootstrap in result.output
