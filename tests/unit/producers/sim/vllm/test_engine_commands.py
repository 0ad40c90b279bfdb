"""The vLLM knobs as signed commands (issues 12 and 14): hold / release, abort and empty_cache, executed
on the vLLM-faithful engine; the stream mirror, fed only by the engine's events, stays exact."""

from __future__ import annotations

import pytest

from kvguard.actuators.executor import Executor
from kvguard.contracts.commands import (
    PAYLOADS,
    AbortPayload,
    AckOutcome,
    Command,
    EmptyCachePayload,
    HoldPayload,
    Mode,
    ReleasePayload,
)
from kvguard.contracts.events import EventKind, Outcome
from kvguard.contracts.units import NS_PER_S
from kvguard.producers.sim.fleet import Fleet
from kvguard.producers.sim.profiles import load_profile
from kvguard.producers.sim.vllm.engine import VllmEngine
from kvguard.producers.sim.workloads import Request, load_workload
from kvguard.streams.core import StreamConfig, StreamCore

VLLM = "llama3-8b-24gb-vllm"


def command(payload) -> Command:
    return Command(id="c1", node="sim-0/gpu0", payload=payload, reason="test", mode=Mode.DEFAULT, variant="v",
                   issued_at_ns=0, ttl_ns=30 * NS_PER_S)


def hold(max_prompt_tokens: int, steps: int = 0) -> Command:
    return command(HoldPayload(max_prompt_tokens, steps))


def abort(*requests: int) -> Command:
    return command(AbortPayload(requests))


RELEASE, EMPTY_CACHE = command(ReleasePayload()), command(EmptyCachePayload())


def run(engine: VllmEngine, seconds: float) -> None:
    engine.advance(engine.now_ns + int(seconds * NS_PER_S))


def status(engine: VllmEngine, req: int) -> str | None:
    seq = engine.scheduler.requests.get(req)
    return None if seq is None else seq.status.value


def test_a_hold_keeps_long_prompts_waiting_lets_short_ones_pass_and_release_admits_them():
    engine = VllmEngine(load_profile(VLLM))
    ex = Executor(engine)
    assert ex.execute(hold(4000), 0).outcome is AckOutcome.EXECUTED
    engine.submit(Request(1, 0, 9000, 4))  # ahead of the short one in arrival order
    engine.submit(Request(2, 1, 500, 4))
    run(engine, 2.0)
    assert status(engine, 1) == "waiting" and engine.completed == 1  # the short one passed the held one
    assert ex.execute(RELEASE, engine.now_ns).outcome is AckOutcome.EXECUTED
    run(engine, 5.0)
    assert engine.completed == 2 and engine.failed == 0
    assert ex.execute(RELEASE, engine.now_ns).outcome is AckOutcome.NOOP  # nothing held any more


def test_a_hold_of_everything_drains_running_requests_finish_waiting_ones_stay():
    engine = VllmEngine(load_profile(VLLM))
    engine.submit(Request(1, 0, 300, 50))
    run(engine, 0.2)
    assert status(engine, 1) == "running"
    Executor(engine).execute(hold(0), engine.now_ns)  # drain
    engine.submit(Request(2, engine.now_ns, 300, 4))
    run(engine, 10.0)
    assert engine.completed == 1 and status(engine, 2) == "waiting"
    assert engine.queue_lengths()["waiting"] == 1  # a held request still counts as waiting


def test_a_hold_for_n_steps_lifts_itself():
    engine = VllmEngine(load_profile(VLLM))
    engine.submit(Request(1, 0, 200, 40))  # keeps the engine stepping
    engine.submit(Request(2, 0, 6000, 4))
    engine.hold_admissions(1000, steps=5)
    run(engine, 0.05)
    assert status(engine, 2) == "waiting"
    run(engine, 10.0)
    assert engine.completed == 2 and engine._hold_cap is None


def test_abort_ends_a_running_request_as_failed_frees_its_blocks_and_the_mirror_follows():
    engine = VllmEngine(load_profile(VLLM))
    engine.submit(Request(1, 0, 3000, 500))
    engine.submit(Request(2, 0, 400, 500))
    run(engine, 1.0)
    free_before = engine.scheduler.kv.num_free_blocks
    result = Executor(engine).execute(abort(1, 99), engine.now_ns)
    assert result.outcome is AckOutcome.EXECUTED and result.targets_done == 1 and result.targets_noop == 1
    assert result.units_freed >= 3000 // engine.block_size
    assert engine.scheduler.kv.num_free_blocks - free_before == result.units_freed
    assert status(engine, 1) is None and engine.failed == engine.aborted == 1
    rows = engine.take_events()
    finish = rows[(rows["kind"] == int(EventKind.FINISH)) & (rows["req"] == 1)]
    assert list(finish["flags"]) == [int(Outcome.ABORTED)]
    run(engine, 30.0)
    assert engine.completed == 1  # the other request is untouched
    summary = engine.summary()
    assert summary.failed == 1 and summary.slo_met <= summary.completed


def test_the_stream_mirror_stays_exact_through_abort_hold_and_empty_cache():
    fleet = Fleet(1, load_profile(VLLM), snapshot_every_s=5)
    engine = fleet.engines[0]
    core = StreamCore(StreamConfig(tick_s=1.0))
    ex = Executor(engine)
    for r in range(8):
        engine.submit(Request(r, r * NS_PER_S // 4, 2500 + 400 * r, 200))
    ticks = []
    for second in range(1, 40):
        if second == 3:
            ex.execute(abort(2, 3), engine.now_ns)
        if second == 4:
            ex.execute(hold(3000), engine.now_ns)
        if second == 6:
            assert ex.execute(EMPTY_CACHE, engine.now_ns).outcome is AckOutcome.EXECUTED
        if second == 8:
            ex.execute(RELEASE, engine.now_ns)
        fleet.advance(second * NS_PER_S)
        got, _ = core.process_many(fleet.take_batches(second * NS_PER_S))
        ticks.extend(got)
    node = core.nodes[engine.node]
    assert node.mirror.synced and all(t.synced for t in ticks), "the mirror lost sync with the engine"
    assert core.counters.batches_rejected == core.counters.batches_failed == 0
    m = node.mirror.metrics()
    assert m.free_units + m.cached_units == engine.scheduler.kv.num_free_blocks
    stats = engine.memory.stats()
    assert ticks[-1].alloc_reserved_bytes == stats["reserved_bytes"]
    assert engine.aborted == 2 and engine.completed == 6


def test_empty_cache_returns_cached_segments_to_the_device_and_says_how_many_bytes():
    engine = VllmEngine(load_profile(VLLM))
    engine.submit(Request(1, 0, 8000, 2))  # a long prefill grows the activation cache
    run(engine, 3.0)
    assert engine.completed == 1
    reserved = engine.memory.stats()["reserved_bytes"]
    engine.take_events()
    result = Executor(engine).execute(EMPTY_CACHE, engine.now_ns)
    assert result.outcome is AckOutcome.EXECUTED
    released = int(result.errors[0].split()[1])
    assert released > 0 and engine.memory.stats()["reserved_bytes"] == reserved - released
    rows = engine.take_events()
    assert int((rows["size"][rows["kind"] == int(EventKind.SEG_FREE)]).sum()) == released
    # a second one finds nothing left to release
    again = Executor(engine).execute(EMPTY_CACHE, engine.now_ns)
    assert again.outcome is AckOutcome.EXECUTED and again.errors[0].startswith("empty_cache: 0 bytes")


@pytest.mark.parametrize("cmd", [hold(100), RELEASE, abort(1), EMPTY_CACHE], ids=lambda c: c.action.value)
def test_the_seed_engine_acks_noop_with_the_reason(cmd):
    from tests.unit.actuators.test_executor import make_engine

    result = Executor(make_engine()).execute(cmd, 0)
    assert result.outcome is AckOutcome.NOOP and "this engine" in result.errors[0]


def test_a_command_of_each_new_action_survives_the_wire():
    for c in (hold(123, 4), RELEASE, abort(7), EMPTY_CACHE):
        back = Command.from_dict(c.to_dict())
        assert back == c and type(back.payload) is PAYLOADS[c.action]


def test_a_drained_gpu_fails_the_routers_health_check_and_new_requests_go_elsewhere():
    fleet = Fleet(2, load_profile(VLLM))
    drained = fleet.engines[0]
    Executor(drained).execute(hold(0), 0)
    assert not drained.is_up(0) and fleet.engines[1].is_up(0)
    fleet.submit_workload(load_workload("mixed", rate_scale=1.0, window=60, seed=0))
    fleet.advance(60 * NS_PER_S)
    assert fleet.routed[0] == 0 and fleet.routed[1] > 0
    Executor(drained).execute(RELEASE, drained.now_ns)
    assert drained.is_up(drained.now_ns)
    Executor(drained).execute(hold(4000), drained.now_ns)  # a partial hold keeps it in
    assert drained.is_up(drained.now_ns)
