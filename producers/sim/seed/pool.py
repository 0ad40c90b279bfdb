"""PagedPool: the paged KV pool of one GPU (docs/ARCHITECTURE.md, "Node side"), recording allocator events (docs/ARCHITECTURE.md, "Metrics").

The dynamic region D (``geometry.dynamic_units`` units of ``unit_tokens`` tokens) is one arena
shared by KV pages and per-step workspace buffers, managed by a contiguous free-run allocator
with coalescing (``producers.sim.seed.free_runs``). A page of class c (``geometry.page_classes[i]`` = c
units, a power of two) occupies c contiguous units aligned to c; a workspace buffer is a run of
any length. So external fragmentation is real: a large page or a workspace buffer can fail while
the total free space would suffice.

Which class a request's pages use (this is what mixes page sizes): tokens are appended in order,
first into the free room of the request's last page; then, at each position that is a multiple of
the *block* (the largest class, in tokens) with at least a block of new tokens left in this call,
one largest-class page is used; every other token goes into smallest-class pages. So a prompt
prefilled in one call gets large pages for its full blocks and small pages for its tail, and
decode growth (a token at a time) always uses small pages. With a single class every page is of
that class. Large pages are always full; only they (or, with one class, pages that start on a
block) can carry a block hash.

Prefix sharing: ``grow(..., block_hashes=)`` gives one hash per block of the request's prompt
(block i = tokens [i*B, (i+1)*B), B = ``block_tokens``). Hashes are chained (the key of block i
mixes the key of block i-1), so only identical leading chains share. A full page whose chain key
is registered is shared (SHARE) instead of allocated; a shared page keeps one physical copy and a
list of holders (its reference count). When the last holder releases a registered page it becomes
cached (LRU, FREE with F_TO_CACHE) until ``reclaim_cached`` drops it (RECLAIM) or a request with
the same chain revives it (SHARE). Unhashed pages are freed. Pass ``block_hashes`` on every grow of
a prompt: it is compared by identity first, so that is cheap.

Policy actions: ``evict`` takes live pages from a request (all, the last n, or given offsets)
with a ``Handling``: RECOMPUTE frees them, SWAP copies them to bounded host swap, CHECKPOINT writes
the page set to the checkpoint store (one small JSON file per evict call in ``checkpoint_dir``, or a
dict when it is None), RETAIN keeps their units occupied as *retained* for ``retain_ttl_ns``.
Evicted entries stay in the request's page table as placeholders, so ``swap_in`` (swapped *and*
checkpointed pages, SWAP_IN rows) and ``remap`` (retained pages, REMAP rows) restore them in place.
A page another request still holds stays live; evicting it only drops this request's reference.
``expire`` frees retained pages past their TTL (EXPIRE). ``migrate`` moves one page (live, cached
or retained) into the best-fitting hole away from it when that leaves fewer free runs, or as many
with the free space more concentrated (MIGRATE; state unchanged); ``compact`` grows the longest free runs by migrating
the pages that border them, longest run first.

Check, then act: every refusal (``PoolExhausted``, ``SwapFull``, ``UnknownRequest``,
``UnknownPage``, ``UnknownWorkspace``, ``CheckpointMissing``) leaves the pool as it was. A grow
that needs several pages places all of them before committing any, and rolls the placements back
on failure (a free-run set is a function of the free units, so the rollback is exact).

Events follow the kvguard/events.py contract. Column conventions for "-": ``req`` = -1, numbers 0.
Token writes into already allocated pages accumulate into one pending FILL row, which is flushed
before any other event is recorded (and by ``take_events``/``snapshot``), so a mirror replaying the
rows is exact after every row. A failed ``grow``/``swap_in``/``alloc_workspace`` records an
ALLOC_FAIL row (``record_failure=False`` to skip); ``can_grow`` records nothing. The pool never
reads a clock (``now_ns`` is an argument) and never publishes.

Additions to the CONTRACTS.md API: ``block_tokens``; ``can_grow(..., block_hashes=)``;
``units_needed``; ``alloc_workspace(..., tokens=)``; ``record_failure=`` keywords;
``record_event`` (lifecycle rows from the engine: ARRIVE, ADMIT, FINISH, PREEMPT, OOM, STEP,
ALLOC_FAIL, so one ordered stream per node); ``request_tokens``, ``request_units``,
``has_request``, ``requests``; ``utilization_split``; ``swap_used_units``, ``live_units``,
``cached_units``, ``retained_units``, ``workspace_units``, ``tokens_stored``, ``free_units``,
``largest_free_run`` (cheap attributes for hot paths; ``metrics()`` computes the floats);
``page_at``; ``compact(..., runs_per_move=)``; ``grow_many`` (one step's decode growth in one call).

Speed: the simulator's hot work is single-unit small pages (a decode page per few tokens, freed
when its request ends). ``grow``/``grow_many`` place them without a plan (``_grow_small``: best fit
for one unit is the allocator's first free run), ``release`` frees a request's unshared unhashed
pages inline, and rows are packed into a byte buffer laid out as EVENT_DTYPE, so ``take_events``
is one copy. Same state and rows as the general paths (tests/unit/producers/sim/seed/test_pool_perf_paths.py).
``release`` of an unknown request returns 0 (idempotent); other request actions raise.
A retained or swapped entry still in the table when its request is released is dropped then
(retained units: EXPIRE rows). ``reset`` drops everything, swap and checkpoints included.
"""

from __future__ import annotations

import heapq
import json
import os
import struct
from collections import OrderedDict
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from kvguard.contracts import pressure
from kvguard.contracts.events import (
    EVENT_DTYPE,
    F_TO_CACHE,
    EventKind,
    Geometry,
    Handling,
    PoolState,
    RegionState,
    empty_events,
    free_runs_checksum,
)
from kvguard.contracts.pool_types import (
    CheckpointMissing,
    EvictResult,
    PageInfo,
    PageState,
    PoolError,
    PoolExhausted,
    PoolMetrics,
    SwapFull,
    UnknownPage,
    UnknownRequest,
    UnknownWorkspace,
    UtilizationSplit,
)
from kvguard.producers.sim.seed.free_runs import FreeRunAllocator

__all__ = ["PagedPool", "PoolError", "PoolExhausted", "SwapFull", "UnknownRequest", "UnknownPage",
           "UnknownWorkspace", "CheckpointMissing", "EvictResult", "PageInfo", "PageState", "PoolMetrics",
           "UtilizationSplit", "Handling"]

_ALLOC, _SHARE, _FREE, _FILL = int(EventKind.ALLOC), int(EventKind.SHARE), int(EventKind.FREE), int(EventKind.FILL)
_RECLAIM, _EVICT, _SWAP_IN = int(EventKind.RECLAIM), int(EventKind.EVICT), int(EventKind.SWAP_IN)
_REMAP, _EXPIRE, _MIGRATE = int(EventKind.REMAP), int(EventKind.EXPIRE), int(EventKind.MIGRATE)
_WS_ALLOC, _WS_FREE, _ALLOC_FAIL = int(EventKind.WS_ALLOC), int(EventKind.WS_FREE), int(EventKind.ALLOC_FAIL)
_RESET, _SNAPSHOT = int(EventKind.RESET), int(EventKind.SNAPSHOT)
_LIFECYCLE_KINDS = frozenset(int(k) for k in (EventKind.ARRIVE, EventKind.ADMIT, EventKind.FINISH,
                                              EventKind.PREEMPT, EventKind.OOM, EventKind.STEP,
                                              EventKind.ALLOC_FAIL))
_LIVE, _CACHED, _RETAINED, _FREED = PageState.LIVE, PageState.CACHED, PageState.RETAINED, PageState.FREED
_EVICTED_STATE = {Handling.RECOMPUTE: PageState.DROPPED, Handling.SWAP: PageState.SWAPPED,
                  Handling.CHECKPOINT: PageState.CHECKPOINTED, Handling.RETAIN: PageState.RETAINED}
_MASK64 = (1 << 64) - 1
# One event row packed little-endian with no padding: the memory layout of EVENT_DTYPE, so the
# recorded bytes are the array (np.frombuffer) with no per-row conversion and no tuple per row.
_STRUCT_CODE = {"<i8": "q", "|u1": "B"}


def _row_struct() -> struct.Struct:
    codes = [_STRUCT_CODE.get(EVENT_DTYPE.fields[name][0].str) for name in EVENT_DTYPE.names]
    row = struct.Struct("<" + "".join(code or "?" for code in codes))
    offsets = [struct.calcsize("<" + "".join(codes[:i])) for i in range(len(codes))] if all(codes) else []
    if row.size != EVENT_DTYPE.itemsize or offsets != [EVENT_DTYPE.fields[n][1] for n in EVENT_DTYPE.names]:
        raise TypeError(f"kvguard.contracts.events.EVENT_DTYPE {EVENT_DTYPE}: producers.sim.seed.pool packs rows as {row.format!r}; "
                        f"update _STRUCT_CODE for the new layout")
    return row


_ROW = _row_struct()
_pack_row = _ROW.pack


def _chain_key(parent: int, block_hash) -> int:
    """Key of a block given its parent's key: a bijective 64-bit mix, so equal chains give equal
    keys and, for a given parent, different hashes give different keys."""
    h = block_hash if type(block_hash) is int else hash(block_hash)
    x = (((parent ^ h) & _MASK64) * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & _MASK64
    x ^= x >> 31
    return (x * 0xBF58476D1CE4E5B9) & _MASK64


class _Page:
    """A physical page. ``holders`` lists the requests using it (its reference count)."""

    __slots__ = ("offset", "size", "cls", "tokens", "state", "holders", "key", "registered", "owner",
                 "expires_ns")

    def __init__(self, offset: int, size: int, cls: int, tokens: int, key: int | None, req: int):
        self.offset = offset
        self.size = size
        self.cls = cls
        self.tokens = tokens
        self.state = _LIVE
        self.holders = [req]
        self.key = key
        self.registered = False
        self.owner = -1  # the request a retained page is kept for
        self.expires_ns = 0


class _Evicted:
    """A page-table entry whose page was evicted; ``page`` is the retained (or still shared)
    page for RETAIN, ``ckpt`` the checkpoint id for CHECKPOINT."""

    __slots__ = ("size", "cls", "tokens", "key", "state", "page", "ckpt")

    def __init__(self, page: _Page, state: PageState, ckpt: int):
        self.size, self.cls, self.tokens, self.key = page.size, page.cls, page.tokens, page.key
        self.state = state
        self.page = page if state == _RETAINED else None
        self.ckpt = ckpt


class _Table:
    """A request's page table: entries in token order, ``n_tokens`` counts every entry's tokens."""

    __slots__ = ("entries", "n_tokens", "hashes", "keys")

    def __init__(self):
        self.entries: list[_Page | _Evicted] = []
        self.n_tokens = 0
        self.hashes: Sequence = ()
        self.keys: list[int] = []


class CheckpointStore:
    """Evicted page sets by id: one small JSON file each under ``directory``, or a dict when None."""

    def __init__(self, directory: str | os.PathLike | None, node: str):
        self.directory = Path(directory) if directory is not None else None
        self._prefix = "".join(ch if ch.isalnum() else "_" for ch in node) or "node"
        self._mem: dict[int, dict] = {}
        self._ids: set[int] = set()
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)

    def path(self, ckpt_id: int) -> Path | None:
        return None if self.directory is None else self.directory / f"{self._prefix}-ckpt{ckpt_id}.json"

    def put(self, ckpt_id: int, payload: dict) -> None:
        if self.directory is None:
            self._mem[ckpt_id] = payload
        else:
            path = self.path(ckpt_id)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(payload))
            tmp.replace(path)
        self._ids.add(ckpt_id)

    def check(self, ckpt_id: int, req: int) -> None:
        """Raise CheckpointMissing unless the set is readable and is the request's."""
        if self.directory is None:
            payload = self._mem.get(ckpt_id)
            where = f"memory:{ckpt_id}"
        else:
            where = str(self.path(ckpt_id))
            try:
                payload = json.loads(self.path(ckpt_id).read_text())
            except (OSError, ValueError):
                payload = None
        if payload is None or payload.get("req") != req:
            raise CheckpointMissing(req, where)

    def delete(self, ckpt_id: int) -> None:
        self._ids.discard(ckpt_id)
        if self.directory is None:
            self._mem.pop(ckpt_id, None)
        else:
            try:
                self.path(ckpt_id).unlink()
            except FileNotFoundError:
                pass

    def clear(self) -> None:
        for ckpt_id in list(self._ids):
            self.delete(ckpt_id)


class PagedPool:
    """The paged KV pool of one GPU. See the module docstring for the rules."""

    def __init__(self, geometry: Geometry, *, node: str = "", swap_capacity_units: int = 0,
                 checkpoint_dir: str | os.PathLike | None = None, retain_ttl_ns: int = 60_000_000_000,
                 fit: str = "best"):
        classes = tuple(geometry.page_classes)
        if not classes or any(c <= 0 or c & (c - 1) for c in classes) or list(classes) != sorted(set(classes)):
            raise ValueError(f"geometry.page_classes: expected ascending distinct powers of two, got {classes!r}")
        if geometry.dynamic_units < classes[-1]:
            raise ValueError(f"geometry.dynamic_units: {geometry.dynamic_units} is smaller than the largest "
                             f"page class {classes[-1]}")
        if geometry.unit_tokens <= 0:
            raise ValueError(f"geometry.unit_tokens: expected a positive integer, got {geometry.unit_tokens!r}")
        if swap_capacity_units < 0:
            raise ValueError(f"swap_capacity_units: expected >= 0, got {swap_capacity_units!r}")
        if retain_ttl_ns < 0:
            raise ValueError(f"retain_ttl_ns: expected >= 0, got {retain_ttl_ns!r}")
        self.geometry = geometry
        self.node = node
        self.swap_capacity_units = swap_capacity_units
        self.retain_ttl_ns = retain_ttl_ns
        self.dynamic_units = geometry.dynamic_units
        self.unit_tokens = geometry.unit_tokens
        self.page_classes = classes
        self.block_tokens = classes[-1] * geometry.unit_tokens
        self._large_cls = len(classes) - 1
        self._small_tokens = classes[0] * geometry.unit_tokens
        # single-unit small pages with best fit: ``grow`` places them without a plan (_grow_small)
        self._unit_pages = classes[0] == 1 and fit == "best"
        self._alloc = FreeRunAllocator(geometry.dynamic_units, fit)
        self._store = CheckpointStore(checkpoint_dir, node)
        self._rows = bytearray()  # recorded rows, packed as EVENT_DTYPE (see _pack_row)
        self._pending_fill = 0
        self._pending_fill_ts = 0
        self._next_ckpt = 0
        self._clear_state()

    def _clear_state(self) -> None:
        self._tables: dict[int, _Table] = {}
        self._pages: dict[int, _Page] = {}  # offset -> page, for pages occupying units
        self._page_end: dict[int, _Page] = {}  # end offset -> page
        self._by_key: dict[int, _Page] = {}  # chain key -> registered (live or cached) page
        self._lru: OrderedDict[_Page, None] = OrderedDict()  # cached pages, oldest first
        self._retained: list[tuple[int, int, _Page]] = []  # heap (expires_ns, seq, page), lazy deletes
        self._retain_seq = 0
        self._workspace: dict[int, int] = {}  # offset -> units
        self._ckpt_refs: dict[int, int] = {}  # checkpoint id -> entries still pointing at it
        self.live_units = 0
        self.cached_units = 0
        self.retained_units = 0
        self.workspace_units = 0
        self.tokens_stored = 0
        self.swap_used_units = 0

    # ======================================================================= events
    def _emit(self, ts: int, kind: int, cls: int = 0, flags: int = 0, req: int = -1, offset: int = 0,
              size: int = 0, tokens: int = 0, aux: int = 0) -> None:
        if self._pending_fill:
            self._flush_fill()
        self._rows += _pack_row(ts, kind, cls, flags, req, offset, size, tokens, aux)

    def _flush_fill(self) -> None:
        self._rows += _pack_row(self._pending_fill_ts, _FILL, 0, 0, -1, 0, 0, self._pending_fill, 0)
        self._pending_fill = 0

    def take_events(self) -> np.ndarray:
        """All rows recorded since the last call, in order, as EVENT_DTYPE; clears them."""
        if self._pending_fill:
            self._flush_fill()
        if not self._rows:
            return empty_events(0)
        out = np.frombuffer(self._rows, dtype=EVENT_DTYPE).copy()
        self._rows = bytearray()
        return out

    def record_event(self, kind: EventKind | int, now_ns: int, *, req: int = -1, cls: int = 0, flags: int = 0,
                     offset: int = 0, size: int = 0, tokens: int = 0, aux: int = 0) -> None:
        """Record a lifecycle row (ARRIVE, ADMIT, FINISH, PREEMPT, OOM, STEP, ALLOC_FAIL) in order
        with the pool's own rows. Memory rows are the pool's alone: they would desync a mirror."""
        if int(kind) not in _LIFECYCLE_KINDS:
            raise ValueError(f"record_event: kind {EventKind(kind).name} changes memory; only "
                             f"{sorted(EventKind(k).name for k in _LIFECYCLE_KINDS)} may be recorded")
        try:
            row = _pack_row(now_ns, int(kind), cls, flags, req, offset, size, tokens, aux)
        except struct.error as e:
            raise ValueError(f"record_event: {EventKind(kind).name} row does not fit EVENT_DTYPE (cls and flags "
                             f"0-255, the rest int64): {e}") from None
        if self._pending_fill:
            self._flush_fill()
        self._rows += row

    # ======================================================================= request memory
    def grow(self, req: int, n_tokens: int, now_ns: int, block_hashes: Sequence = (), *,
             record_failure: bool = True) -> None:
        """Append ``n_tokens`` tokens to ``req``, allocating or sharing pages as needed.

        Raises PoolExhausted (state unchanged; an ALLOC_FAIL row unless ``record_failure=False``).
        """
        if n_tokens <= 0:
            if n_tokens < 0:
                raise ValueError(f"n_tokens: expected >= 0, got {n_tokens}")
            return
        table = self._tables.get(req)
        fresh = table is None
        if fresh:
            table = _Table()
        if block_hashes:
            self._set_hashes(table, block_hashes)
        last = table.entries[-1] if table.entries else None
        fill = 0
        if last is not None and type(last) is _Page:
            fill = min(last.size * self.unit_tokens - last.tokens, n_tokens)
        if fill == n_tokens:
            self._fill(table, last, fill, now_ns)
            return
        pos, rest = table.n_tokens + fill, n_tokens - fill
        if self._unit_pages and pos % self._small_tokens == 0:
            block = self.block_tokens
            if self._large_cls:  # no large page: no block boundary with a whole block after it
                simple = pos + rest < -(-pos // block) * block + block
            else:  # every page starts on a block: none may have a hash
                simple = pos // block >= len(table.hashes)
            if simple and -(-rest // self._small_tokens) <= self._alloc.free_units:
                if fresh:
                    self._tables[req] = table
                if fill:
                    self._fill(table, last, fill, now_ns)
                self._grow_small(table, req, rest, now_ns)
                return
        plan = self._plan(table, pos, rest)
        offsets = self._place_all(plan)
        if offsets is None:
            self._refuse(req, plan, now_ns, record_failure, "pages")
        if fresh:
            self._tables[req] = table
        if fill:
            self._fill(table, last, fill, now_ns)
        entries, pages, page_end, classes = table.entries, self._pages, self._page_end, self.page_classes
        unit = self.unit_tokens
        for (cls, tokens, key, shared), offset in zip(plan, offsets):
            if shared is not None:
                page = self._share(shared, req, now_ns)
            else:  # _new_live_page inlined
                size = classes[cls]
                page = _Page(offset, size, cls, tokens, key, req)
                pages[offset] = page
                page_end[offset + size] = page
                self.live_units += size
                self.tokens_stored += tokens
                if key is not None and tokens == size * unit:
                    self._register(page)
                if self._pending_fill:
                    self._flush_fill()
                self._rows += _pack_row(now_ns, _ALLOC, cls, 0, req, offset, size, tokens, 0)
            entries.append(page)
            table.n_tokens += tokens

    def _grow_small(self, table: _Table, req: int, rest: int, now_ns: int) -> None:
        """The common case of ``grow`` (decode growth, prompt tails): ``rest`` tokens into new
        unhashed single-unit small pages, enough free units known to be there. Same pages, offsets
        and rows as the general path (``_plan`` + ``_place_all`` + ``_new_live_page``), inlined."""
        small = self._small_tokens
        total = rest
        n = -(-rest // small)
        if self._pending_fill:
            self._flush_fill()
        pages, page_end, entries = self._pages, self._page_end, table.entries
        rows = self._rows
        for offset in self._alloc.take_units(n):
            tokens = small if rest > small else rest
            rest -= tokens
            page = _Page(offset, 1, 0, tokens, None, req)
            pages[offset] = page
            page_end[offset + 1] = page
            entries.append(page)
            rows += _pack_row(now_ns, _ALLOC, 0, 0, req, offset, 1, tokens, 0)
        self.live_units += n
        table.n_tokens += total
        self.tokens_stored += total

    def grow_many(self, reqs: Sequence[int], n_tokens: Sequence[int], now_ns: int,
                  block_hashes: Sequence[Sequence] | None = None) -> int:
        """``grow(reqs[i], n_tokens[i], now_ns, block_hashes[i])`` for i = 0, 1, ... in order (one
        engine step's decode growth in one call), while each grow is the simple kind: the request
        already has pages, and its new tokens fit the free room of its last page plus new
        single-unit, unhashed small pages that the free units can hold (so nothing is shared or
        revived, and ``free_units`` drops by exactly the new pages). Stops before the first grow
        that is not: that one and the rest are left untouched, nothing recorded for them (grow
        them one by one). Returns how many grew. Same state and rows as the single grows."""
        for n in n_tokens:
            if n < 0:
                raise ValueError(f"n_tokens: expected >= 0, got {n}")
        if not self._unit_pages:
            return 0
        tables, alloc = self._tables, self._alloc
        unit, small, block, large = self.unit_tokens, self._small_tokens, self.block_tokens, self._large_cls
        for i, req in enumerate(reqs):
            n = n_tokens[i]
            if n == 0:
                continue
            table = tables.get(req)
            if table is None:
                return i
            if block_hashes is not None and block_hashes[i]:
                self._set_hashes(table, block_hashes[i])
            last = table.entries[-1] if table.entries else None
            fill = 0
            if type(last) is _Page:
                fill = last.size * unit - last.tokens
                if fill > n:
                    fill = n
            pos, rest = table.n_tokens + fill, n - fill
            if rest:
                if pos % small:
                    return i
                if large:
                    if pos + rest >= -(-pos // block) * block + block:
                        return i
                elif pos // block < len(table.hashes):
                    return i
                if -(-rest // small) > alloc.free_units:
                    return i
            if fill:  # _fill inlined
                last.tokens += fill
                table.n_tokens += fill
                self.tokens_stored += fill
                self._pending_fill += fill
                self._pending_fill_ts = now_ns
                if last.key is not None and last.tokens == last.size * unit:
                    self._register(last)
            if rest:
                self._grow_small(table, req, rest, now_ns)
        return len(reqs)

    def can_grow(self, req: int, n_tokens: int, block_hashes: Sequence = ()) -> bool:
        """Whether ``grow(req, n_tokens, block_hashes=...)`` would succeed now. Records nothing."""
        plan = self._plan_for(req, n_tokens, block_hashes)
        if not plan:
            return True
        offsets = self._place_all(plan)
        if offsets is None:
            return False
        self._unplace(plan, offsets)
        return True

    def units_needed(self, req: int, n_tokens: int, block_hashes: Sequence = ()) -> int:
        """Units of new pages ``grow`` would allocate (shared/revived pages cost none)."""
        table = self._tables.get(req)
        if self._unit_pages and not block_hashes and (table is None or not table.hashes) and n_tokens > 0:
            # no hash anywhere: nothing is shared, so count the pages of _plan without making it
            fill = 0
            if table is not None and table.entries and type(table.entries[-1]) is _Page:
                last = table.entries[-1]
                fill = min(last.size * self.unit_tokens - last.tokens, n_tokens)
            pos = 0 if table is None else table.n_tokens + fill
            return self._plan_units(pos, n_tokens - fill)
        return sum(self.page_classes[cls] for cls, _, _, shared in self._plan_for(req, n_tokens, block_hashes)
                   if shared is None)

    def _plan_units(self, pos: int, rest: int) -> int:
        """Units of the pages ``_plan(table, pos, rest)`` makes when nothing is shared: small pages
        up to the next block boundary, then one large page per whole block, then small pages.
        Small pages that start off the small-page grid never reach a block boundary."""
        if rest <= 0:
            return 0
        small, block = self._small_tokens, self.block_tokens
        classes = self.page_classes
        if not self._large_cls or pos % small:
            return -(-rest // small) * classes[0]
        head = min(rest, -pos % block)
        large, tail = divmod(rest - head, block)
        return (-(-head // small) + -(-tail // small)) * classes[0] + large * classes[-1]

    def release(self, req: int, now_ns: int, cache_prefix: bool = True) -> int:
        """Drop every page of ``req`` (tail first, so the LRU reclaims tails before heads).
        Returns the units that became free; 0 for an unknown request."""
        table = self._tables.pop(req, None)
        if table is None:
            return 0
        # The common page (held by req alone, unhashed) is freed inline: the same rows and free
        # runs as ``_drop_ref``, its units returned with one ``free_many`` call (best fit only:
        # no list of starts to keep).
        freed = tokens = units = 0
        pages, page_end = self._pages, self._page_end
        alloc = self._alloc
        inline = alloc.fit == "best"
        rows = self._rows  # appended in place: the same buffer _emit writes to
        blocks: list[tuple[int, int]] = []  # freed in one call after the loop: coalescing is order-free
        for entry in reversed(table.entries):
            if type(entry) is _Page:
                holders = entry.holders
                if inline and entry.key is None and len(holders) == 1 and holders[0] == req:
                    start, size, n = entry.offset, entry.size, entry.tokens
                    holders.clear()
                    entry.state = _FREED
                    del pages[start]
                    end = start + size
                    del page_end[end]
                    units += size
                    tokens += n
                    if self._pending_fill:
                        self._flush_fill()
                    rows += _pack_row(now_ns, _FREE, entry.cls, 0, req, start, size, n, 0)
                    blocks.append((start, size))
                else:
                    freed += self._drop_ref(entry, req, now_ns, cache_prefix)
            else:
                freed += self._discard_evicted(entry, req, now_ns)
        if units:
            alloc.free_many(blocks)
            self.live_units -= units
            self.tokens_stored -= tokens
        return freed + units

    def reclaim_cached(self, units_needed: int, now_ns: int) -> int:
        """Drop least recently used cached pages until ``units_needed`` units are freed (or none
        is left). Returns the units freed."""
        freed = 0
        while freed < units_needed and self._lru:
            page, _ = self._lru.popitem(last=False)
            self._unregister(page)
            self.cached_units -= page.size
            self._release_units(page)
            self._emit(now_ns, _RECLAIM, page.cls, 0, -1, page.offset, page.size, page.tokens)
            freed += page.size
        return freed

    # ======================================================================= workspace
    def alloc_workspace(self, units: int, now_ns: int, tokens: int = 0, *, record_failure: bool = True) -> int:
        """A contiguous workspace buffer of ``units`` units; returns its offset."""
        if units <= 0:
            raise ValueError(f"units: expected a positive integer, got {units}")
        offset = self._alloc.alloc(units)
        if offset is None:
            largest = self._alloc.largest
            if record_failure:
                self._emit(now_ns, _ALLOC_FAIL, 0, 0, -1, 0, units, 0, largest)
            raise PoolExhausted(units, largest, self._alloc.free_units, "workspace")
        self._workspace[offset] = units
        self.workspace_units += units
        self._emit(now_ns, _WS_ALLOC, 0, 0, -1, offset, units, tokens)
        return offset

    def free_workspace(self, offset: int, now_ns: int) -> None:
        units = self._workspace.pop(offset, None)
        if units is None:
            raise UnknownWorkspace(offset)
        self.workspace_units -= units
        self._alloc.free(offset, units)
        self._emit(now_ns, _WS_FREE, 0, 0, -1, offset, units)

    # ======================================================================= policy actions
    def evict(self, req: int, now_ns: int, *, pages: int | Iterable[int] | None = None,
              handling: Handling = Handling.RECOMPUTE) -> EvictResult:
        """Take live pages from ``req``: all (None), the last ``pages`` live ones (int), or the
        pages at the given offsets. Raises UnknownRequest, UnknownPage, SwapFull (nothing done)."""
        handling = Handling(handling)
        table = self._tables.get(req)
        if table is None:
            raise UnknownRequest(req)
        chosen = self._choose(table, req, pages)
        units = sum(table.entries[i].size for i in chosen)
        if handling == Handling.SWAP and self.swap_used_units + units > self.swap_capacity_units:
            raise SwapFull(units, self.swap_capacity_units - self.swap_used_units)
        ckpt = -1
        if handling == Handling.CHECKPOINT and chosen:
            ckpt = self._checkpoint(table, req, chosen, now_ns)
        freed = retained = tokens = shared = 0
        state = _EVICTED_STATE[handling]
        for i in reversed(chosen):
            page = table.entries[i]
            tokens += page.tokens
            self._emit(now_ns, _EVICT, page.cls, int(handling), req, page.offset, page.size, page.tokens)
            page.holders.remove(req)
            if page.holders:
                shared += 1
            else:
                self._unregister(page)
                self.live_units -= page.size
                self.tokens_stored -= page.tokens
                if handling == Handling.RETAIN:
                    self._retain(page, req, now_ns)
                    retained += page.size
                else:
                    self._release_units(page)
                    freed += page.size
            table.entries[i] = _Evicted(page, state, ckpt)
        if handling == Handling.SWAP:
            self.swap_used_units += units
        self._trim(table, req)
        return EvictResult(req, handling, len(chosen), freed, retained, tokens,
                           units if handling == Handling.SWAP else 0, shared)

    def swap_in(self, req: int, now_ns: int, *, record_failure: bool = True) -> int:
        """Give new live pages to the swapped and checkpointed entries of ``req`` (SWAP_IN rows).
        Returns the units allocated. Raises UnknownRequest, CheckpointMissing, PoolExhausted."""
        table = self._tables.get(req)
        if table is None:
            raise UnknownRequest(req)
        chosen = [i for i, e in enumerate(table.entries)
                  if type(e) is _Evicted and e.state in (PageState.SWAPPED, PageState.CHECKPOINTED)]
        if not chosen:
            return 0
        for ckpt in {table.entries[i].ckpt for i in chosen if table.entries[i].state == PageState.CHECKPOINTED}:
            self._store.check(ckpt, req)
        plan = [(table.entries[i].cls, table.entries[i].tokens, table.entries[i].key, None) for i in chosen]
        offsets = self._place_all(plan)
        if offsets is None:
            self._refuse(req, plan, now_ns, record_failure, "swap-in pages")
        units = 0
        for i, offset in zip(chosen, offsets):
            entry = table.entries[i]
            table.entries[i] = self._new_live_page(offset, entry.cls, entry.tokens, entry.key, req, now_ns, _SWAP_IN)
            units += entry.size
            if entry.state == PageState.SWAPPED:
                self.swap_used_units -= entry.size
            else:
                self._drop_ckpt_ref(entry.ckpt)
        return units

    def remap(self, req: int, now_ns: int) -> bool:
        """Make the retained entries of ``req`` live again (REMAP; a page other requests kept
        live or cached is shared back: SHARE). True when it had retained entries and none was lost
        (expired); lost ones become dropped entries to recompute."""
        table = self._tables.get(req)
        if table is None:
            raise UnknownRequest(req)
        chosen = [i for i, e in enumerate(table.entries) if type(e) is _Evicted and e.state == _RETAINED]
        complete = bool(chosen)
        for i in chosen:
            entry = table.entries[i]
            page = entry.page
            if page.state == _RETAINED and page.owner == req:
                self.retained_units -= page.size
                self.live_units += page.size
                self.tokens_stored += page.tokens
                page.state, page.holders, page.owner = _LIVE, [req], -1
                self._register(page)
                self._emit(now_ns, _REMAP, page.cls, 0, req, page.offset, page.size, page.tokens)
                table.entries[i] = page
            elif page.state in (_LIVE, _CACHED) and req not in page.holders and page.owner != req:
                table.entries[i] = self._share(page, req, now_ns)
            else:
                entry.state, entry.page = PageState.DROPPED, None
                complete = False
        self._trim(table, req)
        return complete

    def expire(self, now_ns: int) -> int:
        """Free retained pages whose TTL ran out by ``now_ns`` (EXPIRE). Returns units freed."""
        freed = 0
        heap = self._retained
        while heap and heap[0][0] <= now_ns:
            expires_ns, _, page = heapq.heappop(heap)
            if page.state == _RETAINED and page.expires_ns == expires_ns:
                freed += self._expire_page(page, now_ns)
        return freed

    def migrate(self, offset: int, now_ns: int) -> int | None:
        """Move the page at ``offset`` (live, cached or retained) to the best-fitting free run away
        from it when that coalesces free space: fewer free runs, or as many with the free space more
        concentrated (the sum of squared run lengths grows). Returns the new offset, or None when
        no move helps. Raises UnknownPage."""
        page = self._pages.get(offset)
        if page is None:
            raise UnknownPage(offset)
        size = page.size
        left = self._alloc.run_ending_at(offset)
        right = self._alloc.run_at(offset + size)
        merged = size + (offset - left if left is not None else 0) + (right or 0)
        found = self._alloc.find(size, size, avoid=(offset, offset + size))
        if found is None:
            return None
        run_start, new_offset = found
        run_size = self._alloc.run_at(run_start)
        head, tail = new_offset - run_start, run_start + run_size - new_offset - size
        delta_runs = (head > 0) + (tail > 0) - (left is not None) - (right is not None)
        if delta_runs > 0:
            return None
        if delta_runs == 0:
            left_size = offset - left if left is not None else 0
            before = left_size * left_size + (right or 0) * (right or 0) + run_size * run_size
            if merged * merged + head * head + tail * tail <= before:
                return None
        self._alloc.take(run_start, new_offset, size)
        self._alloc.free(offset, size)
        del self._pages[offset]
        del self._page_end[offset + size]
        page.offset = new_offset
        self._pages[new_offset] = page
        self._page_end[new_offset + size] = page
        who = page.holders[0] if page.state == _LIVE else page.owner
        self._emit(now_ns, _MIGRATE, page.cls, 0, who, offset, size, page.tokens, new_offset)
        return new_offset

    def compact(self, now_ns: int, max_moves: int, *, runs_per_move: int = 32) -> int:
        """Grow the longest free runs: migrate the pages bordering them (longest run first, up to
        ``runs_per_move`` runs tried per move) into holes elsewhere, at most ``max_moves`` moves.
        Returns the units moved."""
        moved = moves = 0
        while moves < max_moves:
            page = self._compaction_move(now_ns, runs_per_move)
            if page is None:
                break
            moved += page.size
            moves += 1
        return moved

    def _compaction_move(self, now_ns: int, runs_per_move: int) -> _Page | None:
        for run_size, start in self._alloc.largest_runs(runs_per_move):
            for page in (self._pages.get(start + run_size), self._page_end.get(start)):
                if page is not None and self.migrate(page.offset, now_ns) is not None:
                    return page
        return None

    def reset(self, now_ns: int) -> None:
        """Every unit free again (the engine restarted after an OOM); swap and checkpoints dropped."""
        self._store.clear()
        self._alloc.reset()
        self._clear_state()
        self._emit(now_ns, _RESET)

    # ======================================================================= queries
    def metrics(self) -> PoolMetrics:
        free = self._alloc.free_units
        largest = self._alloc.largest
        d = self.dynamic_units
        f_ext = pressure.f_ext(free, largest)
        f_int = pressure.f_int(self.tokens_stored, self.live_units, self.unit_tokens)
        psi = pressure.psi(self.live_units, self.workspace_units, d, f_ext, f_int, self.geometry.reserved_frac)
        return PoolMetrics(d, self.live_units, self.cached_units, self.retained_units, self.workspace_units,
                           free, largest, self._alloc.n_runs, self.tokens_stored, self.live_units / d,
                           f_ext, f_int, psi, len(self._tables), self.swap_used_units)

    @property
    def free_units(self) -> int:
        return self._alloc.free_units

    @property
    def largest_free_run(self) -> int:
        return self._alloc.largest

    def free_runs(self) -> tuple[np.ndarray, np.ndarray]:
        """Free runs sorted by offset: (offsets, sizes) as int64 arrays."""
        starts, sizes = self._alloc.runs()
        return np.asarray(starts, dtype=np.int64), np.asarray(sizes, dtype=np.int64)

    def free_run_histogram(self) -> dict[int, int]:
        """Free runs per power-of-two size bucket: {lower bound in units: count}, ascending."""
        hist: dict[int, int] = {}
        for size, _ in self._alloc.sizes_ascending():
            bucket = 1 << (size.bit_length() - 1)
            hist[bucket] = hist.get(bucket, 0) + 1
        return hist

    def utilization_split(self) -> UtilizationSplit:
        g = self.geometry
        ub = g.unit_bytes
        budget = int(g.total_bytes * g.gpu_memory_utilization)
        return UtilizationSplit(
            total_bytes=g.total_bytes, unmanaged_bytes=g.total_bytes - budget, weights_bytes=g.weights_bytes,
            context_bytes=g.context_bytes, workspace_bytes=self.workspace_units * ub,
            kv_live_bytes=self.live_units * ub, kv_cached_bytes=self.cached_units * ub,
            kv_retained_bytes=self.retained_units * ub,
            reserved_bytes=int(g.reserved_frac * self.dynamic_units) * ub,
            free_bytes=self._alloc.free_units * ub)

    def has_request(self, req: int) -> bool:
        return req in self._tables

    def requests(self) -> list[int]:
        return list(self._tables)

    def request_pages(self, req: int) -> list[PageInfo]:
        """The page table of ``req`` in token order. Raises UnknownRequest."""
        table = self._tables.get(req)
        if table is None:
            raise UnknownRequest(req)
        out = []
        for e in table.entries:
            if type(e) is _Page:
                out.append(PageInfo(e.offset, e.size, e.cls, e.tokens, PageState.LIVE, len(e.holders), e.key is not None))
            else:
                offset = e.page.offset if e.page is not None and e.page.state == _RETAINED and e.page.owner == req else -1
                out.append(PageInfo(offset, e.size, e.cls, e.tokens, e.state, 0, e.key is not None))
        return out

    def request_tokens(self, req: int) -> int:
        """Tokens of ``req`` held in live pages (0 for an unknown request)."""
        table = self._tables.get(req)
        return 0 if table is None else sum(e.tokens for e in table.entries if type(e) is _Page)

    def request_units(self, req: int) -> int:
        """Units of the live pages ``req`` holds, shared pages counted in full (0 when unknown)."""
        table = self._tables.get(req)
        return 0 if table is None else sum(e.size for e in table.entries if type(e) is _Page)

    def page_at(self, offset: int) -> PageInfo | None:
        page = self._pages.get(offset)
        if page is None:
            return None
        return PageInfo(page.offset, page.size, page.cls, page.tokens, page.state, len(page.holders),
                        page.key is not None)

    def snapshot(self, now_ns: int) -> PoolState:
        """Record a SNAPSHOT row and return the full state right after it."""
        offsets, sizes = self.free_runs()
        self._emit(now_ns, _SNAPSHOT, 0, 0, -1, self._alloc.largest, self._alloc.n_runs, self.tokens_stored,
                   free_runs_checksum(offsets, sizes))
        rows = []
        state_of = {_LIVE: RegionState.LIVE, _CACHED: RegionState.CACHED, _RETAINED: RegionState.RETAINED}
        for page in self._pages.values():
            refs = tuple(page.holders) if page.state == _LIVE else ()
            rows.append((page.offset, page.size, int(state_of[page.state]), page.cls, page.tokens, refs))
        for offset, units in self._workspace.items():
            rows.append((offset, units, int(RegionState.WORKSPACE), 0, 0, ()))
        rows.sort(key=lambda r: r[0])

        def col(i):
            return np.asarray([r[i] for r in rows], dtype=np.int64)
        return PoolState(col(0), col(1), col(2), col(3), col(4), [r[5] for r in rows], self.tokens_stored)

    # ======================================================================= internals
    def _set_hashes(self, table: _Table, block_hashes: Sequence) -> None:
        if block_hashes is table.hashes:
            return
        hashes = tuple(block_hashes)
        if hashes != table.hashes:
            n_same = 0
            for a, b in zip(hashes, table.hashes):
                if a != b:
                    break
                n_same += 1
            del table.keys[n_same:]
            table.hashes = hashes

    def _key(self, table: _Table, block: int) -> int | None:
        if block >= len(table.hashes):
            return None
        keys = table.keys
        while len(keys) <= block:
            keys.append(_chain_key(keys[-1] if keys else 0, table.hashes[len(keys)]))
        return keys[block]

    def _plan_for(self, req: int, n_tokens: int, block_hashes: Sequence) -> list:
        if n_tokens < 0:
            raise ValueError(f"n_tokens: expected >= 0, got {n_tokens}")
        table = self._tables.get(req)
        if table is None:
            table = _Table()
            self._set_hashes(table, block_hashes)
        elif block_hashes and block_hashes is not table.hashes:
            probe = _Table()
            probe.entries, probe.n_tokens = table.entries, table.n_tokens
            probe.hashes, probe.keys = table.hashes, list(table.keys)
            self._set_hashes(probe, block_hashes)
            table = probe
        last = table.entries[-1] if table.entries else None
        fill = min(last.size * self.unit_tokens - last.tokens, n_tokens) if type(last) is _Page else 0
        return self._plan(table, table.n_tokens + fill, n_tokens - fill) if n_tokens > fill else []

    def _plan(self, table: _Table, pos: int, rest: int) -> list[tuple[int, int, int | None, _Page | None]]:
        """New pages for ``rest`` tokens starting at token position ``pos``:
        (class index, tokens, chain key or None, registered page to share or None)."""
        block_tokens, small_tokens = self.block_tokens, self._small_tokens
        single = self._large_cls == 0
        plan = []
        while rest > 0:
            on_block = pos % block_tokens == 0
            if on_block and rest >= block_tokens:
                key = self._key(table, pos // block_tokens)
                shared = self._by_key.get(key) if key is not None else None
                plan.append((self._large_cls, block_tokens, key, shared))
                pos += block_tokens
                rest -= block_tokens
            else:
                tokens = min(rest, small_tokens)
                key = self._key(table, pos // block_tokens) if single and on_block else None
                plan.append((0, tokens, key, None))
                pos += tokens
                rest -= tokens
        return plan

    def _place_all(self, plan: list) -> list[int] | None:
        """Place every unshared page of ``plan`` (largest first, to pack better), or none of them."""
        classes = self.page_classes
        if len(plan) == 1:  # the decode case: one page
            if plan[0][3] is not None:
                return [-1]
            size = classes[plan[0][0]]
            offset = self._alloc.alloc(size, size)
            return None if offset is None else [offset]
        order = sorted((i for i, p in enumerate(plan) if p[3] is None), key=lambda i: -plan[i][0])
        offsets = [-1] * len(plan)
        alloc = self._alloc
        if self._unit_pages:
            # class by class, largest first, each class's pages in plan order: the same offsets as
            # one alloc per page, with the batch placements of the allocator
            taken: list[tuple[int, int]] = []
            n = 0
            while n < len(order):
                cls = plan[order[n]][0]
                group = [i for i in order[n:] if plan[i][0] == cls]
                size = classes[cls]
                if size == 1:
                    got = alloc.take_units(len(group)) if len(group) <= alloc.free_units else None
                else:
                    got = alloc.take_aligned(size, len(group))
                if got is None:
                    alloc.free_many(taken)
                    return None
                for i, offset in zip(group, got):
                    offsets[i] = offset
                    taken.append((offset, size))
                n += len(group)
            return offsets
        done = []
        for i in order:
            size = classes[plan[i][0]]
            offset = alloc.alloc(size, size)
            if offset is None:
                alloc.free_many([(offsets[j], classes[plan[j][0]]) for j in done])
                return None
            offsets[i] = offset
            done.append(i)
        return offsets

    def _unplace(self, plan: list, offsets: list[int]) -> None:
        for (cls, _, _, shared), offset in zip(plan, offsets):
            if shared is None:
                self._alloc.free(offset, self.page_classes[cls])

    def _refuse(self, req: int, plan: list, now_ns: int, record_failure: bool, what: str) -> None:
        units = sum(self.page_classes[p[0]] for p in plan if p[3] is None)
        largest = self._alloc.largest
        if record_failure:
            self._emit(now_ns, _ALLOC_FAIL, max(p[0] for p in plan), 0, req, 0, units, 0, largest)
        raise PoolExhausted(units, largest, self._alloc.free_units, what)

    def _fill(self, table: _Table, page: _Page, tokens: int, now_ns: int) -> None:
        page.tokens += tokens
        table.n_tokens += tokens
        self.tokens_stored += tokens
        self._pending_fill += tokens
        self._pending_fill_ts = now_ns
        if page.key is not None and page.tokens == page.size * self.unit_tokens:
            self._register(page)

    def _new_live_page(self, offset: int, cls: int, tokens: int, key: int | None, req: int, now_ns: int,
                       kind: int) -> _Page:
        size = self.page_classes[cls]
        page = _Page(offset, size, cls, tokens, key, req)
        self._pages[offset] = page
        self._page_end[offset + size] = page
        self.live_units += size
        self.tokens_stored += tokens
        if key is not None and tokens == size * self.unit_tokens:
            self._register(page)
        self._emit(now_ns, kind, cls, 0, req, offset, size, tokens)
        return page

    def _share(self, page: _Page, req: int, now_ns: int) -> _Page:
        if page.state == _CACHED:
            del self._lru[page]
            self.cached_units -= page.size
            self.live_units += page.size
            self.tokens_stored += page.tokens
            page.state, page.holders = _LIVE, [req]
        else:
            page.holders.append(req)
        self._emit(now_ns, _SHARE, page.cls, 0, req, page.offset, page.size, page.tokens)
        return page

    def _drop_ref(self, page: _Page, req: int, now_ns: int, cache_prefix: bool) -> int:
        page.holders.remove(req)
        if page.holders:
            self._emit(now_ns, _FREE, page.cls, 0, req, page.offset, page.size, page.tokens)
            return 0
        self.live_units -= page.size
        self.tokens_stored -= page.tokens
        if cache_prefix and page.registered:
            page.state = _CACHED
            self.cached_units += page.size
            self._lru[page] = None
            self._emit(now_ns, _FREE, page.cls, F_TO_CACHE, req, page.offset, page.size, page.tokens)
            return 0
        self._unregister(page)
        self._release_units(page)
        self._emit(now_ns, _FREE, page.cls, 0, req, page.offset, page.size, page.tokens)
        return page.size

    def _discard_evicted(self, entry: _Evicted, req: int, now_ns: int) -> int:
        if entry.state == PageState.SWAPPED:
            self.swap_used_units -= entry.size
        elif entry.state == PageState.CHECKPOINTED:
            self._drop_ckpt_ref(entry.ckpt)
        elif entry.state == _RETAINED:
            page = entry.page
            if page.state == _RETAINED and page.owner == req:
                return self._expire_page(page, now_ns)
        return 0

    def _expire_page(self, page: _Page, now_ns: int) -> int:
        self.retained_units -= page.size
        self._release_units(page)
        self._emit(now_ns, _EXPIRE, page.cls, 0, page.owner, page.offset, page.size, page.tokens)
        return page.size

    def _retain(self, page: _Page, req: int, now_ns: int) -> None:
        page.state, page.owner = _RETAINED, req
        page.expires_ns = now_ns + self.retain_ttl_ns
        self.retained_units += page.size
        self._retain_seq += 1
        heapq.heappush(self._retained, (page.expires_ns, self._retain_seq, page))

    def _release_units(self, page: _Page) -> None:
        page.state = _FREED
        del self._pages[page.offset]
        del self._page_end[page.offset + page.size]
        self._alloc.free(page.offset, page.size)

    def _register(self, page: _Page) -> None:
        if page.key is not None and not page.registered and page.key not in self._by_key:
            self._by_key[page.key] = page
            page.registered = True

    def _unregister(self, page: _Page) -> None:
        if page.registered:
            del self._by_key[page.key]
            page.registered = False

    def _choose(self, table: _Table, req: int, pages) -> list[int]:
        live = [i for i, e in enumerate(table.entries) if type(e) is _Page]
        if pages is None:
            return live
        if isinstance(pages, (int, np.integer)):
            if pages < 0:
                raise ValueError(f"pages: expected a count >= 0, got {pages}")
            return live[max(0, len(live) - int(pages)):] if pages else []
        index_of = {table.entries[i].offset: i for i in live}
        chosen = set()
        for offset in pages:
            i = index_of.get(int(offset))
            if i is None:
                raise UnknownPage(int(offset), req)
            chosen.add(i)
        return sorted(chosen)

    def _checkpoint(self, table: _Table, req: int, chosen: list[int], now_ns: int) -> int:
        ckpt = self._next_ckpt
        payload = {"node": self.node, "req": req, "ts_ns": now_ns, "unit_tokens": self.unit_tokens,
                   "pages": [{"index": i, "cls": table.entries[i].cls, "units": table.entries[i].size,
                              "tokens": table.entries[i].tokens} for i in chosen]}
        self._store.put(ckpt, payload)
        self._next_ckpt += 1
        self._ckpt_refs[ckpt] = len(chosen)
        return ckpt

    def _drop_ckpt_ref(self, ckpt: int) -> None:
        left = self._ckpt_refs.get(ckpt, 0) - 1
        if left <= 0:
            self._ckpt_refs.pop(ckpt, None)
            self._store.delete(ckpt)
        else:
            self._ckpt_refs[ckpt] = left

    def _trim(self, table: _Table, req: int) -> None:
        """Drop trailing lost entries (their tokens are recomputed by growing again) and forget a
        request left with nothing."""
        entries = table.entries
        while entries and type(entries[-1]) is _Evicted and entries[-1].state == PageState.DROPPED:
            table.n_tokens -= entries.pop().tokens
        if not entries:
            del self._tables[req]
