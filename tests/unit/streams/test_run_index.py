"""The sparse run index keeps its gap multiset and per-state units equal to a from-scratch
recomputation over a dense model, whatever the writes (overlapping and inconsistent runs included)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.contracts.events import EVENT_DTYPE
from kvguard.contracts.events import EventKind as K
from kvguard.streams.mirror import AllocatorMirror
from kvguard.streams.run_index import STATE_FREE, RunIndex, SparseCounts
from tests.unit.streams.streams_refpool import small_geometry


def dense_reference(size: np.ndarray, state: np.ndarray, units: int) -> tuple[dict, np.ndarray, tuple]:
    """Gap multiset, units per state and free runs of dense arrays, the mirror's old way."""
    occ = np.flatnonzero(size)
    ends = occ + size[occ]
    start = np.concatenate(([0], ends))
    stop = np.concatenate((occ, [units]))
    sizes = stop - start
    keep = sizes > 0
    values, counts = np.unique(sizes[keep], return_counts=True)
    by_state = np.bincount(state[occ], weights=size[occ], minlength=5).astype(np.int64)
    return dict(zip(values.tolist(), counts.tolist())), by_state, (start[keep].tolist(), sizes[keep].tolist())


writes = st.lists(st.tuples(st.integers(0, 63), st.integers(0, 12), st.integers(0, 4)), min_size=0, max_size=24)


@settings(max_examples=150, deadline=None)
@given(batches=st.lists(writes, min_size=1, max_size=12), units=st.sampled_from([1, 7, 64]),
       read_every=st.integers(1, 4))
def test_incremental_gaps_equal_a_full_recomputation(batches, units, read_every):
    """Read after every write, or after several (deferred writes merged as one)."""
    index = RunIndex(units)
    size = np.zeros(units, dtype=np.int64)
    state = np.zeros(units, dtype=np.int8)
    for i, batch in enumerate(batches):
        rows = [(o % units, s, k) for o, s, k in batch]
        last = {o: (s, k) for o, s, k in rows}  # last write wins, as the mirror folds a batch
        offs = np.array(sorted(last), dtype=np.int64)
        sizes = np.array([last[o][0] for o in offs.tolist()], dtype=np.int64)
        states = np.array([last[o][1] for o in offs.tolist()], dtype=np.int8)
        index.write(offs, sizes, states)
        for o, (s, k) in last.items():
            size[o] = s if k != STATE_FREE else 0
            state[o] = k if size[o] else STATE_FREE
        if i % read_every and i != len(batches) - 1:
            continue
        gaps, by_state, runs = dense_reference(size, state, units)
        assert index.gap_multiset() == gaps
        assert index.n_free_runs == sum(gaps.values())
        assert index.largest_free_run == (max(gaps) if gaps else 0)
        assert index.by_state.tolist() == by_state.tolist()
        got_off, got_size = index.free_runs()
        assert (got_off.tolist(), got_size.tolist()) == runs
        got_dense_size, got_dense_state = index.dense()
        assert got_dense_size.tolist() == size.tolist()
        assert got_dense_state[size > 0].tolist() == state[size > 0].tolist()
    # a full load of the same runs gives the same bookkeeping
    other = RunIndex(units)
    other.load(index.off, index.size, index.state)
    assert other.gap_multiset() == index.gap_multiset() and other.by_state.tolist() == index.by_state.tolist()


@settings(max_examples=100, deadline=None)
@given(batches=st.lists(st.dictionaries(st.integers(0, 40), st.integers(-2, 5), max_size=12), min_size=1,
                        max_size=10))
def test_sparse_counts_equal_a_dense_array(batches):
    counts = SparseCounts()
    dense = np.zeros(41, dtype=np.int64)
    for batch in batches:
        offs = np.array(sorted(batch), dtype=np.int64)
        counts.set(offs, np.array([batch[o] for o in offs.tolist()], dtype=np.int64))
        for o, v in batch.items():
            dense[o] = max(v, 0)
        assert counts.dense(41).tolist() == dense.tolist()
        assert counts.get(np.arange(41)).tolist() == dense.tolist()
        assert (counts.vals > 0).all() and np.all(np.diff(counts.keys) > 0)


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(st.sampled_from([K.ALLOC, K.FREE, K.SHARE, K.EVICT, K.RECLAIM, K.WS_ALLOC,
                                                K.WS_FREE, K.MIGRATE, K.RESET]),
                               st.integers(0, 31), st.integers(1, 8), st.integers(0, 31), st.integers(0, 3)),
                     min_size=1, max_size=80),
       cut=st.integers(1, 20))
def test_mirror_metrics_equal_a_recomputation_from_its_runs_on_arbitrary_streams(rows, cut):
    """Streams that no pool would write (double frees, overlapping runs, moves onto a run): the
    incremental figures still equal the ones recomputed from the runs the mirror holds."""
    mirror = AllocatorMirror(small_geometry(32))
    ev = np.zeros(len(rows), dtype=EVENT_DTYPE)
    for i, (kind, off, size, aux, req) in enumerate(rows):
        ev[i]["ts_ns"], ev[i]["kind"], ev[i]["offset"], ev[i]["size"] = i, kind, off, min(size, 32 - off)
        ev[i]["aux"], ev[i]["req"], ev[i]["tokens"] = aux, req, 1
    for start in range(0, len(rows), cut):
        mirror.apply(ev[start:start + cut])
        size, state = mirror.run_size, mirror.run_state
        gaps, by_state, runs = dense_reference(size, state, 32)
        m = mirror.metrics()
        assert (m.largest_free_run, m.n_free_runs) == ((max(gaps) if gaps else 0), sum(gaps.values()))
        assert (m.live_units, m.cached_units, m.retained_units, m.workspace_units) == \
            tuple(int(by_state[s]) for s in (1, 2, 3, 4))
        assert tuple(x.tolist() for x in mirror.free_runs()) == runs
