"""The preemption-storm guard (issue 29): predicted from the KV demand trend, prevented with vLLM's
knobs, released when the demand falls; per-node state; registered at the end of the table."""

from __future__ import annotations

from dataclasses import replace

from kvguard.contracts.commands import Action, BatchCapPayload, HeadroomPayload, HoldPayload, Mode, ReleasePayload
from kvguard.contracts.units import NS_PER_S
from kvguard.policy.engine import EngineConfig, PolicyEngine
from kvguard.policy.guards.base import Observation
from kvguard.policy.guards.registry import GUARDS
from kvguard.policy.guards.storm import PreemptionStorm
from kvguard.policy.planner import NodeView
from kvguard.policy.strategy import DEFAULT

D = 10_000
SECRET = b"test-secret-of-at-least-thirty-two-bytes"


def view(ts_s=10, saturation=None, node="n0/gpu0", **changes) -> NodeView:
    return replace(NodeView(node=node, ts_ns=ts_s * NS_PER_S, u_kv=0.5, f_ext=0.0, f_int=0.05, psi=0.5,
                            dynamic_units=D, free_units=5000, largest_free_run_units=5000),
                   endpoint_saturation=saturation, **changes)


def seen(v: NodeView, at_risk=None) -> Observation:
    return Observation(view=v, mode=Mode.DEFAULT, strategy=DEFAULT, at_risk=at_risk)




def payloads(finding):
    return [p.payload for p in finding.proposals]


def test_a_rising_demand_is_a_predicted_storm_and_gets_vllms_knobs_once():
    guard = PreemptionStorm(EngineConfig(dynamic_units=D))
    assert not payloads(guard.observe(seen(view(10, 0.85))))
    got = guard.observe(seen(view(20, 0.93)))
    assert got.risk and "rising" in got.risk
    kinds = [type(p) for p in payloads(got)]
    assert kinds == [HeadroomPayload, BatchCapPayload, HoldPayload]
    assert payloads(got)[0].units == int(0.05 * D) and payloads(got)[1].tokens == 1024
    assert not payloads(guard.observe(seen(view(30, 0.95))))  # applied: not re-sent


def test_a_flat_high_demand_below_the_high_mark_is_no_storm():
    guard = PreemptionStorm(EngineConfig(dynamic_units=D))
    for t in range(10, 60, 10):
        assert not payloads(guard.observe(seen(view(t, 0.92))))


def test_released_after_calm_ticks_but_not_while_the_node_is_at_risk():
    guard = PreemptionStorm(EngineConfig(dynamic_units=D))
    assert payloads(guard.observe(seen(view(10, 0.99))))
    assert not payloads(guard.observe(seen(view(20, 0.5))))  # one calm tick
    assert not payloads(guard.observe(seen(view(30, 0.5), at_risk="KV pressure")))
    released = payloads(guard.observe(seen(view(40, 0.5))))
    assert [type(p) for p in released] == [HeadroomPayload, BatchCapPayload, ReleasePayload]
    assert released[0].units == 0 and released[1].tokens == 0


def test_nodes_without_a_gate_and_other_nodes_are_left_alone():
    guard = PreemptionStorm(EngineConfig(dynamic_units=D))
    assert not payloads(guard.observe(seen(view(10, None, preemptions=50))))
    assert payloads(guard.observe(seen(view(10, 0.99, node="a/gpu0"))))
    assert not payloads(guard.observe(seen(view(10, 0.5, node="b/gpu0"))))
    guard.restart("a/gpu0")  # the fresh engine runs without the knobs: prevented again
    assert payloads(guard.observe(seen(view(20, 0.99, node="a/gpu0"))))
    guard.forget("a/gpu0")
    assert "a/gpu0" not in guard.window and "a/gpu0" not in guard.applied


def test_registered_last_and_its_commands_come_from_the_policy_engine():
    assert GUARDS[-1] is PreemptionStorm
    engine = PolicyEngine(EngineConfig(dynamic_units=D), SECRET)
    engine.decide(view(10, 0.85))
    actions = [c.action for c in engine.decide(view(20, 0.99)).commands]
    assert actions[-3:] == [Action.HEADROOM, Action.BATCH_CAP, Action.HOLD]
