"""Replaying recorded traces through the caching-allocator twin (producers/sim/torch_allocator/replay.py).

The real files are ``torch.cuda.memory._dump_snapshot()`` pickles recorded on GPUs by others (see
tests/data/torch_snapshots/README.md). A replay matches when the twin made the same segment_alloc calls
in the same order and ended with the same blocks (offset, size, state) in every segment; every alloc
must also land at the address the real allocator chose (no notes).
"""

from __future__ import annotations

import gzip
import pickle
import random
from pathlib import Path

import pytest

from kvguard.producers.sim.torch_allocator.caching_allocator import AllocatorConfig, CachingAllocator, OutOfMemoryError
from kvguard.producers.sim.torch_allocator.replay import (
    ReplayUnsupported,
    compare_replay,
    config_from_snapshot,
    replay_device_trace,
)

MiB = 1 << 20
SNAPSHOTS = Path(__file__).resolve().parents[4] / "data" / "torch_snapshots"
TRACED = ["cs336_silmont2000_mem_snapshot.pickle", "decomfl_memory.pickle.gz",
          "cs336_magma27_memory_snapshot.pickle.gz", "cs336_wedsonlin_medium_1024_training.pickle.gz"]


def load(name: str) -> dict:
    data = (SNAPSHOTS / name).read_bytes()
    return pickle.loads(gzip.decompress(data) if name.endswith(".gz") else data)


@pytest.mark.parametrize("name", TRACED)
def test_real_trace_replays_to_the_real_segments_and_blocks(name):
    snapshot = load(name)
    comparison = compare_replay(snapshot, replay_device_trace(snapshot))
    assert comparison.matches, comparison.first_difference()
    assert comparison.notes == ()  # every alloc at the real address, every segment action reproduced
    assert len(comparison.real_layout) == len(snapshot["segments"])


def test_a_real_trace_from_an_empty_cache_makes_the_same_segment_allocations():
    comparison = compare_replay(snapshot := load("decomfl_memory.pickle.gz"), replay_device_trace(snapshot))
    assert len(comparison.twin_segment_allocs) == 61
    assert comparison.twin_segment_allocs == comparison.real_segment_allocs


@pytest.mark.parametrize("config", [AllocatorConfig(roundup_power2_divisions=4),
                                    AllocatorConfig(max_split_size_bytes=20 * MiB),
                                    AllocatorConfig(expandable_segments=True)])
def test_a_replay_under_the_wrong_settings_does_not_match(config):
    snapshot = load("decomfl_memory.pickle.gz")
    comparison = compare_replay(snapshot, replay_device_trace(snapshot, config=config))
    assert not comparison.matches and comparison.notes


def test_the_snapshot_settings_give_the_config():
    snapshot = load("cs336_wedsonlin_medium_1024_training.pickle.gz")
    assert config_from_snapshot(snapshot) == AllocatorConfig()
    snapshot["allocator_settings"] = dict(snapshot["allocator_settings"], max_split_size=256 * MiB)
    assert config_from_snapshot(snapshot).max_split_size_bytes == 256 * MiB
    snapshot["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    assert config_from_snapshot(snapshot).expandable_segments


def test_a_snapshot_without_trace_seeds_the_default_pool_and_leaves_private_pools_out():
    snapshot = load("verl_mem_no_trace.pickle.gz")
    twin = replay_device_trace(snapshot)
    comparison = compare_replay(snapshot, twin)
    assert comparison.matches, comparison.first_difference()
    assert len(comparison.real_layout) == 59  # the (0, 0) pool; vLLM's two MemPools are not modelled
    assert comparison.notes == ("68 private-pool (CUDA graph / MemPool) segments are not modelled and left out",)
    pending = [b for s in twin.snapshot()["segments"] for b in s["blocks"] if b["state"] == "active_pending_free"]
    assert pending  # blocks awaiting a cross-stream free stay pending


def workload(config: AllocatorConfig, seed: int, *, trace_max_entries=None, steps=1500) -> CachingAllocator:
    """A random, OOM-prone workload on two streams with cross-stream frees and empty_cache calls."""
    rng = random.Random(seed)
    allocator = CachingAllocator(300 * MiB, config=config, trace_max_entries=trace_max_entries)
    live = []
    for step in range(steps):
        r = rng.random()
        if r < 0.55 or not live:
            size = rng.choice([rng.randint(1, 4096), rng.randint(1, 2 * MiB), rng.randint(1, 30 * MiB),
                               rng.randint(20 * MiB, 80 * MiB)])
            try:
                live.append(allocator.malloc(size, stream=rng.choice([0, 0, 0, 7]), now_ns=step * 1000))
            except OutOfMemoryError:
                pass
        elif r < 0.97:
            address = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.1:
                allocator.record_stream(address, 99)
            allocator.free(address, now_ns=step * 1000)
            if rng.random() < 0.2:
                allocator.synchronize()
        else:
            allocator.empty_cache(now_ns=step * 1000)
    return allocator


CONFIGS = [AllocatorConfig(), AllocatorConfig(max_split_size_bytes=40 * MiB), AllocatorConfig(expandable_segments=True),
           AllocatorConfig(per_process_memory_fraction=0.8, garbage_collection_threshold=0.6,
                           max_split_size_bytes=30 * MiB)]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.to_string() or "default")
def test_a_twins_whole_trace_replays_exactly_with_ooms_retries_and_cross_stream_frees(config):
    for seed in range(2):
        allocator = workload(config, seed)
        stats = allocator.memory_stats()
        assert stats["num_ooms"] and stats["num_alloc_retries"]  # the workload exercises the hard paths
        snapshot = allocator.snapshot()
        comparison = compare_replay(snapshot, replay_device_trace(snapshot, total_bytes=300 * MiB))
        assert comparison.matches, comparison.first_difference()
        assert comparison.notes == ()


@pytest.mark.parametrize("config", CONFIGS[:2] + CONFIGS[3:], ids=lambda c: c.to_string() or "default")
def test_a_wrapped_trace_is_replayed_from_seeded_segments(config):
    for seed in range(3):
        snapshot = workload(config, seed, trace_max_entries=600).snapshot()
        comparison = compare_replay(snapshot, replay_device_trace(snapshot, total_bytes=300 * MiB))
        assert comparison.matches, comparison.first_difference()


def test_expandable_segments_that_predate_the_trace_cannot_be_seeded():
    snapshot = workload(AllocatorConfig(expandable_segments=True), 0, trace_max_entries=600).snapshot()
    with pytest.raises(ReplayUnsupported, match="expandable"):
        replay_device_trace(snapshot, total_bytes=300 * MiB)


def test_a_divergent_replay_reports_where_it_diverged():
    allocator = CachingAllocator(300 * MiB)
    allocator.free(allocator.malloc(30 * MiB))
    allocator.malloc(12 * MiB)  # reuses the cached 30 MiB block
    snapshot = allocator.snapshot()
    replayed = replay_device_trace(snapshot, config=AllocatorConfig(max_split_size_bytes=20 * MiB))
    comparison = compare_replay(snapshot, replayed)  # now oversize: the 12 MiB needs its own segment
    assert not comparison.matches
    assert comparison.first_difference() == "segment allocations: real made 1, twin 2"
    assert any("did not need" in note for note in comparison.notes)
