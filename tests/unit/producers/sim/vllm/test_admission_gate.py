"""kvguard's admission gate on the vLLM-faithful engine (issue 29): every request answered, the rows
that say so, priorities through vLLM's priority policy, and the gate against vLLM's unbounded queue."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvguard.contracts.events import EventKind, Outcome
from kvguard.contracts.units import NS_PER_S
from kvguard.producers.admission import AdmissionConfig, Decision, parse_priority_mix, priority_for
from kvguard.producers.sim.fleet import Fleet
from kvguard.producers.sim.profiles import EngineKnobs, load_profile
from kvguard.producers.sim.vllm.engine import VllmEngineConfig
from kvguard.producers.sim.workloads import load_workload, mix_hash

VLLM = "llama3-8b-24gb-vllm"
MIX = parse_priority_mix("9:0.1,5:0.6,1:0.3")


def _requests(rate=2.0, window=60.0):
    wl = load_workload("azure-conv", rate_scale=rate, window=window, seed=0)
    return [dataclasses.replace(r, priority=priority_for(mix_hash(r.req_id, 0), MIX)) for r in wl.requests]


def _run(knobs=None, admission=None, router="least_loaded", gpus=1, rate=3.0, window=60.0):
    fleet = Fleet(gpus, load_profile(VLLM, knobs=knobs), config=VllmEngineConfig(admission=admission), router=router)
    fleet.submit_workload(_requests(rate, window))
    rows = []
    end = int(window * NS_PER_S)
    for _, batches in fleet.steps(end, step_ns=10 * NS_PER_S, drain=True, drain_cap_ns=end + 600 * NS_PER_S):
        rows += [b.events for b in batches]
    return fleet, np.concatenate(rows)


@pytest.fixture(scope="module")
def gated():
    return _run(EngineKnobs(scheduling_policy="priority"), AdmissionConfig(), router="kvguard", gpus=2)


@pytest.fixture(scope="module")
def default():
    return _run(gpus=2)


def test_every_request_is_answered_and_each_refusal_is_counted_and_rowed(gated):
    fleet, rows = gated
    s = fleet.summary()
    assert s.refused > 0
    assert s.completed + s.failed + s.rejected + s.refused + s.unfinished == s.requests
    assert s.unfinished == 0  # drained: every held request was released or refused
    finish = rows[rows["kind"] == EventKind.FINISH]
    assert int(np.count_nonzero(finish["flags"] == Outcome.REFUSED)) == s.refused
    adm = rows[(rows["kind"] == EventKind.ADMISSION) & (rows["req"] >= 0)]  # req -1: the endpoint state rows
    assert np.count_nonzero((rows["kind"] == EventKind.ADMISSION) & (rows["req"] == -1)) > 0
    refused_rows = adm[adm["cls"] == Decision.REFUSE]
    assert len(refused_rows) == s.refused
    assert (refused_rows["offset"] >= 1000).all()  # Retry-After of at least a second
    stats = [e.gate.stats for e in fleet.engines]
    assert int(np.count_nonzero(adm["cls"] == Decision.HOLD)) == sum(st.held for st in stats)
    assert int(np.count_nonzero(adm["cls"] == Decision.RELEASE)) == sum(st.released for st in stats)
    assert ((adm["size"] >= 0) & (adm["size"] <= 1000)).all()


def test_the_gate_beats_vllms_unbounded_queue_and_protects_the_vip(gated, default):
    g, d = gated[0].summary(), default[0].summary()
    assert d.slo_attainment < 0.5  # the workload overloads vLLM's defaults
    assert g.slo_attainment >= 2 * d.slo_attainment
    by = g.slo_attainment_by_priority
    assert set(by) == {"1", "5", "9"}
    assert by["9"] >= by["5"] >= by["1"]
    assert by["9"] > 0.9
    assert g.ooms == 0
    assert g.slo == "ttft:2000 tpot:100"


def test_without_the_gate_nothing_is_held_or_refused(default):
    fleet, rows = default
    assert fleet.summary().refused == 0
    assert not np.count_nonzero(rows["kind"] == EventKind.ADMISSION)


def test_priorities_reach_vllms_scheduler_reversed():
    fleet = Fleet(1, load_profile(VLLM, knobs=EngineKnobs(scheduling_policy="priority")))
    e = fleet.engines[0]
    fleet.submit_workload([dataclasses.replace(r, priority=p) for r, p in zip(_requests(window=5)[:3], (9, None, 1))])
    fleet.advance(5 * NS_PER_S)
    assert e.priority_defaulted == 1
    got = {e._reqs[rid].priority: seq.priority for rid, seq in e.scheduler.requests.items()} if e.scheduler.requests \
        else None
    if got:  # still running: vLLM's value is 10 - p
        assert all(v == 10 - k for k, v in got.items())
    assert e.requests_by_priority == {9: 1, 5: 1, 1: 1}


def test_the_stream_turns_the_gates_state_rows_into_the_router_series_of_each_tick():
    from kvguard.streams.core import StreamCore

    fleet = Fleet(1, load_profile(VLLM, knobs=EngineKnobs(scheduling_policy="priority")),
                  config=VllmEngineConfig(admission=AdmissionConfig()), router="kvguard")
    fleet.submit_workload(_requests(rate=3.0, window=40.0))
    core = StreamCore()
    ticks = []
    for _, batches in fleet.steps(40 * NS_PER_S, step_ns=10 * NS_PER_S):
        ticks += core.process_many(batches)[0]
    ticks = [t for t in ticks if t.endpoint_admit is not None]
    assert ticks
    assert all(0.0 <= t.endpoint_saturation <= 1.0 and t.endpoint_queue_delay_s >= 0 for t in ticks)
    assert {t.endpoint_admit for t in ticks} <= {0, 1}
    assert max(t.endpoint_saturation for t in ticks) > 0.5  # the overload shows


def test_without_a_gate_the_ticks_carry_no_router_series(default):
    from kvguard.streams.core import StreamCore

    fleet = Fleet(1, load_profile(VLLM))
    fleet.submit_workload(_requests(window=20.0))
    core = StreamCore()
    ticks = []
    for _, batches in fleet.steps(20 * NS_PER_S, step_ns=10 * NS_PER_S):
        ticks += core.process_many(batches)[0]
    assert ticks and all(t.endpoint_admit is None for t in ticks)
