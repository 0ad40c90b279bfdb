"""`kvguard dataset --events LOG`: training data from recorded event logs (issue 13), computed by the
same stream core as a simulated run."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from kvguard.cli.app import app
from kvguard.ml.dataset import VLLM, DatasetError, RunSpec, TickDataset, dataset_from_logs, sequences_from_log, simulate_run

SPEC = RunSpec("mixed", rate_scale=2.25, profile=VLLM, seed=0, duration_s=900.0, n_gpus=1,
               gpu_memory_utilization=0.95, prompt_logprobs_frac=0.05)


@pytest.fixture(scope="module")
def oom_log(tmp_path_factory):
    """The same run as SPEC, recorded by `kvguard simulate --events-out` (no drain: the window only)."""
    path = tmp_path_factory.mktemp("logs") / "mixed.jsonl.gz"
    result = CliRunner().invoke(app, [
        "simulate", "--workload", SPEC.workload, "--rate-scale", str(SPEC.rate_scale), "--profile", SPEC.profile,
        "--seed", "0", "--duration", "900s", "--gpus", "1", "--no-drain", "--json",
        "--gpu-memory-utilization", "0.95", "--prompt-logprobs-frac", "0.05", "--model-runner", "v1",
        "--events-out", str(path)])  # the V1 runner, as dataset runs of vLLM profiles use (kvguard.ml.dataset)
    assert result.exit_code == 0, result.output
    return path


def test_a_logs_sequences_equal_the_simulated_runs_of_the_same_run(oom_log):
    record, simulated = sequences_from_log(oom_log), simulate_run(SPEC)
    assert [s.node for s in record.sequences] == [s.node for s in simulated.sequences]
    for got, want in zip(record.sequences, simulated.sequences):
        assert len(want.oom_ts_ns) > 0
        np.testing.assert_array_equal(got.oom_ts_ns, want.oom_ts_ns)
        np.testing.assert_array_equal(got.ts_ns, want.ts_ns)
        np.testing.assert_allclose(got.features, want.features, rtol=1e-6, atol=1e-6)
        for tier in ("threshold", "slope"):
            np.testing.assert_array_equal(got.firing[tier], want.firing[tier])
        # the log does not say when the GPU was up again: its next scheduled step bounds it from above
        end = int(SPEC.duration_s * 10**9)
        assert got.end_ns == want.end_ns == end
        seen_up, true_up = np.minimum(got.up_times(), end + 1), np.minimum(want.up_times(), end + 1)
        assert (seen_up >= true_up).all() and (seen_up - true_up <= 30 * 10**9).all()
        down_got, _ = got.masks()
        down_want, _ = want.masks()
        assert (down_got >= down_want).all() and down_want.any()  # never fewer down ticks than the truth


def test_kvguard_dataset_from_logs_writes_a_dataset_that_train_and_eval_read(oom_log, tmp_path):
    out = tmp_path / "from-logs"
    result = CliRunner().invoke(app, ["dataset", "--events", str(oom_log), "--split", "test", "--out", str(out),
                                      "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    ds = TickDataset.load(f"{out}.npz")
    assert ds.runs[0]["workload"] == "mixed" and ds.runs[0]["split"] == "test"
    assert ds.runs[0]["source"] == "events" and ds.runs[0]["ooms"] > 0
    assert ds.labels[ds.scored].sum() > 0 and ds.down.any()
    assert summary["files"]["npz"].endswith("from-logs.npz")
    assert oom_log.name in ds.inputs


def test_an_identical_log_is_kept_once_and_splits_are_checked(oom_log):
    ds = dataset_from_logs([oom_log, oom_log], ["train", "test"])
    assert len(ds.runs) == 1 and ds.runs[0]["split"] == "train"
    assert ds.duplicates[0]["same_as"] == ds.runs[0]["key"]
    with pytest.raises(DatasetError, match="one split for all logs or one per log"):
        dataset_from_logs([oom_log, oom_log, oom_log], ["train", "test"])
    with pytest.raises(DatasetError, match="expected one of"):
        dataset_from_logs([oom_log], ["holdout"])


def test_a_missing_or_bad_log_is_a_one_line_error(tmp_path):
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(b"not gzip")
    for path in (bad, tmp_path / "missing.jsonl.gz"):
        result = CliRunner().invoke(app, ["dataset", "--events", str(path), "--out", str(tmp_path / "x")])
        assert result.exit_code == 2
        assert f"error: {path}" in result.output
    result = CliRunner().invoke(app, ["dataset", "--split", "test", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "--split goes with --events" in result.output
