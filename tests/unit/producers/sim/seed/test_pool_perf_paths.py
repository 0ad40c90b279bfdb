"""Equivalence of the pool's and engine's fast paths with the plain (one-at-a-time) semantics.

The fast paths (``FreeRunAllocator.take_units``/``free_many``/inlined ``find``, ``PagedPool``'s
``_grow_small``, batched small-page placement, inline ``release``, ``grow_many``, and the engine's
``_decode_batch``) must give the same pool state and the same event rows as the code they bypass.
The reference here is the same pool with those paths switched off: an allocator whose operations
go through ``_place``/``alloc``/``free`` one block at a time, ``release`` through ``_drop_ref`` per
entry, and ``grow`` through ``_plan``/``_place_all``/``_new_live_page``.
"""

from __future__ import annotations

import random
from bisect import bisect_left

import numpy as np
import pytest

from kvguard.contracts.events import EVENT_DTYPE, EventKind, Geometry, Handling
from kvguard.contracts.units import NS_PER_S
from kvguard.producers.sim.fleet import Fleet
from kvguard.producers.sim.profiles import load_profile
from kvguard.producers.sim.seed.engine import Engine
from kvguard.producers.sim.seed.free_runs import FreeRunAllocator
from kvguard.producers.sim.seed.pool import PagedPool, PoolError, _Page, _Table
from kvguard.producers.sim.workloads import load_workload


class SlowAllocator(FreeRunAllocator):
    """The allocator's operations one block at a time, through ``_place`` (the pre-fast-path code)."""

    def find(self, size, align=1, avoid=None):
        if size <= 0 or size > self.largest:
            return None
        if self._starts is not None:
            return super().find(size, align, avoid)
        k = self._k
        for i in range(bisect_left(self._keys, size * k), len(self._keys)):
            run_size, start = divmod(self._keys[i], k)
            hit = self._place(start, run_size, size, align, avoid)
            if hit is not None:
                return start, hit
        return None

    def take_units(self, n):
        return [self.alloc(1, 1) for _ in range(n)]

    def free_many(self, blocks):
        for offset, size in blocks:
            self.free(offset, size)

    def take_aligned(self, size, n):
        out = []
        for _ in range(n):
            offset = self.alloc(size, size)
            if offset is None:
                self.free_many([(o, size) for o in out])
                return None
            out.append(offset)
        return out


class SlowPool(PagedPool):
    """PagedPool with its fast paths off."""

    def __init__(self, geometry, **kw):
        super().__init__(geometry, **kw)
        self._alloc = SlowAllocator(geometry.dynamic_units, kw.get("fit", "best"))
        self._unit_pages = False

    def release(self, req, now_ns, cache_prefix=True):
        table = self._tables.pop(req, None)
        if table is None:
            return 0
        freed = 0
        for entry in reversed(table.entries):
            if type(entry) is _Page:
                freed += self._drop_ref(entry, req, now_ns, cache_prefix)
            else:
                freed += self._discard_evicted(entry, req, now_ns)
        return freed

    def grow_many(self, reqs, n_tokens, now_ns, block_hashes=None):
        return 0


def geometry(classes, units=400, unit_tokens=4):
    return Geometry(total_bytes=1 << 30, weights_bytes=1 << 29, context_bytes=0, gpu_memory_utilization=0.9,
                    unit_tokens=unit_tokens, kv_bytes_per_token=64, dynamic_units=units, page_classes=classes)


def assert_same(fast: PagedPool, slow: PagedPool, where: str) -> None:
    a, b = fast.take_events(), slow.take_events()
    assert a.tobytes() == b.tobytes(), f"{where}: event rows differ\nfast={a}\nslow={b}"
    fa, sa = fast.free_runs(), slow.free_runs()
    assert np.array_equal(fa[0], sa[0]) and np.array_equal(fa[1], sa[1]), f"{where}: free runs differ"
    assert fast.metrics() == slow.metrics(), f"{where}: metrics differ"
    assert fast.requests() == slow.requests(), f"{where}: requests differ"
    for req in fast.requests():
        assert fast.request_pages(req) == slow.request_pages(req), f"{where}: page table of {req} differs"


def both(pools, method, *args, **kw):
    """Call ``method`` on both pools; both must raise the same error class or return the same value."""
    out = []
    for pool in pools:
        try:
            out.append(("ok", getattr(pool, method)(*args, **kw)))
        except (PoolError, ValueError) as e:
            out.append(("err", type(e)))
    assert out[0] == out[1], f"{method}{args}: fast {out[0]} != slow {out[1]}"
    return out[0]


# ------------------------------------------------------------------------------- allocator

@pytest.mark.parametrize("seed", range(4))
def test_allocator_fast_paths_match_one_block_at_a_time(seed):
    rng = random.Random(seed)
    fast, slow = FreeRunAllocator(300), SlowAllocator(300)
    held: list[tuple[int, int]] = []
    for step in range(600):
        op = rng.random()
        if op < 0.35:
            n = rng.randint(1, 6)
            if n <= fast.free_units:
                got = fast.take_units(n)
                assert got == slow.take_units(n), f"step {step}: take_units({n})"
                held += [(o, 1) for o in got]
        elif op < 0.5:
            size, n = rng.choice([2, 4, 8, 16]), rng.randint(1, 8)
            got = fast.take_aligned(size, n)
            assert got == slow.take_aligned(size, n), f"step {step}: take_aligned({size}, {n})"
            held += [(o, size) for o in got or ()]
        elif op < 0.7:
            size = rng.choice([1, 2, 4, 8, 16, 5, 13])
            align = rng.choice([1, size]) if size & (size - 1) == 0 else 1
            assert fast.find(size, align) == slow.find(size, align), f"step {step}: find({size}, {align})"
            off = fast.alloc(size, align)
            assert off == slow.alloc(size, align)
            if off is not None:
                held.append((off, size))
        elif held:
            rng.shuffle(held)
            k = rng.randint(1, min(8, len(held)))
            blocks, held = held[:k], held[k:]
            fast.free_many(blocks)
            slow.free_many(blocks)
        assert fast.runs() == slow.runs() and fast.free_units == slow.free_units, f"step {step}"
        assert fast._keys == slow._keys and fast._start_of_end == slow._start_of_end


def test_take_units_refuses_more_than_free_and_first_fit():
    a = FreeRunAllocator(4)
    with pytest.raises(ValueError, match="take_units"):
        a.take_units(5)
    with pytest.raises(ValueError, match="take_units"):
        FreeRunAllocator(4, "first").take_units(1)
    with pytest.raises(ValueError, match="take_aligned"):
        FreeRunAllocator(8).take_aligned(3, 1)


def test_take_aligned_is_all_or_nothing():
    a = FreeRunAllocator(40)
    runs = a.runs()
    assert a.take_aligned(16, 3) is None  # two aligned 16-blocks fit in 40 units, not three
    assert a.runs() == runs and a.free_units == 40
    assert a.take_aligned(16, 2) == [0, 16]


def test_find_with_avoid_unchanged():
    fast, slow = FreeRunAllocator(64), SlowAllocator(64)
    for a in (fast, slow):
        a.take(0, 0, 64)
        for off, size in ((0, 8), (16, 8), (40, 16)):
            a.free(off, size)
    assert fast.find(8, 8, avoid=(0, 8)) == slow.find(8, 8, avoid=(0, 8)) == (16, 16)


# ------------------------------------------------------------------------------- pool

CHAINS = [(), (11, 12, 13), (11, 12, 14), (21,), (31, 32, 33, 34)]


@pytest.mark.parametrize("classes,unit_tokens,fit", [((1, 16), 4, "best"), ((1,), 16, "best"), ((1, 8), 2, "first"),
                                                     ((2, 8), 2, "best"), ((1, 4, 16), 1, "best")])
@pytest.mark.parametrize("seed", range(3))
def test_random_operations_same_state_and_rows(classes, unit_tokens, fit, seed):
    rng = random.Random(seed * 1000 + len(classes))
    g = geometry(classes, units=480, unit_tokens=unit_tokens)
    kw = dict(node="eq", swap_capacity_units=40, retain_ttl_ns=200, fit=fit)
    fast, slow = PagedPool(g, **kw), SlowPool(g, **kw)
    pools = (fast, slow)
    now = 0
    chain_of: dict[int, tuple] = {}
    ws: list[int] = []
    for step in range(400):
        now += 10
        req = rng.randint(0, 9)
        op = rng.random()
        where = f"step {step} op {op:.2f}"
        if op < 0.45:
            chain = chain_of.setdefault(req, rng.choice(CHAINS))
            if fast.has_request(req):  # decode-like growth, sometimes a chunk
                n = rng.choice([1, 1, 2, 3, 5, rng.randint(1, 40)])
            else:  # a prompt: its hashed blocks are shared, cached or revived
                n = rng.randint(1, 300)
            both(pools, "grow", req, n, now, chain)
        elif op < 0.55:
            reqs = rng.sample(range(10), rng.randint(1, 6))
            ns = [rng.choice([0, 1, 2, 5, 9]) for _ in reqs]
            hashes = [chain_of.get(r, ()) for r in reqs]
            done = fast.grow_many(reqs, ns, now, hashes)
            assert 0 <= done <= len(reqs)
            for r, n, h in zip(reqs[:done], ns[:done], hashes[:done]):
                slow.grow(r, n, now, h)
        elif op < 0.68:
            both(pools, "release", req, now, rng.random() < 0.8)
            chain_of.pop(req, None)
        elif op < 0.72:
            pages = rng.choice([None, 1, 2])
            both(pools, "evict", req, now, pages=pages, handling=rng.choice(list(Handling)))
        elif op < 0.76:
            both(pools, "swap_in", req, now)
        elif op < 0.79:
            both(pools, "remap", req, now)
        elif op < 0.82:
            both(pools, "expire", now)
        elif op < 0.85:
            both(pools, "reclaim_cached", rng.randint(1, 30), now)
        elif op < 0.90:
            kind, off = both(pools, "alloc_workspace", rng.randint(1, 20), now, 7)
            if kind == "ok":
                ws.append(off)
        elif op < 0.93 and ws:
            both(pools, "free_workspace", ws.pop(rng.randrange(len(ws))), now)
        elif op < 0.97:
            both(pools, "compact", now, rng.randint(1, 4))
        elif op < 0.985:
            both(pools, "can_grow", req, rng.randint(1, 80), chain_of.get(req, ()))
            both(pools, "units_needed", req, rng.randint(0, 200), chain_of.get(req, ()) if rng.random() < 0.5 else ())
        else:
            both(pools, "reset", now)
            chain_of.clear()
            ws.clear()
        assert_same(fast, slow, where)


@pytest.mark.parametrize("classes,unit_tokens", [((1, 16), 4), ((1,), 16), ((1, 4, 16), 1), ((1, 8), 2)])
def test_unhashed_units_needed_counts_the_plan(classes, unit_tokens):
    pool = PagedPool(geometry(classes, units=4000, unit_tokens=unit_tokens))
    table = _Table()
    for pos in range(0, 160):
        for rest in range(0, 160):
            plan = pool._plan(table, pos, rest)
            assert pool._plan_units(pos, rest) == sum(classes[c] for c, _, _, _ in plan), (pos, rest)


def test_grow_many_equals_single_grows_and_stops_untouched():
    g = geometry((1, 16), units=64, unit_tokens=4)
    fast, slow = PagedPool(g), SlowPool(g)
    for pool in (fast, slow):
        for req in range(4):
            pool.grow(req, 10, 0)
    # 4 requests x 9 tokens: fill 2 + 7 -> 2 pages each; fits
    assert fast.grow_many([0, 1, 2, 3], [9, 9, 9, 9], 5) == 4
    for req in range(4):
        slow.grow(req, 9, 5)
    assert_same(fast, slow, "batch")
    # a grow crossing a whole block (a large page) stops the batch before it, nothing recorded for it
    assert fast.grow_many([0, 1, 2], [1, 120, 1], 7) == 1
    slow.grow(0, 1, 7)
    assert_same(fast, slow, "stop at large page")
    # an unknown request (no pages yet) stops too
    assert fast.grow_many([9], [3], 8) == 0
    assert_same(fast, slow, "stop at fresh")
    # not enough free units: stops, no ALLOC_FAIL row
    free = fast.free_units
    assert fast.grow_many([1], [4 * free + 16], 9) == 0
    assert len(fast.take_events()) == 0
    with pytest.raises(ValueError, match="n_tokens"):
        fast.grow_many([1], [-1], 9)


def test_pending_fill_is_not_flushed_by_a_release_without_rows():
    """A FILL stays pending across a release that records nothing (only swapped entries)."""
    g = geometry((1, 16), units=64, unit_tokens=4)
    fast, slow = PagedPool(g, swap_capacity_units=64), SlowPool(g, swap_capacity_units=64)
    for pool in (fast, slow):
        pool.grow(1, 4, 0)
        pool.evict(1, 1, handling=Handling.SWAP)
        pool.grow(2, 2, 2)
        pool.grow(2, 1, 3)  # pending FILL
        pool.release(1, 4)  # swapped entry only: no row
        pool.grow(2, 1, 5)  # merges into the same FILL row
    assert_same(fast, slow, "fill")


def test_take_events_is_the_rows_in_event_dtype_and_bad_lifecycle_rows_are_refused():
    pool = PagedPool(geometry((1, 16), units=64, unit_tokens=4))
    pool.record_event(EventKind.ARRIVE, 5, req=3, cls=7, flags=1, tokens=100, aux=2**62)
    pool.grow(3, 70, 6)
    rows = pool.take_events()
    assert rows.dtype == EVENT_DTYPE and rows.flags.writeable
    assert rows[0].tolist() == (5, int(EventKind.ARRIVE), 7, 1, 3, 0, 0, 100, 2**62)
    assert [int(k) for k in rows["kind"]] == [int(EventKind.ARRIVE)] + [int(EventKind.ALLOC)] * 3
    with pytest.raises(ValueError, match="cls and flags 0-255"):
        pool.record_event(EventKind.FINISH, 7, req=3, flags=256)
    assert len(pool.take_events()) == 0


# ------------------------------------------------------------------------------- engine

def run_fleet(profile_name, workload, rate_scale, seconds, batched: bool, monkeypatch) -> tuple[bytes, dict]:
    with monkeypatch.context() as m:
        if not batched:
            m.setattr(Engine, "_decode_batch", lambda self, decode, n, now: 0)
        profile = load_profile(profile_name)
        wl = load_workload(workload, rate_scale=rate_scale, window=seconds,
                           max_prompt_tokens=min(profile.max_model_len - 1024, int(profile.capacity_tokens * 0.6)))
        fleet = Fleet(1, profile, seed=0)
        fleet.submit_workload(wl)
        rows = []
        for t in range(1, int(seconds) + 1):
            fleet.advance(t * NS_PER_S)
            rows += [b.events.tobytes() if hasattr(b, "events") else repr(b).encode() for b in fleet.take_batches(t * NS_PER_S)]
        return b"".join(rows), fleet.summary().to_dict()


@pytest.mark.parametrize("profile_name,workload,rate_scale,seconds", [
    ("llama3-8b-24gb", "azure-conv", 6.0, 40),  # preemptions and OOM crashes
    ("llama3-8b-24gb-p16", "sessions", 1.0, 40),  # prefix sharing, single class
])
def test_engine_batched_decode_gives_the_same_events(profile_name, workload, rate_scale, seconds, monkeypatch):
    fast_rows, fast_summary = run_fleet(profile_name, workload, rate_scale, seconds, True, monkeypatch)
    slow_rows, slow_summary = run_fleet(profile_name, workload, rate_scale, seconds, False, monkeypatch)
    assert fast_summary == slow_summary
    assert fast_rows == slow_rows
