import numpy as np
import pytest

from kvguard.contracts.events import EventKind, Outcome
from kvguard.contracts.units import NS_PER_S
from kvguard.producers.sim.fleet import Fleet
from kvguard.producers.sim.seed.engine import SeedEngineConfig
from kvguard.producers.sim.workloads import Request, load_workload
from tests.unit.producers.sim.seed.test_engine import tiny_profile


def _fleet(n=3, **kw):
    fleet = Fleet(n, tiny_profile(1500), seed=7, snapshot_every_s=30.0, **kw)
    fleet.submit_workload(load_workload("mixed", window=90, seed=2))
    return fleet


def _run(fleet, until_s=120, flush_s=10):
    batches = []
    for t in range(flush_s, until_s + 1, flush_s):
        fleet.advance(t * NS_PER_S)
        batches += fleet.take_batches(t * NS_PER_S)
    return batches


def test_nodes_are_named_and_least_loaded_router_spreads_requests():
    fleet = _fleet()
    assert fleet.nodes == ["sim-0/gpu0", "sim-0/gpu1", "sim-0/gpu2"]
    _run(fleet)
    assert sum(fleet.routed) == len(load_workload("mixed", window=90, seed=2))
    assert min(fleet.routed) > 0.2 * max(fleet.routed)
    s = fleet.summary()
    assert s.requests == sum(fleet.routed)
    assert s.completed + s.failed + s.rejected + s.unfinished == s.requests


def test_batches_have_increasing_seq_fixed_epoch_geometry_first_and_periodic_snapshots():
    fleet = _fleet()
    batches = _run(fleet)
    for node in fleet.nodes:
        mine = [b for b in batches if b.node == node]
        assert [b.seq for b in mine] == list(range(len(mine)))
        assert {b.epoch for b in mine} == {7}
        assert mine[0].geometry == fleet.profile.geometry and mine[0].state is not None
        snaps = [b for b in mine if b.state is not None]
        assert len(snaps) == 4  # at t = 10 s (the first drain), 40, 70 and 100 s
        for b in snaps:
            assert b.geometry is not None and b.events["kind"][-1] == EventKind.SNAPSHOT
        for b in mine:
            if b.state is None:
                assert b.geometry is None
        ts = np.concatenate([b.events["ts_ns"] for b in mine])
        assert np.all(np.diff(ts) >= 0)


def test_fleet_runs_are_deterministic():
    fa, fb = _fleet(), _fleet()
    a = _run(fa)
    b = _run(fb)
    s = fa.summary()
    assert s.ooms >= 1 and s.rejected >= 1 and s.failed >= 1  # crashes and refusals replay identically too
    assert s == fb.summary() and fa.routed == fb.routed
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x.node, x.seq) == (y.node, y.seq) and x.events.tobytes() == y.events.tobytes()


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="n_gpus"):
        Fleet(0, tiny_profile())
    with pytest.raises(ValueError, match="router"):
        Fleet(1, tiny_profile(), router="random")


def _crash_fleet(n=2, router="least_loaded", fragment=(0,)):
    from tests.unit.producers.sim.seed.test_engine import _fragment

    profile = tiny_profile(1000, activation_bytes_per_token=4096, max_batched_tokens=32)
    fleet = Fleet(n, profile, seed=1, router=router, config=SeedEngineConfig(restart_s=60.0))
    for i in fragment:  # these GPUs crash on their first step (no contiguous run for the workspace)
        _fragment(fleet.engines[i].pool)
    return fleet


def _outcomes(fleet):
    out = {}
    for e in fleet.engines:
        ev = e.take_events()
        fin = ev[ev["kind"] == EventKind.FINISH]
        out.update({int(r): (e.node, Outcome(int(f))) for r, f in zip(fin["req"], fin["flags"])})
    return out


@pytest.mark.parametrize("router", ["least_loaded", "round_robin"])
def test_router_sends_no_work_to_a_gpu_that_is_restarting(router):
    fleet = _crash_fleet(router=router)
    reqs = [Request(0, 1 * NS_PER_S, 20, 10, 5, ())]  # gpu0 takes it and crashes
    reqs += [Request(i, (5 + 5 * i) * NS_PER_S, 20, 10, 5, ()) for i in range(1, 9)]  # gpu0 is down until ~61 s
    reqs += [Request(20, 100 * NS_PER_S, 20, 10, 5, ()), Request(21, 100 * NS_PER_S, 20, 10, 5, ())]  # both up again
    fleet.submit_workload(reqs)
    fleet.advance(200 * NS_PER_S)
    got = _outcomes(fleet)
    assert got[0] == ("sim-0/gpu0", Outcome.FAILED_OOM)
    assert fleet.engines[0].ooms == 1 and fleet.engines[1].ooms == 0
    for i in range(1, 9):
        assert got[i] == ("sim-0/gpu1", Outcome.COMPLETED), i
    assert {got[20][0], got[21][0]} == {"sim-0/gpu0", "sim-0/gpu1"}  # gpu0 serves again after its restart
    assert got[20][1] == got[21][1] == Outcome.COMPLETED
    s = fleet.summary()
    assert (s.requests, s.completed, s.failed, s.rejected, s.unfinished) == (11, 10, 1, 0, 0)


def test_when_every_gpu_is_down_arrivals_are_rejected():
    fleet = _crash_fleet(fragment=(0, 1))
    fleet.submit_workload([Request(0, 1 * NS_PER_S, 20, 10, 5, ()), Request(1, 1 * NS_PER_S, 20, 10, 5, ()),
                           Request(2, 10 * NS_PER_S, 20, 10, 5, ()), Request(3, 20 * NS_PER_S, 20, 10, 5, ())])
    fleet.advance(100 * NS_PER_S)
    got = _outcomes(fleet)
    assert got[0] == ("sim-0/gpu0", Outcome.FAILED_OOM) and got[1] == ("sim-0/gpu1", Outcome.FAILED_OOM)
    assert got[2][1] is Outcome.REJECTED and got[3][1] is Outcome.REJECTED
    s = fleet.summary()
    assert (s.requests, s.failed, s.rejected, s.ooms, s.unfinished) == (4, 2, 2, 2, 0)
    assert sum(fleet.routed) == 4


def test_fleet_summary_accounts_for_every_request():
    fleet = _fleet()
    _run(fleet, until_s=60)
    s = fleet.summary()
    assert s.ooms >= 1 and s.rejected >= 1  # this stress crashes, so the new fields are exercised
    assert s.requests == s.completed + s.failed + s.rejected + s.unfinished
    assert s.unfinished == sum(len(e._waiting) + len(e._running) + len(e._swapped) for e in fleet.engines)


def _times(fleet, end_s, step_s, **kw):
    return [now / NS_PER_S for now, _ in fleet.steps(int(end_s * NS_PER_S), step_ns=int(step_s * NS_PER_S), **kw)]


def test_the_run_loop_yields_what_advancing_by_hand_gives():
    by_hand, looped = _fleet(), _fleet()
    expected = _run(by_hand, until_s=120, flush_s=10)
    got = [b for _, batches in looped.steps(120 * NS_PER_S, step_ns=10 * NS_PER_S) for b in batches]
    assert [(b.node, b.seq) for b in got] == [(b.node, b.seq) for b in expected]
    assert all(x.events.tobytes() == y.events.tobytes() for x, y in zip(got, expected))
    assert looped.summary() == by_hand.summary()


def test_the_run_loop_ends_at_the_end_with_clamp_and_a_whole_step_past_it_without():
    assert _times(_fleet(), 25, 10, clamp=True) == [10, 20, 25]
    assert _times(_fleet(), 25, 10) == [10, 20, 30]
    assert _times(_fleet(), 30, 10, clamp=True) == _times(_fleet(), 30, 10) == [10, 20, 30]


def test_the_run_loop_takes_no_step_past_a_reached_end_unless_draining():
    fleet = _fleet()
    _times(fleet, 30, 10)
    assert _times(fleet, 30, 10) == []
    assert _times(fleet, 40, 10) == [40]


def test_draining_goes_on_past_the_end_until_the_fleet_is_idle_or_the_cap():
    drained = _fleet()
    times = _times(drained, 60, 10, drain=True, drain_cap_ns=3600 * NS_PER_S)
    assert times[-1] > 60 and drained.idle()
    capped = _fleet()
    assert _times(capped, 60, 10, drain=True, drain_cap_ns=70 * NS_PER_S)[-1] == 70
    assert not capped.idle()
