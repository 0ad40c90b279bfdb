"""`kvguard rca` and `kvguard replay` over vLLM-faithful logs (issue 27): the log `kvguard simulate`
writes for the default engine (allocator OOMs, each GPU down while its engine restarts), and one
with a producer restart (a new epoch) and a seq gap on top. Both commands run to the end, with and
without the shipped predictor, and account for the log's OOMs."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvguard.cli import app
from kvguard.wire.eventlog import read_event_log, write_event_log
from tests.unit.streams.vllm_oom_log import ooms, vllm_oom_log

runner = CliRunner()
PREDICTOR = pytest.mark.parametrize("predictor", [[], ["--no-lstm"]], ids=["shipped-predictor", "no-predictor"])


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    """Issue 27's run, compressed: a minute, 30 % of requests asking for prompt logprobs, on the V1 model
    runner (Model Runner V2 computes prompt logprobs in chunks and does not OOM there)."""
    path = tmp_path_factory.mktemp("sim") / "run.jsonl.gz"
    result = runner.invoke(app, ["simulate", "--workload", "azure-conv", "--gpus", "2", "--duration", "60s",
                                 "--gpu-memory-utilization", "0.95", "--prompt-logprobs-frac", "0.3",
                                 "--model-runner", "v1",
                                 "--events-out", str(path), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["ooms"] >= 2 and all(g["downtime_s"] > 0 for g in summary["per_gpu"]), summary
    _, batches = read_event_log(path)
    assert ooms(list(batches)) == summary["ooms"]
    return path, summary["ooms"]


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    path = tmp_path_factory.mktemp("restart") / "run.jsonl.gz"
    batches = vllm_oom_log()
    write_event_log(path, batches, {"workload": "azure-conv"})
    return path, ooms(batches)


@PREDICTOR
@pytest.mark.parametrize("which", ["simulated", "restarted"])
def test_rca_reports_every_oom_of_a_vllm_log(which, predictor, tmp_path, request):
    path, n_ooms = request.getfixturevalue(which)
    result = runner.invoke(app, ["rca", "--events", str(path), "--report", str(tmp_path / "rep"), "--json",
                                 *predictor])
    assert result.exit_code == 0, result.output
    ooms = json.loads(result.stdout)["ooms"]
    assert len(ooms) == n_ooms
    assert all(o["cause_key"] == "allocator:prompt_logprobs" and o["explanation"]["requests"] for o in ooms)
    md = (tmp_path / "rep" / "rca.md").read_text()
    assert "largest free run" not in md and "reserved-but-unallocated" in md
    assert len(list((tmp_path / "rep").glob("oom_*.png"))) == n_ooms


@PREDICTOR
@pytest.mark.parametrize("which", ["simulated", "restarted"])
def test_replay_runs_a_vllm_log_to_its_end(which, predictor, request):
    path, n_ooms = request.getfixturevalue(which)
    result = runner.invoke(app, ["replay", str(path), "--json", *predictor])
    assert result.exit_code == 0, result.output
    dry = json.loads(result.stdout)["dry_run"]
    # replay ends with a flush at the log's last event: an OOM in a node's unfinished last interval
    # has no tick yet, and a restart drops the old run's unfinished interval
    assert dry["nodes"] == 2 and dry["ticks"] > 0 and 0 < dry["ooms"] <= n_ooms
    assert dry["oom_rows"] == n_ooms
