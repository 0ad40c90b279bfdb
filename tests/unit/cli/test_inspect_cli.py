"""`kvguard inspect snapshot|replay` on real GPU-recorded snapshots (tests/data/torch_snapshots)."""

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from kvguard.cli import app

DATA = Path(__file__).resolve().parents[2] / "data" / "torch_snapshots"
runner = CliRunner()


def test_snapshot_report_as_json_names_the_fragmentation_of_a_real_file():
    result = runner.invoke(app, ["inspect", "snapshot", str(DATA / "cs336_silmont2000_mem_snapshot.pickle"), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    text = json.dumps(report)
    assert "f_ext" in text and "pinned" in text


def test_replay_reproduces_a_real_trace_and_writes_a_snapshot_memory_viz_reads(tmp_path):
    out = tmp_path / "twin.pickle"
    result = runner.invoke(app, ["inspect", "replay", str(DATA / "decomfl_memory.pickle.gz"), "--out", str(out),
                                 "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["matches"] and summary["segment_allocs"] == {"real": 61, "twin": 61}
    viz = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "stats", str(out)], capture_output=True,
                         text=True, timeout=120)
    assert viz.returncode == 0, viz.stderr


def test_a_file_that_is_not_a_snapshot_is_refused_with_one_line(tmp_path):
    bad = tmp_path / "x.pickle"
    bad.write_bytes(b"not a pickle at all")
    result = runner.invoke(app, ["inspect", "snapshot", str(bad)])
    assert result.exit_code == 2 and "error:" in result.output and "Traceback" not in result.output


def test_a_snapshot_with_a_negative_size_is_refused_not_reported_as_negative_tib(tmp_path):
    import pickle

    real = DATA / "cs336_silmont2000_mem_snapshot.pickle"
    snap = pickle.loads(real.read_bytes())
    snap["segments"][0]["total_size"] = -(1 << 50)
    bad = tmp_path / "negative.pickle"
    bad.write_bytes(pickle.dumps(snap))
    result = runner.invoke(app, ["inspect", "snapshot", str(bad)])
    assert result.exit_code == 2, result.output
    assert "segment 0: 'total_size' is -1125899906842624, expected >= 0" in result.output
    assert "TiB" not in result.output and "Traceback" not in result.output
    snap["segments"][0]["total_size"] = abs(snap["segments"][0]["total_size"])
    snap["segments"][0]["blocks"][0]["size"] = -512
    bad.write_bytes(pickle.dumps(snap))
    result = runner.invoke(app, ["inspect", "snapshot", str(bad)])
    assert result.exit_code == 2 and "a block of segment 0: 'size' is -512" in result.output, result.output
