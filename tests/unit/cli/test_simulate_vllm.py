"""`kvguard simulate`: the allocator and OOM-cause fields, the vLLM profiles, bounded inputs, log failures."""

import json

import pytest
from typer.testing import CliRunner

from kvguard.cli import app

ALLOCATOR_KEYS = {"peak_reserved_bytes", "peak_allocated_bytes", "inactive_split_bytes", "num_alloc_retries"}


def _json(args):
    result = CliRunner().invoke(app, ["simulate", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_vllm_profile_json_has_oom_causes_allocator_and_rejection_reasons():
    out = _json(["--workload", "drill", "--duration", "2m", "--gpus", "2", "--profile", "llama3-8b-24gb-vllm"])
    assert out["engine"] == "vllm" and out["ooms_by_cause"] == {} and out["ooms"] == 0
    # the drill's 32,768-token prompts equal max_model_len: vLLM rejects them (nothing is truncated)
    assert out["rejected_by_reason"] == {"prompt_equals_max_model_len": 100}
    assert not any("capped" in note for note in out["workload"]["notes"])
    for gpu in out["per_gpu"]:
        assert ALLOCATOR_KEYS <= gpu["allocator"].keys()
        assert 0 < gpu["allocator"]["peak_allocated_bytes"] <= gpu["allocator"]["peak_reserved_bytes"]
        assert set(gpu) >= {"ooms_by_cause", "rejected_by_reason"}
    assert out["requests"] == out["completed"] + out["failed"] + out["rejected"]


def test_seed_profile_json_has_the_same_fields_and_no_allocator():
    out = _json(["--workload", "mixed", "--duration", "1m", "--profile", "llama3-8b-24gb"])
    assert out["engine"] == "seed" and out["per_gpu"][0]["allocator"] is None
    # the seed engine's OOMs are KV-arena runs; every one has a cause
    assert sum(out["ooms_by_cause"].values()) == out["ooms"]
    assert all(cause.startswith("kv_arena:") for cause in out["ooms_by_cause"])


def test_the_table_fits_80_columns():
    result = CliRunner().invoke(app, ["simulate", "--workload", "azure-code", "--duration", "1m", "--gpus", "4",
                                      "--profile", "llama3-8b-24gb-vllm"])
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80
    assert "sim-0/gpu3" in result.output and "fleet" in result.output


@pytest.mark.parametrize("args, message", [
    (["--rate-scale", "inf"], "finite"), (["--rate-scale", "1001"], "1000"), (["--rate-scale", "nan"], "finite"),
    (["--rate-scale", "0"], "finite"), (["--duration", "31d"], "30 days"), (["--duration", "1e400"], "duration"),
])
def test_unbounded_inputs_are_refused_with_a_clear_message(args, message):
    result = CliRunner().invoke(app, ["simulate", "--workload", "mixed", *args])
    assert result.exit_code == 2 and message in result.output


def test_an_event_log_that_cannot_be_written_still_prints_the_summary_and_exits_non_zero(tmp_path):
    target = tmp_path / "missing-dir" / "events.jsonl.gz"
    result = CliRunner().invoke(app, ["simulate", "--workload", "mixed", "--duration", "30s", "--json",
                                      "--events-out", str(target)])
    assert result.exit_code == 1
    out = json.loads(result.stdout.splitlines()[0])
    assert out["requests"] > 0
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "could not write the event log" in errors[0]
