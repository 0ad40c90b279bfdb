"""`kvguard ingest torch-snapshot` on real GPU-recorded ``_dump_snapshot`` files (tests/data/torch_snapshots,
with their attribution in its README): the log feeds `kvguard metrics` and `kvguard rca`, and the last
tick's ``alloc_reserved_bytes`` / ``alloc_allocated_bytes`` are the snapshot's own totals (summed here
from the pickle's segments, independently of the converter). A snapshot with an ``oom`` entry gives an
OOM that `rca` explains. No torch, no vllm needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import kvguard.cli
import kvguard.cli.ingest  # noqa: F401 - until kvguard/cli/__init__.py imports it
from kvguard.cli.app import app
from kvguard.producers.torch_snapshot.snapshot import load_snapshot
from kvguard.producers.torch_snapshot.to_events import snapshot_to_batches
from kvguard.wire.eventlog import write_event_log

DATA = Path(__file__).resolve().parents[1] / "data" / "torch_snapshots"
FILES = ["cs336_silmont2000_mem_snapshot.pickle", "cs336_magma27_memory_snapshot.pickle.gz",
         "decomfl_memory.pickle.gz", "verl_mem_no_trace.pickle.gz"]
runner = CliRunner()


def totals(snapshot: dict) -> tuple[int, int]:
    segments = [s for s in snapshot["segments"] if s.get("device", 0) == 0]
    return (sum(s["total_size"] for s in segments),
            sum(b["size"] for s in segments for b in s["blocks"] if b["state"] == "active_allocated"))


@pytest.mark.parametrize("name", FILES)
def test_the_last_tick_has_the_snapshots_reserved_and_allocated_bytes(name, tmp_path):
    log = tmp_path / "snap.jsonl.gz"
    result = runner.invoke(app, ["ingest", "torch-snapshot", str(DATA / name), "--events-out", str(log), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["rows"] > 0 and summary["skipped"].get("alloc_outside_segments", 0) == 0

    result = runner.invoke(app, ["metrics", "--events", str(log), "--json", "--tick", "100ms"])
    assert result.exit_code == 0, result.output
    ticks = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    reserved, allocated = totals(load_snapshot(DATA / name))
    assert ticks[-1]["alloc_reserved_bytes"] == reserved and ticks[-1]["alloc_allocated_bytes"] == allocated
    if summary["entries"] > 100:
        assert len(ticks) > 1 and len({t["alloc_allocated_bytes"] for t in ticks}) > 1  # the history, not one state

    result = runner.invoke(app, ["rca", "--events", str(log), "--no-lstm", "--tick", "100ms", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["ooms"] == []


def test_an_oom_entry_becomes_an_oom_rca_explains(tmp_path):
    snapshot = load_snapshot(DATA / "cs336_silmont2000_mem_snapshot.pickle")
    trace = snapshot["device_traces"][0]
    last = trace[-1]
    trace.append({"action": "oom", "size": 40 << 30, "device_free": 1 << 30, "stream": 0,
                  "time_us": last["time_us"] + 1000})
    batches, summary = snapshot_to_batches(snapshot, "snap/gpu0")
    assert summary.ooms == 1
    log = tmp_path / "oom.jsonl.gz"
    write_event_log(log, batches, {"nodes": ["snap/gpu0"]})
    result = runner.invoke(app, ["rca", "--events", str(log), "--no-lstm", "--tick", "100ms", "--json"])
    assert result.exit_code == 0, result.output
    ooms = json.loads(result.output)["ooms"]
    assert len(ooms) == 1 and ooms[0]["node"] == "snap/gpu0"


def test_a_file_that_is_no_snapshot_is_refused_with_the_reason(tmp_path):
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(b"not a pickle")
    result = runner.invoke(app, ["ingest", "torch-snapshot", str(bad), "--events-out", str(tmp_path / "x.jsonl.gz")])
    assert result.exit_code == 2 and "not a readable pickle" in result.output
