"""Canary rollout over both SLO ledgers (memory and a private redis-server on a free port): the
stage moves and survives a restart, records count once; `kvguard slo report` shows a section per
variant; and an embedded closed loop with two variants on a small fleet attributes its commands."""

from __future__ import annotations

import asyncio
import json
import uuid
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from kvguard.contracts.commands import Action
from kvguard.contracts.units import NS_PER_S
from kvguard.policy.canary import (
    CANDIDATE,
    CONTROL,
    PROMOTED,
    ROLLED_BACK,
    Canary,
    CanaryConfig,
    node_bucket,
    resolve_candidate,
)
from kvguard.policy.slo import MemorySloLedger, SloConfig
from kvguard.policy.strategy import DEFAULT

S = NS_PER_S
CANDIDATE_VARIANT = "request/priority/sync/recompute/hard"
FLEET = [f"rack{r}/gpu{g}" for r in range(25) for g in range(8)]  # 200 nodes
# this machine is shared: a Redis reply slower than the default 1 s timeout would read as an outage
# (writes buffered, the canary on the control until it reads its state), which these tests do not test
PATIENT = {"socket_timeout_s": 10.0, "connect_timeout_s": 5.0}


@pytest.fixture
def private_redis(redis_server):
    return redis_server().url


def prefix() -> str:
    return f"test{uuid.uuid4().hex[:8]}"


def open_ledger(kind: str, url: str | None, key_prefix: str):
    from kvguard.policy.slo_redis import open_slo_ledger

    return open_slo_ledger(url if kind == "redis" else None, SloConfig(key_prefix=key_prefix + ":"), **PATIENT)


@pytest.fixture(params=["memory", "redis"])
def ledger_factory(request):
    """``make()`` opens the same ledger again (for Redis: a new client, as a restarted policy would)."""
    url = request.getfixturevalue("private_redis") if request.param == "redis" else None
    key_prefix, opened = prefix(), []
    memory = MemorySloLedger() if request.param == "memory" else None

    def make():
        ledger = memory if memory is not None else open_ledger("redis", url, key_prefix)
        opened.append(ledger)
        return ledger

    yield make
    for ledger in opened:
        ledger.close()


def config(**changes) -> CanaryConfig:
    values = dict(candidate=resolve_candidate(CANDIDATE_VARIANT, DEFAULT), control=DEFAULT, min_node_hours=0.3,
                  stages=(10, 50, 100), min_resolved_evictions=3)
    values.update(changes)
    return CanaryConfig(**values)


def feed(canary, start_s: int, rounds: int, ooms_every: dict[str, int]) -> int:
    t = start_s
    for i in range(rounds):
        t += 10
        for node in FLEET:
            every = ooms_every.get(canary.arm(node))
            tick = SimpleNamespace(node=node, ts_ns=t * S, tick_s=10.0, epoch=0,
                                   ooms=int(bool(every) and (i + 1) % every == 0))
            evict = SimpleNamespace(action=Action.EVICT)
            canary.observe_decision(tick, SimpleNamespace(commands=[evict] if node.endswith("gpu0") else []))
    return t


def test_a_better_candidate_is_promoted_and_the_stage_survives_a_restart(ledger_factory):
    canary = Canary(config(), ledger_factory())
    t = 0
    while canary.state.stage < 1:
        t = feed(canary, t, 6, {CONTROL: 3})
    restarted = Canary(config(), ledger_factory())
    assert restarted.state == canary.state and restarted.percent == 50
    assert [restarted.arm(n) for n in FLEET] == [canary.arm(n) for n in FLEET]
    while restarted.state.status != PROMOTED and t < 10_000:
        t = feed(restarted, t, 6, {CONTROL: 3})
    assert restarted.state.status == PROMOTED and all(restarted.arm(n) == CANDIDATE for n in FLEET)
    report = ledger_factory().canary_report(canary.rollout)
    assert [(h["from_stage"], h["to_stage"]) for h in report.history] == [(0, 1), (1, 2)]
    assert report.meta["candidate"] == CANDIDATE_VARIANT and report.meta["control"] == DEFAULT.variant
    shares = {stage: report.arm(stage, CANDIDATE).nodes / len(FLEET) for stage in (0, 1)}
    assert shares[0] == pytest.approx(0.10, abs=0.06) and shares[1] == pytest.approx(0.50, abs=0.08)
    assert report.arm(0, CONTROL).ooms > 0 and report.arm(0, CANDIDATE).ooms == 0
    assert report.total(CONTROL).evict_commands + report.total(CANDIDATE).evict_commands == 25 * (t // 10)


def test_a_worse_candidate_is_rolled_back_on_every_node_at_once(ledger_factory):
    ledger = ledger_factory()
    canary = Canary(config(stages=(50, 100)), ledger)
    t = feed(canary, 0, 12, {CANDIDATE: 2, CONTROL: 12})
    assert canary.state.status == ROLLED_BACK and all(canary.arm(n) == CONTROL for n in FLEET)
    assert Canary(config(stages=(50, 100)), ledger_factory()).state.status == ROLLED_BACK
    feed(canary, t, 3, {})
    assert canary.state.status == ROLLED_BACK


def test_evictions_and_their_outcomes_count_once_for_the_arm_that_evicted(ledger_factory):
    ledger = ledger_factory()
    canary = Canary(config(stages=(50, 100), min_node_hours=1000), ledger)
    feed(canary, 0, 2, {})
    for req, node in enumerate(FLEET[:40]):
        canary.observe_eviction(node, req)
        canary.observe_eviction(node, req)  # evicted again: the first eviction counts
        canary.observe_outcome(node, req, completed=req % 4 != 0)
        canary.observe_outcome(node, req, completed=True)  # a second outcome does not count
    report = ledger.canary_report(canary.rollout)
    arms = {arm: report.total(arm) for arm in (CONTROL, CANDIDATE)}
    assert sum(a.evictions for a in arms.values()) == 40
    assert sum(a.failed for a in arms.values()) == 10 and sum(a.completed for a in arms.values()) == 30
    expected = {arm: sum(1 for n in FLEET[:40] if canary.arm(n) == arm) for arm in arms}
    assert {arm: a.evictions for arm, a in arms.items()} == expected
    # replayed ticks count once
    feed(canary, 0, 2, {})
    assert ledger.canary_report(canary.rollout).total(CONTROL).ticks == report.total(CONTROL).ticks


def test_slo_report_json_and_table_show_a_section_per_variant(private_redis, monkeypatch):
    from kvguard.cli.app import app
    from kvguard.policy.slo_redis import RedisSloLedger

    key_prefix = prefix()
    monkeypatch.setenv("KVGUARD_BUDGET__KEY_PREFIX", key_prefix)
    ledger = RedisSloLedger(private_redis, SloConfig(key_prefix=key_prefix + ":"), **PATIENT)
    canary = Canary(config(stages=(50, 100), min_node_hours=1000), ledger)
    feed(canary, 0, 3, {CANDIDATE: 3})
    ledger.close()
    runner = CliRunner()
    result = runner.invoke(app, ["slo", "report", "--redis", private_redis, "--json"])
    assert result.exit_code == 0, result.output
    (rollout,) = json.loads(result.stdout)["canary"]
    assert (rollout["status"], rollout["stage"], rollout["percent"]) == ("running", 0, 50)
    variants = {v["arm"]: v for v in rollout["variants"]}
    assert variants["candidate"]["variant"] == CANDIDATE_VARIANT and variants["control"]["variant"] == DEFAULT.variant
    assert variants["candidate"]["nodes"] + variants["control"]["nodes"] == len(FLEET)
    assert variants["candidate"]["ooms"] == variants["candidate"]["nodes"] and variants["control"]["ooms"] == 0
    assert variants["control"]["node_hours"] == pytest.approx(variants["control"]["nodes"] * 30 / 3600)
    assert variants["candidate"]["ooms_per_node_hour"] == pytest.approx(120.0)
    assert set(variants["control"]["evictions"]) >= {"requests", "completed", "failed", "completion_rate"}
    table = runner.invoke(app, ["slo", "report", "--redis", private_redis], env={"COLUMNS": "200"})
    assert table.exit_code == 0 and "Canary" in table.stdout and CANDIDATE_VARIANT in table.stdout


def test_two_variants_on_an_embedded_fleet_attribute_commands_to_each(private_redis, monkeypatch):
    """End to end: the closed loop on 4 GPUs, half of them on the candidate, the SLO ledger in
    Redis; the report's commands per variant add up to the policy's, and every command of a
    candidate node in DEFAULT mode carries the candidate's variant."""
    from kvguard.bus.inproc import InprocBus
    from kvguard.cli.app import app
    from kvguard.config.settings import Settings
    from kvguard.contracts.commands import Command
    from kvguard.policy.slo_redis import RedisSloLedger
    from kvguard.runtime.bootstrap import bootstrap
    from kvguard.runtime.embedded import demo_workload, run_embedded
    from kvguard.runtime.mapping import slo_config

    host = next(h for h in (f"canary-{i}" for i in range(1000))
                if sorted(node_bucket(f"{h}/gpu{g}") < 50 for g in range(4)) == [False, False, True, True])
    key_prefix = prefix()
    monkeypatch.setenv("KVGUARD_BUDGET__KEY_PREFIX", key_prefix)
    settings = Settings(budget={"key_prefix": key_prefix},
                        canary={"enabled": True, "candidate": CANDIDATE_VARIANT, "stages": [50, 100],
                                "min_node_hours": 1000})
    slo_ledger = RedisSloLedger(private_redis, slo_config(settings), **PATIENT)
    graph = bootstrap(settings, predictor=None, profile="llama3-8b-24gb", slo_ledger=slo_ledger)
    wl = demo_workload(graph.profile, workload="mixed", rate_scale=6.0, duration_s=240.0, seed=1)
    bus = InprocBus.from_settings(settings)
    result = asyncio.run(run_embedded(graph, wl, n_gpus=4, duration_s=240.0, seed=1, guarded=True, host=host,
                                      bus=bus))
    slo_ledger.flush()
    slo_ledger.close()

    audit = bus.subscribe([settings.topics.name("commands")], "audit")
    commands = [Command.from_bytes(r.value) for r in asyncio.run(audit.getmany(max_records=100_000, timeout_s=0))]
    policy = result.summary["kvguard"]["policy"]
    why = f"ledger {slo_ledger.stats().to_dict()}"
    assert len(commands) == policy["commands"] > 0, why
    on_candidate = {f"{host}/gpu{g}" for g in range(4) if node_bucket(f"{host}/gpu{g}") < 50}
    default_mode = [c for c in commands if c.mode.value == "default"]
    assert {c.variant for c in default_mode if c.node in on_candidate} == {CANDIDATE_VARIANT}, why
    assert {c.variant for c in default_mode if c.node not in on_candidate} == {DEFAULT.variant}, why

    report = CliRunner().invoke(app, ["slo", "report", "--redis", private_redis, "--json"])
    assert report.exit_code == 0, report.output
    (rollout,) = json.loads(report.stdout)["canary"]
    variants = {v["arm"]: v for v in rollout["variants"]}
    why += f" variants {variants}"
    assert variants["candidate"]["nodes"] == variants["control"]["nodes"] == 2, why
    assert variants["candidate"]["commands"] > 0 and variants["control"]["commands"] > 0
    for arm, nodes in (("candidate", on_candidate), ("control", {f"{host}/gpu{g}" for g in range(4)} - on_candidate)):
        assert variants[arm]["commands"] == sum(1 for c in commands if c.node in nodes), why
    assert variants["candidate"]["node_hours"] == pytest.approx(2 * 240 / 3600, rel=0.1)
    assert (variants["candidate"]["ooms"] + variants["control"]["ooms"]
            == result.summary["ooms"])
    # evictions on both arms, and together the SLO ledger's evicted requests (the same acks)
    evicted = {arm: variants[arm]["evictions"] for arm in variants}
    assert all(e["requests"] > 0 and e["completed"] + e["failed"] + e["pending"] == e["requests"]
               for e in evicted.values())
    weekly = json.loads(report.stdout)["evictions"]
    assert sum(e["requests"] for e in evicted.values()) == weekly["requests"]
    assert sum(e["completed"] for e in evicted.values()) == weekly["completed"]


def test_a_restarted_node_counts_again_from_its_new_epoch_and_a_stale_stage_not_at_all(ledger_factory):
    ledger = ledger_factory()
    canary = Canary(config(min_node_hours=1000), ledger)
    rollout, stage = canary.rollout, canary.state.stage

    def tick(epoch: int, ts_s: int, at_stage: int = stage) -> bool:
        return ledger.record_canary_tick(rollout, at_stage, CONTROL, "n0", epoch, ts_s * S, node_ms=10_000, ooms=1,
                                         commands=2, evict_commands=0)

    assert tick(0, 100) and not tick(0, 100) and not tick(0, 90)
    assert tick(1, 10)  # the node restarted: its clock starts over in a new epoch
    assert not tick(0, 200)  # a late tick of the old run
    assert not tick(1, 20, at_stage=stage + 1)  # recorded by an instance that saw another stage
    totals = ledger.canary_report(rollout).total(CONTROL)
    assert (totals.ticks, totals.ooms, totals.commands, totals.nodes) == (2, 2, 4, 1)
