"""Train the per-tick boosted-trees predictor (``kvguard train --model boosting``) and export it to the
arrays ``streams.tick_model`` scores with.

The estimator and its threshold are the ``boosting`` baseline's (``kvguard.ml.baselines``): fitted on the
scored ticks of the train runs, threshold FPR <= 5 % on the scored ticks of the val runs, so the model
shipped is the model the protocol measured. The export reads the fitted trees of scikit-learn's
``HistGradientBoostingClassifier`` (``_predictors``: per iteration one ``TreePredictor`` whose ``nodes``
record array holds value, feature_idx, num_threshold, missing_go_to_left, left, right, is_leaf) and
its ``_baseline_prediction``; those are private attributes, so ``export_trees`` refuses a model with
categorical splits or more than one tree per iteration, and every export is checked against
``predict_proba`` before it is saved (a scikit-learn release that changes the layout fails at training,
never at inference: the stream worker needs no scikit-learn). Tested with scikit-learn 1.9.
"""

from __future__ import annotations

import datetime as _dt

import numpy as np

from kvguard.ml.baselines import fit_tick_models
from kvguard.ml.dataset import TickDataset
from kvguard.streams.tick_model import TickModelMetadata, TickModelPredictor, TreeArrays


def export_trees(estimator) -> tuple[TreeArrays, float, int]:
    """``(trees, baseline, max_depth)`` of a fitted binary ``HistGradientBoostingClassifier``."""
    if getattr(estimator, "n_trees_per_iteration_", None) != 1:
        raise ValueError("export_trees: a binary classifier (one tree per iteration) is expected")
    columns: dict[str, list[np.ndarray]] = {k: [] for k in ("feature", "threshold", "left", "right", "is_leaf",
                                                             "value", "missing_left")}
    roots, offset, depth = [], 0, 0
    for (tree,) in estimator._predictors:
        nodes = tree.nodes
        if nodes["is_categorical"].any():
            raise ValueError("export_trees: categorical splits are not supported")
        leaf = nodes["is_leaf"].astype(bool)
        columns["feature"].append(np.where(leaf, 0, nodes["feature_idx"]).astype(np.int32))
        columns["threshold"].append(nodes["num_threshold"].astype(np.float64))
        columns["left"].append(np.where(leaf, 0, nodes["left"].astype(np.int64) + offset).astype(np.int32))
        columns["right"].append(np.where(leaf, 0, nodes["right"].astype(np.int64) + offset).astype(np.int32))
        columns["is_leaf"].append(leaf)
        columns["value"].append(np.where(leaf, nodes["value"], 0.0).astype(np.float64))
        columns["missing_left"].append(nodes["missing_go_to_left"].astype(bool))
        roots.append(offset)
        offset += len(nodes)
        depth = max(depth, int(nodes["depth"].max()))
    trees = TreeArrays(**{k: np.concatenate(v) for k, v in columns.items()}, roots=np.asarray(roots, np.int32))
    baseline = float(np.asarray(estimator._baseline_prediction).ravel()[0])
    return trees, baseline, depth


def train_tick_model(ds: TickDataset, *, seed: int = 0, max_fpr: float = 0.05) -> TickModelPredictor:
    """Fit, calibrate and export the boosting model of ``ds``; raises if the export disagrees with
    scikit-learn on the dataset's ticks."""
    import sklearn  # only for its version string; fit_tick_models imported the estimator already

    model = fit_tick_models(ds, seed=seed, max_fpr=max_fpr, names=("boosting",))["boosting"]
    trees, baseline, depth = export_trees(model.estimator)
    train_rows = ds.scored_rows_in("train")
    summary = ds.summary()
    meta = TickModelMetadata(
        feature_names=list(ds.feature_names), threshold=float(model.threshold), baseline=baseline, max_depth=depth,
        tick_s=float(ds.tick_s), horizon_s=float(ds.horizon_s),
        version=f"trees-{_dt.date.today().isoformat()}-s{seed}",
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        trained_with=f"scikit-learn {sklearn.__version__} {model.estimator!r}",
        training={"runs": [r for r in ds.runs], "summary": summary, "seed": seed,
                  "calibration": "FPR <= 5 % on the scored ticks of the val runs (train runs when there are none)"},
        metrics={"trees": int(len(trees.roots)), "nodes": int(len(trees.feature)), "max_depth": depth,
                 "train_scored_ticks": int(len(train_rows))})
    predictor = TickModelPredictor(trees, meta)
    sample = ds.features[train_rows[: 20000]]
    want, got = model.score(sample), predictor.score(sample)
    if len(sample) and not np.allclose(want, got, rtol=1e-9, atol=1e-9):
        raise AssertionError(f"the exported trees disagree with scikit-learn (max |dp| "
                             f"{float(np.abs(want - got).max()):.3g}): scikit-learn's tree layout changed")
    return predictor
