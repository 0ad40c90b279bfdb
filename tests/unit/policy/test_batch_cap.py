"""The batch-token cap (issue 12): a real vLLM knob as a signed command, its execution on the vLLM-faithful
engine, and the policy's allocator guard that sends it on allocator pressure and releases it when calm."""

from __future__ import annotations

from dataclasses import replace

from kvguard.actuators.executor import Executor
from kvguard.contracts.commands import AckOutcome, Action, BatchCapPayload, Command, Mode
from kvguard.contracts.units import NS_PER_S
from kvguard.policy.engine import EngineConfig, PolicyEngine
from kvguard.policy.planner import NodeView
from kvguard.producers.sim.profiles import load_profile
from kvguard.producers.sim.vllm.engine import VllmEngine
from kvguard.producers.sim.workloads import Request
from kvguard.runtime.bootstrap import bootstrap

VLLM = "llama3-8b-24gb-vllm"
SECRET = b"test-secret-of-at-least-thirty-two-bytes"


def cap_command(tokens: int, steps: int = 0) -> Command:
    return Command(id="c1", node="sim-0/gpu0", payload=BatchCapPayload(tokens, steps), reason="test",
                   mode=Mode.DEFAULT, variant="v", issued_at_ns=0, ttl_ns=30 * NS_PER_S)


def test_the_cap_bounds_every_step_and_release_restores_the_profile_budget():
    profile = load_profile(VLLM)
    engine = VllmEngine(profile)
    engine.submit(Request(1, 0, 6000, 4))  # a long prompt: chunked at the budget
    result = Executor(engine).execute(cap_command(1024), engine.now_ns)
    assert result.outcome is AckOutcome.EXECUTED
    assert engine.scheduler.max_num_scheduled_tokens == 1024
    tokens = []
    while engine.completed == 0:
        out_before = engine.steps
        engine.advance(engine.now_ns + NS_PER_S // 50)
        if engine.steps > out_before:
            tokens.append(engine.scheduler.max_num_scheduled_tokens)
    assert set(tokens) == {1024}
    assert engine.steps >= 6  # 6000 prompt tokens in chunks of at most 1024
    Executor(engine).execute(cap_command(0), engine.now_ns)
    assert engine.scheduler.max_num_scheduled_tokens == profile.max_batched_tokens == 2048


def test_a_cap_for_n_steps_lifts_itself_and_never_goes_below_max_num_seqs():
    profile = load_profile(VLLM)
    engine = VllmEngine(profile)
    engine.set_batch_token_cap(8, steps=3)
    assert engine.scheduler.max_num_scheduled_tokens == profile.max_num_seqs  # vLLM needs budget >= max_num_seqs
    engine.submit(Request(1, 0, 3000, 2))
    engine.advance(2 * NS_PER_S)
    assert engine.steps >= 3
    assert engine.scheduler.max_num_scheduled_tokens == profile.max_batched_tokens


def test_the_cap_survives_an_engine_restart():
    engine = VllmEngine(load_profile(VLLM))
    engine.set_batch_token_cap(512)
    engine.scheduler = engine._new_scheduler()  # what a crash-restart does
    assert engine.scheduler.max_num_scheduled_tokens == 512


def test_an_engine_without_a_token_budget_acks_noop_with_the_reason():
    from tests.unit.actuators.test_executor import make_engine

    result = Executor(make_engine()).execute(cap_command(512), 0)
    assert result.outcome is AckOutcome.NOOP and "no per-step token budget" in result.errors[0]


def guard_engine(**changes) -> PolicyEngine:
    graph = bootstrap(predictor=None, profile=VLLM)
    return PolicyEngine(replace(graph.engine_config, **changes), SECRET)


def node_view(ts_s: int, **changes) -> NodeView:
    base = NodeView(node="sim-0/gpu0", ts_ns=ts_s * NS_PER_S, u_kv=0.3, f_ext=0.0, f_int=0.0, psi=0.3,
                    dynamic_units=2523, free_units=1700, largest_free_run_units=1700, unit_tokens=16,
                    alloc_reserved_bytes=1 << 30)
    return replace(base, **changes)


def caps(decision) -> list[int]:
    return [c.payload.tokens for c in decision.commands if c.action is Action.BATCH_CAP]


def test_vllm_profiles_get_the_allocator_guard_and_no_kv_headroom_hold():
    config = bootstrap(predictor=None, profile=VLLM).engine_config
    assert config.allocator_guard and config.batch_cap_tokens == 1024 and not config.use_headroom
    seed = bootstrap(predictor=None, profile="llama3-8b-24gb").engine_config
    assert not seed.allocator_guard and seed.batch_cap_tokens == 0 and seed.use_headroom


def test_allocator_pressure_caps_the_budget_and_calm_releases_it():
    policy = guard_engine(batch_cap_calm_ticks=3, headroom_refresh_s=1e9)
    assert caps(policy.decide(node_view(10))) == []  # calm from the start: nothing sent
    first = policy.decide(node_view(20, alloc_retries=2))
    assert caps(first) == [1024]
    assert "allocator retries" in next(c.reason for c in first.commands if c.action is Action.BATCH_CAP)
    assert caps(policy.decide(node_view(30))) == []  # still held (level already sent)
    assert caps(policy.decide(node_view(40))) == []
    assert caps(policy.decide(node_view(50))) == [0]  # 3 calm ticks: released
    assert caps(policy.decide(node_view(60))) == []
    assert caps(policy.decide(node_view(70, ooms=1))) == [1024]  # an OOM is pressure too
    assert policy.counters.batch_cap_commands == 3


def test_the_guard_resends_the_cap_to_a_restarted_node():
    policy = guard_engine(batch_cap_calm_ticks=30, headroom_refresh_s=1e9)
    assert caps(policy.decide(node_view(10, ooms=1))) == [1024]
    policy._restart("sim-0/gpu0")  # a newer producer epoch: the fresh process has no cap
    assert caps(policy.decide(node_view(5))) == [1024]  # still within the calm window: sent again


def test_the_guard_does_nothing_when_off():
    policy = guard_engine(allocator_guard=False)
    assert caps(policy.decide(node_view(10, alloc_retries=5, ooms=1))) == []


def test_vllm_nodes_get_no_cache_reclaim_their_cached_blocks_already_count_as_free():
    from kvguard.policy.planner import plan
    from kvguard.policy.strategy import DEFAULT

    full = node_view(10, u_kv=0.99, free_units=0, largest_free_run_units=0, cached_units=400)
    reclaimed = {}
    for profile in (VLLM, "llama3-8b-24gb"):
        config = bootstrap(predictor=None, profile=profile).engine_config
        view = replace(full, unit_tokens=config.unit_tokens)
        reclaimed[profile] = plan(view, DEFAULT, config.planner, config.cost, reason="t").reclaim_units
    assert reclaimed == {VLLM: 0, "llama3-8b-24gb": 400}  # the seed arena: cached pages go first


def test_one_tick_of_a_bogus_epoch_does_not_silence_the_node():
    from tests.unit.streams.test_alerts import tick as alert_tick

    def tick(ts_s: int, epoch: int):
        return replace(alert_tick(ts_s, u_kv=0.3, node="sim-0/gpu0"), epoch=epoch)

    policy = guard_engine()
    assert not policy.decide(tick(10, 1 << 60)).stale  # a first tick with an absurd epoch: taken, unconfirmed
    real = [policy.decide(tick(t, 7)) for t in (20, 30, 40)]
    assert [d.stale for d in real] == [False, False, False] and policy.counters.epochs_retracted == 1
    assert policy.decide(tick(50, 8)).stale is False and policy.counters.restarts == 1  # a real restart
    assert policy.decide(tick(60, 8)).stale is False  # seen twice: confirmed
    assert policy.decide(tick(70, 7)).stale is True  # the old epoch late: stale, not a retraction
    assert policy.counters.epochs_retracted == 1
