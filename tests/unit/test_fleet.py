import numpy as np
import pytest

from kvguard.events import EventKind
from producers.engine import NS
from producers.fleet import Fleet
from producers.workloads import load_workload
from tests.unit.test_engine import tiny_profile


def _fleet(n=3, **kw):
    fleet = Fleet(n, tiny_profile(1500), seed=7, snapshot_every_s=30.0, **kw)
    fleet.submit_workload(load_workload("mixed", window=90, seed=2))
    return fleet


def _run(fleet, until_s=120, flush_s=10):
    batches = []
    for t in range(flush_s, until_s + 1, flush_s):
        fleet.advance(t * NS)
        batches += fleet.take_batches(t * NS)
    return batches


def test_nodes_are_named_and_least_loaded_router_spreads_requests():
    fleet = _fleet()
    assert fleet.nodes == ["sim-0/gpu0", "sim-0/gpu1", "sim-0/gpu2"]
    _run(fleet)
    assert sum(fleet.routed) == len(load_workload("mixed", window=90, seed=2))
    assert min(fleet.routed) > 0.2 * max(fleet.routed)
    s = fleet.summary()
    assert s.requests == sum(fleet.routed)
    assert s.completed + s.failed <= s.requests


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
    a = _run(_fleet())
    b = _run(_fleet())
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x.node, x.seq) == (y.node, y.seq) and x.events.tobytes() == y.events.tobytes()


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="n_gpus"):
        Fleet(0, tiny_profile())
    with pytest.raises(ValueError, match="router"):
        Fleet(1, tiny_profile(), router="random")
