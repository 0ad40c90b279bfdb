"""Faults on the real broker and redis-server (issue 15): an actuator killed between executing and
acking, the policy killed between publishing and committing, Redis down when the policy starts."""

from __future__ import annotations

import asyncio
import uuid

import orjson
import pytest

from kvguard.bus.kafka import KafkaBus
from kvguard.contracts.commands import Ack, AckOutcome
from kvguard.contracts.units import NS_PER_S
from tests.integration.bus_helpers import consume, drain_quietly
from tests.unit.actuators.test_actuator import NODE, SECRET, Crash, CrashAfterEffect, evict_command
from tests.unit.actuators.test_executor import running_engine

pytestmark = pytest.mark.integration


async def test_an_actuator_killed_between_executing_and_acking_acks_the_redelivery_once(kafka_settings, tmp_path):
    from kvguard.actuators.actuator import Actuator, AppliedJournal, run_actuators
    from kvguard.actuators.executor import Executor

    settings = kafka_settings
    group = f"act-{uuid.uuid4().hex[:6]}"
    bus = KafkaBus(settings)
    await bus.start()
    try:
        e = running_engine()
        live_before = e.pool.metrics().live_units
        await (await bus.publish(settings.topics.name("commands"), NODE, evict_command().to_bytes()))
        journal = tmp_path / "applied.journal"
        killed = Actuator(NODE, CrashAfterEffect(e), SECRET, journal=AppliedJournal(journal))
        with pytest.raises(Crash):  # the process dies after the effect, before the ack and the commit
            await asyncio.wait_for(run_actuators(bus, settings, {NODE: killed}, node_time_ns=lambda n: e.now_ns,
                                                 group=group, poll_s=0.05), timeout=60)
        freed_once = live_before - e.pool.metrics().live_units
        assert freed_once > 0
        acks: list[Ack] = []
        stop = asyncio.Event()

        def collect(ack):
            acks.append(ack)
            stop.set()

        restarted = Actuator(NODE, Executor(e), SECRET, journal=AppliedJournal(journal))
        await asyncio.wait_for(run_actuators(bus, settings, {NODE: restarted}, node_time_ns=lambda n: e.now_ns,
                                             group=group, stop=stop, on_ack=collect, poll_s=0.05), timeout=60)
        assert [a.outcome for a in acks] == [AckOutcome.DUPLICATE]
        assert live_before - e.pool.metrics().live_units == freed_once  # not executed a second time
        reader = bus.subscribe([settings.topics.name("acks")], f"r-{uuid.uuid4().hex[:6]}")
        on_topic = [Ack.from_bytes(r.value) for r in await consume(reader, 1)]
        assert [a.outcome for a in on_topic + await drain_quietly(reader)] == [AckOutcome.DUPLICATE]
    finally:
        await bus.stop()


class CommitCrashBus:
    """The policy's bus, whose process dies right before it commits (after the commands went out)."""

    def __init__(self, inner):
        self.inner = inner

    def subscribe(self, topics, group):
        sub = self.inner.subscribe(topics, group)

        class Dying:
            async def getmany(self, *args, **kwargs):
                return await sub.getmany(*args, **kwargs)

            async def commit(self):
                raise Crash("killed between publishing and committing")

            async def close(self):
                await sub.close()

        return Dying()

    async def publish(self, *args, **kwargs):
        return await self.inner.publish(*args, **kwargs)


def hot_tick(ts_s: int) -> bytes:
    return orjson.dumps({"schema": "1.0", "node": NODE, "ts_ns": ts_s * NS_PER_S, "tick_s": 10.0, "u_kv": 0.97,
                         "f_ext": 0.3, "f_int": 0.0, "psi": 1.0, "free_units": 40, "largest_free_run_units": 40})


async def test_the_policy_killed_between_publishing_and_committing_reissues_the_same_commands(kafka_settings):
    from kvguard.policy.engine import EngineConfig, PolicyEngine
    from kvguard.policy.service import PolicyService

    settings = kafka_settings
    group = f"pol-{uuid.uuid4().hex[:6]}"
    bus = KafkaBus(settings)
    await bus.start()
    try:
        for ts_s in (10, 20, 30):
            await (await bus.publish(settings.topics.name("metrics"), NODE, hot_tick(ts_s)))

        def service(carrier):
            return PolicyService(PolicyEngine(EngineConfig(dynamic_units=1000), SECRET), settings, bus=carrier)

        first = service(CommitCrashBus(bus))
        with pytest.raises(Crash):
            await asyncio.wait_for(first.run(group=group, poll_s=0.05), timeout=60)
        assert first.ticks == 3

        second = service(bus)
        stop = asyncio.Event()
        decided = []

        def seen(out):
            decided.append(out.decision.ts_ns)
            if len(decided) == 3:
                stop.set()

        await asyncio.wait_for(second.run(group=group, stop=stop, poll_s=0.05, on_output=seen), timeout=60)
        assert decided == [10 * NS_PER_S, 20 * NS_PER_S, 30 * NS_PER_S]  # uncommitted: redelivered
        reader = bus.subscribe([settings.topics.name("commands")], f"r-{uuid.uuid4().hex[:6]}")
        records = await drain_quietly(reader, settle_s=2.0)
        ids = [orjson.loads(r.value)["id"] for r in records]
        assert ids and len(ids) == 2 * len(set(ids)), "each decision published twice, with the same id"
        # the node applies each id once: the second copy is acked as a duplicate
        from kvguard.actuators.actuator import Actuator
        from kvguard.actuators.executor import Executor
        from kvguard.contracts.commands import Command

        e = running_engine()
        actuator = Actuator(NODE, Executor(e), SECRET)
        outcomes = [actuator.handle(Command.from_bytes(r.value), 10 * NS_PER_S).outcome for r in records]
        assert outcomes.count(AckOutcome.DUPLICATE) == len(set(ids))
    finally:
        await bus.stop()


def test_redis_down_when_the_policy_starts(redis_server):
    from kvguard.config.settings import Settings
    from kvguard.policy.budget_redis import RedisBudgetLedger
    from kvguard.policy.engine import EngineConfig, PolicyEngine
    from kvguard.policy.service import PolicyService
    from kvguard.runtime.mapping import budget_config
    from kvguard.wire.schemas import decode

    server = redis_server()
    server.stop()  # down before the policy comes up
    settings = Settings()
    ledger = RedisBudgetLedger(server.url, budget_config(settings), retry_interval_s=0.0)
    service = PolicyService(PolicyEngine(EngineConfig(dynamic_units=1000), SECRET), settings, ledger=ledger)
    fragmented = [decode("metrics", hot_tick(ts_s).replace(b'"f_ext":0.3', b'"f_ext":0.9')).to_tick()
                  for ts_s in range(10, 110, 10)]
    for tick in fragmented[:5]:
        assert service.handle_tick(tick).decision.node == NODE  # decided without the budget
    stats = ledger.stats()  # the ledger answers from what it buffered; nothing reached the service
    assert stats.outage and stats.buffered == 5 and service.ticks == 5
    server.start()
    for tick in fragmented[5:]:
        service.handle_tick(tick)
    assert ledger.flush()
    stats = ledger.stats()
    assert (stats.outage, stats.buffered, stats.replayed, stats.counted) == (False, 0, 5, 10)
    from kvguard.policy.budget import tick_week

    used = ledger.status(tick_week(fragmented[0].ts_ns)).nodes[0].used_s
    assert used == pytest.approx(10 * 10.0)  # every tick once
    assert service.engine.counters.ticks == 10
    ledger.close()
