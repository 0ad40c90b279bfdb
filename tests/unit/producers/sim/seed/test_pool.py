"""Behaviours of the paged KV pool (producers/sim/seed/pool.py), one per test."""

from __future__ import annotations

import json

import pytest

from kvguard.contracts.events import F_TO_CACHE, EventKind, Geometry, Handling, RegionState, free_runs_checksum
from kvguard.producers.sim.seed.free_runs import FreeRunAllocator
from kvguard.producers.sim.seed.pool import (
    CheckpointMissing,
    PagedPool,
    PageState,
    PoolExhausted,
    SwapFull,
    UnknownPage,
    UnknownRequest,
    UnknownWorkspace,
)
from tests.unit.producers.sim.seed.pool_replay import ReplayMirror


def geometry(units=256, classes=(1, 16), unit_tokens=4) -> Geometry:
    return Geometry(total_bytes=1 << 34, weights_bytes=1 << 33, context_bytes=1 << 29, gpu_memory_utilization=0.9,
                    unit_tokens=unit_tokens, kv_bytes_per_token=1024, dynamic_units=units, page_classes=classes)


def make_pool(units=256, classes=(1, 16), **kw) -> PagedPool:
    kw.setdefault("swap_capacity_units", 64)
    kw.setdefault("retain_ttl_ns", 100)
    return PagedPool(geometry(units, classes), node="sim-0/gpu0", **kw)


def kinds(events) -> list[str]:
    return [EventKind(int(k)).name for k in events["kind"]]


def replay_matches(pool: PagedPool, mirror: ReplayMirror) -> None:
    mirror.apply(pool.take_events())
    offsets, sizes = pool.free_runs()
    m_offsets, m_sizes = mirror.free_runs()
    assert offsets.tolist() == m_offsets.tolist() and sizes.tolist() == m_sizes.tolist()
    m = pool.metrics()
    mm = mirror.metrics()
    for name, value in mm.items():
        assert getattr(m, name) == value, name


# ---------------------------------------------------------------- allocator
def test_allocator_coalesces_neighbours_into_one_run():
    a = FreeRunAllocator(64)
    x, y, z = a.alloc(8), a.alloc(8), a.alloc(8)
    a.free(x, 8)
    a.free(z, 8)
    assert a.n_runs == 2  # [0,8) and [16,64)
    a.free(y, 8)
    assert a.runs() == ([0], [64]) and a.largest == 64


def test_allocator_best_fit_picks_the_smallest_run_that_fits():
    a = FreeRunAllocator(100)
    offs = [a.alloc(10) for _ in range(10)]
    a.free(offs[1], 10)  # a 10-run at 10
    a.free(offs[4], 10)
    a.free(offs[5], 10)  # a 20-run at 40
    assert a.alloc(10) == 10


def test_allocator_first_fit_picks_the_lowest_run_that_fits():
    a = FreeRunAllocator(100, fit="first")
    offs = [a.alloc(10) for _ in range(10)]
    a.free(offs[4], 10)
    a.free(offs[5], 10)  # a 20-run at 40
    a.free(offs[8], 10)  # a 10-run at 80
    assert a.alloc(10) == 40


def test_allocator_aligns_blocks_and_skips_misaligned_runs():
    a = FreeRunAllocator(64)
    a.take(0, 0, 3)  # free run [3, 64)
    assert a.alloc(16, 16) == 48  # aligned and flush with the run's end: one leftover fragment, not two
    a2 = FreeRunAllocator(40)
    a2.take(0, 0, 2)
    a2.take(2, 20, 20)  # free: [2, 20) only: 18 units, no aligned 16 inside
    assert a2.alloc(16, 16) is None and a2.alloc(16) == 2


def test_allocator_rejects_double_free():
    a = FreeRunAllocator(32)
    off = a.alloc(4)
    a.free(off, 4)
    with pytest.raises(ValueError, match="double free"):
        a.free(off, 4)


# ---------------------------------------------------------------- grow / release / classes
def test_prompt_uses_large_pages_for_full_blocks_and_small_pages_for_the_tail():
    pool = make_pool()
    pool.grow(1, 64 * 2 + 10, 0)
    pages = pool.request_pages(1)
    assert [p.size for p in pages] == [16, 16, 1, 1, 1]
    assert [p.tokens for p in pages] == [64, 64, 4, 4, 2]
    assert all(p.offset % p.size == 0 for p in pages)


def test_decode_growth_fills_the_last_page_then_uses_small_pages():
    pool = make_pool()
    pool.grow(1, 64, 0)
    for t in range(1, 10):
        pool.grow(1, 1, t)
    assert [p.size for p in pool.request_pages(1)] == [16, 1, 1, 1]
    assert pool.request_tokens(1) == 73
    ev = pool.take_events()
    assert kinds(ev).count("ALLOC") == 4
    assert ev[ev["kind"] == EventKind.FILL]["tokens"].sum() == 9 - 3 * 1


def test_single_class_pool_uses_only_that_class():
    pool = make_pool(classes=(4,))
    pool.grow(1, 37, 0)
    assert [p.size for p in pool.request_pages(1)] == [4, 4, 4]
    assert [p.tokens for p in pool.request_pages(1)] == [16, 16, 5]


def test_fill_rows_are_aggregated_and_flushed_before_the_next_row():
    pool = make_pool()
    for r in (1, 2, 3):
        pool.grow(r, 2, 0)
    for r in (1, 2, 3):
        pool.grow(r, 1, 5)
    pool.alloc_workspace(3, 6)
    ev = pool.take_events()
    assert kinds(ev) == ["ALLOC", "ALLOC", "ALLOC", "FILL", "WS_ALLOC"]
    assert ev["tokens"][3] == 3 and ev["ts_ns"][3] == 5


def test_release_frees_units_and_returns_them():
    pool = make_pool()
    pool.grow(1, 70, 0)
    assert pool.release(1, 1) == 16 + 2
    assert pool.metrics().free_units == 256 and not pool.has_request(1)
    assert pool.release(1, 2) == 0  # unknown: idempotent


def test_metrics_follow_the_contract_definitions():
    pool = make_pool()
    pool.grow(1, 66, 0)  # 16 + 1 units, 66 tokens
    ws = pool.alloc_workspace(10, 0)
    m = pool.metrics()
    assert (m.live_units, m.workspace_units, m.tokens_stored) == (17, 10, 66)
    assert m.free_units == 256 - 27 and m.u_kv == 17 / 256
    assert m.f_int == pytest.approx(1 - 66 / (17 * 4))
    assert m.f_ext == 1 - m.largest_free_run / m.free_units
    assert m.psi == pytest.approx((17 + 10 + 0.05 * 256) / 256 * (1 + 2 * m.f_ext + m.f_int))
    pool.free_workspace(ws, 1)
    assert pool.metrics().workspace_units == 0


# ---------------------------------------------------------------- check, then act
def test_grow_that_does_not_fit_raises_and_changes_nothing():
    pool = make_pool(units=64)
    pool.grow(1, 40, 0)
    before = (pool.free_runs()[0].tolist(), pool.metrics())
    pool.take_events()
    with pytest.raises(PoolExhausted) as info:
        pool.grow(2, 64 * 4, 1)
    assert info.value.requested_units == 64 and info.value.largest_free_run == pool.largest_free_run
    assert (pool.free_runs()[0].tolist(), pool.metrics()) == before
    assert not pool.has_request(2)
    ev = pool.take_events()
    assert kinds(ev) == ["ALLOC_FAIL"] and ev["size"][0] == 64 and ev["aux"][0] == pool.largest_free_run


def test_can_grow_agrees_with_grow_and_records_nothing():
    pool = make_pool(units=64)
    pool.grow(1, 40, 0)
    pool.take_events()
    assert pool.can_grow(2, 64) and not pool.can_grow(2, 64 * 4)
    assert len(pool.take_events()) == 0
    assert pool.units_needed(2, 70) == 16 + 2


def test_workspace_that_does_not_fit_raises_with_the_largest_run():
    pool = make_pool(units=64)
    pool.grow(1, 64, 0)
    pool.grow(2, 4, 0)
    with pytest.raises(PoolExhausted) as info:
        pool.alloc_workspace(100, 1)
    assert info.value.what == "workspace" and info.value.largest_free_run == pool.largest_free_run
    with pytest.raises(UnknownWorkspace):
        pool.free_workspace(12345, 1)


def test_mixed_sizes_make_a_large_page_fail_while_total_free_would_suffice():
    pool = make_pool(units=64)
    for r in range(64):
        pool.grow(r, 4, 0)  # 64 one-unit pages
    for r in range(0, 64, 2):
        pool.release(r, 1)  # every other unit free: 32 free, largest run 1
    m = pool.metrics()
    assert m.free_units == 32 and m.largest_free_run == 1 and m.f_ext == pytest.approx(1 - 1 / 32)
    assert not pool.can_grow(100, 64)


# ---------------------------------------------------------------- prefix sharing and cache
def test_identical_prefix_chains_share_one_physical_page():
    pool = make_pool()
    pool.grow(1, 64 * 2 + 4, 0, block_hashes=[7, 8])
    pool.grow(2, 64 * 2 + 4, 1, block_hashes=[7, 8])
    p1, p2 = pool.request_pages(1), pool.request_pages(2)
    assert [p.offset for p in p1[:2]] == [p.offset for p in p2[:2]]
    assert p1[0].refcount == 2 and p1[2].offset != p2[2].offset
    assert pool.metrics().live_units == 32 + 2
    ev = pool.take_events()
    assert kinds(ev)[-3:] == ["SHARE", "SHARE", "ALLOC"]


def test_chains_share_only_their_identical_leading_blocks():
    pool = make_pool()
    pool.grow(1, 128, 0, block_hashes=[7, 8])
    pool.grow(2, 128, 0, block_hashes=[9, 8])  # same second hash, different chain
    assert pool.request_pages(1)[1].offset != pool.request_pages(2)[1].offset
    assert pool.request_pages(1)[1].refcount == 1


def test_last_user_leaving_caches_a_hashed_page_and_frees_the_rest():
    pool = make_pool()
    pool.grow(1, 68, 0, block_hashes=[5])
    pool.grow(2, 68, 0, block_hashes=[5])
    pool.take_events()
    assert pool.release(1, 1) == 1
    assert pool.metrics().cached_units == 0  # still held by 2
    assert pool.release(2, 2) == 1
    m = pool.metrics()
    assert m.cached_units == 16 and m.live_units == 0 and m.tokens_stored == 0
    ev = pool.take_events()
    assert ev["flags"][-1] == F_TO_CACHE and kinds(ev)[-1] == "FREE"


def test_release_without_cache_prefix_frees_hashed_pages():
    pool = make_pool()
    pool.grow(1, 64, 0, block_hashes=[5])
    assert pool.release(1, 1, cache_prefix=False) == 16
    assert pool.metrics().cached_units == 0


def test_a_cached_page_is_revived_by_the_same_chain():
    pool = make_pool()
    pool.grow(1, 64, 0, block_hashes=[5])
    pool.release(1, 1)
    pool.take_events()
    pool.grow(2, 64, 2, block_hashes=[5])
    assert pool.metrics().cached_units == 0 and pool.metrics().live_units == 16
    assert kinds(pool.take_events()) == ["SHARE"]


def test_reclaim_drops_least_recently_cached_pages_first():
    pool = make_pool()
    pool.grow(1, 64, 0, block_hashes=[1])
    pool.grow(2, 64, 0, block_hashes=[2])
    pool.release(1, 1)
    pool.release(2, 2)
    pool.take_events()
    assert pool.reclaim_cached(10, 3) == 16
    ev = pool.take_events()
    assert kinds(ev) == ["RECLAIM"]
    pool.grow(3, 64, 4, block_hashes=[2])  # page of chain [2] survived
    assert kinds(pool.take_events()) == ["SHARE"]


def test_single_class_page_registers_its_hash_when_filled_later():
    pool = make_pool(classes=(4,))
    pool.grow(1, 10, 0, block_hashes=[3])
    pool.grow(1, 6, 1)  # block 0 is full now
    pool.grow(2, 16, 2, block_hashes=[3])
    assert pool.request_pages(2)[0].offset == pool.request_pages(1)[0].offset


# ---------------------------------------------------------------- eviction and restore
def test_evict_recompute_frees_the_tail_pages_and_shortens_the_request():
    pool = make_pool()
    pool.grow(1, 64 + 12, 0)
    res = pool.evict(1, 1, pages=2)
    assert (res.pages, res.units_freed, res.tokens) == (2, 2, 8)
    assert pool.request_tokens(1) == 68 and len(pool.request_pages(1)) == 2


def test_evict_all_recompute_forgets_the_request():
    pool = make_pool()
    pool.grow(1, 70, 0)
    res = pool.evict(1, 1)
    assert res.units_freed == 18 and not pool.has_request(1)
    with pytest.raises(UnknownRequest):
        pool.evict(1, 2)


def test_evicting_a_shared_page_keeps_it_live_for_the_other_holder():
    pool = make_pool()
    pool.grow(1, 64, 0, block_hashes=[4])
    pool.grow(2, 64, 0, block_hashes=[4])
    res = pool.evict(1, 1)
    assert res.shared_pages == 1 and res.units_freed == 0 and pool.metrics().live_units == 16


def test_swap_out_then_swap_in_restores_pages_in_place():
    pool = make_pool()
    pool.grow(1, 64 + 8, 0)
    res = pool.evict(1, 1, handling=Handling.SWAP)
    assert res.swap_units == 18 and pool.swap_used_units == 18 and pool.metrics().live_units == 0
    assert [p.state for p in pool.request_pages(1)] == [PageState.SWAPPED] * 3
    assert pool.swap_in(1, 2) == 18
    assert pool.swap_used_units == 0 and pool.request_tokens(1) == 72
    assert kinds(pool.take_events())[-3:] == ["SWAP_IN"] * 3


def test_swap_refuses_when_host_swap_is_full_and_changes_nothing():
    pool = make_pool(swap_capacity_units=10)
    pool.grow(1, 64, 0)
    with pytest.raises(SwapFull) as info:
        pool.evict(1, 1, handling=Handling.SWAP)
    assert info.value.requested_units == 16 and info.value.free_swap_units == 10
    assert pool.metrics().live_units == 16


def test_swap_in_that_does_not_fit_changes_nothing():
    pool = make_pool(units=32, swap_capacity_units=32)
    pool.grow(1, 64, 0)
    pool.evict(1, 1, handling=Handling.SWAP)
    pool.grow(2, 64, 2)
    pool.grow(3, 4, 2)  # occupies a unit of the other 16-aligned slot
    with pytest.raises(PoolExhausted):
        pool.swap_in(1, 3)
    assert pool.request_pages(1)[0].state == PageState.SWAPPED and pool.swap_used_units == 16


def test_checkpoint_writes_a_file_and_swap_in_restores_and_deletes_it(tmp_path):
    pool = make_pool(checkpoint_dir=tmp_path)
    pool.grow(1, 70, 0)
    pool.evict(1, 1, handling=Handling.CHECKPOINT)
    files = list(tmp_path.iterdir())
    assert len(files) == 1
    payload = json.loads(files[0].read_text())
    assert payload["req"] == 1 and [p["units"] for p in payload["pages"]] == [16, 1, 1]
    assert pool.swap_in(1, 2) == 18 and list(tmp_path.iterdir()) == []


def test_swap_in_of_a_deleted_checkpoint_names_it(tmp_path):
    pool = make_pool(checkpoint_dir=tmp_path)
    pool.grow(1, 64, 0)
    pool.evict(1, 1, handling=Handling.CHECKPOINT)
    for f in tmp_path.iterdir():
        f.unlink()
    with pytest.raises(CheckpointMissing, match="ckpt"):
        pool.swap_in(1, 2)


def test_retained_pages_stay_occupied_and_remap_makes_them_live_again():
    pool = make_pool()
    pool.grow(1, 68, 0)
    res = pool.evict(1, 1, handling=Handling.RETAIN)
    m = pool.metrics()
    assert res.units_retained == 17 and m.retained_units == 17 and m.live_units == 0 and m.free_units == 256 - 17
    assert pool.remap(1, 2)
    m = pool.metrics()
    assert m.live_units == 17 and m.retained_units == 0 and pool.request_tokens(1) == 68


def test_remap_shares_back_a_page_another_request_kept_live():
    pool = make_pool()
    pool.grow(1, 64, 0, block_hashes=[4])
    pool.grow(2, 64, 0, block_hashes=[4])
    res = pool.evict(1, 1, handling=Handling.RETAIN)
    assert res.shared_pages == 1 and res.units_retained == 0
    pool.take_events()
    assert pool.remap(1, 2)
    assert pool.request_pages(1)[0].refcount == 2 and kinds(pool.take_events()) == ["SHARE"]


def test_same_operations_give_identical_events():
    def run():
        pool = make_pool()
        for r in range(6):
            pool.grow(r, 20 + 13 * r, r, block_hashes=[1, 2] if r % 2 else [])
        pool.release(2, 9)
        pool.evict(3, 10, pages=1, handling=Handling.RETAIN)
        pool.compact(11, 4)
        return pool.take_events()
    assert run().tobytes() == run().tobytes()


def test_retained_pages_expire_after_the_ttl():
    pool = make_pool(retain_ttl_ns=100)
    pool.grow(1, 68, 0)
    pool.evict(1, 10, handling=Handling.RETAIN)
    assert pool.expire(109) == 0
    assert pool.expire(110) == 17
    assert pool.metrics().free_units == 256
    assert not pool.remap(1, 111)  # lost: the request has nothing left
    assert not pool.has_request(1)


def test_a_page_retained_again_after_remap_keeps_its_new_deadline():
    pool = make_pool(retain_ttl_ns=100)
    pool.grow(1, 64, 0)
    pool.evict(1, 10, handling=Handling.RETAIN)  # deadline 110
    assert pool.remap(1, 20)
    pool.evict(1, 50, handling=Handling.RETAIN)  # deadline 150
    assert pool.expire(120) == 0 and pool.metrics().retained_units == 16
    assert pool.expire(150) == 16


def test_releasing_a_request_drops_its_retained_pages():
    pool = make_pool()
    pool.grow(1, 64, 0)
    pool.evict(1, 1, handling=Handling.RETAIN)
    pool.take_events()
    assert pool.release(1, 2) == 16
    assert kinds(pool.take_events()) == ["EXPIRE"]


def test_evict_by_offsets_takes_exactly_those_pages():
    pool = make_pool()
    pool.grow(1, 64 + 12, 0)
    mid = pool.request_pages(1)[2].offset
    pool.evict(1, 1, pages=[mid])
    assert [p.state for p in pool.request_pages(1)] == [PageState.LIVE, PageState.LIVE, PageState.DROPPED,
                                                         PageState.LIVE]
    with pytest.raises(UnknownPage):
        pool.evict(1, 2, pages=[9999])


# ---------------------------------------------------------------- migrate / compact
def test_migrate_moves_a_page_into_a_hole_and_coalesces_free_space():
    pool = make_pool(units=64)
    for r in range(4):
        pool.grow(r, 4, 0)  # units 0..3
    pool.release(1, 1)  # hole at 1
    before = pool.metrics()
    new = pool.migrate(3, 2)  # unit 3 borders the big free run; moving it into the hole merges
    assert new == 1
    after = pool.metrics()
    assert after.n_free_runs == 1 and after.largest_free_run == before.free_units
    assert after.live_units == before.live_units and pool.request_pages(3)[0].offset == 1


def test_migrate_refuses_a_move_that_does_not_help():
    pool = make_pool(units=64)
    pool.grow(0, 64 * 4, 0)  # full
    pool.release(0, 1)
    pool.grow(1, 4, 1)
    assert pool.migrate(pool.request_pages(1)[0].offset, 2) is None
    with pytest.raises(UnknownPage):
        pool.migrate(63, 2)


def test_compact_reduces_fragmentation_without_changing_contents():
    pool = make_pool(units=128)
    for r in range(64):
        pool.grow(r, 4, 0)
    for r in range(0, 64, 2):
        pool.release(r, 1)
    tokens_before = pool.metrics().tokens_stored
    moved = pool.compact(2, max_moves=64)
    m = pool.metrics()
    assert moved > 0 and m.f_ext < 0.5 and m.tokens_stored == tokens_before
    assert all(pool.request_tokens(r) == 4 for r in range(1, 64, 2))


def test_compact_grows_the_longest_free_run():
    pool = make_pool(units=64)
    for r in range(48):
        pool.grow(r, 4, 0)  # units 0..47 one page each, free run [48, 64)
    for r in range(0, 32, 2):
        pool.release(r, 1)  # 16 one-unit holes below
    before = pool.metrics()
    pool.compact(2, max_moves=16)
    after = pool.metrics()
    assert before.largest_free_run == 16 and after.largest_free_run == 32 and after.n_free_runs == 1


# ---------------------------------------------------------------- queries
def test_utilization_split_accounts_for_every_byte_of_the_dynamic_region():
    pool = make_pool()
    pool.grow(1, 64, 0, block_hashes=[1])
    pool.release(1, 1)
    pool.grow(2, 8, 1)
    pool.alloc_workspace(5, 1)
    u = pool.utilization_split()
    unit_bytes = pool.geometry.unit_bytes
    assert (u.kv_cached_bytes, u.kv_live_bytes, u.workspace_bytes) == (16 * unit_bytes, 2 * unit_bytes, 5 * unit_bytes)
    assert u.kv_live_bytes + u.kv_cached_bytes + u.kv_retained_bytes + u.workspace_bytes + u.free_bytes == \
        256 * unit_bytes


def test_free_run_histogram_counts_runs_per_power_of_two_bucket():
    pool = make_pool(units=64)
    for r in range(10):
        pool.grow(r, 4, 0)
    pool.release(1, 1)  # 1-unit hole
    pool.release(3, 1)
    pool.release(4, 1)  # 2-unit hole
    assert pool.free_run_histogram() == {1: 1, 2: 1, 32: 1}  # and [10, 64): 54 units


def test_first_fit_pool_places_pages_in_the_lowest_hole():
    pool = make_pool(units=64, fit="first")
    for r in range(10):
        pool.grow(r, 4, 0)
    pool.release(2, 1)
    pool.release(5, 1)
    pool.release(6, 1)
    pool.grow(20, 4, 2)
    assert pool.request_pages(20)[0].offset == 2


# ---------------------------------------------------------------- reset, snapshot, events
def test_reset_frees_everything_and_records_reset():
    pool = make_pool()
    pool.grow(1, 100, 0, block_hashes=[1])
    pool.alloc_workspace(5, 0)
    pool.reset(1)
    m = pool.metrics()
    assert m.free_units == 256 and m.n_free_runs == 1 and m.n_requests == 0 and m.tokens_stored == 0
    assert kinds(pool.take_events())[-1] == "RESET"


def test_snapshot_row_and_state_describe_the_pool():
    pool = make_pool()
    pool.grow(1, 68, 0, block_hashes=[1])
    pool.grow(2, 68, 0, block_hashes=[1])
    ws = pool.alloc_workspace(3, 0)
    state = pool.snapshot(5)
    ev = pool.take_events()
    row = ev[-1]
    offsets, sizes = pool.free_runs()
    assert EventKind(row["kind"]) == EventKind.SNAPSHOT
    assert (row["offset"], row["size"], row["tokens"]) == (pool.largest_free_run, len(sizes), 68 + 4)
    assert row["aux"] == free_runs_checksum(offsets, sizes)
    assert list(state.offset) == sorted(state.offset)
    assert state.refs[list(state.offset).index(0)] == (1, 2)
    assert RegionState.WORKSPACE in set(state.state.tolist()) and ws in state.offset.tolist()
    assert int(state.size.sum()) + int(sizes.sum()) == 256


def test_take_events_returns_rows_in_order_and_clears():
    pool = make_pool()
    pool.grow(1, 3, 10)
    pool.grow(1, 1, 11)
    ws = pool.alloc_workspace(2, 12, tokens=9)
    ev = pool.take_events()
    assert ev.dtype.names[0] == "ts_ns" and kinds(ev) == ["ALLOC", "FILL", "WS_ALLOC"]
    assert ev["ts_ns"].tolist() == [10, 11, 12] and ev["tokens"][2] == 9 and ev["offset"][2] == ws
    assert len(pool.take_events()) == 0


def test_record_event_keeps_lifecycle_rows_in_order_and_refuses_memory_kinds():
    pool = make_pool()
    pool.record_event(EventKind.ARRIVE, 1, req=7, tokens=100, cls=5)
    pool.grow(7, 4, 2)
    assert kinds(pool.take_events()) == ["ARRIVE", "ALLOC"]
    with pytest.raises(ValueError, match="ALLOC"):
        pool.record_event(EventKind.ALLOC, 3)


def test_replaying_events_reproduces_free_runs_and_metrics_after_a_mixed_run(tmp_path):
    pool = make_pool(checkpoint_dir=tmp_path)
    mirror = ReplayMirror(256, 4)
    pool.grow(1, 150, 0, block_hashes=[1, 2])
    pool.grow(2, 130, 1, block_hashes=[1, 2])
    ws = pool.alloc_workspace(7, 1)
    replay_matches(pool, mirror)
    pool.grow(1, 3, 2)
    pool.evict(2, 3, pages=1, handling=Handling.SWAP)
    pool.evict(1, 3, pages=1, handling=Handling.RETAIN)
    replay_matches(pool, mirror)
    pool.release(1, 4)
    pool.free_workspace(ws, 4)
    pool.swap_in(2, 5)
    pool.compact(6, 8)
    pool.snapshot(7)
    replay_matches(pool, mirror)
    assert mirror.snapshots_checked == 1


def test_bad_geometry_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="page_classes"):
        make_pool(classes=(3,))
    with pytest.raises(ValueError, match="page_classes"):
        make_pool(classes=(16, 1))
