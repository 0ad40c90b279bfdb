"""Invariants of the caching-allocator twin under random malloc/free/empty_cache sequences (hypothesis).

After every step: the blocks of each segment tile it exactly; no two adjacent blocks of a segment are
both free; every stat equals the sum over the snapshot's segments; allocated <= reserved <= capacity and
the driver holds exactly what the allocator reserved. And a twin's own snapshot replays to itself.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvguard.producers.sim.torch_allocator.caching_allocator import AllocatorConfig, CachingAllocator, OutOfMemoryError
from kvguard.producers.sim.torch_allocator.replay import compare_replay, replay_device_trace

MiB = 1 << 20
CAPACITY = 128 * MiB

configs = st.sampled_from([
    AllocatorConfig(),
    AllocatorConfig(max_split_size_bytes=40 * MiB),
    AllocatorConfig(expandable_segments=True),
    AllocatorConfig(roundup_power2_divisions=4),
    AllocatorConfig(per_process_memory_fraction=0.8, garbage_collection_threshold=0.5, max_split_size_bytes=24 * MiB),
])
sizes = st.one_of(st.integers(1, 8192), st.integers(1, 2 * MiB), st.integers(MiB, 24 * MiB),
                  st.integers(20 * MiB, 60 * MiB))
operations = st.lists(st.one_of(
    st.tuples(st.just("malloc"), sizes, st.sampled_from([0, 0, 0, 5])),
    st.tuples(st.just("free"), st.integers(0, 10_000), st.booleans()),  # (index into live, cross-stream use)
    st.tuples(st.just("synchronize"), st.none(), st.none()),
    st.tuples(st.just("empty_cache"), st.none(), st.none()),
), min_size=30, max_size=200)


def run(config: AllocatorConfig, ops) -> tuple[CachingAllocator, list]:
    allocator = CachingAllocator(CAPACITY, config=config)
    live: list[int] = []
    for step, (kind, a, b) in enumerate(ops):
        if kind == "malloc":
            try:
                live.append(allocator.malloc(a, stream=b, now_ns=step * 1000))
            except OutOfMemoryError:
                pass
        elif kind == "free" and live:
            address = live.pop(a % len(live))
            if b:
                allocator.record_stream(address, 9)
            allocator.free(address, now_ns=step * 1000)
        elif kind == "synchronize":
            allocator.synchronize()
        elif kind == "empty_cache":
            allocator.empty_cache(now_ns=step * 1000)
        yield allocator


def check_invariants(allocator: CachingAllocator) -> None:
    snapshot = allocator.snapshot()
    stats = allocator.memory_stats()
    sums = dict.fromkeys(("allocated", "active", "requested", "reserved", "split_bytes", "split_blocks"), 0)
    segments = {"small": 0, "large": 0}
    largest_free = 0
    for segment in snapshot["segments"]:
        address, previous_free = segment["address"], False
        for block in segment["blocks"]:
            assert block["address"] == address, "blocks must tile the segment without gaps"
            address += block["size"]
            free = block["state"] == "inactive"
            assert not (free and previous_free), "two adjacent free blocks should have merged"
            previous_free = free
            sums["allocated"] += block["size"] if block["state"] == "active_allocated" else 0
            sums["active"] += 0 if free else block["size"]
            sums["requested"] += 0 if free else block["requested_size"]
            if free:
                largest_free = max(largest_free, block["size"])
            if free and len(segment["blocks"]) > 1 and not segment["is_expandable"]:
                sums["split_bytes"] += block["size"]
                sums["split_blocks"] += 1
        assert address == segment["address"] + segment["total_size"], "blocks must tile the segment exactly"
        sums["reserved"] += segment["total_size"]
        segments[segment["segment_type"]] += 0 if segment["is_expandable"] else 1
    assert stats["allocated_bytes.all.current"] == sums["allocated"]
    assert stats["active_bytes.all.current"] == sums["active"]
    assert stats["requested_bytes.all.current"] == sums["requested"]
    assert stats["reserved_bytes.all.current"] == sums["reserved"]
    assert stats["inactive_split_bytes.all.current"] == sums["split_bytes"]
    assert stats["inactive_split.all.current"] == sums["split_blocks"]
    assert stats["segment.small_pool.current"] == segments["small"]
    assert stats["segment.large_pool.current"] == segments["large"]
    for name in ("allocated_bytes", "reserved_bytes", "active_bytes", "segment", "allocation"):
        assert stats[f"{name}.all.current"] == stats[f"{name}.small_pool.current"] + stats[f"{name}.large_pool.current"]
        assert stats[f"{name}.all.peak"] >= stats[f"{name}.all.current"] >= 0
    assert stats["allocated_bytes.all.current"] <= stats["reserved_bytes.all.current"] <= CAPACITY
    assert allocator.device_memory.used_bytes == stats["reserved_bytes.all.current"]
    assert allocator.largest_free_cached_block() == largest_free


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs, operations)
def test_random_sequences_keep_the_allocator_invariants(config, ops):
    for allocator in run(config, ops):
        check_invariants(allocator)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs, operations)
def test_a_twins_own_snapshot_replays_to_the_same_allocator(config, ops):
    *_, allocator = run(config, ops)
    snapshot = allocator.snapshot()
    replayed = replay_device_trace(snapshot, total_bytes=CAPACITY)
    comparison = compare_replay(snapshot, replayed)
    assert comparison.matches, comparison.first_difference()
    assert comparison.notes == ()
    assert replayed.memory_stats()["allocated_bytes.all.current"] == allocator.memory_stats()[
        "allocated_bytes.all.current"]
