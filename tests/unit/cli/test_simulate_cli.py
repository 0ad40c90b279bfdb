import json

import pytest
import typer
from typer.testing import CliRunner

from kvguard.cli import app
from kvguard.cli.simulate import parse_duration
from kvguard.wire.eventlog import read_event_log

CONTRACT_FIELDS = {"requests", "completed", "failed", "rejected", "unfinished", "ooms", "preemptions", "ttft_p99_s", "goodput_tokens_per_s",
                   "events", "sim_seconds", "wall_seconds"}


@pytest.mark.parametrize("text, seconds", [("30m", 1800), ("90s", 90), ("1h", 3600), ("1h30m", 5400),
                                           ("45", 45), ("250ms", 0.25), ("2.5m", 150)])
def test_durations(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "abc", "10x", "m30", "-5", "0s"])
def test_bad_durations_are_named(text):
    with pytest.raises(typer.BadParameter):
        parse_duration(text)


def test_simulate_json_has_the_contract_fields_and_writes_a_readable_event_log(tmp_path):
    out_path = tmp_path / "events.jsonl.gz"
    result = CliRunner().invoke(app, ["simulate", "--workload", "mixed", "--duration", "2m", "--gpus", "2",
                                      "--seed", "3", "--events-out", str(out_path), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert CONTRACT_FIELDS <= out.keys()
    assert out["requests"] > 100 and out["completed"] > 0 and out["sim_seconds"] >= 120
    # drained to the end: every request completed, failed in a crash or was refused
    assert out["unfinished"] == 0
    assert out["requests"] == out["completed"] + out["failed"] + out["rejected"]
    assert all({"rejected", "unfinished"} <= g.keys() for g in out["per_gpu"])
    assert [g["node"] for g in out["per_gpu"]] == ["sim-0/gpu0", "sim-0/gpu1"]
    meta, batches = read_event_log(out_path)
    assert meta["gpus"] == 2 and meta["seed"] == 3
    total = sum(len(b) for b in batches)
    assert total == out["events"]


def test_simulate_human_output_is_a_table():
    result = CliRunner().invoke(app, ["simulate", "--workload", "rag", "--duration", "60s"])
    assert result.exit_code == 0, result.output
    assert "sim-0/gpu0" in result.output and "fleet" in result.output and "rejected" in result.output


def test_unknown_workload_and_profile_fail_with_a_clear_message(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    result = CliRunner().invoke(app, ["simulate", "--workload", str(bad), "--json"])
    assert result.exit_code == 2 and "bad.csv:1" in result.output
    result = CliRunner().invoke(app, ["simulate", "--workload", "mixed", "--profile", "gpt-9"])
    assert result.exit_code == 2 and "gpt-9" in result.output
