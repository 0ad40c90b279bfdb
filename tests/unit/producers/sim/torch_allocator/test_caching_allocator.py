"""Behaviours of the CUDA caching-allocator twin (producers/sim/torch_allocator/caching_allocator.py), one rule per test."""

from __future__ import annotations

import gzip
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from kvguard.producers.sim.torch_allocator.caching_allocator import (
    AllocatorConfig,
    CachingAllocator,
    DeviceMemory,
    OutOfMemoryError,
    UnknownAddress,
    format_size,
    get_allocation_size,
)
from kvguard.producers.sim.torch_allocator.config import ConfigError, roundup_power2_next_division
from kvguard.producers.sim.torch_allocator.device import ExternalReservationFailed

MiB = 1 << 20
GiB = 1 << 30
SNAPSHOTS = Path(__file__).resolve().parents[4] / "data" / "torch_snapshots"


def twin(capacity=GiB, **config) -> CachingAllocator:
    return CachingAllocator(capacity, config=AllocatorConfig(**config))


def layout(allocator: CachingAllocator) -> list[list[tuple[int, str]]]:
    """Per segment (by address): the (size, state) of its blocks."""
    return [[(b["size"], b["state"]) for b in s["blocks"]] for s in allocator.snapshot()["segments"]]


def actions(allocator: CachingAllocator) -> list[tuple[str, int]]:
    return [(e["action"], e["size"]) for e in allocator.take_trace()]


# ---- rounding and pools ---------------------------------------------------------------------

def test_round_size_is_at_least_512_bytes_and_a_multiple_of_512():
    config = AllocatorConfig()
    assert [config.round_size(n) for n in (1, 511, 512, 513, MiB + 1)] == [512, 512, 512, 1024, MiB + 512]


def test_roundup_power2_divisions_round_to_the_next_step_between_powers_of_two():
    config = AllocatorConfig(roundup_power2_divisions=4)
    assert config.round_size(5 * MiB + 1) == 6 * MiB  # steps of 1 MiB between 4 and 8 MiB
    assert config.round_size(8 * MiB) == 8 * MiB  # a power of two stays
    assert config.round_size(1200) == 1536  # under 512 * divisions: plain 512-byte rounding
    assert roundup_power2_next_division(1200, 4) == 1280  # the worked example in the C++ comment


def test_config_parses_pytorch_cuda_alloc_conf_and_skips_unknown_keys():
    config = AllocatorConfig.from_string("backend:native, expandable_segments:True,max_split_size_mb:128,"
                                         "garbage_collection_threshold:0.6,pinned_use_cuda_host_register:True,"
                                         "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
    assert config.expandable_segments and config.max_split_size_bytes == 128 * MiB
    assert config.garbage_collection_threshold == 0.6
    assert config.roundup_power2_divisions == (1,) * 9 + (2, 4) + (8,) * 5
    assert AllocatorConfig.from_string(config.to_string()) == config
    with pytest.raises(ConfigError, match="max_split_size"):
        AllocatorConfig.from_string("max_split_size_mb:10")  # PyTorch's minimum is 20 MiB


def test_requests_up_to_1_mib_use_the_small_pool_and_larger_ones_the_large_pool():
    allocator = twin()
    allocator.malloc(MiB)
    allocator.malloc(MiB + 1)
    stats = allocator.memory_stats()
    assert stats["segment.small_pool.current"] == 1 and stats["reserved_bytes.small_pool.current"] == 2 * MiB
    assert stats["segment.large_pool.current"] == 1 and stats["reserved_bytes.large_pool.current"] == 20 * MiB


@pytest.mark.parametrize(("request_bytes", "segment_bytes"), [
    (100, 2 * MiB), (MiB, 2 * MiB), (MiB + 1, 20 * MiB), (10 * MiB - 512, 20 * MiB), (10 * MiB - 1, 10 * MiB),
    (10 * MiB, 10 * MiB),
    (10 * MiB + 1, 12 * MiB), (101 * MiB, 102 * MiB)])
def test_new_segments_are_2_mib_20_mib_or_the_request_rounded_to_2_mib(request_bytes, segment_bytes):
    allocator = twin()
    allocator.malloc(request_bytes)
    assert actions(allocator)[0] == ("segment_alloc", segment_bytes)
    assert get_allocation_size(AllocatorConfig().round_size(request_bytes)) == segment_bytes


# ---- best fit, splitting, merging ----------------------------------------------------------------

def test_small_pool_splits_whenever_512_bytes_or_more_remain():
    allocator = twin()
    allocator.malloc(512)
    assert layout(allocator) == [[(512, "active_allocated"), (2 * MiB - 512, "inactive")]]
    allocator.malloc(MiB)
    allocator.malloc(MiB - 512)  # exactly the rest: nothing left to split off
    assert layout(allocator) == [[(512, "active_allocated"), (MiB, "active_allocated"),
                                  (MiB - 512, "active_allocated")]]


def test_large_pool_splits_only_when_more_than_1_mib_remains():
    allocator = twin()
    allocator.malloc(19 * MiB)  # 1 MiB would remain: the block keeps the whole segment
    allocator.malloc(int(18.5 * MiB))  # 1.5 MiB remains: split
    assert layout(allocator) == [[(20 * MiB, "active_allocated")],
                                 [(int(18.5 * MiB), "active_allocated"), (int(1.5 * MiB), "inactive")]]
    assert allocator.memory_stats()["allocated_bytes.all.current"] == 20 * MiB + int(18.5 * MiB)


def test_best_fit_takes_the_smallest_cached_block_that_fits():
    allocator = twin()
    big, small = allocator.malloc(16 * MiB), allocator.malloc(12 * MiB)
    allocator.free(big)
    allocator.free(small)
    assert allocator.malloc(11 * MiB) == small
    assert allocator.memory_stats()["num_device_alloc"] == 2


def test_a_cached_block_serves_only_its_own_stream():
    allocator = twin()
    allocator.free(allocator.malloc(4096, stream=0))
    allocator.malloc(4096, stream=7)
    assert [s["stream"] for s in allocator.snapshot()["segments"]] == [0, 7]


def test_freeing_merges_a_block_with_its_free_neighbours():
    allocator = twin()
    a, b, c = (allocator.malloc(512) for _ in range(3))
    allocator.free(a)
    allocator.free(c)
    assert layout(allocator) == [[(512, "inactive"), (512, "active_allocated"), (2 * MiB - 1024, "inactive")]]
    assert allocator.memory_stats()["inactive_split.small_pool.current"] == 2
    allocator.free(b)
    assert layout(allocator) == [[(2 * MiB, "inactive")]]
    stats = allocator.memory_stats()
    assert stats["inactive_split.all.current"] == 0 and stats["inactive_split_bytes.all.current"] == 0


# ---- max_split_size -------------------------------------------------------------------------------

def test_max_split_size_keeps_oversize_blocks_from_small_requests():
    allocator = twin(max_split_size_bytes=40 * MiB)
    allocator.free(allocator.malloc(60 * MiB))
    allocator.malloc(30 * MiB)  # may not take the cached 60 MiB block
    assert [s["total_size"] for s in allocator.snapshot()["segments"]] == [60 * MiB, 30 * MiB]
    assert allocator.memory_stats()["oversize_segments.current"] == 1


def test_an_oversize_request_takes_an_oversize_block_within_the_rounding_limit_unsplit():
    allocator = twin(max_split_size_bytes=40 * MiB)
    block = allocator.malloc(60 * MiB)
    allocator.free(block)
    assert allocator.malloc(45 * MiB) == block  # 60 < 45 + 20: taken whole
    assert layout(allocator) == [[(60 * MiB, "active_allocated")]]
    allocator.free(block)
    assert allocator.malloc(39 * MiB) != block  # 39 MiB is not oversize (its new 40 MiB segment is)
    assert allocator.malloc(41 * MiB) == block  # refused only from 41 + 20 = 61 MiB on
    assert allocator.memory_stats()["oversize_allocations.allocated"] == 4


def test_release_available_cached_blocks_frees_an_oversize_block_before_a_full_flush():
    allocator = twin(capacity=140 * MiB, max_split_size_bytes=40 * MiB)
    allocator.free(allocator.malloc(100 * MiB))
    kept = allocator.malloc(4 * MiB)  # a 20 MiB segment that must survive
    allocator.free(kept)
    allocator.malloc(45 * MiB)  # too small for the cached 100 MiB block; cudaMalloc fails
    stats = allocator.memory_stats()
    assert stats["num_alloc_retries"] == 0 and stats["num_device_free"] == 1
    assert [s["total_size"] for s in allocator.snapshot()["segments"]] == [20 * MiB, 46 * MiB]


# ---- failed cudaMalloc, retries and OOM ----------------------------------------------------------

def test_a_failed_cudamalloc_releases_the_cache_and_retries():
    allocator = twin(capacity=100 * MiB)
    allocator.free(allocator.malloc(60 * MiB))
    allocator.take_trace()
    allocator.malloc(70 * MiB)
    assert actions(allocator) == [("segment_free", 60 * MiB), ("segment_alloc", 70 * MiB), ("alloc", 70 * MiB)]
    stats = allocator.memory_stats()
    assert stats["num_alloc_retries"] == 1 and stats["num_sync_all_streams"] == 1 and stats["num_ooms"] == 0


def test_oom_at_peak_carries_pytorchs_fields():
    allocator = twin(capacity=100 * MiB)
    allocator.malloc(90 * MiB)
    with pytest.raises(OutOfMemoryError) as caught:
        allocator.malloc(15 * MiB)
    oom = caught.value
    assert (oom.tried_to_allocate_bytes, oom.device_total_bytes, oom.device_free_bytes) == (16 * MiB, 100 * MiB,
                                                                                          10 * MiB)
    assert (oom.allocated_bytes, oom.reserved_unallocated_bytes, oom.cause) == (90 * MiB, 0, "peak")
    assert str(oom).startswith("CUDA out of memory. Tried to allocate 16.00 MiB. GPU 0 has a total capacity of "
                               "100.00 MiB of which 10.00 MiB is free. Of the allocated memory 90.00 MiB is "
                               "allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated.")
    assert allocator.memory_stats()["num_ooms"] == 1
    oom_entry = allocator.take_trace()[-1]
    assert oom_entry["action"] == "oom" and oom_entry["device_free"] == 10 * MiB and "addr" not in oom_entry


def test_oom_with_enough_reserved_but_scattered_memory_is_fragmentation():
    allocator = twin(capacity=20 * MiB)
    a, _, c = (allocator.malloc(6 * MiB) for _ in range(3))  # [a 6][b 6][c 6][2 free] in one 20 MiB segment
    allocator.free(a)
    allocator.free(c)  # 14 MiB free, in pieces of 6 and 8 MiB
    with pytest.raises(OutOfMemoryError) as caught:
        allocator.malloc(10 * MiB)
    assert caught.value.cause == "fragmentation" and caught.value.reserved_unallocated_bytes == 14 * MiB
    assert "14.00 MiB is reserved by PyTorch but unallocated" in str(caught.value)
    assert allocator.largest_free_cached_block() == 8 * MiB


def test_memory_fraction_caps_reservations_and_is_reported_in_the_oom():
    allocator = CachingAllocator(200 * MiB, config=AllocatorConfig(per_process_memory_fraction=0.5))
    with pytest.raises(OutOfMemoryError, match=r"100\.00 MiB allowed; "):
        allocator.malloc(120 * MiB)
    assert allocator.device_memory.free_bytes == 200 * MiB


# ---- empty_cache and garbage collection ----------------------------------------------------------

def test_empty_cache_releases_only_segments_without_allocations():
    allocator = twin()
    allocator.malloc(3 * MiB)  # splits a 20 MiB segment: it stays
    allocator.free(allocator.malloc(30 * MiB))
    allocator.empty_cache()
    assert [s["total_size"] for s in allocator.snapshot()["segments"]] == [20 * MiB]
    stats = allocator.memory_stats()
    assert stats["reserved_bytes.all.current"] == 20 * MiB and stats["num_device_free"] == 1


def test_garbage_collection_releases_the_longest_unused_cached_blocks_first():
    config = AllocatorConfig(per_process_memory_fraction=0.5, garbage_collection_threshold=0.5)
    allocator = CachingAllocator(200 * MiB, config=config)  # allowed 100 MiB, collect above 50 MiB
    allocator.free(allocator.malloc(12 * MiB, stream=1))
    allocator.free(allocator.malloc(20 * MiB))  # "old": cached, then never reused
    for _ in range(5):  # large-pool searches age every cached block; the one they reuse starts again
        allocator.free(allocator.malloc(12 * MiB, stream=1))
    allocator.free(allocator.malloc(22 * MiB))  # "young": 54 MiB reserved now
    allocator.take_trace()
    allocator.malloc(25 * MiB)  # nothing cached fits: collect above-average ages (old: 7, others 2 and 1)
    assert actions(allocator) == [("segment_free", 20 * MiB), ("segment_alloc", 26 * MiB), ("alloc", 25 * MiB)]
    assert sorted(s["total_size"] for s in allocator.snapshot()["segments"]) == [12 * MiB, 22 * MiB, 26 * MiB]


def test_without_a_memory_fraction_the_garbage_collector_never_runs():
    allocator = twin(capacity=200 * MiB, garbage_collection_threshold=0.5)
    allocator.free(allocator.malloc(30 * MiB))
    allocator.malloc(35 * MiB)
    assert allocator.memory_stats()["num_device_free"] == 0


# ---- expandable segments ------------------------------------------------------------------------

def test_expandable_segments_grow_one_segment_instead_of_adding_segments():
    allocator = twin(expandable_segments=True)
    allocator.malloc(3 * MiB)
    allocator.malloc(30 * MiB)
    assert actions(allocator) == [("segment_map", 20 * MiB), ("alloc", 3 * MiB), ("segment_map", 20 * MiB),
                                  ("alloc", 30 * MiB)]
    (segment,) = allocator.snapshot()["segments"]
    assert segment["is_expandable"] and segment["total_size"] == 40 * MiB
    assert [(b["size"], b["state"]) for b in segment["blocks"]] == [
        (3 * MiB, "active_allocated"), (30 * MiB, "active_allocated"), (7 * MiB, "inactive")]
    plain = twin()
    plain.malloc(3 * MiB)
    plain.malloc(30 * MiB)
    assert [s["total_size"] for s in plain.snapshot()["segments"]] == [20 * MiB, 30 * MiB]


def test_empty_cache_unmaps_the_whole_free_pages_of_an_expandable_segment():
    allocator = twin(expandable_segments=True)
    allocator.malloc(3 * MiB)
    allocator.free(allocator.malloc(30 * MiB))
    allocator.take_trace()
    allocator.empty_cache()
    assert actions(allocator) == [("segment_unmap", 20 * MiB)]  # [20, 40) MiB; [3, 20) shares a page
    assert layout(allocator) == [[(3 * MiB, "active_allocated"), (17 * MiB, "inactive")]]
    stats = allocator.memory_stats()
    assert stats["reserved_bytes.all.current"] == 20 * MiB and stats["segment.all.current"] == 0
    assert stats["inactive_split_bytes.all.current"] == 0  # PyTorch leaves expandable segments out


def test_expandable_segments_tile_a_growing_batch_that_fragments_plain_segments():
    def grow(allocator):  # each step frees the last batch's tensor and allocates a slightly larger one
        live = [allocator.malloc(24 * MiB)]
        for k in range(1, 12):
            allocator.free(live.pop())
            live.append(allocator.malloc((24 + 2 * k) * MiB))
        return allocator.memory_stats()["reserved_bytes.all.current"]
    assert grow(twin(expandable_segments=True)) == 60 * MiB
    assert grow(twin()) > 200 * MiB


def test_the_small_pool_of_an_expandable_allocator_maps_2_mib_pages():
    allocator = twin(expandable_segments=True)
    allocator.malloc(4096)
    assert actions(allocator)[0] == ("segment_map", 2 * MiB)


# ---- cross-stream frees ---------------------------------------------------------------------------

def test_a_block_used_on_another_stream_is_pending_until_that_stream_catches_up():
    allocator = twin()
    block = allocator.malloc(4096)
    allocator.record_stream(block, 1)
    allocator.free(block)
    assert layout(allocator)[0][0] == (4096, "active_pending_free")
    assert allocator.malloc(4096) != block  # not reusable yet
    allocator.synchronize(1)
    allocator.take_trace()
    allocator.malloc(4096)  # process_events completes the free first, then best fit takes it back
    assert [e["action"] for e in allocator.take_trace()] == ["free_completed", "alloc"]


def test_empty_cache_waits_for_pending_frees_and_then_releases_them():
    allocator = twin()
    block = allocator.malloc(4096)
    allocator.record_stream(block, 1)
    allocator.free(block)
    allocator.empty_cache()
    assert allocator.snapshot()["segments"] == []
    assert allocator.memory_stats()["num_sync_all_streams"] == 1


def test_freeing_an_unknown_or_freed_address_is_refused():
    allocator = twin()
    block = allocator.malloc(4096)
    allocator.free(block)
    with pytest.raises(UnknownAddress, match="not a live allocation"):
        allocator.free(block)


# ---- the device ----------------------------------------------------------------------------------

def test_memory_reserved_outside_the_allocator_shrinks_what_cudamalloc_gets():
    allocator = CachingAllocator(100 * MiB, total_bytes=120 * MiB)
    allocator.device_memory.reserve_external(70 * MiB)  # e.g. a KV-cache arena
    with pytest.raises(OutOfMemoryError) as caught:
        allocator.malloc(40 * MiB)
    assert (caught.value.device_total_bytes, caught.value.device_free_bytes) == (120 * MiB, 30 * MiB)
    allocator.device_memory.release_external(70 * MiB)
    allocator.malloc(40 * MiB)
    with pytest.raises(ExternalReservationFailed):
        allocator.device_memory.reserve_external(61 * MiB)


def test_a_clone_evolves_independently():
    allocator = twin()
    block = allocator.malloc(5 * MiB)
    fork = allocator.clone()
    fork.free(block)
    fork.malloc(50 * MiB)
    assert layout(allocator) == [[(5 * MiB, "active_allocated"), (15 * MiB, "inactive")]]
    assert allocator.memory_stats()["reserved_bytes.all.current"] == 20 * MiB
    assert isinstance(allocator.device_memory, DeviceMemory) and allocator.device_memory.used_bytes == 20 * MiB


# ---- stats, trace and snapshot -------------------------------------------------------------------

def test_memory_stats_use_torchs_key_names_and_values():
    allocator = twin()
    a = allocator.malloc(1000)
    allocator.malloc(3 * MiB)
    allocator.free(a)
    stats = allocator.memory_stats()
    names = ("allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
             "active_bytes", "inactive_split_bytes", "requested_bytes")
    expected = {f"{n}.{p}.{m}" for n in names for p in ("all", "small_pool", "large_pool")
                for m in ("current", "peak", "allocated", "freed")}
    expected |= {f"{n}.{m}" for n in ("oversize_allocations", "oversize_segments")
                 for m in ("current", "peak", "allocated", "freed")}
    expected |= {"num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free",
                 "max_split_size"}
    assert set(stats) == expected and list(stats) == sorted(stats)
    assert stats["allocated_bytes.all.current"] == 3 * MiB and stats["allocated_bytes.all.peak"] == 3 * MiB + 1024
    assert stats["allocated_bytes.small_pool.freed"] == 1024 and stats["requested_bytes.large_pool.current"] == 3 * MiB
    assert stats["reserved_bytes.all.current"] == 22 * MiB and stats["num_device_alloc"] == 2
    assert stats["max_split_size"] == -1  # SIZE_MAX seen through int64, as torch reports it


def test_trace_entries_carry_the_callers_time_and_are_drained_once():
    allocator = twin()
    block = allocator.malloc(4096, now_ns=5_000_000)
    allocator.free(block, now_ns=7_000_000)
    entries = allocator.take_trace()
    assert [(e["action"], e["time_us"]) for e in entries] == [
        ("segment_alloc", 5000), ("alloc", 5000), ("free_requested", 7000), ("free_completed", 7000)]
    assert entries[1] == {"action": "alloc", "addr": block, "size": 4096, "stream": 0, "time_us": 5000,
                          "compile_context": "N/A", "user_metadata": "", "frames": []}
    assert allocator.take_trace() == []


def test_snapshot_has_the_shape_of_a_real_torch_snapshot(tmp_path):
    real = pickle.loads(gzip.decompress((SNAPSHOTS / "decomfl_memory.pickle.gz").read_bytes()))
    allocator = twin()
    allocator.malloc(4096)
    allocator.dump_snapshot(tmp_path / "twin.pickle")
    ours = pickle.loads((tmp_path / "twin.pickle").read_bytes())
    assert set(ours) == set(real)
    assert set(ours["segments"][0]) == set(real["segments"][0])
    assert set(ours["segments"][0]["blocks"][0]) == set(real["segments"][0]["blocks"][0])
    assert set(ours["device_traces"][0][0]) | {"user_metadata"} == set(real["device_traces"][0][0]) | {
        "user_metadata"}
    assert set(ours["allocator_settings"]) == set(real["allocator_settings"])
    assert allocator.snapshot()["device_traces"][0][-1]["action"] == "snapshot"  # the previous snapshot's mark


def test_format_size_matches_pytorchs_boundaries():
    assert [format_size(n) for n in (1024, 1025, MiB, MiB + 1, GiB, GiB + 1)] == [
        "1024 bytes", "1.00 KiB", "1024.00 KiB", "1.00 MiB", "1024.00 MiB", "1.00 GiB"]


# ---- PyTorch's own viewer reads the twin's snapshots -----------------------------------------------

@pytest.fixture(scope="module")
def viz_run(tmp_path_factory):
    """Dump a twin snapshot and run `python -m torch.cuda._memory_viz` on it, with a flamegraph.pl stand-in
    that echoes the folded stacks (the real script is downloaded from the internet)."""
    home = tmp_path_factory.mktemp("home")
    (home / ".cache").mkdir()
    stub = home / ".cache" / "flamegraph.pl"
    stub.write_text("#!/bin/sh\ncat\n")
    stub.chmod(0o755)
    allocator = twin()
    blocks = [allocator.malloc(n) for n in (4096, 3 * MiB, 25 * MiB, 700_000)]
    allocator.free(blocks[1])
    path = home / "twin.pickle"
    allocator.dump_snapshot(path)
    env = dict(os.environ, HOME=str(home))

    def run(*args):
        return subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", *args, str(path)], env=env,
                              capture_output=True, text=True, timeout=120, cwd=home, check=False)
    return allocator, run, home


def test_memory_viz_stats_reports_the_twins_totals(viz_run):
    allocator, run, _ = viz_run
    out = run("stats")
    assert out.returncode == 0, out.stderr
    stats = allocator.memory_stats()
    assert f"segments: {stats['segment.all.current']}\n" in out.stdout
    assert f"total_reserved: {stats['reserved_bytes.all.current'] / MiB:3.1f}MiB" in out.stdout
    requested = stats["requested_bytes.all.current"]
    assert f"total_allocated: {requested / MiB:3.1f}MiB" in out.stdout


def test_memory_viz_segments_and_trace_read_the_twins_snapshot(viz_run):
    _, run, home = viz_run
    segments = run("segments", "-o", str(home / "segments.txt"))
    assert segments.returncode == 0, segments.stderr
    folded = (home / "segments.txt").read_text()
    assert "stream_0;seg_" in folded and ";inactive;" in folded and ";active_allocated;" in folded
    trace = run("trace")
    assert trace.returncode == 0, trace.stderr
    assert "cudaMalloc(" in trace.stdout and "del " in trace.stdout


def test_the_twin_imports_only_the_standard_library():
    code = ("import sys\n"
            "import kvguard.producers.sim.torch_allocator.caching_allocator as m\n"
            "m.replay_device_trace\n"
            "print(','.join(sorted(n for n in ('torch', 'numpy', 'pydantic', 'faust', 'redis') if n in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
