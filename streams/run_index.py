"""Sparse, incremental bookkeeping of a mirror's pool: its occupied runs, their free gaps and refcounts.

Pure (numpy + stdlib). Memory is proportional to the live state (occupied runs, referenced pages),
never to the dynamic region D, and a write costs work proportional to the offsets it changes
(plus one ``memmove`` of the run arrays when runs appear or disappear), never a scan of D:

``RunIndex``: the occupied runs as sorted arrays ``off`` / ``size`` (> 0) / ``state`` (the mirror's
run-state codes), the units held per state, and the multiset of free-run sizes (the gaps between
consecutive occupied runs, the region's ends included: ``free_runs()``'s sizes, those > 0).

The gap multiset is kept exact under any batch of writes by this argument: a gap is identified by
the pair of consecutive runs around it. Call a gap *touched* by an offset ``u`` when ``u`` is the
start of one of its two runs, or lies strictly between them. A gap that no written offset touches
has both its runs unchanged and no run written between them, so it is a gap, of the same size,
before and after the writes, and untouched in both. Hence removing the sizes of the gaps touched
in the old state and adding those touched in the new one turns the old multiset into the new.
``tests/unit/streams/test_run_index.py`` checks it against a from-scratch recomputation
(hypothesis, overlapping and inconsistent runs included).

``SparseCounts``: per-offset reference counts (> 0 kept, 0 dropped), gathered and written by
vectorised binary search.
"""

from __future__ import annotations

import numpy as np

STATE_FREE = 0
_N_STATES = 5
_MIN_PENDING = 2048  # written offsets kept unmerged at least up to this many


def index_dtype(units: int) -> np.dtype:
    """Offsets and sizes of a region of ``units`` units: int32 (half the bytes) while an offset
    plus a size cannot pass its range, int64 beyond."""
    return np.dtype(np.int32) if units < 2**30 else np.dtype(np.int64)


def _positions(keys: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For sorted ``keys``: the insertion points of ``u`` and whether each is present."""
    u = u.astype(keys.dtype, copy=False)  # a mixed-dtype search would convert the whole table
    j = np.searchsorted(keys, u)
    if keys.size == 0:
        return j, np.zeros(u.size, dtype=bool)
    return j, keys[np.minimum(j, keys.size - 1)] == u


def _sorted_unique(a: np.ndarray) -> np.ndarray:
    """``np.unique`` by a sort (numpy's hash-based unique costs far more on the small arrays here)."""
    a = np.sort(a)
    return a[np.append(True, a[1:] != a[:-1])] if a.size else a


def _upsert(keys: np.ndarray, cols: list[np.ndarray], u: np.ndarray, values: list[np.ndarray],
            keep: np.ndarray, found: tuple[np.ndarray, np.ndarray] | None = None
            ) -> tuple[np.ndarray, list[np.ndarray]]:
    """Write ``values`` at the sorted, unique keys ``u`` of a sorted sparse table; rows where
    ``keep`` is False are removed (or not inserted). ``found``: ``_positions(keys, u)`` if known.
    Rows written in place; removals and insertions in one merge per column (no ``np.insert``)."""
    j, hit = found if found is not None else _positions(keys, u)
    upd = hit & keep
    ju = j[upd]
    if ju.size:
        for col, val in zip(cols, values):
            col[ju] = val[upd]
    drop = hit & ~keep
    add = ~hit & keep
    n_drop, n_add = int(np.count_nonzero(drop)), int(np.count_nonzero(add))
    if not n_drop and not n_add:
        return keys, cols
    if n_drop:
        stay = np.ones(keys.size, dtype=bool)
        stay[j[drop]] = False
        keys = keys[stay]
        cols = [col[stay] for col in cols]
    if not n_add:
        return keys, cols
    ua = u[add].astype(keys.dtype, copy=False)
    final = keys.searchsorted(ua) + np.arange(n_add)  # where the new keys land in the merged table
    old = np.ones(keys.size + n_add, dtype=bool)
    old[final] = False
    merged_keys = np.empty(old.size, dtype=keys.dtype)
    merged_keys[old] = keys
    merged_keys[final] = ua
    merged = []
    for col, val in zip(cols, values):
        m = np.empty(old.size, dtype=col.dtype)
        m[old] = col
        m[final] = val[add]
        merged.append(m)
    return merged_keys, merged


class SparseCounts:
    """Non-negative counts per offset; absent offsets count 0."""

    __slots__ = ("keys", "vals", "dtype")

    def __init__(self, dtype=np.int64) -> None:
        self.dtype = np.dtype(dtype)
        self.keys = np.zeros(0, dtype=self.dtype)
        self.vals = np.zeros(0, dtype=self.dtype)

    def get(self, offsets: np.ndarray) -> np.ndarray:
        return self.lookup(offsets)[0]

    def lookup(self, offsets: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
        """The counts at ``offsets`` and where they are (for a ``set`` of the same offsets)."""
        offsets = np.asarray(offsets, dtype=np.int64)
        j, hit = found = _positions(self.keys, offsets)
        out = np.zeros(offsets.size, dtype=np.int64)
        out[hit] = self.vals[j[hit]]
        return out, found

    def set(self, offsets: np.ndarray, values: np.ndarray,
            found: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """``offsets`` sorted and unique; a value ≤ 0 removes the offset. ``found``: from a
        ``lookup`` of the same offsets with no write in between."""
        values = np.asarray(values, dtype=np.int64)
        self.keys, (self.vals,) = _upsert(self.keys, [self.vals], np.asarray(offsets, dtype=np.int64),
                                          [values], values > 0, found)

    def load(self, offsets: np.ndarray, values: np.ndarray) -> None:
        offsets, values = np.asarray(offsets, dtype=np.int64), np.asarray(values, dtype=np.int64)
        keep = values > 0
        order = np.argsort(offsets[keep], kind="stable")
        self.keys, self.vals = offsets[keep][order].astype(self.dtype), values[keep][order].astype(self.dtype)

    def clear(self) -> None:
        self.__init__(self.dtype)

    def dense(self, units: int) -> np.ndarray:
        out = np.zeros(units, dtype=np.int64)
        out[self.keys] = self.vals
        return out

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.vals.nbytes


class RunIndex:
    """Occupied runs of a region of ``units`` units, with their gaps and per-state units kept incrementally."""

    __slots__ = ("units", "dtype", "_off", "_size", "_state", "_by_state", "_gaps", "_n_gaps", "_max_gap",
                 "_pending", "_pending_n")

    def __init__(self, units: int) -> None:
        self.units = int(units)
        self.dtype = index_dtype(self.units)
        self.clear()

    def clear(self) -> None:
        self._off = np.zeros(0, dtype=self.dtype)
        self._size = np.zeros(0, dtype=self.dtype)
        self._state = np.zeros(0, dtype=np.int8)
        self._by_state = np.zeros(_N_STATES, dtype=np.int64)
        self._pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # writes not merged yet
        self._pending_n = 0
        self._gaps: dict[int, int] = {self.units: 1}  # free-run size -> how many
        self._n_gaps = 1
        self._max_gap: int | None = self.units

    # ------------------------------------------------------------------ reading
    # every reader merges the pending writes first (``_flush``)
    @property
    def off(self) -> np.ndarray:
        self._flush()
        return self._off

    @property
    def size(self) -> np.ndarray:
        self._flush()
        return self._size

    @property
    def state(self) -> np.ndarray:
        self._flush()
        return self._state

    @property
    def by_state(self) -> np.ndarray:
        self._flush()
        return self._by_state

    def get(self, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(size, state) of the runs starting at ``offsets`` (0, STATE_FREE where none does)."""
        self._flush()
        offsets = np.asarray(offsets, dtype=np.int64)
        j, hit = _positions(self._off, offsets)
        size = np.zeros(offsets.size, dtype=np.int64)
        state = np.zeros(offsets.size, dtype=np.int8)
        size[hit] = self._size[j[hit]]
        state[hit] = self._state[j[hit]]
        return size, state

    def free_runs(self) -> tuple[np.ndarray, np.ndarray]:
        """Maximal free runs (offsets, sizes) sorted by offset: O(runs), for snapshots and checksums."""
        self._flush()
        off = self._off.astype(np.int64)
        gap_start = np.concatenate(([0], off + self._size))
        gap_end = np.concatenate((off, [self.units]))
        sizes = gap_end - gap_start
        keep = sizes > 0
        return gap_start[keep], sizes[keep]

    @property
    def n_free_runs(self) -> int:
        self._flush()
        return self._n_gaps

    @property
    def largest_free_run(self) -> int:
        self._flush()
        if self._max_gap is None:
            self._max_gap = max(self._gaps) if self._gaps else 0
        return self._max_gap

    def gap_multiset(self) -> dict[int, int]:
        self._flush()
        return dict(self._gaps)

    @property
    def nbytes(self) -> int:
        self._flush()
        return self._off.nbytes + self._size.nbytes + self._state.nbytes + 64 * len(self._gaps)

    def dense(self) -> tuple[np.ndarray, np.ndarray]:
        """(run_size, run_state) as D-sized arrays: for tests and debugging, never the hot path."""
        self._flush()
        size = np.zeros(self.units, dtype=np.int64)
        state = np.zeros(self.units, dtype=np.int8)
        size[self._off] = self._size
        state[self._off] = self._state
        return size, state

    # ------------------------------------------------------------------ writing
    def write(self, offsets: np.ndarray, sizes: np.ndarray, states: np.ndarray) -> None:
        """The runs at the sorted, unique ``offsets`` become (size, state); a FREE state or a size
        ≤ 0 means no run starts there any more.

        Deferred: the writes are kept as they come and merged into the runs, the per-state units
        and the gap multiset in one step when a reader needs them or when they reach a quarter of
        the runs (``_flush``), so a batch costs its own offsets, and the O(runs) merge is paid once
        per many batches. Merging the union of several writes (the last one per offset wins) is
        the same as merging them one by one: the gap argument above holds for any set of written
        offsets between two states."""
        u = np.asarray(offsets, dtype=np.int64)
        if u.size == 0:
            return
        states = np.asarray(states, dtype=np.int8)
        sizes = np.where(states != STATE_FREE, np.asarray(sizes, dtype=np.int64), 0)
        self._pending.append((u, sizes, states))
        self._pending_n += u.size
        if self._pending_n > max(_MIN_PENDING, self._off.size // 4):
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        if len(self._pending) == 1:
            u, sizes, states = self._pending[0]
        else:
            cat_u = np.concatenate([p[0] for p in self._pending])
            cat_size = np.concatenate([p[1] for p in self._pending])
            cat_state = np.concatenate([p[2] for p in self._pending])
            u, first_in_reversed = np.unique(cat_u[::-1], return_index=True)
            last = cat_u.size - 1 - first_in_reversed
            sizes, states = cat_size[last], cat_state[last]
        self._pending.clear()
        self._pending_n = 0
        self._merge(u, sizes, states)

    def _merge(self, u: np.ndarray, sizes: np.ndarray, states: np.ndarray) -> None:
        keep = sizes > 0
        found = _positions(self._off, u)
        j, hit = found
        # only states change (same runs, same sizes, e.g. freed pages kept as prefix cache): the gaps stay
        same_runs = bool(hit.all() and keep.all() and np.array_equal(self._size[j], sizes))
        old_gaps = None if same_runs else self._touched_gap_sizes(u, found)
        jh = j[hit]
        if jh.size:  # the runs written over leave their units
            self._by_state -= np.bincount(self._state[jh], weights=self._size[jh], minlength=_N_STATES).astype(np.int64)
        if keep.any():
            self._by_state += np.bincount(states[keep], weights=sizes[keep], minlength=_N_STATES).astype(np.int64)
        self._off, (self._size, self._state) = _upsert(self._off, [self._size, self._state], u, [sizes, states], keep,
                                                    found)
        if old_gaps is not None:
            self._gap_delta(old_gaps, self._touched_gap_sizes(u))

    def load(self, offsets: np.ndarray, sizes: np.ndarray, states: np.ndarray) -> None:
        """Replace every run (a full state dump): rebuilt from scratch, O(runs)."""
        offsets = np.asarray(offsets, dtype=np.int64)
        sizes = np.asarray(sizes, dtype=np.int64)
        states = np.asarray(states, dtype=np.int8)
        # a dense write keeps the last of duplicate offsets, as the dump is applied row by row
        order = np.argsort(offsets, kind="stable")
        offsets, sizes, states = offsets[order], sizes[order], states[order]
        if offsets.size:
            last = np.append(offsets[1:] != offsets[:-1], True)
            offsets, sizes, states = offsets[last], sizes[last], states[last]
        keep = (sizes > 0) & (states != STATE_FREE)
        self.clear()
        self._off, self._size = offsets[keep].astype(self.dtype), sizes[keep].astype(self.dtype)
        self._state = states[keep].copy()
        self._by_state = np.bincount(self._state, weights=self._size, minlength=_N_STATES).astype(np.int64)
        _, gaps = self.free_runs()
        self._gaps, self._n_gaps, self._max_gap = {}, 0, None
        self._gap_update(gaps, +1)

    # ------------------------------------------------------------------ gaps
    def _touched_gap_sizes(self, u: np.ndarray, found: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """Sizes of the gaps touched by the offsets ``u`` (see the module docstring), each gap once.
        Gap ``g`` lies before run ``g`` (``g == len(off)``: after the last run)."""
        off = self._off
        n = off.size
        j, hit = found if found is not None else _positions(off, u)
        g = _sorted_unique(np.concatenate((j, j[hit] + 1)))
        start = np.zeros(g.size, dtype=np.int64)
        inner = g > 0
        prev = g[inner] - 1
        start[inner] = off[prev] + self._size[prev]
        stop = np.full(g.size, self.units, dtype=np.int64)
        before = g < n
        stop[before] = off[g[before]]
        return stop - start

    def _gap_delta(self, old: np.ndarray, new: np.ndarray) -> None:
        """The multiset loses the gap sizes ``old`` and gains ``new`` (those > 0), in one pass over
        the sizes whose count changes."""
        old, new = np.sort(old[old > 0]), np.sort(new[new > 0])
        if np.array_equal(old, new):
            return
        values, inverse = np.unique(np.concatenate((old, new)), return_inverse=True)
        net = np.bincount(inverse, weights=np.concatenate((-np.ones(old.size), np.ones(new.size))),
                          minlength=values.size).astype(np.int64)
        changed = np.flatnonzero(net)
        gaps = self._gaps
        for v, c in zip(values[changed].tolist(), net[changed].tolist()):
            left = gaps.get(v, 0) + c
            if left > 0:
                gaps[v] = left
            elif left == 0:
                gaps.pop(v, None)
                if v == self._max_gap:
                    self._max_gap = None
            else:  # cannot happen with the argument above: fail loudly rather than drift
                raise AssertionError(f"free-run multiset: removed a gap of {v} units it does not hold")
            if c > 0 and self._max_gap is not None and v > self._max_gap:
                self._max_gap = v
        self._n_gaps += new.size - old.size

    def _gap_update(self, sizes: np.ndarray, sign: int) -> None:
        sizes = sizes[sizes > 0]
        if sizes.size == 0:
            return
        sizes = np.sort(sizes)
        first = np.flatnonzero(np.append(True, sizes[1:] != sizes[:-1]))
        values, counts = sizes[first], np.diff(np.append(first, sizes.size))
        gaps = self._gaps
        for v, c in zip(values.tolist(), counts.tolist()):
            left = gaps.get(v, 0) + sign * c
            if left > 0:
                gaps[v] = left
            elif left == 0:
                gaps.pop(v, None)
                if v == self._max_gap:
                    self._max_gap = None
            else:  # cannot happen with the argument above: fail loudly rather than drift
                raise AssertionError(f"free-run multiset: removed a gap of {v} units it does not hold")
        self._n_gaps += sign * int(sizes.size)
        if sign > 0 and self._max_gap is not None:
            self._max_gap = max(self._max_gap, int(values[-1]))
