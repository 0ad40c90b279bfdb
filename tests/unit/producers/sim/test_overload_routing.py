"""The SLO as vllm bench serve spells it, per-priority attainment, the trace's priority winning over a
mix, and the llm-d-style router baseline (issue 29)."""

from __future__ import annotations

import pytest

from kvguard.contracts.units import NS_PER_S
from kvguard.producers.admission import Decision, Verdict, parse_priority_mix
from kvguard.producers.sim.fleet import Fleet
from kvguard.producers.sim.profiles import load_profile
from kvguard.producers.sim.routing import LlmdUtilizationRouter, llmd_priority, route_by_admission
from kvguard.producers.sim.run import DEFAULT_SLO, SloTargets, parse_goodput, slo_fields
from kvguard.producers.sim.workloads import Request, Workload, load_workload, with_priority_mix


def test_goodput_is_spelled_as_vllm_bench_serve_spells_it():
    assert DEFAULT_SLO.name == "ttft:2000 tpot:100"
    slo = parse_goodput("ttft:500 tpot:50 e2el:8000")
    assert (slo.ttft_s, slo.tpot_s, slo.e2el_s) == (0.5, 0.05, 8.0)
    assert slo.name == "ttft:500 tpot:50 e2el:8000"
    assert parse_goodput(["ttft:1000"]) == SloTargets(1.0, 0.1)
    for bad in ("ttft", "itl:100", "ttft:-1", "ttft:x"):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)


def test_attainment_by_priority_counts_each_class_arrivals_and_e2el_binds():
    s = NS_PER_S
    served = [(1 * s, 0.05 * s, 11), (3 * s, 0.05 * s, 11), (1 * s, 0.05 * s, 101)]
    out = slo_fields(served, 4, 10.0, DEFAULT_SLO, priorities=([9, 9, 1], {9: 2, 1: 2}))
    assert out["slo_attainment_by_priority"] == {"1": 0.5, "9": 0.5}
    assert out["slo"] == "ttft:2000 tpot:100"
    e2el = slo_fields(served, 4, 10.0, SloTargets(2.0, 0.1, 3.0), priorities=([9, 9, 1], {9: 2, 1: 2}))
    assert e2el["slo_attainment_by_priority"] == {"1": 0.0, "9": 0.5}  # 1 s + 100 x 50 ms > 3 s


def test_a_traces_own_priority_wins_over_the_mix():
    reqs = [Request(i, i * NS_PER_S, 100, 10, 7 if i % 2 else None) for i in range(200)]
    out = with_priority_mix(Workload("t", reqs), parse_priority_mix("9:0.1,5:0.6,1:0.3"), seed=1)
    assert all(r.priority == 7 for r in out.requests if r.req_id % 2)
    drawn = [r.priority for r in out.requests if not r.req_id % 2]
    assert set(drawn) <= {9, 5, 1} and drawn.count(5) > drawn.count(9)
    assert "100 requests kept" in out.notes[-1]


class _Endpoint:
    def __init__(self, waiting, usage, up=True):
        self.waiting, self.up = waiting, up
        self.scheduler = type("S", (), {"usage": usage})()

    def queue_lengths(self):
        return {"waiting": self.waiting}

    def is_up(self, at_ns):
        return self.up


def test_llmd_baseline_filters_saturated_endpoints_and_sheds_only_sheddable_when_the_pool_is_saturated():
    router = LlmdUtilizationRouter()
    assert llmd_priority(5) == 0 and llmd_priority(1) < 0 and llmd_priority(None) == 0
    vip, low = Request(0, 0, 10, 10, 9), Request(1, 0, 10, 10, 1)
    calm = [_Endpoint(6, 0.5), _Endpoint(1, 0.5)]  # the first has a queue over 5: filtered
    assert router(calm, low) == 1
    hot = [_Endpoint(10, 0.9), _Endpoint(8, 0.85)]  # pool saturation >= 1
    assert router(hot, low) == -1
    assert router(hot, vip) == 1  # all filtered: the least scored one (fallbackOnEmpty)


class _Gated:
    def __init__(self, admit, saturation, delay, outstanding, up=True):
        self.gate = type("G", (), {"endpoint_state": lambda _self: Verdict(
            Decision.ADMIT if admit else Decision.HOLD, delay, saturation)})()
        self.outstanding, self.up = outstanding, up

    def outstanding_tokens(self):
        return self.outstanding

    def is_up(self, at_ns):
        return self.up


def test_kvguards_router_filters_on_the_admit_bit_then_picks_the_least_loaded():
    r = Request(0, 0, 10, 10, 5)
    assert route_by_admission([_Gated(0, 0.9, 5.0, 10), _Gated(1, 0.5, 0.1, 900), _Gated(1, 0.6, 0.2, 500)], r) == 2
    assert route_by_admission([_Gated(0, 0.9, 5.0, 10), _Gated(0, 0.7, 9.0, 900)], r) == 1  # none admits
    assert route_by_admission([_Gated(1, 0.1, 0.1, 10, up=False), _Gated(1, 0.5, 0.1, 900)], r) == 1  # down


def test_requests_the_llmd_baseline_sheds_are_counted_as_refused_misses():
    wl = with_priority_mix(load_workload("azure-conv", rate_scale=3.0, window=40.0, seed=0),
                           parse_priority_mix("9:0.1,5:0.6,1:0.3"), seed=0)
    fleet = Fleet(1, load_profile("llama3-8b-24gb-vllm"), router="llmd_utilization")
    fleet.submit_workload(wl)
    for _ in fleet.steps(40 * NS_PER_S, step_ns=10 * NS_PER_S, drain=True, drain_cap_ns=400 * NS_PER_S):
        pass
    s = fleet.summary()
    assert fleet.shed > 0 and s.refused == fleet.shed
    assert set(fleet.shed_by_priority) <= {1}  # only llm-d's sheddable class (priority < 5)
    assert s.requests == len(wl.requests)
    assert s.completed + s.failed + s.rejected + s.refused + s.unfinished == s.requests
