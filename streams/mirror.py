"""The allocator mirror: one GPU's paged pool rebuilt from its event stream, vectorised over batches.

Pure (numpy + stdlib). The mirror keeps the pool's occupied runs keyed by their start offset, in
sparse structures whose size follows the live state, never the dynamic region D
(``kvguard.streams.run_index``):

- ``runs``: the occupied runs (offset, size, state), with the units per state and the multiset of
  free-run sizes kept incrementally, so a batch costs work proportional to the offsets it writes;
- ``refcounts``: how many requests reference the live page at each offset (> 0 only);
- request references as a sorted array of keys ``slot * D + offset`` (one per request and page),
  plus a log of added/dropped references that is folded in only when a query needs it (ticks).

Why keyed by offset and not by unit: an event changes one run, so the final state of a run after a
batch is the state written by the *last* event at its offset ("last write wins"), computed for the
whole batch with one ``np.unique``; refcounts are grouped cumulative sums per offset. Free runs are
the gaps between occupied runs: their count and the largest come from the incremental multiset
(``metrics()``), their list is built from the runs when a snapshot is checked (``free_runs()``).
RESET, MIGRATE and SNAPSHOT rows are barriers handled one by one. ``run_size`` / ``run_state`` /
``refcount`` give D-sized views for tests only.

The metric definitions are those of docs/CONTRACTS.md ("Exact metric definitions"); with a
consistent event stream the mirror's values equal the pool's bit for bit.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import numpy as np

from kvguard.contracts import pressure
from kvguard.contracts.events import (
    ALLOCATOR_KINDS,
    EVENT_DTYPE,
    F_TO_CACHE,
    EventKind,
    Geometry,
    Handling,
    PoolState,
    RegionState,
    free_runs_checksum,
)
from kvguard.contracts.units import DEFAULT_PRIORITY
from kvguard.streams.allocator_layer import AllocatorLayer
from kvguard.streams.run_index import RunIndex, SparseCounts, index_dtype

log = logging.getLogger(__name__)


def _nonzero(mask: np.ndarray) -> np.ndarray:
    return mask.nonzero()[0]

# run_state codes: RegionState + 1, so that 0 means "no run starts here".
STATE_FREE = 0
STATE_LIVE = RegionState.LIVE + 1
STATE_CACHED = RegionState.CACHED + 1
STATE_RETAINED = RegionState.RETAINED + 1
STATE_WORKSPACE = RegionState.WORKSPACE + 1
_NO_WRITE = -1

K = EventKind
_N_KINDS = 32
_GOVERN = int(EventKind.GOVERN)
_F_GOV_REFUSED = 16  # producers.vllm.governor.F_GOV_REFUSED (a wing may not import another)


def _table(values: dict[int, int], default: int = 0, dtype=np.int64) -> np.ndarray:
    out = np.full(_N_KINDS, default, dtype=dtype)
    for kind, value in values.items():
        out[int(kind)] = value
    return out


# Reference-count change of each kind (the page at ``offset`` gains or loses the event's request).
REF_DELTA = _table({K.ALLOC: 1, K.SHARE: 1, K.SWAP_IN: 1, K.REMAP: 1,
                    K.FREE: -1, K.EVICT: -1, K.SWAP_OUT: -1})
# Run state written unconditionally by a kind; FREE/EVICT/SWAP_OUT write only when the last
# reference leaves (decided per row); SHARE revives a cached page.
_STATE_WRITE = _table({K.ALLOC: STATE_LIVE, K.SHARE: STATE_LIVE, K.SWAP_IN: STATE_LIVE,
                       K.REMAP: STATE_LIVE, K.RECLAIM: STATE_FREE, K.EXPIRE: STATE_FREE,
                       K.WS_ALLOC: STATE_WORKSPACE, K.WS_FREE: STATE_FREE}, default=_NO_WRITE)
# Tokens added to "tokens stored in live pages" unconditionally.
_TOKENS_ADD = _table({K.ALLOC: 1, K.FILL: 1, K.SWAP_IN: 1, K.REMAP: 1})
_LEAVING = _table({K.FREE: 1, K.EVICT: 1, K.SWAP_OUT: 1}, dtype=bool)
# Kinds whose ``req`` column names a request.
_HAS_REQ = _table({k: 1 for k in (K.ARRIVE, K.ADMIT, K.FINISH, K.PREEMPT, K.ALLOC, K.SHARE, K.FREE,
                                  K.EVICT, K.SWAP_OUT, K.SWAP_IN, K.REMAP, K.ALLOC_FAIL)}, dtype=bool)
# Lifecycle: the last of these per request decides whether it is running.
LIFE_WAITING, LIFE_RUNNING, LIFE_FINISHED = 0, 1, 2
_LIFE = _table({K.ARRIVE: LIFE_WAITING, K.ADMIT: LIFE_RUNNING, K.PREEMPT: LIFE_WAITING,
                K.FINISH: LIFE_FINISHED}, default=-1)
_BARRIERS = _table({K.RESET: 1, K.MIGRATE: 1, K.SNAPSHOT: 1}, dtype=bool)
# Rows of the caching-allocator layer (bytes and device addresses, not KV units).
_ALLOCATOR_LAYER = _table({k: 1 for k in ALLOCATOR_KINDS}, dtype=bool)

_ARRIVE, _SHARE, _FREE, _EVICT, _STEP = int(K.ARRIVE), int(K.SHARE), int(K.FREE), int(K.EVICT), int(K.STEP)
_ADMISSION = int(K.ADMISSION)
_MIGRATE, _RESET, _SNAPSHOT = int(K.MIGRATE), int(K.RESET), int(K.SNAPSHOT)
_RETAIN = int(Handling.RETAIN)


class MirrorError(ValueError):
    """The mirror was given input it cannot use (wrong dtype, offsets outside D)."""


@dataclass(slots=True, frozen=True)
class MirrorMetrics:
    """The pool's exact metrics as the mirror sees them (same names as ``PoolMetrics``)."""

    live_units: int
    cached_units: int
    retained_units: int
    workspace_units: int
    free_units: int
    largest_free_run: int
    n_free_runs: int
    tokens_stored: int
    u_kv: float
    f_ext: float
    f_int: float
    psi: float


@dataclass(slots=True)
class RequestTable:
    """Requests known to the mirror, one row each (parallel arrays). ``running``: admitted and not
    finished or preempted; ``waiting``: its last lifecycle event is an arrival or a preemption. ``shared_units``: units of its pages that other requests also reference
    (an eviction of the request would not free them)."""

    req: np.ndarray
    pages: np.ndarray
    units: np.ndarray
    shared_units: np.ndarray
    priority: np.ndarray
    prompt_tokens: np.ndarray
    arrival_ns: np.ndarray
    last_ts_ns: np.ndarray
    running: np.ndarray
    waiting: np.ndarray
    arrive_flags: np.ndarray | None = None  # the ARRIVE row's flags (F_PROMPT_LOGPROBS …); 0: none seen


class AllocatorMirror:
    """Rebuilds one GPU's allocator from its events. ``apply(events, state=None)`` is the only writer.

    Synchronisation: ``synced`` is False after ``mark_unsynced`` (a seq gap, a new producer epoch)
    and after a SNAPSHOT whose checksum disagrees with the mirror's free runs while no
    ``PoolState`` came with it; it becomes True again when a SNAPSHOT row arrives with a state.
    Events keep being applied while unsynced (best effort, nothing raises on inconsistency).
    """

    def __init__(self, geometry: Geometry, reserved_frac: float | None = None,
                 alpha: float = pressure.ALPHA, beta: float = pressure.BETA):
        self.geometry = geometry
        self.units = int(geometry.dynamic_units)
        if self.units <= 0:
            raise MirrorError(f"geometry.dynamic_units must be > 0, got {self.units}")
        self.reserved_frac = geometry.reserved_frac if reserved_frac is None else reserved_frac
        self.alpha = alpha
        self.beta = beta
        self.runs = RunIndex(self.units)
        self.refcounts = SparseCounts(index_dtype(self.units))
        self.tokens_stored = 0
        self._refs = np.zeros(0, dtype=np.int64)  # sorted keys slot * D + offset
        self._ref_log_keys: list[np.ndarray] = []
        self._ref_log_deltas: list[np.ndarray] = []
        self._slot_of: dict[int, int] = {}
        self._req = np.zeros(0, dtype=np.int64)
        self._priority = np.zeros(0, dtype=np.int64)
        self._prompt = np.zeros(0, dtype=np.int64)
        self._flags = np.zeros(0, dtype=np.int64)  # per request: its ARRIVE row's flags
        self._arrival = np.zeros(0, dtype=np.int64)
        self._last_ts = np.zeros(0, dtype=np.int64)
        self._life = np.zeros(0, dtype=np.int8)
        self._n_slots = 0
        self._index_ids: np.ndarray | None = None
        self._index_slots = np.zeros(0, dtype=np.int64)
        self.kind_counts = np.zeros(_N_KINDS, dtype=np.int64)
        self.never_fits_total = 0
        self.step_tokens_total = 0
        self.decode_tokens_total = 0
        self.evicted_tokens_total = 0
        self.evicted_requests_total = 0
        self.last_ts_ns: int | None = None
        self.synced = True
        self.drift_count = 0
        self.resync_count = 0
        self.unsynced_count = 0
        self.snapshot_checks = 0
        self._metrics_cache: MirrorMetrics | None = None
        self.allocator = AllocatorLayer()  # the caching-allocator layer (SEG_*/BLK_* rows)
        self.endpoint_state: tuple[int, int, int] | None = None  # newest ADMISSION state row: cls, size, aux

    # ------------------------------------------------------------------ writing
    def apply(self, events: np.ndarray, state: PoolState | None = None) -> None:
        """Apply ``events`` (EVENT_DTYPE rows, in order). ``state`` belongs to the last SNAPSHOT row."""
        if events.dtype != EVENT_DTYPE:
            raise MirrorError(f"events must have EVENT_DTYPE, got {events.dtype}")
        if len(events) == 0:
            return
        self._metrics_cache = None
        kind = events["kind"]
        if int(kind.max()) >= _N_KINDS:
            raise MirrorError(f"unknown event kind {int(kind.max())} in events")
        barriers = _nonzero(_BARRIERS[kind])
        snapshot_rows = _nonzero(kind == _SNAPSHOT)
        last_snapshot = int(snapshot_rows[-1]) if snapshot_rows.size else -1
        start = 0
        for b in barriers.tolist():
            if b > start:
                self._apply_plain(events[start:b])
            row = events[b]
            k = int(row["kind"])
            if k == _MIGRATE:
                self._migrate(events[b:b + 1])
            elif k == _RESET:
                self._reset()
            else:
                self._check_snapshot(row, state if b == last_snapshot else None)
            self.kind_counts[k] += 1
            start = b + 1
        if start < len(events):
            self._apply_plain(events[start:])
        self.last_ts_ns = int(events["ts_ns"][-1])
        state_rows = _nonzero((kind == _ADMISSION) & (events["req"] == -1))
        if state_rows.size:  # the node's admission state (issue 29): the newest wins
            row = events[int(state_rows[-1])]
            self.endpoint_state = (int(row["cls"]), int(row["size"]), int(row["aux"]))

    def mark_unsynced(self, reason: str) -> None:
        """The stream lost events (seq gap, producer restart): metrics are best effort until the
        next SNAPSHOT with state."""
        if self.synced:
            log.warning("mirror unsynced: %s", reason)
        self.synced = False
        self.unsynced_count += 1

    def load_state(self, state: PoolState) -> None:
        """Replace the allocator state with a full ``PoolState`` dump (request attributes are kept)."""
        self._metrics_cache = None
        off = np.asarray(state.offset, dtype=np.int64)
        size = np.asarray(state.size, dtype=np.int64)
        if off.size and (off.min() < 0 or int((off + size).max()) > self.units):
            raise MirrorError(f"PoolState runs exceed the dynamic region of {self.units} units")
        self.runs.load(off, size, np.asarray(state.state, dtype=np.int64) + 1)
        refs = state.refs
        counts = np.fromiter((len(r) for r in refs), dtype=np.int64, count=len(refs))
        self._load_refcounts(off, counts)
        keys = [self._slot(int(r)) * self.units + int(o)
                for o, holders in zip(off.tolist(), refs) for r in holders]
        self._refs = np.unique(np.asarray(keys, dtype=np.int64))
        self._ref_log_keys.clear()
        self._ref_log_deltas.clear()
        self.tokens_stored = int(state.tokens_stored)
        self.synced = True
        self.resync_count += 1

    def _apply_plain(self, ev: np.ndarray) -> None:
        layer_rows = _ALLOCATOR_LAYER[ev["kind"]]
        if layer_rows.any():
            self.kind_counts += np.bincount(ev["kind"][layer_rows].astype(np.intp), minlength=_N_KINDS)
            self.allocator.apply(ev[layer_rows])
            ev = ev[~layer_rows]
            if len(ev) == 0:
                return
        kind = ev["kind"].astype(np.intp)
        off = ev["offset"]
        size = ev["size"]
        tokens = ev["tokens"]
        n = len(ev)
        self.kind_counts += np.bincount(kind, minlength=_N_KINDS)
        if self.kind_counts[_GOVERN]:  # the step governor's refusals at arrival (GOVERN with F_GOV_REFUSED)
            self.never_fits_total += int(np.count_nonzero((kind == _GOVERN) & (ev["flags"] & _F_GOV_REFUSED != 0)))

        delta = REF_DELTA[kind]
        ref_rows = _nonzero(delta)
        post = np.zeros(n, dtype=np.int64)
        if ref_rows.size:
            ref_off = off[ref_rows]
            if ref_off.min() < 0 or ref_off.max() >= self.units:
                bad = int(ref_rows[(ref_off < 0) | (ref_off >= self.units)][0])
                raise MirrorError(f"event row {bad}: offset {int(off[bad])} outside D={self.units}")
            post[ref_rows] = self._post_refcounts(ref_off, delta[ref_rows])

        leaving = _LEAVING[kind]
        last_ref = leaving & (post <= 0)
        revived = (kind == _SHARE) & (post == 1)
        tok_add = _TOKENS_ADD[kind].astype(bool) | revived
        self.tokens_stored += int(tokens[tok_add].sum()) - int(tokens[last_ref].sum())

        write = _STATE_WRITE[kind].copy()
        write[last_ref] = STATE_FREE
        to_cache = last_ref & (kind == _FREE) & ((ev["flags"] & F_TO_CACHE) != 0)
        write[to_cache] = STATE_CACHED
        retain = last_ref & (kind == _EVICT) & (ev["flags"] == _RETAIN)
        write[retain] = STATE_RETAINED
        w = _nonzero(write != _NO_WRITE)
        if w.size:
            w_off = off[w]
            if w_off.min() < 0 or w_off.max() >= self.units:
                bad = int(w[(w_off < 0) | (w_off >= self.units)][0])
                raise MirrorError(f"event row {bad}: offset {int(off[bad])} outside D={self.units}")
            uniq, first_in_reversed = np.unique(w_off[::-1], return_index=True)
            last = w[w.size - 1 - first_in_reversed]
            self.runs.write(uniq, size[last], write[last])

        self._apply_requests(ev, kind, ref_rows, delta)
        evict = kind == _EVICT
        if evict.any():
            self.evicted_tokens_total += int(tokens[evict].sum())
            pairs = np.unique(np.stack([ev["req"][evict], ev["ts_ns"][evict]]), axis=1)
            self.evicted_requests_total += pairs.shape[1]
        step = kind == _STEP
        if step.any():
            self.step_tokens_total += int(size[step].sum())
            self.decode_tokens_total += int(tokens[step].sum())

    def _post_refcounts(self, ref_off: np.ndarray, ref_delta: np.ndarray) -> np.ndarray:
        """Refcount after each reference event: grouped cumulative sums per offset."""
        order = np.argsort(ref_off, kind="stable")
        sorted_off = ref_off[order]
        sorted_delta = ref_delta[order]
        cum = np.cumsum(sorted_delta)
        new_group = np.empty(sorted_off.size, dtype=bool)
        new_group[0] = True
        np.not_equal(sorted_off[1:], sorted_off[:-1], out=new_group[1:])
        starts = _nonzero(new_group)
        group = np.cumsum(new_group) - 1
        offsets = sorted_off[starts]  # each offset once, ascending: the same as sorted_off[ends]
        before, found = self.refcounts.lookup(offsets)
        base = before - (cum[starts] - sorted_delta[starts])
        post_sorted = cum + base[group]
        ends = np.append(starts[1:] - 1, sorted_off.size - 1)
        self.refcounts.set(offsets, np.maximum(post_sorted[ends], 0), found)
        post = np.empty_like(post_sorted)
        post[order] = post_sorted
        return post

    def _apply_requests(self, ev: np.ndarray, kind: np.ndarray, ref_rows: np.ndarray,
                        delta: np.ndarray) -> None:
        # a workspace ALLOC_FAIL names no request (req -1): it must not invent a waiting one; a
        # reference row always gets a slot, since the reference log needs one for every such row
        rows = _nonzero(_HAS_REQ[kind] & ((ev["req"] >= 0) | (delta != 0)))
        if rows.size == 0:
            return
        reqs = ev["req"][rows]
        uniq, first_in_reversed, inverse = np.unique(reqs[::-1], return_index=True, return_inverse=True)
        slots = self._slots_for(uniq)
        last_row = rows[rows.size - 1 - first_in_reversed]
        self._last_ts[slots] = ev["ts_ns"][last_row]
        row_slot = np.empty(ev.size, dtype=np.int64)
        row_slot[rows[::-1]] = slots[inverse]

        life = _LIFE[kind]
        life_rows = _nonzero(life >= 0)
        if life_rows.size:
            life_reqs = row_slot[life_rows]
            u, fr = np.unique(life_reqs[::-1], return_index=True)
            self._life[u] = life[life_rows[life_rows.size - 1 - fr]]
            arrive = life_rows[kind[life_rows] == _ARRIVE]
            if arrive.size:
                s = row_slot[arrive]
                self._priority[s] = ev["cls"][arrive]
                self._prompt[s] = ev["tokens"][arrive]
                self._flags[s] = ev["flags"][arrive]
                self._arrival[s] = ev["ts_ns"][arrive]
        if ref_rows.size:
            self._ref_log_keys.append(row_slot[ref_rows] * self.units + ev["offset"][ref_rows])
            self._ref_log_deltas.append(delta[ref_rows])

    def _slots_for(self, uniq: np.ndarray) -> np.ndarray:
        """Slots of the sorted, unique request ids ``uniq`` (new ones get slots), by binary search
        in a sorted index of known ids, so a batch costs no Python per known request."""
        if self._index_ids is None:
            ids = self._req[:self._n_slots]
            order = np.argsort(ids, kind="stable")
            self._index_ids, self._index_slots = ids[order], order.astype(np.int64)
        ids = self._index_ids
        pos = np.minimum(np.searchsorted(ids, uniq), max(ids.size - 1, 0))
        hit = ids[pos] == uniq if ids.size else np.zeros(uniq.size, dtype=bool)
        slots = np.empty(uniq.size, dtype=np.int64)
        slots[hit] = self._index_slots[pos[hit]]
        missing = _nonzero(~hit)
        if missing.size:
            slots[missing] = [self._slot(r) for r in uniq[missing].tolist()]
        return slots

    def _slot(self, req: int) -> int:
        slot = self._slot_of.get(req)
        if slot is not None:
            return slot
        self._index_ids = None
        slot = self._n_slots
        if slot >= self._req.size:
            self._grow_slots(max(64, 2 * self._req.size))
        self._slot_of[req] = slot
        self._req[slot] = req
        self._priority[slot] = DEFAULT_PRIORITY
        self._prompt[slot] = 0
        self._flags[slot] = 0
        self._arrival[slot] = -1
        self._last_ts[slot] = 0
        self._life[slot] = LIFE_WAITING
        self._n_slots += 1
        return slot

    def _grow_slots(self, capacity: int) -> None:
        def grow(a: np.ndarray) -> np.ndarray:
            out = np.zeros(capacity, dtype=a.dtype)
            out[:a.size] = a
            return out
        self._req, self._priority, self._prompt = grow(self._req), grow(self._priority), grow(self._prompt)
        self._flags = grow(self._flags)
        self._arrival, self._last_ts, self._life = grow(self._arrival), grow(self._last_ts), grow(self._life)

    def _fold_refs(self) -> np.ndarray:
        """Fold the reference log into the sorted key array; returns it."""
        if self._ref_log_keys:
            keys = np.concatenate([self._refs, *self._ref_log_keys])
            deltas = np.concatenate([np.ones(self._refs.size, dtype=np.int64), *self._ref_log_deltas])
            uniq, inverse = np.unique(keys, return_inverse=True)
            net = np.bincount(inverse, weights=deltas, minlength=uniq.size)
            self._refs = uniq[net > 0.5]
            self._ref_log_keys.clear()
            self._ref_log_deltas.clear()
        return self._refs

    def _load_refcounts(self, offsets: np.ndarray, counts: np.ndarray) -> None:
        """Refcounts of a dump (the last of duplicate offsets wins, as a dense write would)."""
        offsets = np.asarray(offsets, dtype=np.int64)
        if offsets.size:
            uniq, first_in_reversed = np.unique(offsets[::-1], return_index=True)
            counts = np.asarray(counts, dtype=np.int64)[offsets.size - 1 - first_in_reversed]
            offsets = uniq
        self.refcounts.load(offsets, counts)

    def _migrate(self, row: np.ndarray) -> None:
        old = int(row["offset"][0])
        new = int(row["aux"][0])
        if not (0 <= old < self.units and 0 <= new < self.units):
            raise MirrorError(f"MIGRATE from {old} to {new} outside D={self.units}")
        if old == new:
            return
        (size,), (state,) = self.runs.get(np.array([old]))
        (refs,) = self.refcounts.get(np.array([old]))
        pair = np.array(sorted((old, new)), dtype=np.int64)
        moved_first = pair[0] == new
        self.runs.write(pair, np.array([size, 0] if moved_first else [0, size]),
                        np.array([state, STATE_FREE] if moved_first else [STATE_FREE, state]))
        self.refcounts.set(pair, np.array([refs, 0] if moved_first else [0, refs]))
        keys = self._fold_refs()
        moved = (keys % self.units) == old
        if moved.any():
            keys = keys.copy()
            keys[moved] += new - old
            self._refs = np.sort(keys)

    def _reset(self) -> None:
        self.allocator.reset()
        self.runs.clear()
        self.refcounts.clear()
        self._refs = np.zeros(0, dtype=np.int64)
        self._ref_log_keys.clear()
        self._ref_log_deltas.clear()
        self.tokens_stored = 0

    def _check_snapshot(self, row: np.ndarray, state: PoolState | None) -> None:
        self.snapshot_checks += 1
        offsets, sizes = self.free_runs()
        mine = free_runs_checksum(offsets, sizes)
        drift = mine != int(row["aux"]) or self.tokens_stored != int(row["tokens"])
        if drift:
            self.drift_count += 1
            log.warning("mirror drift at ts_ns=%d: checksum %d != pool %d, tokens %d != pool %d",
                        int(row["ts_ns"]), mine, int(row["aux"]), self.tokens_stored, int(row["tokens"]))
        if state is not None and (drift or not self.synced):
            self.load_state(state)
        elif drift:
            self.mark_unsynced("snapshot checksum mismatch without a state to resync from")

    # ------------------------------------------------------------------ queries
    def free_runs(self) -> tuple[np.ndarray, np.ndarray]:
        """Maximal free runs (offsets, sizes), sorted by offset (O(occupied runs))."""
        return self.runs.free_runs()

    # D-sized views of the runs and refcounts: for tests and debugging only (they cost O(D))
    @property
    def run_size(self) -> np.ndarray:
        return self.runs.dense()[0]

    @property
    def run_state(self) -> np.ndarray:
        return self.runs.dense()[1]

    @property
    def refcount(self) -> np.ndarray:
        return self.refcounts.dense(self.units)

    @property
    def nbytes(self) -> int:
        """Bytes held by the mirror's arrays (runs, refcounts, references, the request table)."""
        arrays = (self._refs, self._req, self._priority, self._prompt, self._flags, self._arrival, self._last_ts,
                  self._life, self._index_slots, self.kind_counts, *self._ref_log_keys, *self._ref_log_deltas)
        return self.runs.nbytes + self.refcounts.nbytes + sum(a.nbytes for a in arrays)

    def metrics(self) -> MirrorMetrics:
        if self._metrics_cache is not None:
            return self._metrics_cache
        by_state = self.runs.by_state
        live, cached, retained, workspace = (int(by_state[s]) for s in
                                             (STATE_LIVE, STATE_CACHED, STATE_RETAINED, STATE_WORKSPACE))
        free_units = self.units - live - cached - retained - workspace
        largest = self.runs.largest_free_run
        fe = pressure.f_ext(free_units, largest)
        fi = pressure.f_int(self.tokens_stored, live, self.geometry.unit_tokens)
        self._metrics_cache = MirrorMetrics(
            live_units=live, cached_units=cached, retained_units=retained, workspace_units=workspace,
            free_units=free_units, largest_free_run=largest, n_free_runs=self.runs.n_free_runs,
            tokens_stored=self.tokens_stored, u_kv=live / self.units, f_ext=fe, f_int=fi,
            psi=pressure.psi(live, workspace, self.units, fe, fi, self.reserved_frac, self.alpha, self.beta),
        )
        return self._metrics_cache

    def checksum(self) -> int:
        return free_runs_checksum(*self.free_runs())

    def request_table(self) -> RequestTable:
        """Every known request with its pages, units and shared units (computed now)."""
        keys = self._fold_refs()
        n = self._n_slots
        slot = keys // self.units
        offset = keys % self.units
        size, _ = self.runs.get(offset)
        pages = np.bincount(slot, minlength=n)[:n]
        units = np.bincount(slot, weights=size, minlength=n)[:n].astype(np.int64)
        shared = np.bincount(slot, weights=size * (self.refcounts.get(offset) > 1), minlength=n)[:n]
        return RequestTable(
            req=self._req[:n].copy(), pages=pages, units=units, shared_units=shared.astype(np.int64),
            priority=self._priority[:n].copy(), prompt_tokens=self._prompt[:n].copy(),
            arrival_ns=self._arrival[:n].copy(), last_ts_ns=self._last_ts[:n].copy(),
            running=self._life[:n] == LIFE_RUNNING, waiting=self._life[:n] == LIFE_WAITING,
            arrive_flags=self._flags[:n].copy(),
        )

    def request_pages(self, req: int) -> int:
        slot = self._slot_of.get(int(req))
        if slot is None:
            return 0
        keys = self._fold_refs()
        return int(np.count_nonzero(keys // self.units == slot))

    def forget_finished(self) -> int:
        """Drop finished requests that hold no page (keeps the request table bounded); returns how many."""
        table = self.request_table()
        dead = (self._life[:self._n_slots] == LIFE_FINISHED) & (table.pages == 0)
        if not dead.any():
            return 0
        keep = _nonzero(~dead)
        remap = np.full(self._n_slots, -1, dtype=np.int64)
        remap[keep] = np.arange(keep.size)
        keys = self._refs
        self._refs = np.sort(remap[keys // self.units] * self.units + keys % self.units)
        for name in ("_req", "_priority", "_prompt", "_flags", "_arrival", "_last_ts", "_life"):
            arr = getattr(self, name)
            fresh = np.zeros_like(arr)
            fresh[:keep.size] = arr[keep]
            setattr(self, name, fresh)
        self._n_slots = int(keep.size)
        self._index_ids = None
        self._slot_of = {int(r): i for i, r in enumerate(self._req[:keep.size].tolist())}
        return int(dead.sum())

    # ------------------------------------------------------------------ persistence
    def state_arrays(self) -> dict[str, np.ndarray]:
        """Everything needed to rebuild this mirror, as compact arrays (see ``from_state_arrays``)."""
        keys = self._fold_refs()
        occ = self.runs.off
        n = self._n_slots
        scalars = np.array([self.tokens_stored, int(self.synced), self.drift_count, self.resync_count,
                            self.unsynced_count, self.snapshot_checks, self.step_tokens_total,
                            self.decode_tokens_total, self.evicted_tokens_total,
                            self.evicted_requests_total,
                            -1 if self.last_ts_ns is None else self.last_ts_ns], dtype=np.int64)
        return {
            "run_offset": occ.astype(np.int64), "run_size": self.runs.size.astype(np.int64),
            "run_state": self.runs.state.copy(), "run_refcount": self.refcounts.get(occ),
            "ref_req": self._req[keys // self.units], "ref_offset": keys % self.units,
            "req": self._req[:n], "req_priority": self._priority[:n], "req_prompt": self._prompt[:n],
            "req_flags": self._flags[:n],
            "req_arrival": self._arrival[:n], "req_last_ts": self._last_ts[:n], "req_life": self._life[:n],
            "kind_counts": self.kind_counts.copy(), "scalars": scalars,
            "never_fits": np.array([self.never_fits_total], dtype=np.int64),
            "allocator": np.frombuffer(json.dumps(self.allocator.to_dict()).encode(), dtype=np.uint8),
        }

    @classmethod
    def from_state_arrays(cls, geometry: Geometry, arrays: dict[str, np.ndarray], **kwargs) -> "AllocatorMirror":
        m = cls(geometry, **kwargs)
        off = arrays["run_offset"]
        m.runs.load(off, arrays["run_size"], arrays["run_state"])
        m._load_refcounts(off, arrays["run_refcount"])
        for r in arrays["req"].tolist():
            m._slot(int(r))
        n = m._n_slots
        m._priority[:n] = arrays["req_priority"]
        m._prompt[:n] = arrays["req_prompt"]
        if "req_flags" in arrays:  # checkpoints written before the field keep 0
            m._flags[:n] = arrays["req_flags"]
        m._arrival[:n] = arrays["req_arrival"]
        m._last_ts[:n] = arrays["req_last_ts"]
        m._life[:n] = arrays["req_life"]
        slots = np.fromiter((m._slot(int(r)) for r in arrays["ref_req"].tolist()), dtype=np.int64,
                            count=arrays["ref_req"].size)
        m._refs = np.sort(slots * m.units + arrays["ref_offset"])
        m.kind_counts[:] = arrays["kind_counts"]
        if "never_fits" in arrays:  # checkpoints written before the step governor keep 0
            m.never_fits_total = int(arrays["never_fits"][0])
        if "allocator" in arrays:  # checkpoints from before the allocator layer have none
            m.allocator = AllocatorLayer.from_dict(json.loads(arrays["allocator"].tobytes().decode()))
        (m.tokens_stored, synced, m.drift_count, m.resync_count, m.unsynced_count, m.snapshot_checks,
         m.step_tokens_total, m.decode_tokens_total, m.evicted_tokens_total, m.evicted_requests_total,
         last_ts) = (int(x) for x in arrays["scalars"])
        m.synced = bool(synced)
        m.last_ts_ns = None if last_ts < 0 else last_ts
        return m
