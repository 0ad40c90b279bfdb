"""Canary rollout of strategy variants (policy.canary): buckets, stages, the rules, restarts, and
the engine staying as it was when the canary is off."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvguard.config.settings import ConfigError, Settings
from kvguard.contracts.commands import Action, Mode
from kvguard.contracts.units import NS_PER_S
from kvguard.policy.canary import (
    CANDIDATE,
    CONTROL,
    PROMOTED,
    ROLLED_BACK,
    RUNNING,
    ArmStats,
    Canary,
    CanaryConfig,
    CanaryConfigError,
    MemoryCanaryLedger,
    in_candidate,
    judge,
    node_bucket,
    resolve_candidate,
)
from kvguard.policy.engine import EngineConfig, PolicyEngine
from kvguard.policy.slo import MemorySloLedger
from kvguard.policy.strategy import DEFAULT, EMERGENCY, all_strategies
from kvguard.wire.schemas import MetricTick

S = NS_PER_S
CANDIDATE_VARIANT = "request/priority/sync/recompute/hard"
FLEET = [f"rack{r}/host{h}/gpu{g}" for r in range(5) for h in range(10) for g in range(8)]  # 400 nodes


def config(**changes) -> CanaryConfig:
    values = dict(candidate=resolve_candidate(CANDIDATE_VARIANT, DEFAULT), control=DEFAULT, min_node_hours=0.5,
                  evaluate_every_s=60.0, min_resolved_evictions=5)
    values.update(changes)
    return CanaryConfig(**values)


# ----------------------------------------------------------------------------- buckets

@given(st.text(min_size=1, max_size=64))
def test_a_nodes_bucket_is_in_range_and_the_same_every_time(node):
    bucket = node_bucket(node)
    assert 0 <= bucket < 100 and node_bucket(node) == bucket


def test_buckets_do_not_depend_on_the_process_hash_seed():
    code = ("from kvguard.policy.canary import node_bucket; "
            "print([node_bucket(f'sim-0/gpu{i}') for i in range(32)])")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout for seed in ("0", "1", "12345")}
    assert len(outs) == 1
    assert outs.pop().strip() == str([node_bucket(f"sim-0/gpu{i}") for i in range(32)])


@given(st.text(min_size=1, max_size=32), st.lists(st.integers(1, 100), min_size=2, max_size=6, unique=True))
def test_a_candidate_node_stays_a_candidate_at_every_later_stage(node, stages):
    stages = sorted(stages)
    members = [in_candidate(node, p) for p in stages]
    assert members == sorted(members)  # False ... False True ... True: the sets only grow
    assert in_candidate(node, 100) and not in_candidate(node, 0)


@pytest.mark.parametrize("percent", [5, 25, 50, 100])
def test_the_share_of_candidate_nodes_is_near_the_stage_percentage(percent):
    nodes = [f"cluster-a/node{i:05d}/gpu{g}" for i in range(2500) for g in range(8)]  # 20,000
    share = sum(in_candidate(n, percent) for n in nodes) / len(nodes)
    assert abs(share - percent / 100) < 0.012


# ----------------------------------------------------------------------------- candidates and settings

def test_the_candidate_is_a_preset_a_grid_index_or_a_variant():
    assert resolve_candidate("emergency", DEFAULT) is EMERGENCY
    assert resolve_candidate("17", DEFAULT).variant == all_strategies()[17].variant
    picked = resolve_candidate(CANDIDATE_VARIANT, DEFAULT)
    assert picked.variant == CANDIDATE_VARIANT and picked.threshold == DEFAULT.threshold
    for bad in ("243", "block/lru", "block/lru/async/recompute/loud", "", "fast"):
        with pytest.raises(CanaryConfigError) as err:
            resolve_candidate(bad, DEFAULT)
        assert err.value.field == "canary.candidate"
    with pytest.raises(CanaryConfigError, match="other than the control"):
        resolve_candidate(DEFAULT.variant, DEFAULT)


def test_canary_settings_are_off_by_default_and_bad_values_name_the_field():
    assert Settings().canary.enabled is False
    loaded = Settings.load(env={"KVGUARD_CANARY__ENABLED": "true", "KVGUARD_CANARY__CANDIDATE": "emergency",
                                "KVGUARD_CANARY__STAGES": "[10, 50, 100]"})
    assert loaded.canary.stages == [10, 50, 100] and loaded.canary.candidate == "emergency"
    with pytest.raises(ConfigError, match=r"canary\.stages: must be increasing.*KVGUARD_CANARY__STAGES"):
        Settings.load(env={"KVGUARD_CANARY__STAGES": "[5, 50, 25, 100]"})
    with pytest.raises(ConfigError, match=r"canary\.stages"):
        Settings.load(env={"KVGUARD_CANARY__STAGES": "[5, 50]"})
    with pytest.raises(ConfigError, match=r"canary\.candidate: must name"):
        Settings.load(env={"KVGUARD_CANARY__ENABLED": "true"})
    with pytest.raises(ConfigError, match=r"canary\.oom_rate_factor"):
        Settings.load(env={"KVGUARD_CANARY__OOM_RATE_FACTOR": "0"})


def test_bootstrap_builds_the_canary_from_settings_and_names_a_bad_candidate():
    from kvguard.runtime.bootstrap import BootstrapError, bootstrap

    assert bootstrap(Settings(), predictor=None).canary_config is None
    graph = bootstrap(Settings(canary={"enabled": True, "candidate": "emergency", "stages": [20, 100]}),
                      predictor=None)
    assert graph.canary_config.candidate is EMERGENCY and graph.canary_config.stages == (20, 100)
    service = graph.policy_service()
    assert service.canary is service.engine.canary is service.slo.canary
    with pytest.raises(BootstrapError) as err:
        bootstrap(Settings(canary={"enabled": True, "candidate": "block/lru/async/recompute/soft"}), predictor=None)
    assert err.value.field == "canary.candidate"


# ----------------------------------------------------------------------------- rules

def stats(hours: float, ooms: int = 0, completed: int = 0, failed: int = 0) -> ArmStats:
    return ArmStats(nodes=1, ticks=1, node_ms=int(hours * 3_600_000), ooms=ooms,
                    evictions=completed + failed, completed=completed, failed=failed)


def test_a_stage_is_judged_only_once_both_arms_have_the_minimum_node_hours():
    cfg = config(min_node_hours=10)
    assert judge(cfg, stats(9.9), stats(50, ooms=9)) is None
    assert judge(cfg, stats(50), stats(9.9, ooms=9)) is None
    assert judge(cfg, stats(10), stats(10)).action == "promote"


def test_rollback_when_the_candidate_ooms_more_than_the_control_times_the_factor():
    cfg = config(min_node_hours=1, oom_rate_factor=1.5)
    assert judge(cfg, stats(10, ooms=2), stats(10, ooms=3)).action == "promote"  # 0.3 = 0.2 x 1.5
    verdict = judge(cfg, stats(10, ooms=2), stats(10, ooms=4))
    assert verdict.action == "rollback" and "OOMs/node-hour" in verdict.reason


def test_rollback_when_the_completion_rate_falls_below_the_control_minus_the_margin():
    cfg = config(min_node_hours=1, completion_margin=0.05, min_resolved_evictions=10)
    assert judge(cfg, stats(5, completed=20), stats(5, completed=19, failed=1)).action == "promote"
    verdict = judge(cfg, stats(5, completed=20), stats(5, completed=18, failed=2))
    assert verdict.action == "rollback" and "completion rate" in verdict.reason
    # too few resolved evictions on one side: the completion rule does not judge
    assert judge(cfg, stats(5, completed=20), stats(5, completed=1, failed=8)).action == "promote"


@given(st.integers(0, 50), st.integers(0, 50), st.integers(0, 20), st.floats(1.0, 3.0))
def test_more_candidate_ooms_never_turn_a_rollback_into_a_promotion(control_ooms, candidate_ooms, extra, factor):
    cfg = config(min_node_hours=1, oom_rate_factor=factor)
    before = judge(cfg, stats(10, ooms=control_ooms), stats(10, ooms=candidate_ooms))
    after = judge(cfg, stats(10, ooms=control_ooms), stats(10, ooms=candidate_ooms + extra))
    assert not (before.action == "rollback" and after.action == "promote")


def test_stages_must_rise_to_100():
    for stages in ((), (5, 25), (25, 5, 100), (0, 100), (5, 5, 100)):
        with pytest.raises(CanaryConfigError, match="canary.stages"):
            config(stages=stages)


# ----------------------------------------------------------------------------- rollouts over the ledger

def feed(canary: Canary, nodes: list[str], start_s: int, ticks: int, *, ooms_every: dict[str, int] | None = None,
         tick_s: int = 10) -> int:
    """``ticks`` rounds of one tick per node; a node of arm A has an OOM every ``ooms_every[A]``-th
    round. Returns the next round's time."""
    ooms_every = ooms_every or {}
    t = start_s
    for i in range(ticks):
        t += tick_s
        for node in nodes:
            every = ooms_every.get(canary.arm(node))
            tick = SimpleNamespace(node=node, ts_ns=t * S, tick_s=float(tick_s), epoch=0,
                                   ooms=int(bool(every) and (i + 1) % every == 0))
            canary.observe_decision(tick, SimpleNamespace(commands=[SimpleNamespace(action=Action.HEADROOM)]))
    return t


def test_a_better_candidate_is_promoted_stage_by_stage_to_all_nodes():
    ledger = MemorySloLedger()
    canary = Canary(config(), ledger)
    t, seen = 0, []
    while canary.state.status == RUNNING and t < 100_000:
        seen.append((canary.state.stage, sum(canary.arm(n) == CANDIDATE for n in FLEET)))
        t = feed(canary, FLEET, t, 6, ooms_every={CONTROL: 4})
    assert canary.state.status == PROMOTED and canary.percent == 100
    stages_seen = sorted({stage for stage, _ in seen})
    assert stages_seen == [0, 1, 2]
    shares = {stage: count / len(FLEET) for stage, count in seen}
    assert shares[0] == pytest.approx(0.05, abs=0.04) and shares[1] == pytest.approx(0.25, abs=0.06)
    assert shares[2] == pytest.approx(0.50, abs=0.06)
    assert all(canary.arm(n) == CANDIDATE for n in FLEET)
    report = ledger.canary_report(canary.rollout)
    assert [h["to_stage"] for h in report.history] == [1, 2, 3]
    assert report.history[-1]["status"] == PROMOTED
    for stage in (0, 1, 2):
        assert report.arm(stage, CANDIDATE).node_hours >= 0.5 and report.arm(stage, CONTROL).ooms > 0
        assert report.arm(stage, CANDIDATE).ooms == 0


def test_a_worse_candidate_is_rolled_back_and_every_node_returns_to_the_control():
    ledger = MemorySloLedger()
    canary = Canary(config(stages=(25, 50, 100)), ledger)
    t = feed(canary, FLEET, 0, 30, ooms_every={CANDIDATE: 3, CONTROL: 25})
    assert canary.state.status == ROLLED_BACK and canary.state.stage == 0
    assert canary.percent == 0 and all(canary.arm(n) == CONTROL for n in FLEET)
    assert "OOMs/node-hour" in canary.state.reason
    engine = PolicyEngine(plain_engine_config(), b"k" * 32, canary=canary)
    assert {engine.strategy_for(Mode.DEFAULT, n).variant for n in FLEET} == {DEFAULT.variant}
    # after the rollback nothing more is recorded and the state stays
    before = ledger.canary_report(canary.rollout).to_dict()
    feed(canary, FLEET, t, 10)
    assert ledger.canary_report(canary.rollout).to_dict() == before


def plain_engine_config() -> EngineConfig:
    return EngineConfig(dynamic_units=1000)


def test_a_candidate_with_a_worse_completion_rate_is_rolled_back():
    ledger = MemoryCanaryLedger()
    canary = Canary(config(stages=(50, 100)), ledger)
    t = feed(canary, FLEET, 0, 3)
    for i, node in enumerate(FLEET[:200]):
        canary.observe_eviction(node, i)
        canary.observe_outcome(node, i, completed=canary.arm(node) == CONTROL or i % 3 != 0)
    canary.observe_outcome(FLEET[0], 0, completed=False)  # a second outcome of the same request does not count
    feed(canary, FLEET, t, 3)
    assert canary.state.status == ROLLED_BACK and "completion rate" in canary.state.reason
    report = ledger.canary_report(canary.rollout)
    control, candidate = report.arm(0, CONTROL), report.arm(0, CANDIDATE)
    assert control.completion_rate == 1.0 and candidate.completion_rate == pytest.approx(2 / 3, abs=0.08)
    assert control.evictions + candidate.evictions == 200


def test_the_stage_survives_a_policy_restart_and_the_same_inputs_give_the_same_stages():
    def run(ledger, rounds=None):
        canary, t = Canary(config(), ledger), 0
        while (canary.state.stage < 1 if rounds is None else t < rounds * 10):
            t = feed(canary, FLEET, t, 1, ooms_every={CONTROL: 4})
        return canary, t

    ledger = MemorySloLedger()
    first, t = run(ledger)
    assert first.state.stage == 1 and first.state.status == RUNNING
    restarted = Canary(config(), ledger)  # a new policy process over the same ledger
    assert restarted.state == first.state
    assert [restarted.arm(n) for n in FLEET] == [first.arm(n) for n in FLEET]
    feed(restarted, FLEET, t, 12, ooms_every={CONTROL: 4})
    history = ledger.canary_report(restarted.rollout).history
    assert [h["from_stage"] for h in history][:2] == [0, 1]  # it went on from the stored stage
    again, _ = run(MemorySloLedger(), t // 10)
    assert [(m.old, m.new) for m in again.transitions] == [(m.old, m.new) for m in first.transitions]


def test_replayed_ticks_and_ticks_of_a_stale_stage_count_once_or_not_at_all():
    ledger = MemoryCanaryLedger()
    canary = Canary(config(min_node_hours=1000), ledger)
    feed(canary, FLEET[:10], 0, 3)
    feed(canary, FLEET[:10], 0, 3)  # the same ticks again
    report = ledger.canary_report(canary.rollout)
    assert report.total(CONTROL).ticks + report.total(CANDIDATE).ticks == 30
    assert not ledger.record_canary_tick(canary.rollout, 1, CANDIDATE, "x", 0, 10**12, node_ms=1, ooms=0,
                                         commands=0, evict_commands=0)


def test_until_its_state_is_read_every_node_runs_the_control():
    class Down(MemoryCanaryLedger):
        def canary_begin(self, rollout, meta):
            raise ConnectionError("down")

        def canary_report(self, rollout):
            raise ConnectionError("down")

    canary = Canary(config(stages=(100,)), Down())
    assert canary.state is None and canary.errors == 1
    assert all(canary.arm(n) == CONTROL for n in FLEET)
    feed(canary, FLEET[:5], 0, 2)  # nothing raised, nothing recorded
    assert canary.errors > 1


# ----------------------------------------------------------------------------- the engine

def metric_tick(node: str, t_s: int, u_kv: float, ooms: int = 0):
    return MetricTick.model_validate({
        "node": node, "ts_ns": t_s * S, "tick_s": 10.0, "u_kv": u_kv, "psi": u_kv * 1.2, "f_ext": 0.2,
        "f_int": 0.0, "slope_per_min": 0.0, "ooms": ooms, "dynamic_units": 1000, "free_units": int(1000 * (1 - u_kv)),
        "largest_free_run_units": int(1000 * (1 - u_kv)),
        "candidates": [{"req": r, "priority": 5, "units": 40, "tokens": 160, "last_ts_ns": (t_s - r) * S,
                        "prompt_tokens": 64} for r in range(1, 12)]}).to_tick()


def ticks_for(nodes: list[str]) -> list:
    pattern = [0.5, 0.7, 0.9, 0.96, 0.97, 0.8, 0.6, 0.98, 0.99, 0.5]
    return [metric_tick(node, 10 * (i + 1), u, ooms=int(i == 4)) for i, u in enumerate(pattern * 3) for node in nodes]


def commands_of(service, ticks) -> list[tuple]:
    out = []
    for tick in ticks:
        result = service.handle_tick(tick)
        out += [(c.node, c.id, c.action, c.variant, c.payload, c.signature) for c in result.commands]
    return out


SETTINGS = dict(policy={"hmac_secret": "k" * 40})


def graph_service(**canary):
    from kvguard.runtime.bootstrap import bootstrap

    graph = bootstrap(Settings(**SETTINGS, **({"canary": canary} if canary else {})), predictor=None,
                      profile="llama3-8b-24gb")
    return graph.policy_service(ledger=None)


def test_canary_off_changes_nothing_and_a_stage_without_candidate_nodes_neither():
    nodes = [n for n in FLEET if node_bucket(n) >= 5][:4]
    ticks = ticks_for(nodes)
    off = commands_of(graph_service(), ticks)
    assert off and {c[3] for c in off} >= {DEFAULT.variant}
    plain = graph_service()
    plain_engine = PolicyEngine(plain.engine.config, plain.engine.secret)  # the engine as built before canaries
    plain.engine = plain_engine
    assert commands_of(plain, ticks) == off
    at_five = graph_service(enabled=True, candidate=CANDIDATE_VARIANT)
    assert commands_of(at_five, ticks) == off


def test_candidate_nodes_run_the_candidate_in_default_mode_and_the_control_elsewhere():
    candidates = [n for n in FLEET if node_bucket(n) < 50][:3]
    controls = [n for n in FLEET if node_bucket(n) >= 50][:3]
    service = graph_service(enabled=True, candidate=CANDIDATE_VARIANT, stages=[50, 100], min_node_hours=100)
    commands = commands_of(service, ticks_for(candidates + controls))
    by_node: dict[str, set] = {}
    for node, _, _, variant, *_ in commands:
        by_node.setdefault(node, set()).add(variant)
    for node in candidates:
        assert CANDIDATE_VARIANT in by_node[node] and DEFAULT.variant not in by_node[node]
    for node in controls:
        assert CANDIDATE_VARIANT not in by_node[node] and DEFAULT.variant in by_node[node]
    report = service.slo.ledger.canary_report(service.canary.rollout)
    assert report.total(CANDIDATE).nodes == 3 and report.total(CONTROL).nodes == 3
    assert report.total(CANDIDATE).commands + report.total(CONTROL).commands == len(commands)
    assert report.total(CANDIDATE).ooms == report.total(CONTROL).ooms == 3
    assert report.total(CONTROL).node_hours == pytest.approx(3 * 30 * 10 / 3600)


def test_the_canary_in_emergency_mode_leaves_the_default_strategy_alone():
    node = next(n for n in FLEET if node_bucket(n) < 50)
    cfg = CanaryConfig(candidate=resolve_candidate("block/cost/sync/recompute/hard", EMERGENCY), control=EMERGENCY,
                       mode=Mode.EMERGENCY, stages=(50, 100))
    engine = PolicyEngine(plain_engine_config(), b"k" * 32, canary=Canary(cfg, MemoryCanaryLedger()))
    assert engine.strategy_for(Mode.DEFAULT, node) is engine.config.default
    assert engine.strategy_for(Mode.EMERGENCY, node).variant == "block/cost/sync/recompute/hard"
    assert engine.strategy_for(Mode.EMERGENCY) is engine.config.emergency


def test_the_canary_module_is_pure():
    code = ("import sys, kvguard.policy.canary, kvguard.policy.slo; "
            "print(','.join(m for m in ('faust', 'aiokafka', 'redis', 'pydantic') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
