"""The policy guards' registry (policy.guards): one table, each guard its own per-node state, one protocol."""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

import pytest

from kvguard.contracts.commands import Action, HoldPayload, verify
from kvguard.contracts.units import NS_PER_S
from kvguard.policy.engine import EngineConfig, PolicyEngine
from kvguard.policy.guards.base import Finding, Observation, Phase, Placement, Proposal, StatelessGuard
from kvguard.policy.guards.batch_cap import BatchCap
from kvguard.policy.guards.headroom import AdmissionHeadroom
from kvguard.policy.guards.registry import GUARDS, _check
from kvguard.policy.planner import NodeView, PlannerConfig

SECRET = b"test-secret-of-at-least-thirty-two-bytes"
D = 10_000


def view(ts_s: int = 10, **changes) -> NodeView:
    base = NodeView(node="n0/gpu0", ts_ns=ts_s * NS_PER_S, u_kv=0.9, f_ext=0.1, f_int=0.05, psi=0.9,
                    dynamic_units=D, free_units=1000, largest_free_run_units=100, ooms=1)
    return replace(base, **changes)


def config(**changes) -> EngineConfig:
    return replace(EngineConfig(dynamic_units=D, planner=PlannerConfig(required_run_units=200),
                                allocator_guard=True, batch_cap_tokens=1024), **changes)


class Recorder(StatelessGuard):
    """A guard added at the end of the table: proposes a hold on every tick, records the hooks."""

    name: ClassVar[str] = "recorder"
    phase: ClassVar[Phase] = Phase.ACT

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.calls: list[tuple[str, str]] = []
        self.seen: list[Observation] = []

    def observe(self, seen: Observation) -> Finding:
        self.seen.append(seen)
        return Finding(proposals=(Proposal(HoldPayload(max_prompt_tokens=4096), "recorder"),))

    def restart(self, node: str) -> None:
        self.calls.append(("restart", node))

    def forget(self, node: str) -> None:
        self.calls.append(("forget", node))


def test_the_table_names_each_guard_once_in_the_order_decide_runs_them():
    assert [g.name for g in GUARDS] == ["contiguity", "structural", "headroom", "batch_cap"]
    assert [g.phase for g in GUARDS] == [Phase.SIGNAL, Phase.SIGNAL, Phase.ACT, Phase.ACT]
    with pytest.raises(ValueError, match="registered twice"):
        _check((*GUARDS, BatchCap))
    with pytest.raises(ValueError, match="registered twice"):
        PolicyEngine(config(), SECRET, guards=(*GUARDS, AdmissionHeadroom))


def test_each_guard_of_the_table_runs_and_the_commands_keep_their_order():
    engine = PolicyEngine(config(), SECRET)
    decision = engine.decide(view())
    actions = [c.action for c in decision.commands]
    # headroom first (before the plan), the plan's compaction/eviction, the batch cap last
    assert actions[0] is Action.HEADROOM and actions[-1] is Action.BATCH_CAP
    assert Action.COMPACT in actions or Action.EVICT in actions
    assert "largest free run" in decision.reason  # a signal guard's risk/cause reached the plan
    assert all(verify(c, SECRET) for c in decision.commands)


def test_a_guard_added_at_the_end_leaves_every_other_command_and_id_as_it_was():
    plain = PolicyEngine(config(), SECRET).decide(view())
    engine = PolicyEngine(config(), SECRET, guards=(*GUARDS, Recorder))
    more = engine.decide(view())
    assert [c.id for c in more.commands[:-1]] == [c.id for c in plain.commands]
    assert more.commands[-1].action is Action.HOLD and more.commands[-1].reason == "recorder"
    assert engine.counters.reclaim_commands == sum(c.action is Action.RECLAIM for c in more.commands)
    recorder = engine.guard("recorder")
    assert isinstance(recorder, Recorder)
    seen = recorder.seen[-1]
    assert seen.at_risk == more.reason and seen.plan is more.plan and seen.reason is not None


def test_a_restart_and_a_forget_reach_every_guard_and_each_drops_its_own_state():
    engine = PolicyEngine(config(), SECRET, guards=(*GUARDS, Recorder))
    tick = view()
    engine.decide(tick)
    headroom, cap = engine.guard("headroom"), engine.guard("batch_cap")
    assert isinstance(headroom, AdmissionHeadroom) and isinstance(cap, BatchCap)
    assert tick.node in headroom.held and tick.node in cap.sent and tick.node in cap.calm
    engine._restart(tick.node)
    # the fresh engine holds nothing and runs uncapped; the calm count survives, so the cap is re-sent
    assert tick.node not in headroom.held and tick.node not in cap.sent and tick.node in cap.calm
    assert engine.forget(tick.node)
    assert tick.node not in cap.calm
    assert engine.guard("recorder").calls == [("restart", tick.node), ("restart", tick.node), ("forget", tick.node)]


def test_the_engines_hold_helpers_answer_from_the_registered_guard():
    engine = PolicyEngine(config(), SECRET)
    engine.decide(view())
    hold = engine.guard("headroom")
    assert isinstance(hold, AdmissionHeadroom)
    assert engine._held is hold.held and engine._calm is hold.calm
    strategy_hold = int((1 - engine.strategy_for(engine.modes.mode("n0/gpu0")).target_u_kv) * D)
    assert engine.headroom_units(engine.modes.mode("n0/gpu0")) == max(strategy_hold, hold.prompt_hold_units())
