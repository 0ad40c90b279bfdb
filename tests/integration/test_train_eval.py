"""The predictor pipeline end to end on real parts: shadow engine -> stream core -> dataset ->
a real (tiny, seconds) LSTM training -> artifact -> `kvguard eval` through the CLI, online and offline."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from kvguard.cli import app
from kvguard.ml.dataset import PRESETS, RunSpec, TickDataset, build_dataset, simulate_run
from kvguard.streams.metrics import FEATURE_NAMES

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("predictor")


@pytest.fixture(scope="module")
def dataset_path(workdir):
    result = CliRunner().invoke(app, ["dataset", "--preset", "tiny", "--out", str(workdir / "tiny"), "--json"])
    assert result.exit_code == 0, result.output
    return workdir / "tiny.npz"


@pytest.fixture(scope="module")
def model_dir(workdir, dataset_path):
    result = CliRunner().invoke(app, ["train", "--data", str(dataset_path), "--epochs", "2",
                                      "--out", str(workdir / "model"), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["features"] == len(FEATURE_NAMES)
    return workdir / "model"


def test_dataset_has_labelled_ticks_from_the_engine_and_held_out_workloads(dataset_path):
    ds = TickDataset.load(dataset_path)
    summary = ds.summary()
    assert ds.feature_names == list(FEATURE_NAMES)
    assert summary["train"]["ooms"] > 0 and summary["test"]["ooms"] > 0
    assert set(summary["test"]["workloads"]).isdisjoint(summary["train"]["workloads"])
    assert ds.inputs and all(len(h) == 64 for h in ds.inputs.values())  # trace files are hashed
    # every label agrees with the OOM events of its own sequence (docs/ARCHITECTURE.md, "Alerts and prediction")
    for s in range(ds.n_sequences):
        seq = ds.sequence(s)
        lab = ds.labels[ds.seq_offsets[s]:ds.seq_offsets[s + 1]]
        for t, y in zip(seq.ts_ns[::7], lab[::7]):
            upcoming = (seq.oom_ts_ns > t) & (seq.oom_ts_ns <= t + 300 * 10**9)
            assert bool(y) == bool(upcoming.any())


def test_building_the_same_runs_twice_is_deterministic():
    specs = PRESETS["tiny"]()[:1]
    specs = [RunSpec(s.workload, s.rate_scale, s.profile, s.seed, 300.0, s.n_gpus, s.split) for s in specs]
    a, b = build_dataset(specs), build_dataset(specs)
    np.testing.assert_array_equal(a.features, b.features)
    np.testing.assert_array_equal(a.oom_ts_ns, b.oom_ts_ns)


def test_trained_artifact_records_features_normalisation_threshold_and_held_out_metrics(model_dir):
    meta = json.loads((model_dir / "oom_lstm.json").read_text())
    assert meta["feature_names"] == list(FEATURE_NAMES)
    assert len(meta["normalisation"]["mean"]) == len(FEATURE_NAMES)
    assert 0.0 < meta["threshold"] < 1.0
    assert meta["metrics"]["held_out"]["workloads"] == ["azure-conv"]
    assert {r["split"] for r in meta["training"]["runs"]} == {"train", "val", "test"}
    assert (model_dir / "oom_lstm.pt").stat().st_size < 1_000_000


def test_eval_runs_engine_stream_and_all_three_tiers(model_dir, workdir):
    report = workdir / "report"
    result = CliRunner().invoke(app, ["eval", "--model", str(model_dir), "--workload", "azure-conv",
                                      "--rate-scale", "0.5", "--duration", "10m", "--report", str(report), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    for key in ("auc", "recall_at_fpr_5pct", "ooms", "lead_time_median_s", "false_alarms_per_hour"):
        assert key in out
    assert set(out["lead_time_median_s"]) == {"threshold", "slope", "lstm"}
    assert set(out["false_alarms_per_hour"]) == {"threshold", "slope", "lstm"}
    assert out["ooms"] > 0 and out["held_out"] is True
    assert out["all_ticks"] == 60  # 10m of 10 s ticks
    masked = sum(out["masked_ticks"].values())  # GPU-down and right-censored ticks are not scored
    assert out["positive_ticks"] + out["negative_ticks"] == out["ticks"] == out["all_ticks"] - masked
    assert out["runs"][0]["negative_ticks"] == out["negative_ticks"]
    if not out["auc_valid"]:
        assert out["auc"] is None and "withheld" in out["auc_note"]
    for name in ("roc.png", "lead_times.png"):
        assert (report / name).read_bytes()[:4] == b"\x89PNG"


def test_offline_scores_equal_the_stream_core_scores(model_dir):
    from kvguard.ml.training import score_sequence
    from kvguard.streams.loader import load_predictor as load_model

    predictor = load_model(model_dir, expected_features=list(FEATURE_NAMES))
    record = simulate_run(RunSpec("azure-code", 0.4, duration_s=600, split="test"), predictor=predictor)
    seq = record.sequences[0]
    offline = score_sequence(predictor.net, predictor.metadata.normalisation.apply(seq.features),
                             predictor.window_ticks)
    np.testing.assert_allclose(offline, seq.p_oom, atol=1e-5)
    assert seq.firing["lstm"].dtype == bool


def test_eval_offline_on_the_test_split(model_dir, dataset_path):
    result = CliRunner().invoke(app, ["eval", "--model", str(model_dir), "--data", str(dataset_path), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["ooms"] == TickDataset.load(dataset_path).summary()["test"]["ooms"]


def test_eval_refuses_a_model_with_other_features(model_dir, workdir):
    meta = json.loads((model_dir / "oom_lstm.json").read_text())
    meta["feature_names"][0] = "u_kv_percent"
    bad = workdir / "bad"
    bad.mkdir()
    (bad / "oom_lstm.json").write_text(json.dumps(meta))
    (bad / "oom_lstm.pt").write_bytes((model_dir / "oom_lstm.pt").read_bytes())
    result = CliRunner().invoke(app, ["eval", "--model", str(bad), "--workload", "mixed", "--json"])
    assert result.exit_code == 2
    assert "u_kv_percent" in result.output and "feature_names do not match" in result.output
