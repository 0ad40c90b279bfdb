"""The trend trees: derived features, the export, the loader (numpy only at inference)."""

from __future__ import annotations

import numpy as np
import pytest

from kvguard.ml.tick_training import export_trees
from kvguard.streams.loader import load_predictor
from kvguard.streams.metrics import FEATURE_NAMES
from kvguard.streams.predictor import ModelFeatureMismatch, window_from_history
from kvguard.streams.trend_model import (BASE_COLUMNS, TrendModelMetadata, TrendPredictor, derive, derive_sequence,
                                         derived_names, load_trend_model, save_trend_model)

NAMES = list(FEATURE_NAMES)


def leak_sequence(n=300, rate=2e-4, seed=0):
    rng = np.random.default_rng(seed)
    f = rng.normal(0, 0.01, (n, len(NAMES))).astype(np.float32)
    f[:, NAMES.index("util_activation")] = 0.01 + rate * np.arange(n)
    f[:, NAMES.index("u_kv")] = 0.5
    f[:, NAMES.index("util_reserved_unused")] = 0.02
    return f


def test_derive_sequence_is_derive_over_each_padded_window():
    f = leak_sequence(200)
    got = derive_sequence(f, NAMES, 180)
    for i in (0, 5, 179, 199):
        w = window_from_history(f[: i + 1], 180)[None]
        assert np.allclose(got[i], derive(w, NAMES)[0], atol=1e-9)
    assert got.shape == (200, len(derived_names()))


def test_slopes_read_the_growth_per_minute():
    f = leak_sequence(200, rate=2e-4)  # per 10 s tick: 1.2e-3 a minute
    d = dict(zip(derived_names(), derive_sequence(f, NAMES, 180)[-1]))
    for w in (5, 15, 30):
        assert d[f"util_activation@slope{w}m"] == pytest.approx(1.2e-3, rel=0.05)
        assert d[f"nonkv_reserved@slope{w}m"] == pytest.approx(1.2e-3, rel=0.05)
    assert abs(d["u_kv@slope15m"]) < 1e-3


def fitted(tmp_path):
    from sklearn.ensemble import HistGradientBoostingClassifier

    seqs = [leak_sequence(300, rate=r, seed=i) for i, r in enumerate((0.0, 2e-4, 0.0, 3e-4))]
    X = np.concatenate([derive_sequence(f, NAMES, 180) for f in seqs])
    y = np.concatenate([np.full(300, r > 0) for r in (0.0, 2e-4, 0.0, 3e-4)]).astype(int)
    est = HistGradientBoostingClassifier(max_iter=20, random_state=0).fit(X, y)
    trees, baseline, depth = export_trees(est)
    meta = TrendModelMetadata(feature_names=NAMES, threshold=0.5, baseline=baseline, max_depth=depth)
    save_trend_model(trees, meta, tmp_path / "oom_trees")
    return est, X, seqs


def test_export_scores_as_scikit_learn_and_the_loader_finds_it(tmp_path):
    est, X, seqs = fitted(tmp_path)
    model = load_predictor(tmp_path, expected_features=NAMES)
    assert isinstance(model, TrendPredictor) and model.window_ticks == 180
    assert np.allclose(model.score_derived(X), est.predict_proba(X)[:, 1], atol=1e-12)
    windows = np.stack([window_from_history(seqs[1][:i + 1], 180) for i in (100, 299)])
    p, traj = model.predict(windows)
    assert p.shape == (2,) and traj.shape == (2, 0)
    assert np.allclose(p, est.predict_proba(derive_sequence(seqs[1], NAMES, 180)[[100, 299]])[:, 1], atol=1e-6)
    assert p[1] > 0.5  # a growing reserved share is what it learnt


def test_loader_refuses_other_features(tmp_path):
    fitted(tmp_path)
    with pytest.raises(ModelFeatureMismatch):
        load_trend_model(tmp_path, expected_features=NAMES[::-1])


def test_shipped_default_is_a_trend_model_with_its_target():
    model = load_predictor(expected_features=NAMES)
    assert isinstance(model, TrendPredictor)
    assert model.metadata.target == "oom" and set(model.metadata.base_columns) <= {*NAMES, "nonkv_reserved"}
    assert 0.0 < model.threshold < 1.0
    assert tuple(model.metadata.base_columns) == BASE_COLUMNS
