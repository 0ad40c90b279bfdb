"""The models the shipped LSTM is measured against, under one protocol (``kvguard.ml.evaluation``).

- ``threshold`` and ``slope``: the stream's tier-1 and tier-2 alert rules as they fired (the
  score is the firing itself, 0 or 1: what an operator gets from them).
- ``logistic``: logistic regression on one tick's features (standardised, balanced classes).
- ``boosting``: scikit-learn's histogram gradient boosting on one tick's features.

The two fitted models learn from the scored ticks of the ``train`` runs and take their operating
threshold (FPR <= 5 %) from the scored ticks of the ``val`` runs, as the LSTM does, so none of
them sees a held-out workload before it is scored. scikit-learn is imported inside ``fit_tick_models``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvguard.ml.dataset import TickDataset, assemble
from kvguard.ml.evaluation import NodeTrace, evaluate_traces, threshold_for_fpr

TIER_BASELINES = ("threshold", "slope")
MODEL = "model"  # the tier name a baseline's own firing goes by inside its traces


@dataclass(slots=True)
class TickModel:
    """A fitted per-tick classifier and the threshold calibrated on validation ticks."""

    name: str
    estimator: object
    threshold: float

    def score(self, features: np.ndarray) -> np.ndarray:
        x = np.where(np.isfinite(features), features, 0.0).astype(np.float64)
        return self.estimator.predict_proba(x)[:, 1] if len(x) else np.zeros(0)


def _estimators(seed: int) -> dict:
    # scikit-learn takes ~1 s to import: only when a baseline is fitted
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    return {
        "logistic": make_pipeline(StandardScaler(), LogisticRegression(class_weight="balanced", max_iter=2000)),
        "boosting": HistGradientBoostingClassifier(max_iter=200, learning_rate=0.1, max_leaf_nodes=15,
                                                   class_weight="balanced", random_state=seed),
    }


def fit_tick_models(ds: TickDataset, *, seed: int = 0, max_fpr: float = 0.05,
                    names: tuple[str, ...] | None = None) -> dict[str, TickModel]:
    """Fit every per-tick baseline (or those ``names``) on ``ds``'s scored train ticks; thresholds
    from its val ticks (train ticks when it has no val runs)."""
    train_rows = ds.scored_rows_in("train")
    y = ds.labels[train_rows].astype(int)
    if not 0 < y.sum() < len(y):
        raise ValueError(f"the train split needs positive and negative scored ticks "
                         f"(has {int(y.sum())} of {len(y)} positive)")
    calib_rows = ds.scored_rows_in("val")
    if not 0 < ds.labels[calib_rows].sum() < len(calib_rows):
        calib_rows = train_rows
    x = np.where(np.isfinite(ds.features[train_rows]), ds.features[train_rows], 0.0)
    models = {}
    for name, estimator in _estimators(seed).items():
        if names is not None and name not in names:
            continue
        estimator.fit(x, y)
        model = TickModel(name, estimator, 0.5)
        model.threshold = threshold_for_fpr(ds.labels[calib_rows], model.score(ds.features[calib_rows]), max_fpr)
        models[name] = model
    return models


def as_model_traces(traces: list[NodeTrace], scores: list[np.ndarray], firing: list[np.ndarray]) -> list[NodeTrace]:
    """The same node runs scored by another model: its score and its own firing (tier ``MODEL``)."""
    return [NodeTrace(node=tr.node, ts_ns=tr.ts_ns, p_oom=np.asarray(p, np.float64),
                      firing={MODEL: np.asarray(f, dtype=bool)}, oom_ts_ns=tr.oom_ts_ns, tick_s=tr.tick_s,
                      down=tr.down, censored=tr.censored, fleet=tr.fleet)
            for tr, p, f in zip(traces, scores, firing)]


def tier_traces(traces: list[NodeTrace], tier: str) -> list[NodeTrace]:
    """An alert tier as a model: its firing is both the score and the alarm."""
    fires = [np.asarray(tr.firing[tier], dtype=bool) for tr in traces]
    return as_model_traces(traces, [f.astype(np.float64) for f in fires], fires)


def summarise(traces: list[NodeTrace], horizon_s: float, threshold: float | None = None,
              bootstrap_draws: int | None = None) -> dict:
    """One model's row in ``baselines``: AUC (with interval), recall at FPR <= 5 %, median lead
    time, false alarms per GPU-hour and the lead bands."""
    kwargs = {} if bootstrap_draws is None else {"bootstrap_draws": bootstrap_draws}
    out = evaluate_traces(traces, tiers=(MODEL,), horizon_s=horizon_s, threshold=threshold, **kwargs).to_dict()
    return {"auc": out["auc"], "auc_ci": out["auc_ci"], "recall_at_fpr_5pct": out["recall_at_fpr_5pct"],
            "lead_time_median_s": out["lead_time_median_s"][MODEL],
            "lead_time_recall": out["lead_time_recall"][MODEL],
            "false_alarms_per_gpu_hour": out["false_alarms_per_gpu_hour"][MODEL],
            "at_operating_threshold": out["at_operating_threshold"], "bands": out["bands"]}


def fold(ds: TickDataset, held_out: str) -> TickDataset:
    """``ds`` with every run of workload ``held_out`` as ``test`` and every other run training data
    (its ``val`` runs stay ``val`` for the threshold; other ``test`` runs become ``train``)."""
    runs = []
    for r, info in enumerate(ds.runs):
        seqs = [ds.sequence(s) for s in range(ds.n_sequences) if int(ds.seq_run[s]) == r]
        split = "test" if info["workload"] == held_out else ("val" if info["split"] == "val" else "train")
        runs.append((dict(info, split=split), seqs))
    return assemble(ds.feature_names, runs, horizon_s=ds.horizon_s, tick_s=ds.tick_s, inputs=ds.inputs)


def held_out_traces(ds: TickDataset) -> list[NodeTrace]:
    """The ``test`` sequences of ``ds`` as traces (score 0 until a model scores them), with the
    stored tier firing, masks, fleets and features."""
    traces = []
    for s in ds.sequences_in("test"):
        seq = ds.sequence(s)
        a, b = int(ds.seq_offsets[s]), int(ds.seq_offsets[s + 1])
        traces.append(NodeTrace(node=seq.node, ts_ns=seq.ts_ns, p_oom=np.zeros(b - a), firing=seq.firing,
                                oom_ts_ns=seq.oom_ts_ns, tick_s=ds.tick_s, down=ds.down[a:b],
                                censored=ds.censored[a:b], fleet=str(ds.runs[int(ds.seq_run[s])].get("key", s)),
                                features=seq.features))
    return traces


def leave_one_workload_out(ds: TickDataset, *, horizon_s: float, resolve_after_s: float = 60.0,
                           lstm_config=None, bootstrap_draws: int | None = None) -> dict[str, dict]:
    """Per workload, every model fitted without it (threshold from the other workloads' ``val``
    runs) and scored on all of its runs. ``lstm_config``: a ``TrainConfig`` to retrain the LSTM per
    fold (None: the LSTM is left out; it costs a training run per workload)."""
    # training imports torch (seconds): only when the LSTM is retrained per fold
    from kvguard.ml.training import hysteresis, score_dataset, train

    out = {}
    for workload in sorted({r["workload"] for r in ds.runs}):
        f = fold(ds, workload)
        if not f.sequences_in("test") or not f.sequences_in("train"):
            continue
        traces = held_out_traces(f)
        rows = {tier: summarise(tier_traces(traces, tier), horizon_s, bootstrap_draws=bootstrap_draws)
                for tier in TIER_BASELINES}
        for name, model in fit_tick_models(f).items():
            scores = [model.score(tr.features) for tr in traces]
            firing = [hysteresis(tr.ts_ns, p, model.threshold, resolve_after_s) for tr, p in zip(traces, scores)]
            rows[name] = summarise(as_model_traces(traces, scores, firing), horizon_s, threshold=model.threshold,
                                   bootstrap_draws=bootstrap_draws)
        if lstm_config is not None:
            result = train(f, lstm_config)
            meta = result.metadata
            scores = score_dataset(result.net, f, f.sequences_in("test"), meta.normalisation, meta.window_ticks)
            firing = [hysteresis(tr.ts_ns, p, meta.threshold, resolve_after_s) for tr, p in zip(traces, scores)]
            rows["lstm"] = summarise(as_model_traces(traces, scores, firing), horizon_s, threshold=meta.threshold,
                                     bootstrap_draws=bootstrap_draws)
        rows["ooms"] = sum(len(tr.oom_ts_ns) for tr in traces)
        out[workload] = rows
    return out
