"""Every consumer takes a null value (a tombstone), an empty value and a value of any size without
raising (issue 28): the record is dead-lettered with its reason (``tombstone`` for a null value) in
a bounded DLQ record, counted, its offset committed, and what came after it is handled as if it
had not been there. In process (the in-process bus and the worker's small fakes); the same paths
on the real broker are tests/integration/test_hostile_records.py."""

from __future__ import annotations

import asyncio
import base64
import hashlib

import orjson

from kvguard.bus.inproc import InprocBus
from kvguard.config.settings import Settings
from kvguard.wire.schemas import DLQ_PREFIX_BYTES, DlqRecord, decode, encode_batch
from tests.unit.runtime.test_hostile_services import (
    dlq_records,
    events_of,
    faust_worker,
    node_a,
    run_policy,
    run_streams,
    tick,
    wire,
)

BIG = 5_000_000


def garbage(size: int) -> bytes:
    """Bytes that are no JSON, different at every position (so a prefix and a hash mean something)."""
    block = hashlib.sha256(str(size).encode()).digest() * 2  # 64 bytes
    return (block * (size // len(block) + 1))[:size]


def interleave(records: list, every: int, extra) -> list:
    """``records`` with ``extra(i)`` put in after every ``every``-th one."""
    out = []
    for i, record in enumerate(records):
        out.append(record)
        if i % every == every // 2:
            out.append(extra(i))
    return out


def assert_bounded(dead: DlqRecord, value: bytes) -> None:
    assert dead.truncated and dead.value is None and dead.value_bytes == len(value)
    assert dead.value_sha256 == hashlib.sha256(value).hexdigest()
    assert base64.b64decode(dead.value_prefix_b64) == value[:DLQ_PREFIX_BYTES]
    assert len(dead.to_bytes()) < 512 * 1024  # under any broker's default 1 MiB


# ---- the stream service (embedded) and the Faust worker's logic --------------------------------


async def test_the_stream_service_makes_the_same_ticks_with_tombstones_between_the_batches():
    clean = [wire(b) for b in node_a()]
    _, _, _, want = await run_streams(clean)
    hostile = interleave(clean, 3, lambda i: ("a", None, []))
    hostile += [("a", b"", []), ("a", garbage(BIG), [])]
    service, bus, settings, got = await run_streams(hostile)
    assert got == want  # no tick lost, none changed
    dead = await dlq_records(bus, settings)
    tombstones = [d for d in dead if d.reason == "tombstone"]
    assert len(tombstones) == len(hostile) - len(clean) - 2 and all(d.tombstone for d in tombstones)
    malformed = sorted((d for d in dead if d.reason == "malformed"), key=lambda d: d.offset)
    assert "empty value" in malformed[0].detail and malformed[0].value == b""
    assert_bounded(malformed[1], garbage(BIG))
    assert service.decoder.counters.dead_lettered["tombstone"] == len(tombstones)
    again = bus.subscribe([settings.topics.name("events")], service.group)
    assert await again.getmany(timeout_s=0) == []  # committed past every one of them


async def test_the_faust_worker_makes_the_same_ticks_with_tombstones_in_its_chunks():
    clean = node_a()
    reference = faust_worker()
    await reference.handle(events_of(clean))
    worker = faust_worker()
    raw = [wire(b) for b in clean]
    hostile = interleave(raw, 4, lambda i: ("a", None, [])) + [("a", b"", []), ("a", garbage(BIG), [])]
    chunks = [hostile[i:i + 5] for i in range(0, len(hostile), 5)]
    offset = 0
    for chunk in chunks:  # the agent's chunks, each holding a tombstone or two
        events = events_of(chunk)
        for event in events:
            event.message.offset = offset
            offset += 1
        await worker.handle(events)
    assert worker.metrics_topic.sent == reference.metrics_topic.sent  # every tick, byte for byte
    dead = [DlqRecord.model_validate(orjson.loads(v)) for _, v in worker.dlq_topic.sent]
    n_tombstones = len(hostile) - len(raw) - 2
    assert [d.reason for d in dead].count("tombstone") == n_tombstones == worker.counters.tombstones
    assert_bounded(next(d for d in dead if d.value_bytes == BIG), garbage(BIG))
    assert worker.counters.batches == len(clean) and worker.counters.errors == 0


async def test_the_faust_worker_dead_letter_never_raises_even_when_the_dlq_does():
    class BrokenTopic:
        async def send(self, **kwargs):
            raise RuntimeError("the DLQ topic is gone")

    worker = faust_worker()
    worker.dlq_topic = BrokenTopic()
    await worker.handle(events_of([("a", None, [])] + [wire(b) for b in node_a()[:3]]))
    assert worker.counters.dlq_failed == 1 and worker.counters.batches == 3


# ---- the policy, the actuators, the exporter, the recorder ---------------------------------------


async def test_the_policy_decides_on_past_tombstones_empty_and_huge_records():
    ticks = [("n", None), ("n", tick(ts_s=10)), ("n", b""), ("n", garbage(BIG)), ("n", None), ("last", tick("last"))]
    service, bus, settings, outputs = await run_policy(ticks)
    assert [o.decision.node for o in outputs] == ["n", "last"]
    dead = sorted(await dlq_records(bus, settings), key=lambda d: d.offset)
    assert [d.reason for d in dead] == ["tombstone", "malformed", "malformed", "tombstone"]
    assert_bounded(dead[2], garbage(BIG))
    assert service.decoder.counters.dead_lettered["tombstone"] == 2
    again = bus.subscribe([settings.topics.name("metrics")], "p")
    assert await again.getmany(timeout_s=0) == []


async def test_the_actuator_loop_acks_the_command_after_a_tombstone_and_a_huge_record():
    from kvguard.actuators.actuator import Actuator, run_actuators
    from kvguard.actuators.executor import Executor
    from kvguard.contracts.commands import AckOutcome
    from tests.unit.actuators.test_actuator import NODE, SECRET, evict_command
    from tests.unit.actuators.test_executor import running_engine

    settings = Settings()
    bus = InprocBus.from_settings(settings)
    e = running_engine()
    actuator = Actuator(NODE, Executor(e), SECRET)
    topic = settings.topics.name("commands")
    for value in (None, b"", garbage(BIG), evict_command().to_bytes()):
        await bus.publish(topic, NODE, value)
    stop = asyncio.Event()
    acks = []

    def collect(ack):
        acks.append(ack)
        stop.set()

    await asyncio.wait_for(run_actuators(bus, settings, {NODE: actuator}, node_time_ns=lambda n: e.now_ns,
                                         group="act", stop=stop, on_ack=collect, poll_s=0.01), timeout=10)
    assert [a.outcome for a in acks] == [AckOutcome.EXECUTED]
    dead = sorted(await dlq_records(bus, settings), key=lambda d: d.offset)
    assert [d.reason for d in dead] == ["tombstone", "malformed", "malformed"]
    assert_bounded(dead[2], garbage(BIG))
    assert await bus.subscribe([topic], "act").getmany(timeout_s=0) == []
    assert actuator.handle_record(None, e.now_ns) is None and actuator.counters.malformed == 1


def test_the_exporter_counts_a_tombstone_on_each_of_its_topics_and_goes_on():
    from kvguard.ops.export_service import EXPORT_KINDS, ExportService

    settings = Settings()
    topics = {kind: settings.topics.name(kind) for kind in EXPORT_KINDS}
    service = ExportService(InprocBus.from_settings(settings), topics, port=0, clock=lambda: 0)
    for kind in EXPORT_KINDS:
        service.handle(topics[kind], None)
        service.handle(topics[kind], b"")
        service.handle(topics[kind], garbage(BIG))
    service.handle(topics["metrics"], tick("sim-0/gpu0"))
    assert service.decode_errors == {**{(k, "tombstone"): 1 for k in EXPORT_KINDS},
                                     **{(k, "malformed"): 2 for k in EXPORT_KINDS}}
    assert service.records["metrics"] == 1 and 'node="sim-0/gpu0"' in service.state.render(0)


async def test_the_recorder_skips_and_counts_tombstones(tmp_path):
    from kvguard.runtime.record import record_events
    from kvguard.wire.eventlog import read_event_log

    settings = Settings()
    bus = InprocBus.from_settings(settings)
    clean = node_a()[:6]
    for key, value, headers in interleave([wire(b) for b in clean], 2, lambda i: ("a", None, [])):
        await bus.publish(settings.topics.name("events"), key, value, headers)
    summary = await record_events(bus, settings, tmp_path / "log.jsonl.gz", idle_timeout_s=0.2)
    assert (summary.batches, summary.tombstones, summary.undecodable) == (6, 3, 0)
    _, batches = read_event_log(tmp_path / "log.jsonl.gz")
    assert [encode_batch(b) for b in batches] == [encode_batch(b) for b in clean]


def test_a_tombstone_decodes_to_its_own_reason_and_its_dlq_record_says_so():
    from kvguard.wire.schemas import DecodeError

    for kind in ("events", "metrics", "alerts", "commands", "acks", "dlq"):
        try:
            decode(kind, None)
        except DecodeError as err:
            assert err.reason == "tombstone", kind
        else:
            raise AssertionError(f"{kind}: a null value decoded")
    dead = DlqRecord.of(reason="tombstone", detail="", topic="t", partition=0, offset=0, key=None, value=None)
    back = decode("dlq", dead.to_bytes())
    assert back.tombstone and back.value is None and not back.truncated and back.value_bytes == 0
