"""The vectorised allocator mirror agrees exactly with a per-event reference allocator."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvguard.contracts.events import EVENT_DTYPE, free_runs_checksum
from kvguard.contracts.events import EventKind as K
from kvguard.contracts.units import NS_PER_S
from kvguard.streams.mirror import AllocatorMirror, MirrorError
from tests.unit.streams.streams_refpool import RefPool, small_geometry

EXACT = ("live_units", "cached_units", "retained_units", "workspace_units", "free_units",
         "largest_free_run", "n_free_runs", "tokens_stored")


def assert_same(mirror: AllocatorMirror, pool: RefPool) -> None:
    got = mirror.metrics()
    want = pool.metrics()
    for name in EXACT:
        assert getattr(got, name) == want[name], name
    for name in ("u_kv", "f_ext", "f_int", "psi"):
        assert getattr(got, name) == want[name], name
    offs, sizes = mirror.free_runs()
    p_offs, p_sizes = pool.free_runs()
    assert offs.tolist() == p_offs.tolist() and sizes.tolist() == p_sizes.tolist()
    table = mirror.request_table()
    by_req = {int(r): (int(p), int(u), int(s)) for r, p, u, s in
              zip(table.req, table.pages, table.units, table.shared_units) if p > 0}
    assert by_req == pool.request_pages()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), n_ops=st.integers(1, 400), units=st.sampled_from([32, 64, 128]))
def test_mirror_matches_reference_allocator_at_every_batch_boundary(seed, n_ops, units):
    pool = RefPool(small_geometry(units), seed=seed)
    mirror = AllocatorMirror(pool.g)
    applied = 0
    for _ in range(n_ops):
        pool.random_op()
        if pool.rng.random() < 0.15:
            mirror.apply(pool.events(applied))
            applied = len(pool.rows)
            assert_same(mirror, pool)
    mirror.apply(pool.events(applied))
    assert_same(mirror, pool)
    assert mirror.synced


def test_batch_split_does_not_change_the_result():
    pool = RefPool(small_geometry(64), seed=7)
    for _ in range(2000):
        pool.random_op()
    events = pool.events()
    whole = AllocatorMirror(pool.g)
    whole.apply(events)
    rows = AllocatorMirror(pool.g)
    for i in range(len(events)):
        rows.apply(events[i:i + 1])
    assert whole.metrics() == rows.metrics()
    assert whole.checksum() == rows.checksum()
    assert_same(whole, pool)


def test_snapshot_checksum_agreement_keeps_mirror_synced_without_resync():
    pool = RefPool(small_geometry(64), seed=3)
    for _ in range(300):
        pool.random_op()
    state = pool.snapshot()
    mirror = AllocatorMirror(pool.g)
    mirror.apply(pool.events(), state)
    assert mirror.synced and mirror.drift_count == 0 and mirror.resync_count == 0
    assert mirror.snapshot_checks == 1


def test_drift_is_detected_and_resynchronised_from_the_snapshot_state():
    pool = RefPool(small_geometry(64), seed=11)
    for _ in range(300):
        pool.random_op()
    r = pool.arrive()
    pool.requests[r]["running"] = True
    pool.emit(K.ADMIT, req=r)
    n = len(pool.rows)
    while len(pool.rows) == n or pool.rows[-1][1] != K.ALLOC:
        pool.alloc()
    events = pool.events()
    corrupted = events[:-1]  # the last ALLOC is lost
    state = pool.snapshot()
    mirror = AllocatorMirror(pool.g)
    mirror.apply(corrupted)
    mirror.apply(pool.events(len(events)), state)
    assert mirror.drift_count == 1 and mirror.resync_count == 1 and mirror.synced
    assert_same(mirror, pool)
    for _ in range(200):  # and it stays exact afterwards
        pool.random_op()
    mirror.apply(pool.events(len(events) + 1))
    assert_same(mirror, pool)


def test_drift_without_state_marks_unsynced_until_a_state_arrives():
    pool = RefPool(small_geometry(64), seed=5)
    for _ in range(200):
        pool.random_op()
    events = pool.events()
    mirror = AllocatorMirror(pool.g)
    mirror.apply(events[5:])  # lost the start
    n = len(pool.rows)
    pool.snapshot()
    mirror.apply(pool.events(n))
    if mirror.drift_count:
        assert not mirror.synced
    n = len(pool.rows)
    state = pool.snapshot()
    mirror.apply(pool.events(n), state)
    assert mirror.synced
    assert_same(mirror, pool)


def test_state_arrays_round_trip_preserves_everything():
    pool = RefPool(small_geometry(64), seed=9)
    for _ in range(500):
        pool.random_op()
    mirror = AllocatorMirror(pool.g)
    mirror.apply(pool.events())
    copy = AllocatorMirror.from_state_arrays(pool.g, mirror.state_arrays())
    assert copy.metrics() == mirror.metrics()
    n = len(pool.rows)
    for _ in range(300):
        pool.random_op()
    copy.apply(pool.events(n))
    assert_same(copy, pool)


def test_lifecycle_and_request_attributes_come_from_arrive_admit_finish():
    pool = RefPool(small_geometry(64), seed=1)
    r1, r2 = pool.arrive(), pool.arrive()
    pool.requests[r1]["running"] = True
    pool.emit(K.ADMIT, req=r1)
    mirror = AllocatorMirror(pool.g)
    mirror.apply(pool.events())
    t = mirror.request_table()
    row = {int(r): i for i, r in enumerate(t.req)}
    assert bool(t.running[row[r1]]) and not bool(t.running[row[r2]])
    assert int(t.priority[row[r2]]) == pool.requests[r2]["priority"]
    assert int(t.prompt_tokens[row[r2]]) == pool.requests[r2]["prompt"]


def test_bad_input_names_the_problem():
    mirror = AllocatorMirror(small_geometry(16))
    with pytest.raises(MirrorError, match="EVENT_DTYPE"):
        mirror.apply(np.zeros(3, dtype=np.int64))
    ev = np.zeros(1, dtype=EVENT_DTYPE)
    ev["kind"], ev["offset"], ev["size"] = K.ALLOC, 99, 1
    with pytest.raises(MirrorError, match="offset 99 outside D=16"):
        mirror.apply(ev)


def test_empty_pool_checksum_matches_contract_function():
    mirror = AllocatorMirror(small_geometry(16))
    assert mirror.checksum() == free_runs_checksum(np.array([0]), np.array([16]))
    m = mirror.metrics()
    assert m.free_units == 16 and m.f_ext == 0.0 and m.u_kv == 0.0


def test_mirror_equals_the_shadow_engine_pool_after_every_batch_and_at_ticks():
    """Real engine logs (producers.sim.fleet): U_kv, F_ext, F_int, Ψ equal the pool's own exact values."""
    from kvguard.producers.sim.fleet import Fleet
    from kvguard.producers.sim.profiles import load_profile
    from kvguard.producers.sim.workloads import load_workload
    from kvguard.streams.core import StreamCore

    ns = NS_PER_S
    profile = load_profile("llama3-8b-24gb")  # the seed engine: its PagedPool is what the mirror is compared with
    fleet = Fleet(2, profile, seed=3, snapshot_every_s=30)
    fleet.submit_workload(load_workload("mixed", rate_scale=4.0, window=240, seed=3))
    core = StreamCore()
    compared_ticks = 0
    last_capture: dict[str, tuple[int, object]] = {}
    for now in range(ns, 240 * ns + 1, ns):
        fleet.advance(now)
        pools = {e.node: e.pool for e in fleet.engines}
        for batch in fleet.take_batches(now):
            expected = pools[batch.node].metrics()
            ticks, _ = core.process(batch)
            mirror = core.nodes[batch.node].mirror
            got = mirror.metrics()
            for name in EXACT + ("u_kv", "f_ext", "f_int", "psi"):
                assert getattr(got, name) == getattr(expected, name), (batch.node, batch.seq, name)
            for t in ticks:  # the capture before this batch holds the state at t when no event passed t
                prev_max_ts, prev = last_capture.get(batch.node, (None, None))
                if prev is not None and prev_max_ts < t.ts_ns and int(batch.events["ts_ns"][0]) >= t.ts_ns:
                    assert (t.u_kv, t.f_ext, t.f_int, t.psi) == (prev.u_kv, prev.f_ext, prev.f_int, prev.psi)
                    compared_ticks += 1
            last_capture[batch.node] = (int(batch.events["ts_ns"].max()), expected)
    assert compared_ticks >= 10
    assert all(st.mirror.drift_count == 0 and st.mirror.snapshot_checks >= 7 for st in core.nodes.values())
    assert fleet.summary().preemptions > 0
