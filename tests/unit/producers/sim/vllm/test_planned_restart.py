"""The drain-and-restart hooks of the vLLM shadow engine: out of the router while draining, a restart
refused unless drained, and one that returns the leak (no request lost)."""

from __future__ import annotations

from kvguard.producers.sim.fleet import Fleet
from kvguard.producers.sim.profiles import load_profile
from kvguard.producers.sim.registry import engine_kind
from kvguard.producers.sim.vllm.external import Leak
from kvguard.producers.sim.workloads import Request

S = 1_000_000_000


def test_drain_then_planned_restart_returns_the_leak_and_loses_nothing():
    profile = load_profile("llama3-8b-24gb-vllm")
    config = engine_kind(profile).node_config(leak=Leak(bytes_per_s=(8 << 30) / 3600))
    fleet = Fleet(2, profile, seed=0, config=config)
    a, b = fleet.engines
    fleet.submit_workload([Request(i, i * S // 2, 200, 32) for i in range(40)])
    fleet.advance(5 * S)
    a.draining = True
    assert not a.is_up(6 * S) and b.is_up(6 * S)
    routed_before = list(fleet.routed)
    fleet.advance(20 * S)
    assert fleet.routed[0] == routed_before[0]  # nothing new routed to the draining GPU
    assert a.memory.leaked_bytes > 0
    fleet.advance(200 * S)  # everything routed to it finishes
    assert not a.scheduler.requests
    assert a.planned_restart(200 * S)
    assert a.planned_restarts == 1 and not a.draining and a.memory is None
    fleet.advance(300 * S)
    assert a.memory is not None and a.memory.leaked_bytes < (1 << 30)  # a fresh process: the leak is gone
    s = fleet.summary()
    assert s.failed == 0 and s.ooms == 0 and s.completed == 40


def test_planned_restart_is_refused_while_a_request_is_there():
    profile = load_profile("llama3-8b-24gb-vllm")
    fleet = Fleet(1, profile, seed=0)
    (e,) = fleet.engines
    fleet.submit_workload([Request(0, 0, 4000, 512)])
    fleet.advance(S // 10)
    assert e.scheduler.requests
    assert not e.planned_restart(S // 10)
    assert e.planned_restarts == 0 and e.memory is not None
