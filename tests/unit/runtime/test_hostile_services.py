"""Every service survives a poison record: the record goes to the DLQ with the reason, a counter
and a log line say so, its offset is committed, and what came after it is handled (issue 15)."""

import asyncio
import base64

import numpy as np
import orjson
import pytest

from kvguard.bus.inproc import InprocBus
from kvguard.config.settings import Settings
from kvguard.contracts.events import EventBatch
from kvguard.contracts.events import EventKind as K
from kvguard.contracts.units import NS_PER_S
from kvguard.runtime.mapping import stream_config
from kvguard.wire.schemas import DecodeError, DlqRecord, batch_headers, decode, decode_batch, encode_batch
from tests.unit.streams.test_stream_hostile import two_node_stream

S = NS_PER_S


def node_a() -> list[EventBatch]:
    return [b for b in two_node_stream() if b.node == "a"]


def with_bad_offset(batch: EventBatch, offset: int = 10**12) -> EventBatch:
    events = batch.events.copy()
    events["offset"][np.flatnonzero(events["kind"] == K.ALLOC)[0]] = offset
    return EventBatch(node=batch.node, seq=batch.seq, epoch=batch.epoch, events=events, geometry=batch.geometry,
                      state=batch.state)


async def dlq_records(bus, settings) -> list[DlqRecord]:
    import uuid

    records = await bus.subscribe([settings.topics.name("dlq")], uuid.uuid4().hex).getmany(timeout_s=0)
    return [decode("dlq", r.value) for r in records]


# ---- decode: contents the schema lets through ------------------------------------------------


@pytest.mark.parametrize("mutate, words", [
    (lambda d: d["cols"]["offset"].__setitem__(1, 10**12), "offset 1000000000000"),
    (lambda d: d["cols"]["size"].__setitem__(1, 0), "size 0"),
    (lambda d: d["cols"]["size"].__setitem__(1, -4), "cols.size[1]"),
    (lambda d: d["cols"]["kind"].__setitem__(1, 200), "unknown event kind 200"),
    (lambda d: d["geometry"].__setitem__("dynamic_units", 10**11), "geometry.dynamic_units"),
    (lambda d: d["geometry"].__setitem__("total_bytes", 0), "geometry.total_bytes"),
    (lambda d: d.__setitem__("epoch", 2**63), "epoch"),
])
def test_impossible_batch_contents_are_invalid_at_decode(mutate, words):
    first = node_a()[0]
    data = orjson.loads(encode_batch(first))
    data["cols"]["kind"][1] = int(K.ALLOC)  # row 1 is a page run whatever the stream had there
    data["cols"]["size"][1] = 1
    data["cols"]["offset"][1] = 0
    decode_batch(orjson.dumps(data))  # the baseline decodes
    mutate(data)
    with pytest.raises(DecodeError) as err:
        decode_batch(orjson.dumps(data))
    assert err.value.reason == "invalid" and words in err.value.detail, err.value.detail


def test_batch_length_and_region_are_capped_by_the_limits():
    from kvguard.wire.validate import WireLimits

    raw = encode_batch(node_a()[0])
    with pytest.raises(DecodeError, match="at most 3 "):
        decode_batch(raw, limits=WireLimits(max_batch_events=3))
    with pytest.raises(DecodeError, match="dynamic_units"):
        decode_batch(raw, limits=WireLimits(max_dynamic_units=8))


@pytest.mark.parametrize("field, value", [("u_kv", 1e308), ("psi", float("inf")), ("f_ext", -0.5),
                                          ("tokens_per_s", float("nan")), ("free_units", 2**70)])
def test_impossible_tick_values_are_invalid_at_decode(field, value):
    import json

    tick = {"schema": "1.0", "node": "n", "ts_ns": 10 * S, "u_kv": 0.5, "f_ext": 0.1, "f_int": 0.0, "psi": 0.6}
    decode("metrics", json.dumps(tick).encode())
    tick[field] = value
    with pytest.raises(DecodeError) as err:
        decode("metrics", json.dumps(tick).encode())  # NaN and Infinity are not JSON: malformed
    import math

    assert err.value.reason == ("invalid" if math.isfinite(value) else "malformed")


# ---- the stream service ------------------------------------------------------------------------


async def run_streams(records: list[tuple[str, bytes, list]], settings=None):
    from kvguard.streams.embedded import StreamsService

    settings = settings or Settings()
    bus = InprocBus.from_settings(settings)
    for key, value, headers in records:
        await bus.publish(settings.topics.name("events"), key, value, headers)
    service = StreamsService(bus, settings, config=stream_config(settings), max_records=7)
    await asyncio.wait_for(service.run(idle_timeout_s=0.4), timeout=20)
    metrics = await bus.subscribe([settings.topics.name("metrics")], "m").getmany(max_records=10**6, timeout_s=0)
    return service, bus, settings, sorted(r.value for r in metrics)


def wire(batch: EventBatch, key: str | None = None):
    return (key or batch.node, encode_batch(batch), batch_headers(batch))


async def test_the_stream_service_dead_letters_impossible_batches_and_goes_on(caplog):
    clean = node_a()
    _, _, _, want = await run_streams([wire(b) for b in clean])
    bad_offset = with_bad_offset(clean[5])
    jump = EventBatch(node="a", seq=0, epoch=2**62, events=clean[6].events, geometry=clean[0].geometry)
    hostile = [wire(b) for b in clean[:5]] + [wire(bad_offset), wire(clean[5], key="b"), wire(jump)]
    hostile += [wire(b) for b in clean[5:]]
    service, bus, settings, got = await run_streams(hostile)
    assert got == want
    dead = await dlq_records(bus, settings)
    assert [d.reason for d in dead] == ["invalid"] * 3
    by_words = {words: [d for d in dead if words in d.detail] for words in
                ("offset 1000000000000", "does not match node", "max_epoch_jump")}
    assert all(len(found) == 1 for found in by_words.values()), [d.detail for d in dead]
    assert by_words["offset 1000000000000"][0].value == encode_batch(bad_offset)
    assert service.counters.rejected == 1 and service.decoder.counters.dead_lettered["invalid"] == 3
    # everything was committed: the group's next member gets nothing again
    again = bus.subscribe([settings.topics.name("events")], service.group)
    assert await again.getmany(timeout_s=0) == []


async def test_the_stream_service_dead_letters_a_batch_that_raises(monkeypatch):
    from kvguard.streams import mirror

    clean = node_a()
    original = mirror.AllocatorMirror.apply

    def apply(self, events, state=None):
        if len(events) and int(events["ts_ns"][0]) == int(clean[4].events["ts_ns"][0]):
            raise RuntimeError("injected fault")
        return original(self, events, state)

    monkeypatch.setattr(mirror.AllocatorMirror, "apply", apply)
    settings = Settings()
    bus = InprocBus.from_settings(settings)
    from kvguard.streams.embedded import StreamsService

    service = StreamsService(bus, settings, config=stream_config(settings), max_records=1)
    for b in clean:
        await bus.publish(settings.topics.name("events"), *wire(b))
    await asyncio.wait_for(service.run(idle_timeout_s=0.4), timeout=20)
    dead = await dlq_records(bus, settings)
    assert [(d.reason, "injected fault" in d.detail) for d in dead] == [("processing_error", True)]
    assert service.core.counters.batches_failed == 1 and service.counters.ticks > 0


# ---- the Faust worker's per-record logic (no broker: small working fakes) -----------------------


class FakeTopic:
    def __init__(self):
        self.sent = []

    async def send(self, key, value, headers=None):
        self.sent.append((key, value))
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future


class FakeTable:
    def __init__(self):
        self.data = {}
        self.changelog = []

    def get(self, key):
        return self.data.get(key)

    async def send_changelog(self, partition, key, value, value_serializer=None):
        self.changelog.append((partition, key, value))


class Message:
    def __init__(self, offset, key, value, headers):
        self.topic, self.partition, self.offset = "kvguard.events", 0, offset
        self.key, self.headers, self.value = key, headers, value


class Event:
    def __init__(self, message):
        self.message, self.value = message, message.value


def faust_worker(settings=None):
    from kvguard.streams.app import StreamsWorker

    settings = settings or Settings()

    async def no_fetch_back(*args):
        return []

    return StreamsWorker(settings, stream_config(settings), None, table=FakeTable(),
                         metrics_topic=FakeTopic(), alerts_topic=FakeTopic(), dlq_topic=FakeTopic(),
                         fetch_back=no_fetch_back)


def events_of(batches_or_raw) -> list[Event]:
    out = []
    for offset, item in enumerate(batches_or_raw):
        key, value, headers = item if isinstance(item, tuple) else wire(item)
        out.append(Event(Message(offset, key.encode(), value, headers)))
    return out


async def test_the_faust_worker_handles_each_record_on_its_own(monkeypatch):
    clean = node_a()
    reference = faust_worker()
    await reference.handle(events_of(clean))
    worker = faust_worker()
    calls = {"n": 0}
    original = worker.core.process

    def process(batch):
        calls["n"] += 1
        if batch.seq == 7:
            raise MemoryError("injected: the core ran out of memory")
        return original(batch)

    monkeypatch.setattr(worker.core, "process", process)
    hostile = list(clean[:5]) + [with_bad_offset(clean[5], offset=10**6)] + list(clean[5:])
    await worker.handle(events_of(hostile))
    dead = [orjson.loads(v) for _, v in worker.dlq_topic.sent]
    assert [d["reason"] for d in dead] == ["invalid", "processing_error"]
    assert "D = 128 units" in dead[0]["detail"] and "MemoryError" in dead[1]["detail"]
    assert worker.counters.rejected == 1 and worker.counters.errors == 1
    # the batches after both poison records were applied (seq 7's loss is a gap, synced again later)
    assert worker.counters.batches == len(clean) - 1 and calls["n"] == len(hostile)
    assert len(worker.metrics_topic.sent) >= len(reference.metrics_topic.sent) - 2


async def test_the_faust_worker_evicts_past_its_cap_and_after_its_idle_timeout():
    settings = Settings.load(env={"KVGUARD_STREAMS__MAX_NODES": "2", "KVGUARD_STREAMS__NODE_IDLE_TIMEOUT_S": "5"})
    worker = faust_worker(settings)
    first = node_a()[0]
    invented = [EventBatch(node=f"x{i}", seq=0, events=first.events, geometry=first.geometry) for i in range(5)]
    for event in events_of(invented):
        await worker.handle([event])
    assert sorted(worker.core.nodes) == ["x3", "x4"] and set(worker.last_offset) == {"x3", "x4"}
    assert worker.counters.nodes_evicted == 3
    assert {k for k in worker.table.data} == {b"C|x3", b"C|x4"}
    tombstones = [k for _, k, v in worker.table.changelog if v is None and k.startswith(b"C|")]
    assert tombstones == [b"C|x0", b"C|x1", b"C|x2"]
    import time

    await worker.evict_idle(time.monotonic() + 6)
    assert worker.core.nodes == {} and worker.table.data == {}


# ---- the policy service ------------------------------------------------------------------------


def tick(node="n", ts_s=10, **values):
    base = {"schema": "1.0", "node": node, "ts_ns": ts_s * S, "tick_s": 10.0, "u_kv": 0.7, "f_ext": 0.2,
            "f_int": 0.0, "psi": 0.9, "free_units": 300, "largest_free_run_units": 300, "ooms": 0}
    return orjson.dumps({**base, **values})


async def run_policy(ticks: list[tuple[str, bytes]], engine_hook=None):
    from kvguard.policy.engine import EngineConfig, PolicyEngine
    from kvguard.policy.service import PolicyService

    settings = Settings()
    bus = InprocBus.from_settings(settings)
    engine = PolicyEngine(EngineConfig(dynamic_units=1000), b"k" * 32)
    if engine_hook is not None:
        engine_hook(engine)
    service = PolicyService(engine, settings, bus=bus)
    for key, value in ticks:
        await bus.publish(settings.topics.name("metrics"), key, value)
    stop = asyncio.Event()
    outputs = []

    def seen(out):
        outputs.append(out)
        if out.decision.node == "last":
            stop.set()

    await asyncio.wait_for(service.run(group="p", stop=stop, poll_s=0.01, on_output=seen), timeout=10)
    return service, bus, settings, outputs


async def test_the_policy_dead_letters_an_overflowing_tick_and_a_raising_one_and_lives(caplog):
    def raise_on_poison(engine):
        decide = engine.decide

        def guarded(t, **kw):
            if t.node == "poison":
                raise OverflowError("injected: int too large to convert to float")
            return decide(t, **kw)

        engine.decide = guarded

    ticks = [("n", tick(u_kv=1e308)), ("poison", tick("poison")), ("n", tick(ts_s=20)), ("last", tick("last"))]
    service, bus, settings, outputs = await run_policy(ticks, raise_on_poison)
    assert [o.decision.node for o in outputs] == ["n", "last"]
    dead = await dlq_records(bus, settings)
    assert [d.reason for d in dead] == ["invalid", "processing_error"]
    assert "u_kv" in dead[0].detail and "OverflowError" in dead[1].detail
    assert service.errors == 1 and "raised OverflowError" in caplog.text
    again = bus.subscribe([settings.topics.name("metrics")], "p")
    assert await again.getmany(timeout_s=0) == []


async def test_the_policy_dead_letters_an_absurd_epoch_jump_and_keeps_deciding_the_node():
    ticks = [("n", tick(ts_s=10, epoch=5)), ("n", tick(ts_s=20, epoch=2**62)), ("n", tick(ts_s=30, epoch=5)),
             ("last", tick("last"))]
    service, bus, settings, outputs = await run_policy(ticks)
    assert [(o.decision.node, o.decision.ts_ns, o.decision.stale) for o in outputs] == [
        ("n", 10 * S, False), ("n", 30 * S, False), ("last", 10 * S, False)]
    dead = await dlq_records(bus, settings)
    assert [d.reason for d in dead] == ["invalid"] and "max_epoch_jump" in dead[0].detail
    assert service.engine.counters.epoch_jumps_rejected == 1


def test_policy_engine_state_is_capped_and_idle_nodes_are_forgotten():
    from kvguard.policy.engine import EngineConfig, PolicyEngine
    from kvguard.policy.service import PolicyService
    from kvguard.wire.schemas import MetricTick

    engine = PolicyEngine(EngineConfig(dynamic_units=1000, max_nodes=10), b"k" * 32)
    service = PolicyService(engine, Settings())
    for i in range(300):
        service.handle_tick(decode("metrics", tick(f"invented-{i}")).to_tick())
        service._seen(f"invented-{i}")
    held = [engine._last_ts, engine._epoch, engine._held, engine._calm, engine.modes._nodes]
    assert all(len(d) <= 10 for d in held), [len(d) for d in held]
    assert engine.counters.nodes_evicted_cap == 290
    assert len(service.idle_sweep) <= 10
    service.forget_idle(now_s=10**12)
    assert engine._last_ts == {} and engine.counters.nodes_evicted_idle == 10
    assert isinstance(decode("metrics", tick()), MetricTick)


# ---- the actuators -----------------------------------------------------------------------------


async def test_the_actuator_loop_dead_letters_a_command_whose_handling_raises(tmp_path):
    from kvguard.actuators.actuator import Actuator, AppliedJournal, run_actuators
    from kvguard.actuators.executor import Executor
    from kvguard.contracts.commands import AckOutcome
    from tests.unit.actuators.test_actuator import NODE, SECRET, evict_command
    from tests.unit.actuators.test_executor import running_engine

    settings = Settings()
    bus = InprocBus.from_settings(settings)
    e = running_engine()
    journal = AppliedJournal(tmp_path / "journal")
    actuator = Actuator(NODE, Executor(e), SECRET, journal=journal)
    record = journal.record

    def record_or_fail(command_id, expires_at_ns):
        if command_id == evict_command(1, position=0).id:
            raise OSError(28, "No space left on device")
        return record(command_id, expires_at_ns)

    journal.record = record_or_fail
    for position, req in enumerate((1, 2)):
        await bus.publish(settings.topics.name("commands"), NODE, evict_command(req, position=position).to_bytes())
    await bus.publish(settings.topics.name("commands"), NODE, b'{"schema":"2.0","id":"z","node":"' + NODE.encode()
                      + b'","action":"explode","payload":{},"issued_at_ns":1,"ttl_ns":1}')
    stop = asyncio.Event()
    acks = []

    def collect(ack):
        acks.append(ack)

    async def stop_after_dead_letters():
        while len(await dlq_records(bus, settings)) < 2:
            await asyncio.sleep(0.01)
        stop.set()

    await asyncio.wait_for(asyncio.gather(
        run_actuators(bus, settings, {NODE: actuator}, node_time_ns=lambda n: e.now_ns, group="act", stop=stop,
                      on_ack=collect, poll_s=0.01), stop_after_dead_letters()), timeout=10)
    assert [a.outcome for a in acks] == [AckOutcome.EXECUTED]
    dead = sorted(await dlq_records(bus, settings), key=lambda d: d.offset)
    assert [d.reason for d in dead] == ["processing_error", "invalid"]
    assert "No space left" in dead[0].detail and "explode" in dead[1].detail
    assert actuator.counters.errors == 1 and actuator.counters.malformed == 1
    assert base64.b64decode(dead[0].value_b64) == evict_command(1, position=0).to_bytes()


async def test_the_stream_service_evicts_nodes_idle_past_its_timeout():
    import time

    from kvguard.streams.embedded import StreamsService

    settings = Settings.load(env={"KVGUARD_STREAMS__NODE_IDLE_TIMEOUT_S": "60"})
    service = StreamsService(InprocBus.from_settings(settings), settings, config=stream_config(settings))
    first = node_a()[0]
    records = []
    for i, node in enumerate(("p", "q")):
        batch = EventBatch(node=node, seq=0, events=first.events, geometry=first.geometry)
        records.append(_record_of(settings, i, batch))
    await service.handle(records)
    assert sorted(service.core.nodes) == ["p", "q"]
    service.idle_sweep.seen_at["p"] -= 120  # p's last batch two minutes ago
    assert service.evict_idle(time.monotonic()) == ["p"]
    assert sorted(service.core.nodes) == ["q"] and service.counters.nodes_evicted_idle == 1


def _record_of(settings, offset, batch):
    from kvguard.bus.base import Record

    return Record(topic=settings.topics.name("events"), partition=0, offset=offset, key=batch.node.encode(),
                  value=encode_batch(batch), headers=tuple(batch_headers(batch)))
