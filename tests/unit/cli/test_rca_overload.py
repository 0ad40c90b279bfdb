"""`kvguard rca --report` on an overloaded run explains its preemptions and refusals (issue 27 "Incidents"):
azure-conv at 2.5x on one GPU of the default (vLLM-faithful) engine with vLLM's 503 cap on queued requests.
Every refusal of the run is in an incident with its reason, the preemptions are a storm of KV pressure."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvguard.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def overloaded(tmp_path_factory):
    path = tmp_path_factory.mktemp("over") / "run.jsonl.gz"
    result = runner.invoke(app, ["simulate", "--workload", "azure-conv", "--gpus", "1", "--duration", "60s",
                                 "--rate-scale", "2.5", "--max-num-queued-reqs", "64", "--events-out", str(path),
                                 "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["rejected"] > 0 and summary["preemptions"] > 0 and summary["ooms"] == 0, summary
    return path, summary


def test_rca_report_explains_the_refusals_and_preemptions_of_an_overloaded_run(overloaded, tmp_path):
    path, summary = overloaded
    result = runner.invoke(app, ["rca", "--events", str(path), "--no-lstm", "--json", "--report", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    refusals = [i for i in out["incidents"] if i["kind"] == "refusals"]
    assert sum(i["count"] for i in refusals) == summary["rejected"]
    assert {i["cause"] for i in refusals} == {"queue_reqs"}
    assert all("--max-num-queued-reqs" in " ".join(i["details"] + i["prevention"]) for i in refusals)
    storms = [i for i in out["incidents"] if i["kind"] == "preemption_storm"]
    assert storms and {i["cause"] for i in storms} == {"kv_pressure"}
    assert sum(i["count"] for i in storms) <= summary["preemptions"]
    md = (tmp_path / "r" / "rca.md").read_text()
    assert "## Incidents (not OOMs)" in md and "vLLM's 503" in md and "KV pressure" in md
    assert out["summary"]["incidents_by_cause"]["refusals:queue_reqs"] == len(refusals)
    (png,) = out["report"]["incident_images"]
    assert (tmp_path / "r" / "incidents_sim-0_gpu0.png").stat().st_size > 10_000 and png.endswith("gpu0.png")
    assert "![incidents on sim-0/gpu0](incidents_sim-0_gpu0.png)" in md


def test_replay_and_rca_with_the_shipped_predictor_run_the_overloaded_log(overloaded):
    path, _ = overloaded
    for args in (["replay", str(path), "--json"], ["rca", "--events", str(path), "--json"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        assert "Traceback" not in result.output
