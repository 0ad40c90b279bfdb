"""The plugin's command path end to end on vLLM's real scheduler: a signed command on the commands topic →
``kvguard.runtime.plugins`` (kvguard's own Actuator and Executor, on the consumer's thread) → the
engine thread applies it before its next ``schedule()`` → an ack on the acks topic. The bus is the
in-process one, the engine the conformance rig stepped by this test's thread. Needs vllm."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvguard.bus.inproc import InprocBus
from kvguard.config.settings import Settings
from kvguard.contracts.commands import (
    AbortPayload,
    Ack,
    AckOutcome,
    Command,
    EmptyCachePayload,
    EvictPayload,
    HoldPayload,
    Mode,
    Payload,
    ReleasePayload,
    Target,
    sign,
)
from kvguard.runtime.plugins import start_for
from tests.integration.test_vllm_plugin import Rig

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

SECRET = "e50f24450cca5519777154f8a9c59d4e7ca2297cccdfeeb5d1381f0f790f3824"


def signed(plugin, payload: Payload, command_id: str, *, mode: Mode = Mode.DEFAULT) -> Command:
    return sign(Command(id=command_id, node=plugin.node, payload=payload, reason="test", mode=mode,
                        variant="request/lru/sync/recompute/hard", issued_at_ns=time.time_ns(), ttl_ns=30 * 10**9,
                        epoch=plugin.translator.epoch), SECRET.encode())


def evict(plugin, req: int, command_id: str) -> Command:
    return signed(plugin, EvictPayload((Target(req),)), command_id, mode=Mode.EMERGENCY)


def started(rig: Rig):
    settings = Settings.from_dict({"policy": {"hmac_secret": SECRET}, "node": {"journal_dir": None}})
    bus = InprocBus.from_settings(settings)
    consumer = start_for(rig.plugin, settings=settings, bus=bus)
    deadline = time.monotonic() + 5
    while consumer._loop is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return settings, bus, consumer


def send(settings, bus, consumer, command: Command) -> None:
    asyncio.run_coroutine_threadsafe(bus.publish(settings.topics.name("commands"), command.node, command.to_bytes()),
                                     consumer._loop).result(5)


def test_a_signed_evict_command_preempts_the_request_on_the_engine_thread_and_is_acked():
    rig = Rig(600)
    rig.add("victim", 400, max_tokens=200)
    rig.step()
    settings, bus, consumer = started(rig)
    try:
        send(settings, bus, consumer, evict(rig.plugin, rig.plugin.translator.req("victim"), "cmd-1"))
        deadline = time.monotonic() + 10
        scheduled_after = None
        while not consumer.acks and time.monotonic() < deadline:
            scheduled = rig.step()  # the engine thread: the submitted execution runs before this schedule()
            if rig.sched.requests["victim"].num_preemptions:
                scheduled_after = scheduled
            time.sleep(0.01)
        assert consumer.acks, "no ack within 10 s"
        ack = consumer.acks[0]
        assert ack.outcome is AckOutcome.EXECUTED and ack.units_freed >= 25  # 400 prompt tokens and what it decoded
        assert rig.sched.requests["victim"].num_preemptions == 1 and scheduled_after is not None
        sub = asyncio.run_coroutine_threadsafe(_acks(bus, settings), consumer._loop).result(5)
        assert [Ack.from_bytes(v).command_id for v in sub] == ["cmd-1"]
    finally:
        consumer.stop()


async def _acks(bus, settings) -> list[bytes]:
    sub = bus.subscribe([settings.topics.name("acks")], "test-reader")
    return [r.value for r in await sub.getmany(timeout_s=0)]


def test_a_command_for_an_idle_engine_is_acked_failed_with_the_reason():
    rig = Rig(600)
    rig.add("victim", 400, max_tokens=200)
    rig.step()
    settings, bus, consumer = started(rig)
    consumer.actuator.executor.timeout_s = 0.3
    try:
        send(settings, bus, consumer, evict(rig.plugin, rig.plugin.translator.req("victim"), "cmd-2"))
        deadline = time.monotonic() + 10
        while not consumer.acks and time.monotonic() < deadline:
            time.sleep(0.02)  # no engine step: nothing runs the submitted execution
        assert consumer.acks and consumer.acks[0].outcome is AckOutcome.FAILED
        assert "idle" in consumer.acks[0].errors[0]
    finally:
        consumer.stop()


def run_until_acked(rig: Rig, consumer, n: int) -> None:
    deadline = time.monotonic() + 10
    while len(consumer.acks) < n and time.monotonic() < deadline:
        rig.step()
        time.sleep(0.01)
    assert len(consumer.acks) >= n, f"{len(consumer.acks)} of {n} acks within 10 s"


def test_hold_release_and_abort_commands_from_the_bus_change_vllms_scheduling_and_the_mirror_follows():
    rig = Rig(600)
    rig.add("runner", 200, max_tokens=400)
    rig.step()
    settings, bus, consumer = started(rig)
    try:
        send(settings, bus, consumer, signed(rig.plugin, HoldPayload(1000), "hold-1"))
        run_until_acked(rig, consumer, 1)
        assert consumer.acks[0].outcome is AckOutcome.EXECUTED
        rig.add("long", 3000, max_tokens=4)
        rig.add("short", 300, max_tokens=4)
        for _ in range(5):
            rig.step()
        waiting = {r.request_id for r in rig.sched.waiting}
        assert "long" in waiting and "short" not in waiting  # the short prompt passed the held long one
        send(settings, bus, consumer, signed(rig.plugin, ReleasePayload(), "release-1"))
        run_until_acked(rig, consumer, 2)
        for _ in range(5):
            rig.step()
        assert "long" not in {r.request_id for r in rig.sched.waiting}
        runner = rig.plugin.translator.req("runner")
        send(settings, bus, consumer, signed(rig.plugin, AbortPayload((runner,)), "abort-1"))
        run_until_acked(rig, consumer, 3)
        ack = consumer.acks[2]
        assert ack.outcome is AckOutcome.EXECUTED and ack.units_freed > 0
        for _ in range(3):
            rig.step()
        assert "runner" not in rig.sched.requests  # vLLM finished it (FINISHED_ERROR: its client sees an error)
        rig.check_equal()
        assert [a.command_id for a in consumer.acks] == ["hold-1", "release-1", "abort-1"]
    finally:
        consumer.stop()


def test_empty_cache_without_cuda_in_the_process_is_acked_noop_with_the_reason():
    rig = Rig(600)
    rig.add("r", 100, max_tokens=50)
    rig.step()
    settings, bus, consumer = started(rig)
    try:
        send(settings, bus, consumer, signed(rig.plugin, EmptyCachePayload(), "ec-1"))
        run_until_acked(rig, consumer, 1)
        ack = consumer.acks[0]
        assert ack.outcome is AckOutcome.NOOP and "no CUDA" in ack.errors[0]
    finally:
        consumer.stop()
