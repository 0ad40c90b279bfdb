"""The snapshot reader, the fragmentation report and the trace conversion, on real GPU snapshots.

The files in ``tests/data/torch_snapshots/`` were recorded by others on their GPUs (see the
README there). Expected figures are recomputed here straight from the snapshot dicts, not
taken from the module under test.
"""

from __future__ import annotations

import builtins
import gzip
import json
import os
import pickle
from functools import cache
from pathlib import Path

import pytest

import kvguard.producers.torch_snapshot.snapshot as ts

DATA = Path(__file__).resolve().parents[3] / "data" / "torch_snapshots"
TRACED = ["cs336_silmont2000_mem_snapshot.pickle", "decomfl_memory.pickle.gz",
          "cs336_magma27_memory_snapshot.pickle.gz",
          "cs336_wedsonlin_medium_1024_training.pickle.gz"]
ALL = TRACED + ["verl_mem_no_trace.pickle.gz"]
MIB = 1 << 20


@cache
def snapshot(name: str) -> dict:
    return ts.load_snapshot(DATA / name)


def blocks_with_addresses(seg: dict):
    address = seg["address"]
    for block in seg["blocks"]:
        yield address, block
        address += block["size"]


@pytest.mark.parametrize("name", ALL)
def test_loads_each_bundled_snapshot(name):
    snap = snapshot(name)
    assert snap["segments"], name
    if name in TRACED:
        assert any(snap["device_traces"]), f"{name} should carry a trace"


def test_gzip_and_plain_files_load_the_same(tmp_path):
    plain = DATA / TRACED[0]
    packed = tmp_path / (plain.name + ".gz")
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert ts.load_snapshot(packed) == ts.load_snapshot(plain)


@pytest.mark.parametrize("name", ALL)
def test_report_totals_equal_independent_sums_over_segments(name):
    snap = snapshot(name)
    segments = snap["segments"]
    blocks = [b for seg in segments for b in seg["blocks"]]
    free = [b["size"] for b in blocks if b["state"] == "inactive"]
    allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    totals = ts.fragmentation_report(snap)["totals"]

    assert totals["num_segments"] == len(segments)
    assert totals["reserved_bytes"] == sum(seg["total_size"] for seg in segments)
    assert totals["allocated_bytes"] == allocated
    # PyTorch's own per-segment count agrees (memory_allocated() counts rounded block sizes)
    assert totals["allocated_bytes"] == sum(seg["allocated_size"] for seg in segments)
    assert totals["unallocated_bytes"] == totals["reserved_bytes"] - allocated
    assert totals["free_bytes"] == sum(free)
    assert totals["largest_free_bytes"] == max(free, default=0)
    expected_f_ext = 1 - max(free) / sum(free) if free else 0.0
    assert totals["f_ext"] == pytest.approx(expected_f_ext)
    assert totals["rounding_waste_bytes"] == sum(
        b["size"] - b["requested_size"] for b in blocks if b["state"] == "active_allocated")


@pytest.mark.parametrize("name", ALL)
def test_pools_partition_the_totals(name):
    report = ts.fragmentation_report(snapshot(name))
    for key in ("num_segments", "reserved_bytes", "allocated_bytes", "free_bytes",
                "rounding_waste_bytes", "pending_free_bytes"):
        assert sum(pool[key] for pool in report["pools"].values()) == report["totals"][key], key
    small = [r for r in report["segments"] if r["pool"] == "small"]
    assert report["pools"]["small"]["reserved_bytes"] == sum(r["reserved_bytes"] for r in small)


@pytest.mark.parametrize("name", ALL)
def test_small_pool_holds_only_requests_up_to_one_mib(name):
    for seg in snapshot(name)["segments"]:
        live = [b["size"] for b in seg["blocks"] if b["state"] != "inactive"]
        if seg["segment_type"] == "small":
            assert seg["total_size"] == 2 * MIB
            assert all(size <= MIB for size in live)
        else:
            assert seg["total_size"] >= 10 * MIB
            assert all(size > MIB for size in live)


@pytest.mark.parametrize("name", ALL)
def test_pinned_segments_are_the_mostly_free_ones_holding_an_allocated_block(name):
    snap = snapshot(name)
    expected = set()
    for seg in snap["segments"]:
        free = sum(b["size"] for b in seg["blocks"] if b["state"] == "inactive")
        held = any(b["state"] == "active_allocated" for b in seg["blocks"])
        if held and free >= 0.5 * seg["total_size"]:
            expected.add(seg["address"])
    report = ts.fragmentation_report(snap)
    assert {p["address"] for p in report["pinned"]} == expected
    rows = {r["address"]: r for r in report["segments"]}
    for pinned in report["pinned"]:
        holder_bytes = sum(b["size"] for b in pinned["blocks"])
        assert holder_bytes == rows[pinned["address"]]["allocated_bytes"]
    assert report["totals"]["num_pinned_segments"] == len(expected)


def test_pinning_blocks_are_named_by_a_frame_when_the_trace_has_one():
    report = ts.fragmentation_report(snapshot("decomfl_memory.pickle.gz"))
    frames = [b["frame"] for p in report["pinned"] for b in p["blocks"]]
    assert frames and all(frames)
    assert any(".py:" in frame for frame in frames)


@pytest.mark.parametrize("name", ALL)
def test_text_report_fits_80_columns_and_shows_the_totals(name):
    report = ts.fragmentation_report(snapshot(name))
    text = ts.render_report(report)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert ts.format_bytes(report["totals"]["reserved_bytes"]) in text
    assert f"{report['totals']['num_pinned_segments']}," in text


def test_report_is_json_serialisable():
    report = ts.fragmentation_report(snapshot("verl_mem_no_trace.pickle.gz"))
    assert json.loads(json.dumps(report))["totals"] == report["totals"]
    assert report["totals"]["private_pool_reserved_bytes"] > 0  # vLLM's CUDA-graph pools
    assert report["totals"]["pending_free_bytes"] > 0


@pytest.mark.parametrize("name", TRACED)
def test_trace_replayed_on_its_start_state_gives_back_the_dump(name):
    snap = snapshot(name)
    trace = ts.trace_to_allocator_events(snap)
    segments = {s.address: s.size for s in trace.initial_segments}
    blocks = {b.addr: b.size for b in trace.initial_blocks}
    for event in trace.events:
        if event.action == "segment_alloc":
            assert event.addr not in segments
            segments[event.addr] = event.size
        elif event.action == "segment_free":
            end = event.addr + segments.pop(event.addr)
            assert not [a for a in blocks if event.addr <= a < end], "freed a segment in use"
        elif event.action == "alloc":
            assert event.addr not in blocks, "allocated a live address twice"
            start = event.segment_addr
            assert start in segments and event.addr + event.size <= start + segments[start]
            blocks[event.addr] = event.size
        elif event.action == "free_completed":
            assert blocks.pop(event.addr) == event.size
    assert segments == {seg["address"]: seg["total_size"] for seg in snap["segments"]}
    # the trace records requests, so the dump's blocks are compared by requested_size
    assert blocks == {addr: b["requested_size"] for seg in snap["segments"]
                      for addr, b in blocks_with_addresses(seg) if b["state"] != "inactive"}


@pytest.mark.parametrize("name", TRACED)
def test_trace_events_keep_the_recorded_order_and_pool_rule(name):
    snap = snapshot(name)
    events = ts.trace_to_allocator_events(snap).events
    recorded = [e for trace in snap["device_traces"] for e in trace]
    assert [(e.action, e.addr, e.ts_us) for e in events] == [
        (e["action"], e["addr"], e.get("time_us")) for e in recorded]
    for event in events:
        if event.action in ("alloc", "free_requested", "free_completed"):
            assert event.pool == ("small" if event.size <= MIB else "large")


def test_initial_blocks_still_in_the_dump_carry_their_block_size():
    snap = snapshot("cs336_magma27_memory_snapshot.pickle.gz")
    dumped = {addr: b for seg in snap["segments"] for addr, b in blocks_with_addresses(seg)}
    initial = ts.trace_to_allocator_events(snap).initial_blocks
    assert initial
    for block in initial:
        if block.block_size is None:
            assert block.addr not in dumped or dumped[block.addr]["state"] == "inactive"
        else:
            assert block.block_size == dumped[block.addr]["size"] >= block.size
        assert block.segment_addr is not None


def test_traces_recorded_from_an_empty_cache_start_with_no_segments():
    for name in ("cs336_silmont2000_mem_snapshot.pickle", "decomfl_memory.pickle.gz"):
        trace = ts.trace_to_allocator_events(snapshot(name))
        assert trace.initial_segments == [] and trace.initial_blocks == []
        assert trace.events[0].action == "segment_alloc"


class _RunsCode:
    def __init__(self, func, arg):
        self.func, self.arg = func, arg

    def __reduce__(self):
        return self.func, (self.arg,)


@pytest.mark.parametrize("how", ["os.system", "builtins.exec"])
def test_refuses_a_pickle_that_would_run_code(tmp_path, how):
    marker = tmp_path / "ran"
    payload = (_RunsCode(os.system, f"touch {marker}") if how == "os.system"
               else _RunsCode(builtins.exec, f"open({str(marker)!r}, 'w').close()"))
    # shaped like a snapshot, so only the refused global can stop it
    evil = {"segments": [], "device_traces": [[{"action": "alloc", "frames": [payload]}]]}
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps(evil))
    with pytest.raises(ts.SnapshotError, match="refused global"):
        ts.load_snapshot(path)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["cs336_silmont2000_mem_snapshot.pickle",
                                  "decomfl_memory.pickle.gz"])
def test_truncated_file_gives_snapshot_error(tmp_path, name):
    raw = (DATA / name).read_bytes()
    path = tmp_path / name
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ts.SnapshotError) as err:
        ts.load_snapshot(path)
    assert err.value.path == str(path)


@pytest.mark.parametrize("content, reason", [
    (pickle.dumps([1, 2, 3]), "not a dict"),
    (pickle.dumps({"segments": 3, "device_traces": []}), "'segments'"),
    (pickle.dumps({"segments": [{"address": 0}], "device_traces": []}), "segment 0"),
    (pickle.dumps({"segments": [], "device_traces": [[{"action": "alloc", "size": 512}]]}),
     "no 'addr'"),
    (b"segment,total_size\n0,2097152\n", "not a readable pickle"),
])
def test_non_snapshot_file_gives_snapshot_error(tmp_path, content, reason):
    path = tmp_path / "not_a_snapshot.pickle"
    path.write_bytes(content)
    with pytest.raises(ts.SnapshotError, match=reason):
        ts.load_snapshot(path)


def test_pool_boundaries_are_those_of_cuda_caching_allocator():
    assert ts.pool_of_request(MIB) == "small" and ts.pool_of_request(MIB + 1) == "large"
    assert ts.pool_of_segment(2 * MIB) == "small" and ts.pool_of_segment(20 * MIB) == "large"


def test_long_frame_names_are_clipped_to_80_columns():
    frame = {"name": "forward_" * 20, "filename": "/very/long/" * 10 + "model.py", "line": 7}
    segment = {"address": 1 << 40, "total_size": 20 * MIB, "stream": 0, "segment_type": "large",
               "blocks": [{"size": 2 * MIB, "requested_size": 2 * MIB - 3,
                           "state": "active_allocated", "frames": [frame]},
                          {"size": 18 * MIB, "requested_size": 0, "state": "inactive"}]}
    report = ts.fragmentation_report({"segments": [segment], "device_traces": [[]]})
    assert report["pinned"][0]["blocks"][0]["frame"].startswith("forward_forward_")
    assert report["totals"]["rounding_waste_bytes"] == 3
    assert max(len(line) for line in ts.render_report(report).splitlines()) <= 80


def test_segments_freed_during_the_trace_existed_before_it():
    old, new = 1 << 40, (1 << 40) + 64 * MIB
    trace = [
        {"action": "free_requested", "addr": old, "size": 3 * MIB, "stream": 0, "time_us": 1},
        {"action": "free_completed", "addr": old, "size": 3 * MIB, "stream": 0, "time_us": 2},
        {"action": "segment_free", "addr": old, "size": 20 * MIB, "stream": 0, "time_us": 3},
        {"action": "segment_alloc", "addr": new, "size": 2 * MIB, "stream": 0, "time_us": 4},
        {"action": "alloc", "addr": new + 512, "size": 100, "stream": 0, "time_us": 5},
        {"action": "alloc", "addr": old + 4 * MIB, "size": 8 * MIB, "stream": 0, "time_us": 6},
        {"action": "oom", "device_free": 5 * MIB, "size": 64 * MIB, "stream": 0, "time_us": 7},
    ]
    dumped = {"address": new, "total_size": 2 * MIB, "stream": 0, "segment_type": "small",
              "blocks": [{"size": 512, "requested_size": 0, "state": "inactive"},
                         {"size": 512, "requested_size": 100, "state": "active_allocated"},
                         {"size": 2 * MIB - 1024, "requested_size": 0, "state": "inactive"}]}
    result = ts.trace_to_allocator_events({"segments": [dumped], "device_traces": [trace]})
    assert result.initial_segments == [ts.InitialSegment(old, 20 * MIB, 0, "large", 0, None)]
    assert result.initial_blocks == [ts.InitialBlock(old, 3 * MIB, None, 0, "large", old, 0)]
    assert [e.segment_addr for e in result.events] == [old, old, old, new, new, None, None]
    assert [e.pool for e in result.events] == ["large", "large", "large", "small", "small",
                                               "large", "large"]
    assert result.events[-1].addr == 5 * MIB  # an oom entry's device_free
