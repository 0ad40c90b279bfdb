"""The per-tick boosted-trees predictor (issue 13: ship the held-out winner): exported from scikit-learn
to arrays, scored with numpy exactly as scikit-learn scores, loaded without pickle, run by the stream."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvguard.cli.app import app
from kvguard.ml.tick_training import export_trees, train_tick_model
from kvguard.streams.loader import load_predictor as load_model
from kvguard.streams.metrics import FEATURE_NAMES
from kvguard.streams.predictor import ModelError, ModelFeatureMismatch, check_predictor
from kvguard.streams.tick_model import (
    TickModelMetadata,
    TickModelPredictor,
    is_tick_model,
    load_tick_model,
    save_tick_model,
)
from tests.unit.ml.test_dataset import synthetic_dataset

NAMES = list(FEATURE_NAMES)


@pytest.fixture(scope="module")
def ds():
    return synthetic_dataset(NAMES)


@pytest.fixture(scope="module")
def trained(ds):
    return train_tick_model(ds, seed=0)


def fitted_sklearn(seed: int = 0, missing: bool = True):
    from sklearn.ensemble import HistGradientBoostingClassifier

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(3000, 6))
    if missing:
        x[rng.random(x.shape) < 0.05] = np.nan  # trees learn where missing values go
    y = ((np.nan_to_num(x[:, 0]) + np.nan_to_num(x[:, 1]) ** 2 > 1) | np.isnan(x[:, 2])).astype(int)
    return HistGradientBoostingClassifier(max_iter=40, max_leaf_nodes=15, random_state=seed).fit(x, y), x


def as_predictor(estimator, n_features: int) -> TickModelPredictor:
    trees, baseline, depth = export_trees(estimator)
    meta = TickModelMetadata(feature_names=[f"f{i}" for i in range(n_features)], threshold=0.5, baseline=baseline,
                             max_depth=depth)
    return TickModelPredictor(trees, meta)


def test_the_exported_trees_score_exactly_as_scikit_learn_missing_values_included():
    estimator, x = fitted_sklearn()
    predictor = as_predictor(estimator, x.shape[1])
    want = estimator.predict_proba(x)[:, 1]
    raw = predictor.trees.raw(x, predictor.metadata.baseline, predictor.metadata.max_depth)
    np.testing.assert_allclose(1 / (1 + np.exp(-raw)), want, rtol=1e-12, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.floats(-5, 5), min_size=6, max_size=6), min_size=1, max_size=40))
def test_any_input_scores_as_scikit_learn(rows):
    estimator, _ = _FITTED
    x = np.asarray(rows, dtype=np.float64)
    predictor = as_predictor(estimator, 6)
    raw = predictor.trees.raw(x, predictor.metadata.baseline, predictor.metadata.max_depth)
    np.testing.assert_allclose(1 / (1 + np.exp(-raw)), estimator.predict_proba(x)[:, 1], rtol=1e-12, atol=1e-12)


_FITTED = fitted_sklearn(seed=1, missing=False)


def test_a_trained_model_learns_the_signal_and_takes_its_threshold_from_the_val_runs(ds, trained):
    from kvguard.ml.evaluation import threshold_for_fpr

    rows = ds.scored_rows_in("test")
    p = trained.score(ds.features[rows])
    y = ds.labels[rows]
    assert p[y == 1].mean() > p[y == 0].mean() + 0.3  # the synthetic U_kv ramp is learnt
    val = ds.scored_rows_in("val")
    assert trained.threshold == pytest.approx(threshold_for_fpr(ds.labels[val], trained.score(ds.features[val]), 0.05))
    check_predictor(trained)  # the stream's seam accepts it


def test_save_and_load_round_trip_through_the_models_loader_without_pickle(tmp_path, ds, trained):
    npz, meta_path = save_tick_model(trained.trees, trained.metadata, tmp_path / "m")
    assert is_tick_model(tmp_path / "m") and not is_tick_model(tmp_path / "nothing")
    for path in (tmp_path / "m", npz, meta_path):
        loaded = load_model(path, expected_features=NAMES)  # the one loader every command uses
        assert isinstance(loaded, TickModelPredictor)
        np.testing.assert_array_equal(loaded.score(ds.features[:500]), trained.score(ds.features[:500]))
    windows = np.repeat(ds.features[:8, None, :], 3, axis=1)
    p, traj = loaded.predict(windows)
    assert p.shape == (8,) and traj.shape == (8, 0)  # no U_kv forecast: the planner uses the tick's own


def test_a_broken_or_foreign_artifact_is_a_model_error_naming_the_file(tmp_path, trained):
    save_tick_model(trained.trees, trained.metadata, tmp_path / "m")
    with pytest.raises(ModelFeatureMismatch, match="m.json"):
        load_tick_model(tmp_path / "m", expected_features=NAMES[::-1])
    meta = json.loads((tmp_path / "m.json").read_text())
    np.savez(tmp_path / "bad.npz", feature=np.array([99], np.int32), threshold=np.zeros(1), left=np.array([1]),
             right=np.array([2]), is_leaf=np.array([False]), value=np.zeros(1), missing_left=np.array([True]),
             roots=np.array([0], np.int32))
    (tmp_path / "bad.json").write_text(json.dumps(meta))
    with pytest.raises(ModelError, match="bad.npz"):
        load_tick_model(tmp_path / "bad")
    (tmp_path / "m.json").write_text("{not json")
    with pytest.raises(ModelError, match="not JSON"):
        load_tick_model(tmp_path / "m")
    with pytest.raises(ModelError, match="not found"):
        load_tick_model(tmp_path / "absent")


def test_the_stream_core_scores_ticks_with_the_tree_model(trained):
    from kvguard.producers.sim.fleet import Fleet
    from kvguard.producers.sim.profiles import load_profile
    from kvguard.producers.sim.workloads import load_workload
    from kvguard.streams.core import StreamConfig, StreamCore

    fleet = Fleet(1, load_profile("llama3-8b-24gb-vllm"), seed=0)
    fleet.submit_workload(load_workload("mixed", rate_scale=1.0, window=120, seed=0))
    core = StreamCore(StreamConfig(tick_s=10.0), predictor=trained)
    ticks = []
    for now in range(1, 121):
        fleet.advance(now * 10**9)
        got, _ = core.process_many(fleet.take_batches(now * 10**9))
        ticks.extend(got)
    assert ticks and all(t.p_oom is not None and 0 <= t.p_oom <= 1 for t in ticks)
    from kvguard.streams.metrics import tick_features

    want = trained.score(np.stack([tick_features(t) for t in ticks]))
    np.testing.assert_allclose([t.p_oom for t in ticks], want, rtol=1e-6)


def test_kvguard_train_model_boosting_writes_an_artifact_the_loader_reads(tmp_path, ds):
    ds.save(tmp_path / "d")
    result = CliRunner().invoke(app, ["train", "--data", str(tmp_path / "d.npz"), "--model", "boosting",
                                      "--out", str(tmp_path / "trees"), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["model"] == "boosting" and summary["trees"] > 10
    loaded = load_model(tmp_path / "trees", expected_features=NAMES)
    assert loaded.metadata.training["source"]["command"].endswith("--model boosting")
    bad = CliRunner().invoke(app, ["train", "--data", str(tmp_path / "d.npz"), "--model", "forest"])
    assert bad.exit_code == 2 and "expected lstm, boosting or trend" in bad.output


def test_kvguard_eval_scores_a_tree_model_offline_as_the_boosting_baseline_it_was_trained_as(tmp_path, ds, trained):
    ds.save(tmp_path / "d")
    save_tick_model(trained.trees, trained.metadata, tmp_path / "trees")
    result = CliRunner().invoke(app, ["eval", "--model", str(tmp_path / "trees"), "--data", str(tmp_path / "d.npz"),
                                      "--bootstrap", "0", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["model"]["version"] == trained.metadata.version
    assert out["auc"] == pytest.approx(out["baselines"]["boosting"]["auc"])  # the same model, scored twice
