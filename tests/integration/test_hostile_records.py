"""Hostile records on the real broker (issue 28): a tombstone on kvguard.commands, kvguard.metrics
and kvguard.events stops no service and loses no tick; bad records of any size reach the DLQ as
bounded records; ticks naming 10,000-character node ids are refused at decode with the reason.

The hostile producer here may send records up to 32 MiB (``kafka.max_message_bytes``, aiokafka's
``max_request_size``); Tansu 0.6 takes them (it has no ``message.max.bytes``), and aiokafka's
consumers fetch them whole although ``max_partition_fetch_bytes`` is 1 MiB (a fetch returns at
least the first record batch, KIP-74). A Kafka broker refuses records over its ``message.max.bytes``
/ the topic's ``max.message.bytes`` (1 MiB by default) at produce time, so there only records up
to that limit reach the consumers; kvguard's own services keep the default 1 MiB producer limit,
which every DLQ record fits (``DlqRecord.of``)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid
from dataclasses import replace

import orjson
import pytest

from kvguard.bus.kafka import KafkaBus
from kvguard.contracts.units import NS_PER_S
from kvguard.wire.schemas import DLQ_PREFIX_BYTES, DlqRecord, batch_headers, decode, encode_batch
from tests.integration.bus_helpers import consume, drain_quietly

pytestmark = pytest.mark.integration

MIB = 1 << 20


def garbage(size: int) -> bytes:
    """Bytes that are no JSON and differ along their length (so the prefix and the hash tell)."""
    block = hashlib.sha256(str(size).encode()).digest() * 2
    return (block * (size // len(block) + 1))[:size]


def hostile_settings(settings):
    """The same topics, through a producer that sends records up to 32 MiB."""
    return settings.model_copy(update={"kafka": settings.kafka.model_copy(update={"max_message_bytes": 32 * MIB})})


async def publish_raw(settings, topic_kind: str, records: list[tuple[str | None, bytes | None]]) -> None:
    bus = KafkaBus(hostile_settings(settings))
    await bus.start()
    try:
        for key, value in records:
            await (await bus.publish(settings.topics.name(topic_kind), key, value))
    finally:
        await bus.stop()


async def dlq_of(settings, count: int, limit_s: float = 60.0) -> list[DlqRecord]:
    bus = KafkaBus(settings)
    await bus.start()
    try:
        reader = bus.subscribe([settings.topics.name("dlq")], f"dlq-{uuid.uuid4().hex[:6]}")
        records = await consume(reader, count, limit_s=limit_s)
        records += await drain_quietly(reader, settle_s=1.0)
        return [decode("dlq", r.value) for r in records]
    finally:
        await bus.stop()


def assert_bounded(dead: DlqRecord, value: bytes) -> None:
    assert dead.reason == "malformed" and dead.truncated and dead.value_bytes == len(value)
    assert dead.value_sha256 == hashlib.sha256(value).hexdigest()
    import base64

    assert base64.b64decode(dead.value_prefix_b64) == value[:DLQ_PREFIX_BYTES]


# ---- kvguard.commands: every node's actuators -------------------------------------------------------


async def test_a_tombstone_on_the_commands_topic_stops_no_node_and_a_5_mb_command_reaches_the_dlq(kafka_settings):
    from kvguard.actuators.actuator import Actuator, run_actuators
    from kvguard.actuators.executor import Executor
    from kvguard.contracts.commands import AckOutcome, sign
    from tests.unit.actuators.test_actuator import NODE, SECRET, evict_command
    from tests.unit.actuators.test_executor import running_engine

    settings = kafka_settings
    other = "t/gpu1"
    commands = {NODE: evict_command(), other: sign(replace(evict_command(), id="cmd-gpu1", node=other, signature=""),
                                                   SECRET)}
    big = garbage(5_000_000)
    await publish_raw(settings, "commands", [(NODE, None), (other, big), (other, b""), (other, None)]
                      + [(node, c.to_bytes()) for node, c in commands.items()])

    async def node_process(node: str) -> tuple[list, str]:
        """One node's actuator loop, as `kvguard node` runs it: its own group, the whole topic."""
        engine = running_engine()
        actuator = Actuator(node, Executor(engine), SECRET)
        group = f"act-{node.replace('/', '-')}-{uuid.uuid4().hex[:6]}"
        stop = asyncio.Event()
        acks = []

        def collect(ack):
            acks.append(ack)
            stop.set()

        bus = KafkaBus(settings)
        await bus.start()
        try:
            await asyncio.wait_for(run_actuators(bus, settings, {node: actuator}, node_time_ns=lambda n: engine.now_ns,
                                                 group=group, stop=stop, on_ack=collect, poll_s=0.05), timeout=90)
            again = bus.subscribe([settings.topics.name("commands")], group)
            assert await drain_quietly(again, settle_s=2.0) == [], "every record committed, none redelivered"
        finally:
            await bus.stop()
        return acks, group

    (acks_a, group_a), (acks_b, group_b) = await asyncio.gather(node_process(NODE), node_process(other))
    assert [(a.command_id, a.outcome) for a in acks_a] == [(commands[NODE].id, AckOutcome.EXECUTED)]
    assert [(a.command_id, a.outcome) for a in acks_b] == [(commands[other].id, AckOutcome.EXECUTED)]
    dead = await dlq_of(settings, 8)
    for group in (group_a, group_b):  # each node process dead-letters what it could not read
        mine = sorted((d for d in dead if d.group == group), key=lambda d: (d.partition, d.offset))
        assert sorted(d.reason for d in mine) == ["malformed", "malformed", "tombstone", "tombstone"]
        assert all(d.tombstone for d in mine if d.reason == "tombstone")
        assert_bounded(next(d for d in mine if d.value_bytes == len(big)), big)


# ---- kvguard.metrics: the policy ------------------------------------------------------------------


def hot_tick(node: str, ts_s: int) -> bytes:
    return orjson.dumps({"schema": "1.0", "node": node, "ts_ns": ts_s * NS_PER_S, "tick_s": 10.0, "u_kv": 0.97,
                         "f_ext": 0.3, "f_int": 0.0, "psi": 1.0, "free_units": 40, "largest_free_run_units": 40})


async def test_the_policy_lives_past_a_tombstone_an_800_kb_record_and_a_hundred_ten_thousand_character_ids(
        kafka_settings):
    from kvguard.policy.engine import EngineConfig, PolicyEngine
    from kvguard.policy.service import PolicyService
    from tests.unit.actuators.test_actuator import NODE, SECRET

    settings = kafka_settings
    big = garbage(800_000)
    long_ids = [f"{i:05d}" + "n" * 9_995 for i in range(100)]
    records = [(NODE, None), (NODE, hot_tick(NODE, 10)), (NODE, big), (NODE, b"")]
    records += [(node[:8], hot_tick(node, 10)) for node in long_ids]  # keyed short: the id itself is refused
    records += [(NODE, hot_tick(NODE, 20)), ("last/gpu0", hot_tick("last/gpu0", 10))]
    await publish_raw(settings, "metrics", records)
    bus = KafkaBus(settings)
    await bus.start()
    service = PolicyService(PolicyEngine(EngineConfig(dynamic_units=1000), SECRET), settings, bus=bus)
    stop = asyncio.Event()
    decided = []

    def seen(out):
        decided.append((out.decision.node, out.decision.ts_ns))
        if {(NODE, 20 * NS_PER_S), ("last/gpu0", 10 * NS_PER_S)} <= set(decided):
            stop.set()

    try:
        await asyncio.wait_for(service.run(group=f"pol-{uuid.uuid4().hex[:6]}", stop=stop, poll_s=0.05,
                                           on_output=seen), timeout=90)
    finally:
        await bus.stop()
    assert sorted(decided) == [("last/gpu0", 10 * NS_PER_S), (NODE, 10 * NS_PER_S), (NODE, 20 * NS_PER_S)]
    dead = await dlq_of(settings, 103)
    reasons = [d.reason for d in dead]
    assert reasons.count("tombstone") == 1 and reasons.count("malformed") == 2 and reasons.count("invalid") == 100
    refused = [d for d in dead if d.reason == "invalid"]
    assert all("node: Value error, node id is 10000 characters, at most 48" in d.detail for d in refused)
    assert all(len(d.to_bytes()) < 64 * 1024 for d in refused)  # the 10 KB id travels in the value, once
    assert_bounded(next(d for d in dead if d.value_bytes == len(big)), big)
    assert service.decoder.counters.dead_lettered == {"tombstone": 1, "malformed": 2, "invalid": 100}


# ---- kvguard.events: the Faust worker --------------------------------------------------------------


@pytest.fixture(scope="module")
def batches_244():
    """244 batches of a deterministic simulated run of 4 GPUs (snapshots every 30 s)."""
    from tests.integration.streams_helpers import shadow_log

    return shadow_log(n_gpus=4, seconds=170)[:244]


async def worker_ticks(settings, tmp_path, name: str, records: list[tuple[str, bytes | None, list]],
                       expected_ticks: int, expected_dlq: int) -> tuple[dict, list, str]:
    from tests.integration.streams_helpers import OutputReader, WorkerProcess, tick_map

    bus = KafkaBus(hostile_settings(settings))
    await bus.start()
    try:
        for key, value, headers in records:
            await bus.publish(settings.topics.name("events"), key, value, headers)
        await bus.flush()
    finally:
        await bus.stop()
    worker = WorkerProcess(settings, f"kvg-{uuid.uuid4().hex[:8]}", tmp_path, name=name)
    try:
        async with OutputReader(settings, f"reader-{name}") as out:
            worker.start()
            await out.until(lambda o: len(tick_map(o.of("metrics"))[0]) >= expected_ticks
                            and len(o.of("dlq")) >= expected_dlq, what=f"{name}: every tick and DLQ record")
            await out.settle(quiet_s=1.5)
        alive = worker.proc.poll() is None
        log_text = worker.log_text()
    finally:
        worker.stop()
    assert alive, log_text[-3000:]
    return tick_map(out.of("metrics"))[0], [decode("dlq", r.value) for r in out.of("dlq")], log_text


async def test_tombstones_among_244_batches_lose_no_tick_and_a_20_mb_batch_reaches_the_dlq(
        kafka_settings, batches_244, tmp_path):
    from kvguard.config.settings import TOPIC_KINDS
    from kvguard.testing.rigs.tansu import create_topics_sync
    from tests.integration.streams_helpers import expected_records

    expected, _ = expected_records(batches_244)
    clean = [(b.node, encode_batch(b), batch_headers(b)) for b in batches_244]
    hostile = []
    for i, record in enumerate(clean):
        hostile.append(record)
        if i % 20 == 10:  # 12 tombstones, keyed by the node of the batch before: in its partition, between its batches
            hostile.append((record[0], None, []))
    big = garbage(20_000_000)
    hostile[100:100] = [(batches_244[99].node, big, []), (batches_244[99].node, b"", [])]
    assert sum(value is None for _, value, _ in hostile) == 12

    # without the tombstones: the worker's own ticks, on topics of their own
    plain = kafka_settings.model_copy(update={"topics": kafka_settings.topics.model_copy(
        update={"prefix": f"t{uuid.uuid4().hex[:12]}."})})
    create_topics_sync(plain.kafka.bootstrap, {plain.topics.name(k): plain.topics.events.partitions for k in TOPIC_KINDS})
    without, dead_without, _ = await worker_ticks(plain, tmp_path, "plain", clean, len(expected), 0)
    with_them, dead, log_text = await worker_ticks(kafka_settings, tmp_path, "hostile", hostile, len(expected), 14)

    assert without == expected and dead_without == []
    assert with_them == without  # the deterministic comparison: every tick of every node, equal
    assert sorted(d.reason for d in dead) == ["malformed"] * 2 + ["tombstone"] * 12
    assert all(d.tombstone and d.group.startswith("kvg-") for d in dead if d.reason == "tombstone")
    assert_bounded(next(d for d in dead if d.value_bytes == len(big)), big)
    assert log_text.count("tombstone: a null value") == 12 and "Traceback" not in log_text


# ---- the exporter and the recorder ------------------------------------------------------------------


async def test_the_exporter_and_the_recorder_count_tombstones_on_every_topic_and_go_on(kafka_settings, tmp_path):
    import aiohttp

    from kvguard.ops.export_service import EXPORT_KINDS, ExportService
    from kvguard.runtime.record import record_events
    from tests.unit.runtime.test_hostile_services import node_a

    settings = kafka_settings
    for kind in EXPORT_KINDS + ("events",):
        await publish_raw(settings, kind, [("sim-0/gpu0", None)])
    await publish_raw(settings, "metrics", [("sim-0/gpu0", hot_tick("sim-0/gpu0", 10))])
    batches = node_a()[:4]
    bus = KafkaBus(settings)
    await bus.start()
    try:
        for b in batches:
            await (await bus.publish(settings.topics.name("events"), b.node, encode_batch(b), batch_headers(b)))
        summary = await record_events(bus, settings, tmp_path / "log.jsonl.gz", idle_timeout_s=2.0, max_wall_s=60)
        topics = {kind: settings.topics.name(kind) for kind in EXPORT_KINDS}
        service = ExportService(bus, topics, port=0, group=f"exp-{uuid.uuid4().hex[:6]}")
        async with service:
            for _ in range(300):
                if sum(service.decode_errors.values()) >= len(EXPORT_KINDS) and service.records["metrics"]:
                    break
                await asyncio.sleep(0.1)
            async with aiohttp.ClientSession() as session, session.get(service.url + "/metrics") as response:
                text = await response.text()
    finally:
        await bus.stop()
    assert (summary.batches, summary.tombstones, summary.undecodable) == (4, 1, 0)
    assert service.decode_errors == {(kind, "tombstone"): 1 for kind in EXPORT_KINDS}
    assert 'kvguard_u_kv{gpu="0",instance="sim-0",model="",node="sim-0/gpu0"} 0.97' in text
    assert 'kvguard_exporter_decode_errors_total{kind="metrics",reason="tombstone"} 1.0' in text
    assert json.loads(json.dumps(summary.to_dict()))["tombstones"] == 1
