"""The actuator: forged, expired, duplicate and misaddressed commands; unknown requests; restarts."""

import asyncio
from dataclasses import replace

import pytest

from kvguard.actuators.actuator import Actuator, AppliedJournal, run_actuators
from kvguard.actuators.executor import Executor
from kvguard.bus.inproc import InprocBus
from kvguard.config.settings import Settings
from kvguard.contracts.commands import Ack, AckOutcome, Action, Command, EvictPayload, Mode, Target, command_id, sign
from kvguard.contracts.units import NS_PER_S
from tests.unit.actuators.test_executor import running_engine

SECRET = b"shared-secret"
NODE = "t/gpu0"


def evict_command(req=1, *, issued_s=1.0, ttl_s=30.0, position=0) -> Command:
    cmd = Command(id=command_id(NODE, int(issued_s * NS_PER_S), Action.EVICT, position), node=NODE,
                  payload=EvictPayload((Target(req),)), reason="test", mode=Mode.DEFAULT,
                  variant="request/lru/sync/recompute/hard",
                  issued_at_ns=int(issued_s * NS_PER_S), ttl_ns=int(ttl_s * NS_PER_S))
    return sign(cmd, SECRET)


def make_actuator(engine, journal=None):
    return Actuator(NODE, Executor(engine), SECRET, journal=journal)


def test_valid_command_is_executed_and_acked_with_units_freed():
    e = running_engine()
    ack = make_actuator(e).handle(evict_command(), e.now_ns)
    assert ack.outcome is AckOutcome.EXECUTED and ack.units_freed > 0
    assert ack.command_id == evict_command().id and ack.latency_ns >= 0 and ack.action == "evict"


def test_forged_signature_is_rejected_and_nothing_happens():
    e = running_engine()
    actuator = make_actuator(e)
    free_before = e.pool.metrics().free_units
    forged = sign(replace(evict_command(), signature=""), b"attacker-secret")
    altered = replace(evict_command(), payload=EvictPayload((Target(2),)))
    for cmd in (forged, altered):
        ack = actuator.handle(cmd, e.now_ns)
        assert ack.outcome is AckOutcome.REJECTED_SIGNATURE and "signature" in ack.errors[0]
    assert e.pool.metrics().free_units == free_before
    assert actuator.counters.rejected_signature == 2 and actuator.counters.executed == 0


def test_expired_command_is_rejected_with_the_reason():
    e = running_engine()
    actuator = make_actuator(e)
    cmd = evict_command(issued_s=0.0, ttl_s=0.5)
    ack = actuator.handle(cmd, cmd.expires_at_ns() + 1)
    assert ack.outcome is AckOutcome.REJECTED_EXPIRED and "expired" in ack.errors[0]
    assert actuator.counters.rejected_expired == 1 and actuator.counters.executed == 0


def test_duplicate_delivery_is_applied_once():
    e = running_engine()
    actuator = make_actuator(e)
    cmd = evict_command()
    first = actuator.handle(cmd, e.now_ns)
    e.advance(e.now_ns + 2 * NS_PER_S)  # the evicted request is re-admitted meanwhile
    assert 1 in {v.req for v in e.running_requests()}
    second = actuator.handle(cmd, e.now_ns)
    assert first.outcome is AckOutcome.EXECUTED
    assert second.outcome is AckOutcome.DUPLICATE
    assert 1 in {v.req for v in e.running_requests()}, "the duplicate did not evict it again"
    assert actuator.counters.duplicate == 1


def test_command_for_another_node_is_rejected():
    e = running_engine()
    cmd = sign(replace(evict_command(), node="other/gpu9", signature=""), SECRET)
    ack = make_actuator(e).handle(cmd, e.now_ns)
    assert ack.outcome is AckOutcome.REJECTED_NODE


def test_command_naming_a_finished_request_is_a_noop_ack():
    e = running_engine()
    ack = make_actuator(e).handle(evict_command(req=12345), e.now_ns)
    assert ack.outcome is AckOutcome.NOOP and ack.targets_noop == 1
    assert ack.errors == ("req 12345: not running (finished, waiting or unknown): nothing to free",)  # the reason


def test_malformed_record_is_counted_not_raised():
    e = running_engine()
    actuator = make_actuator(e)
    assert actuator.handle_record(b"{not json", e.now_ns) is None
    assert actuator.handle_record({"id": "x"}, e.now_ns) is None
    assert actuator.counters.malformed == 2


class Crash(BaseException):
    """The process dying (not an error the actuator could handle)."""


class CrashAfterEffect(Executor):
    """Executes the command, then the process 'dies' before it can ack or commit."""

    def execute(self, command, now_ns):
        super().execute(command, now_ns)
        raise Crash("killed mid-command")


def test_restart_mid_command_does_not_apply_the_redelivered_command_twice(tmp_path):
    e = running_engine()
    journal_path = tmp_path / "applied.journal"
    cmd = evict_command()
    first = Actuator(NODE, CrashAfterEffect(e), SECRET, journal=AppliedJournal(journal_path))
    with pytest.raises(Crash):
        first.handle(cmd, e.now_ns)
    e.advance(e.now_ns + 2 * NS_PER_S)
    assert 1 in {v.req for v in e.running_requests()}
    restarted = Actuator(NODE, Executor(e), SECRET, journal=AppliedJournal(journal_path))
    ack = restarted.handle(cmd, e.now_ns)
    assert ack.outcome is AckOutcome.DUPLICATE
    assert 1 in {v.req for v in e.running_requests()}


def test_journal_ignores_a_torn_last_line_and_forgets_expired_ids(tmp_path):
    path = tmp_path / "j"
    path.write_text("aaa 100\nbbb 5000\ncc")
    journal = AppliedJournal(path)
    assert "aaa" in journal and "bbb" in journal and len(journal) == 2
    assert journal.prune(now_ns=1000) == 1
    assert "aaa" not in journal and "bbb" in journal


async def test_restart_over_the_inproc_bus_redelivers_and_acks_the_duplicate(tmp_path):
    settings = Settings()
    bus = InprocBus.from_settings(settings)
    e = running_engine()
    cmd = evict_command()
    await bus.publish(settings.topics.name("commands"), NODE, cmd.to_bytes())
    journal_path = tmp_path / "applied.journal"
    crashing = Actuator(NODE, CrashAfterEffect(e), SECRET, journal=AppliedJournal(journal_path))
    with pytest.raises(Crash):
        await run_actuators(bus, settings, {NODE: crashing}, node_time_ns=lambda n: e.now_ns, group="act")

    acks: list[Ack] = []
    stop = asyncio.Event()

    def collect(ack):
        acks.append(ack)
        stop.set()

    restarted = Actuator(NODE, Executor(e), SECRET, journal=AppliedJournal(journal_path))
    await asyncio.wait_for(run_actuators(bus, settings, {NODE: restarted}, node_time_ns=lambda n: e.now_ns,
                                         group="act", stop=stop, on_ack=collect), timeout=5)
    assert [a.outcome for a in acks] == [AckOutcome.DUPLICATE]
    sub = bus.subscribe([settings.topics.name("acks")], "reader")
    records = await sub.getmany(timeout_s=0)
    assert [Ack.from_bytes(r.value).outcome for r in records] == [AckOutcome.DUPLICATE]
    assert records[0].key == NODE.encode()


class RaisingExecutor(Executor):
    """Applies the effect, then raises: an executor bug after a partial effect."""

    def execute(self, command, now_ns):
        super().execute(command, now_ns)
        raise RuntimeError("executor bug")


def test_execute_raising_is_acked_failed_and_a_redelivery_is_not_applied_again(tmp_path):
    e = running_engine()
    journal_path = tmp_path / "applied.journal"
    actuator = Actuator(NODE, RaisingExecutor(e), SECRET, journal=AppliedJournal(journal_path))
    ack = actuator.handle(evict_command(), e.now_ns)
    assert ack.outcome is AckOutcome.FAILED and "RuntimeError: executor bug" in ack.errors[0]
    assert actuator.counters.failed == 1
    again = Actuator(NODE, Executor(e), SECRET, journal=AppliedJournal(journal_path)).handle(evict_command(), e.now_ns)
    assert again.outcome is AckOutcome.DUPLICATE, "at most one application per id"


async def test_run_actuators_survives_a_raising_execute_and_acks_every_command():
    settings = Settings()
    bus = InprocBus.from_settings(settings)
    e = running_engine()
    for position, req in enumerate((1, 2)):
        await bus.publish(settings.topics.name("commands"), NODE, evict_command(req, position=position).to_bytes())
    stop = asyncio.Event()
    acks: list[Ack] = []

    def collect(ack):
        acks.append(ack)
        if len(acks) == 2:
            stop.set()

    actuator = Actuator(NODE, RaisingExecutor(e), SECRET)
    await asyncio.wait_for(run_actuators(bus, settings, {NODE: actuator}, node_time_ns=lambda n: e.now_ns,
                                         group="act", stop=stop, on_ack=collect), timeout=5)
    assert [a.outcome for a in acks] == [AckOutcome.FAILED, AckOutcome.FAILED]
    records = await bus.subscribe([settings.topics.name("acks")], "reader").getmany(timeout_s=0)
    assert [Ack.from_bytes(r.value).outcome for r in records] == [AckOutcome.FAILED, AckOutcome.FAILED]


class FlakyBus:
    """The in-process bus behind a broker outage: the first ``refuse`` publishes raise
    SendBufferFull, the next ``fail`` deliveries fail; then it recovers."""

    def __init__(self, inner, *, refuse=0, fail=0):
        self.inner, self.refuse, self.fail = inner, refuse, fail

    async def publish(self, topic, key, value, headers=()):
        from kvguard.bus import SendBufferFull

        if topic.endswith("dlq"):
            return await self.inner.publish(topic, key, value, headers)
        if self.refuse:
            self.refuse -= 1
            raise SendBufferFull(topic, 10, 10, 0.01)
        if self.fail:
            self.fail -= 1
            future = asyncio.get_running_loop().create_future()
            future.set_exception(ConnectionError("broker went away"))
            return future
        return await self.inner.publish(topic, key, value, headers)

    def subscribe(self, topics, group):
        return self.inner.subscribe(topics, group)


async def test_acks_survive_a_broker_outage_before_the_commands_are_committed():
    settings = Settings()
    inner = InprocBus.from_settings(settings)
    bus = FlakyBus(inner, refuse=2, fail=1)
    e = running_engine()
    await inner.publish(settings.topics.name("commands"), NODE, evict_command().to_bytes())
    stop = asyncio.Event()
    acks = await inner.subscribe([settings.topics.name("acks")], "reader").getmany(timeout_s=0)

    async def until_acked():
        reader = inner.subscribe([settings.topics.name("acks")], "reader2")
        while not await reader.getmany(timeout_s=0.05):
            pass
        stop.set()

    await asyncio.wait_for(asyncio.gather(
        run_actuators(bus, settings, {NODE: make_actuator(e)}, node_time_ns=lambda n: e.now_ns, group="act",
                      stop=stop), until_acked()), timeout=10)
    records = await inner.subscribe([settings.topics.name("acks")], "reader3").getmany(timeout_s=0)
    assert acks == [] and [Ack.from_bytes(r.value).outcome for r in records] == [AckOutcome.EXECUTED]


def test_journal_skips_a_line_past_its_bound_and_keeps_the_ids_around_it(tmp_path, monkeypatch):
    import kvguard.actuators.actuator as actuator_module

    monkeypatch.setattr(actuator_module, "JOURNAL_LINE_CHARS", 100)
    path = tmp_path / "applied.journal"
    path.write_text("aaa 10\n" + "x" * 1000 + " 20\n" + "bbb 30\n", encoding="ascii")
    journal = AppliedJournal(path)
    assert "aaa" in journal and "bbb" in journal and len(journal) == 2
