"""Train and evaluate trend prediction per target, beside the baselines operators already have.

Targets (``kvguard.ml.trend``): ``oom`` — an OOM within 5 minutes (growth and neighbour runs) — and
``storm`` — a preemption storm begins within 5 minutes (``storm_dataset``). Every model is scored on
the same scored ticks of the held-out ``test`` runs (workloads and seeds no train or val run has),
its alarm threshold taken at FPR <= 5 % on the ``val`` runs, so none of them sees a test run first:

- ``predict_linear_<col>_<w>m``: Prometheus's ``predict_linear(col[w], 300)`` — the least-squares line
  over the last w minutes, extrapolated 5 minutes — on the allocator's reserved share outside the KV
  pool (``nonkv_reserved``, the device memory vLLM holds beyond its budget) and on KV usage (``u_kv``).
- ``kalman_<col>``: a local-linear-trend Kalman filter (level and slope; the forecast 5 minutes ahead),
  the shape of Dynamo's planner's load forecast.
- ``threshold``, ``slope``: the stream's tier-1/2 rules as they fired.
- ``logistic``, ``trend_trees`` (seeds 0-2: mean and spread): fitted on the derived trend features of
  ``streams.trend_model``. The trees are what ships.

Also a time-to-exhaustion estimate with an interval (``time_to_exhaustion``) and its coverage.
scikit-learn is imported inside the fitting functions.
"""

from __future__ import annotations

import numpy as np

from kvguard.contracts.units import NS_PER_S
from kvguard.ml.dataset import TickDataset
from kvguard.ml.evaluation import NodeTrace, evaluate_traces, threshold_for_fpr
from kvguard.ml.training import hysteresis
from kvguard.streams.trend_model import (DEFAULT_TREND_WINDOW_TICKS, base_series, derive_sequence,
                                         derived_names)

AHEAD_S = 300.0
LINEAR_WINDOWS_M = (5, 15, 30)
TRAINED_SEEDS = (0, 1, 2)


def derived_matrix(ds: TickDataset, window_ticks: int = DEFAULT_TREND_WINDOW_TICKS) -> np.ndarray:
    """[N, D] the trend features of every tick of ``ds`` (each over its own window)."""
    out = [derive_sequence(ds.features[ds.seq_offsets[s]:ds.seq_offsets[s + 1]], ds.feature_names, window_ticks,
                           tick_s=ds.tick_s) for s in range(ds.n_sequences)]
    return np.concatenate(out) if out else np.zeros((0, len(derived_names())))


def series(ds: TickDataset, name: str) -> np.ndarray:
    """[N] one base column (``nonkv_reserved`` derived) of every tick."""
    return base_series(ds.features[None, :, :], ds.feature_names, (name,))[0, :, 0]


def linear_forecast(y: np.ndarray, k: int, ahead: int) -> np.ndarray:
    """Per index i: the least-squares line over y[i-k+1 .. i] (left-padded with y[0]) at i + ``ahead``
    (``predict_linear``)."""
    y = np.asarray(y, dtype=np.float64)
    if not len(y):
        return y
    k = max(2, k)
    p = np.concatenate([np.full(k - 1, y[0]), y])
    g = np.arange(len(p), dtype=np.float64)
    c0, c1 = np.r_[0.0, np.cumsum(p)], np.r_[0.0, np.cumsum(g * p)]
    i = np.arange(len(y))  # window i covers p[i : i + k]
    s0 = c0[i + k] - c0[i]
    s1 = c1[i + k] - c1[i] - i * s0
    jm = (k - 1) / 2.0
    slope = (s1 - jm * s0) / float(((np.arange(k) - jm) ** 2).sum())
    return s0 / k + slope * (jm + ahead)


def kalman_forecast(y: np.ndarray, ahead: int, *, q_level: float = 1e-6, q_slope: float = 1e-8,
                    r: float = 1e-4) -> np.ndarray:
    """A local-linear-trend Kalman filter over y (state: level, slope per tick); per tick the filtered
    level + ``ahead`` x slope."""
    y = np.asarray(y, dtype=np.float64)
    out = np.zeros(len(y))
    if not len(y):
        return out
    x = np.array([y[0], 0.0])
    P = np.eye(2)
    F = np.array([[1.0, 1.0], [0.0, 1.0]])
    Q = np.diag([q_level, q_slope])
    for i, v in enumerate(y):
        x = F @ x
        P = F @ P @ F.T + Q
        s = P[0, 0] + r
        kg = P[:, 0] / s
        x = x + kg * (v - x[0])
        P = P - np.outer(kg, P[0, :])
        out[i] = x[0] + ahead * x[1]
    return out


def per_sequence(ds: TickDataset, fn, y: np.ndarray) -> np.ndarray:
    return np.concatenate([fn(y[ds.seq_offsets[s]:ds.seq_offsets[s + 1]]) for s in range(ds.n_sequences)]
                          or [np.zeros(0)])


def baseline_scores(ds: TickDataset) -> dict[str, np.ndarray]:
    """Every untrained baseline's score per tick of ``ds``."""
    ahead = int(round(AHEAD_S / ds.tick_s))
    out = {}
    for col in ("nonkv_reserved", "u_kv"):
        y = series(ds, col)
        for w in LINEAR_WINDOWS_M:
            k = int(round(w * 60 / ds.tick_s))
            out[f"predict_linear_{col}_{w}m"] = per_sequence(ds, lambda v, k=k: linear_forecast(v, k, ahead), y)
        out[f"kalman_{col}"] = per_sequence(ds, lambda v: kalman_forecast(v, ahead), y)
    return out


def _estimators(seed: int) -> dict:
    # scikit-learn takes ~1 s to import: only when a model is fitted
    from sklearn.ensemble import HistGradientBoostingClassifier
    # scikit-learn takes ~1 s to import: only when a model is fitted
    from sklearn.linear_model import LogisticRegression
    # scikit-learn takes ~1 s to import: only when a model is fitted
    from sklearn.pipeline import make_pipeline
    # scikit-learn takes ~1 s to import: only when a model is fitted
    from sklearn.preprocessing import StandardScaler

    return {"logistic": make_pipeline(StandardScaler(), LogisticRegression(class_weight="balanced", max_iter=3000)),
            "trend_trees": HistGradientBoostingClassifier(max_iter=200, learning_rate=0.1, max_leaf_nodes=15,
                                                          l2_regularization=1.0, class_weight="balanced",
                                                          random_state=seed)}


def fit(name: str, X: np.ndarray, y: np.ndarray, rows: np.ndarray, seed: int = 0):
    est = _estimators(seed)[name]
    est.fit(np.where(np.isfinite(X[rows]), X[rows], 0.0), y[rows].astype(int))
    return est


def proba(est, X: np.ndarray) -> np.ndarray:
    return est.predict_proba(np.where(np.isfinite(X), X, 0.0))[:, 1] if len(X) else np.zeros(0)


def calibrate(scores: np.ndarray, ds: TickDataset, split: str = "val", max_fpr: float = 0.05) -> float:
    """The alarm threshold at FPR <= ``max_fpr`` on ``split``'s scored ticks."""
    rows = ds.scored_rows_in(split)
    return float(threshold_for_fpr(ds.labels[rows], scores[rows], max_fpr))


def traces(ds: TickDataset, scores: np.ndarray, threshold: float, split: str, name: str = "model",
           resolve_after_s: float = 60.0, seqs: list[int] | None = None) -> list[NodeTrace]:
    """The ``split``'s sequences as traces of one score; its firing is the alert rule's (hysteresis)."""
    out = []
    for s in (seqs if seqs is not None else ds.sequences_in(split)):
        a, b = int(ds.seq_offsets[s]), int(ds.seq_offsets[s + 1])
        seq = ds.sequence(s)
        down, censored = seq.masks(ds.horizon_s)
        fire = hysteresis(seq.ts_ns, scores[a:b], threshold, resolve_after_s)
        out.append(NodeTrace(node=f"{ds.runs[int(ds.seq_run[s])]['key']}/{seq.node}", ts_ns=seq.ts_ns,
                             p_oom=scores[a:b], firing={name: fire, **seq.firing}, oom_ts_ns=seq.oom_ts_ns,
                             tick_s=ds.tick_s, down=down, censored=censored))
    return out


def calm_sequences(ds: TickDataset, split: str) -> list[int]:
    """``split``'s sequences of runs with no growth, no neighbour and no ramp."""
    return [s for s in ds.sequences_in(split)
            if not (ds.runs[int(ds.seq_run[s])].get("leak") or ds.runs[int(ds.seq_run[s])].get("neighbour")
                    or float(ds.runs[int(ds.seq_run[s])].get("ramp", 1.0) or 1.0) != 1.0)]


def score_one(ds: TickDataset, scores: np.ndarray, threshold: float, split: str, bootstrap: int,
              seqs: list[int] | None = None) -> dict:
    """The protocol's figures of one score on ``split`` (or its sequences ``seqs``), firing at ``threshold``."""
    tr = traces(ds, scores, threshold, split, seqs=seqs)
    if not tr:
        return {}
    r = evaluate_traces(tr, tiers=("model",), horizon_s=ds.horizon_s, threshold=threshold, bootstrap_draws=bootstrap)
    d = r.to_dict()
    keep = ("auc", "auc_ci", "recall_at_fpr_5pct", "bands", "ooms", "events", "ticks", "positive_ticks",
            "at_operating_threshold")
    out = {k: d[k] for k in keep}
    out["lead_time_median_s"] = d["lead_time_median_s"]["model"]
    out["lead_time_recall"] = d["lead_time_recall"]["model"]
    out["false_alarms_per_gpu_hour"] = d["false_alarms_per_gpu_hour"]["model"]
    out["threshold"] = round(float(threshold), 6)
    calm = calm_sequences(ds, split) if seqs is None else []
    if calm:
        c = evaluate_traces(traces(ds, scores, threshold, split, seqs=calm), tiers=("model",),
                            horizon_s=ds.horizon_s, bootstrap_draws=0)
        out["calm_false_alarms_per_gpu_hour"] = round(c.false_alarms_per_hour()["model"], 4)
        out["calm_gpu_hours"] = round(c.scored_hours, 3)
    return out


def tier_scores(ds: TickDataset) -> dict[str, np.ndarray]:
    """The threshold and slope tiers as 0/1 scores (what an operator gets from them)."""
    return {t: ds.firing[t].astype(np.float64) for t in ("threshold", "slope") if t in ds.firing}


def evaluate_target(ds: TickDataset, X: np.ndarray, *, split: str = "test", bootstrap: int = 200,
                    seeds: tuple[int, ...] = TRAINED_SEEDS) -> tuple[dict, dict]:
    """(figures per model on ``split``, the fitted trend trees of seed 0 with their threshold)."""
    train = ds.scored_rows_in("train")
    y = ds.labels
    if not 0 < int(y[train].sum()) < len(train):
        raise ValueError("the train split needs positive and negative scored ticks")
    out: dict[str, dict] = {}
    for name, s in {**baseline_scores(ds), **tier_scores(ds)}.items():
        thr = 0.5 if name in ("threshold", "slope") else calibrate(s, ds)
        out[name] = score_one(ds, s, thr, split, bootstrap)
    shipped = {}
    for name in ("logistic", "trend_trees"):
        per_seed = []
        for seed in (seeds if name == "trend_trees" else seeds[:1]):
            est = fit(name, X, y, train, seed)
            s = proba(est, X)
            thr = calibrate(s, ds)
            per_seed.append(score_one(ds, s, thr, split, bootstrap if seed == seeds[0] else 0))
            if name == "trend_trees" and seed == seeds[0]:
                shipped = {"estimator": est, "threshold": thr}
        row = dict(per_seed[0])
        if len(per_seed) > 1:
            row["seeds"] = {k: [p.get(k) for p in per_seed] for k in
                            ("auc", "recall_at_fpr_5pct", "lead_time_median_s", "false_alarms_per_gpu_hour")}
        out[name] = row
    return out, shipped


def lowo(ds: TickDataset, X: np.ndarray, *, bootstrap: int = 0) -> dict:
    """Leave one workload out: for each workload, the trend trees fitted on every other workload's
    train ticks (threshold from the other workloads' val runs, else their train runs), scored on all
    of the left-out workload's runs (whatever their split)."""
    runs_w = np.array([ds.runs[int(ds.seq_run[s])]["workload"] for s in range(ds.n_sequences)])
    rows_of = [np.arange(ds.seq_offsets[s], ds.seq_offsets[s + 1]) for s in range(ds.n_sequences)]
    scored = ds.scored
    out = {}
    for w in sorted(set(runs_w.tolist())):
        fit_seqs = [s for s in range(ds.n_sequences) if runs_w[s] != w and ds.split_of(s) == "train"]
        cal_seqs = [s for s in range(ds.n_sequences) if runs_w[s] != w and ds.split_of(s) == "val"] or fit_seqs
        test_seqs = [s for s in range(ds.n_sequences) if runs_w[s] == w]
        if not fit_seqs:
            continue
        fr = np.concatenate([rows_of[s] for s in fit_seqs])
        fr = fr[scored[fr]]
        if not 0 < int(ds.labels[fr].sum()) < len(fr):
            continue
        est = fit("trend_trees", X, ds.labels, fr, 0)
        s = proba(est, X)
        cr = np.concatenate([rows_of[q] for q in cal_seqs])
        cr = cr[scored[cr]]
        thr = float(threshold_for_fpr(ds.labels[cr], s[cr], 0.05))
        tr = traces(ds, s, thr, "test", seqs=test_seqs)
        r = evaluate_traces(tr, tiers=("model",), horizon_s=ds.horizon_s, threshold=thr, bootstrap_draws=bootstrap)
        d = r.to_dict()
        out[w] = {"auc": d["auc"], "recall_at_fpr_5pct": d["recall_at_fpr_5pct"], "ooms": d["ooms"],
                  "lead_time_median_s": d["lead_time_median_s"]["model"],
                  "false_alarms_per_gpu_hour": d["false_alarms_per_gpu_hour"]["model"]}
    return out


# -- time to exhaustion ------------------------------------------------------------------------------------

def time_to_exhaustion(ts_s: np.ndarray, used: np.ndarray, capacity: float, *, z: float = 1.96,
                       horizon_cap_s: float = 86400.0) -> tuple[float, float, float]:
    """(estimate, low, high) seconds until ``used`` reaches ``capacity`` on the least-squares line through
    the points; the interval from the slope's standard error (slope ± z·se, widened for the residuals'
    lag-1 autocorrelation), capped at
    ``horizon_cap_s`` (inf: not rising). Pure: the worker can run it on the allocator layer's series."""
    t = np.asarray(ts_s, dtype=np.float64)
    y = np.asarray(used, dtype=np.float64)
    if len(t) < 3:
        return float("inf"), float("inf"), float("inf")
    tc = t - t.mean()
    sxx = float((tc ** 2).sum())
    if sxx <= 0:
        return float("inf"), float("inf"), float("inf")
    b = float((tc * (y - y.mean())).sum() / sxx)
    a = y.mean() + b * (t[-1] - t.mean())  # the line's value now
    resid = y - (y.mean() + b * tc)
    se = float(np.sqrt(max((resid ** 2).sum() / max(len(t) - 2, 1), 0.0) / sxx))
    # residuals of a memory series are autocorrelated (a segment stays reserved for many ticks): the
    # slope's standard error grows by sqrt((1 + rho) / (1 - rho)) for a lag-1 correlation rho
    if len(resid) > 3 and float((resid ** 2).sum()) > 0:
        rho = float(np.clip((resid[1:] * resid[:-1]).sum() / (resid ** 2).sum(), 0.0, 0.95))
        se *= float(np.sqrt((1 + rho) / (1 - rho)))
    gap = capacity - a
    if gap <= 0:
        return 0.0, 0.0, 0.0

    def at(slope: float) -> float:
        return min(horizon_cap_s, gap / slope) if slope > 0 else float("inf")

    return at(b), at(b + z * se), at(b - z * se)


# -- the shipped trend model -------------------------------------------------------------------------------

def target_dataset(ds: TickDataset, target: str) -> TickDataset:
    """``ds`` labelled for ``target``: ``oom`` (as built) or ``storm`` (``trend.storm_dataset``)."""
    if target == "oom":
        return ds
    if target == "storm":
        # kvguard.ml.dataset imports this module's hooks: imported here to avoid the cycle
        from kvguard.ml.trend import storm_dataset

        return storm_dataset(ds)
    raise ValueError(f"target {target!r}: expected oom or storm")


def train_trend_model(ds: TickDataset, *, target: str = "oom", seed: int = 0, X: np.ndarray | None = None,
                      window_ticks: int = DEFAULT_TREND_WINDOW_TICKS):
    """Fit the trend trees for ``target`` on the train runs' scored ticks, threshold FPR <= 5 % on the val
    runs', export to arrays and check the export against scikit-learn; a ``streams.trend_model.TrendPredictor``."""
    # only this path needs it (keeps the module light to import)
    import datetime as _dt

    # scikit-learn takes ~1 s to import: only when a model is fitted
    import sklearn

    # only this path needs it (keeps the module light to import)
    from kvguard.ml.tick_training import export_trees
    # only this path needs it (keeps the module light to import)
    from kvguard.streams.trend_model import TrendModelMetadata, TrendPredictor

    ds = target_dataset(ds, target)
    X = derived_matrix(ds, window_ticks) if X is None else X
    train = ds.scored_rows_in("train")
    if not 0 < int(ds.labels[train].sum()) < len(train):
        raise ValueError(f"target {target}: the train split needs positive and negative scored ticks")
    est = fit("trend_trees", X, ds.labels, train, seed)
    s = proba(est, X)
    thr = calibrate(s, ds) if len(ds.scored_rows_in("val")) else float(threshold_for_fpr(ds.labels[train], s[train]))
    trees, baseline, depth = export_trees(est)
    meta = TrendModelMetadata(
        feature_names=list(ds.feature_names), threshold=thr, baseline=baseline, max_depth=depth, target=target,
        window_ticks=window_ticks, tick_s=float(ds.tick_s), horizon_s=float(ds.horizon_s),
        version=f"trend-{target}-{_dt.date.today().isoformat()}-s{seed}",
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        trained_with=f"scikit-learn {sklearn.__version__} {est!r}",
        training={"runs": [{k: r.get(k) for k in ("key", "workload", "seed", "split", "leak", "neighbour", "ramp",
                                                  "ooms", "ticks", "positive_ticks")} for r in ds.runs],
                  "summary": ds.summary(), "seed": seed,
                  "calibration": "FPR <= 5 % on the scored ticks of the val runs"},
        metrics={"trees": int(len(trees.roots)), "nodes": int(len(trees.feature)), "max_depth": depth})
    predictor = TrendPredictor(trees, meta)
    sample = X[train[:20000]]
    want, got = proba(est, sample), predictor.score_derived(sample)
    if len(sample) and not np.allclose(want, got, rtol=1e-9, atol=1e-9):
        raise AssertionError(f"the exported trees disagree with scikit-learn (max |dp| {float(np.abs(want - got).max()):.3g})")
    return predictor


def _subset(ds: TickDataset, split: str) -> TickDataset:
    """``ds`` with every run relabelled into ``split`` (simulated eval runs are all held out)."""
    # kvguard.ml.dataset imports this module's hooks: imported here to avoid the cycle
    from kvguard.ml.dataset import assemble

    runs: dict[int, list] = {}
    for s in range(ds.n_sequences):
        runs.setdefault(int(ds.seq_run[s]), []).append(ds.sequence(s))
    return assemble(ds.feature_names, [(dict(ds.runs[r], split=split), seqs) for r, seqs in sorted(runs.items())],
                    horizon_s=ds.horizon_s, tick_s=ds.tick_s, inputs=ds.inputs, duplicates=ds.duplicates)


def targets_block(ds: TickDataset, predictors: dict, *, split: str = "test", calib: TickDataset | None = None,
                  bootstrap: int = 200) -> dict:
    """Per target, the shipped model's figures and the untrained baselines' on ``split`` of ``ds``.

    ``predictors``: target -> ``TrendPredictor`` (its own calibrated threshold). The baselines take
    their thresholds from ``calib``'s val runs (a dataset from ``kvguard dataset --preset trend``),
    else from these very ticks (FPR <= 5 %; optimistic, said in ``baseline_thresholds``)."""
    out = {}
    for target, predictor in predictors.items():
        tds = target_dataset(ds, target)
        X = derived_matrix(tds, predictor.window_ticks)
        rows = tds.scored_rows_in(split)
        block: dict = {"model": {"version": predictor.metadata.version, "kind": predictor.metadata.kind}}
        s = predictor.score_derived(X)
        block["shipped"] = score_one(tds, s, predictor.threshold, split, bootstrap)
        cal = target_dataset(calib, target) if calib is not None else None
        cal_scores = baseline_scores(cal) if cal is not None else {}
        for name, b in {**baseline_scores(tds), **tier_scores(tds)}.items():
            if name in ("threshold", "slope"):
                thr = 0.5
            elif cal is not None:
                thr = calibrate(cal_scores[name], cal)
            else:
                thr = float(threshold_for_fpr(tds.labels[rows], b[rows], 0.05)) if len(rows) else 0.5
            block[name] = score_one(tds, b, thr, split, bootstrap)
        block["baseline_thresholds"] = ("FPR <= 5 % on the val runs of the calibration dataset" if cal is not None
                                        else "FPR <= 5 % on these same ticks (optimistic for the baselines)")
        block["storm_definition"] = None if target != "storm" else _storm_definition()
        block["positive_ticks"] = int(tds.labels[rows].sum()) if len(rows) else 0
        out[target] = block
    return out


def _storm_definition() -> str:
    # kvguard.ml.dataset imports this module's hooks: imported here to avoid the cycle
    from kvguard.ml.trend import STORM_PER_MIN, STORM_WINDOW_S

    return (f">= {STORM_PER_MIN:g} preemptions a minute over a trailing {STORM_WINDOW_S:g} s on one GPU "
            f"(kvguard.ml.trend.storm_episodes)")


# -- time to exhaustion, measured -----------------------------------------------------------------------

def exhaustion_level(ds: TickDataset, split: str = "train", column: str = "nonkv_reserved") -> float:
    """The ``column`` level the engine's memory had reached on the last tick before each growth OOM of
    ``split`` (median): the capacity the time-to-exhaustion line is extrapolated to. The allocator's
    reserved share outside the KV pool is what a leak fills; the level is a property of the profile
    (its gpu_memory_utilization and activation peak), calibrated on the train runs."""
    y = series(ds, column)
    levels = []
    for s in ds.sequences_in(split):
        run = ds.runs[int(ds.seq_run[s])]
        if not run.get("leak"):
            continue
        a = int(ds.seq_offsets[s])
        seq = ds.sequence(s)
        for t in seq.oom_ts_ns:
            k = int(np.searchsorted(seq.ts_ns, t, side="left")) - 1
            if k >= 0:
                levels.append(y[a + k])
    return float(np.median(levels)) if levels else float("nan")


def tte_evaluation(ds: TickDataset, capacity: float, *, split: str = "test", window_s: float = 900.0,
                   column: str = "nonkv_reserved", max_lead_s: float = 1800.0) -> dict:
    """On ``split``'s leak runs, every scored tick up to ``max_lead_s`` before a growth OOM: the
    estimate's error against the true time to that OOM and the share of ticks whose interval holds it."""
    y = series(ds, column)
    k = int(round(window_s / ds.tick_s))
    errors, covered, n = [], 0, 0
    by_band: dict[str, list[float]] = {}
    for s in ds.sequences_in(split):
        if not ds.runs[int(ds.seq_run[s])].get("leak"):
            continue
        a = int(ds.seq_offsets[s])
        seq = ds.sequence(s)
        down, censored = seq.masks(ds.horizon_s)
        scored = ~(down | censored)
        ts_s = seq.ts_ns / NS_PER_S
        for i in range(len(seq.ts_ns)):
            nxt = seq.oom_ts_ns[seq.oom_ts_ns > seq.ts_ns[i]]
            if not len(nxt) or not scored[i] and not censored[i]:
                continue
            truth = (nxt[0] - seq.ts_ns[i]) / NS_PER_S
            if truth > max_lead_s:
                continue
            lo_i = i - k + 1
            if lo_i < 0:
                continue
            if len(seq.oom_ts_ns[(seq.oom_ts_ns > seq.ts_ns[lo_i]) & (seq.oom_ts_ns <= seq.ts_ns[i])]):
                continue  # the window spans a restart
            est, lo, hi = time_to_exhaustion(ts_s[lo_i:i + 1], y[a + lo_i:a + i + 1], capacity)
            n += 1
            errors.append(est - truth)
            covered += int(lo <= truth <= hi)
            band = "0-300s" if truth <= 300 else "300-900s" if truth <= 900 else "900-1800s"
            by_band.setdefault(band, []).append(abs(est - truth) / max(truth, 1.0))
    if not n:
        return {"ticks": 0}
    e = np.asarray(errors)
    finite = np.isfinite(e)
    return {"ticks": n, "capacity": round(capacity, 5), "window_s": window_s,
            "median_abs_error_s": round(float(np.median(np.abs(e[finite]))), 1) if finite.any() else None,
            "median_error_s": round(float(np.median(e[finite])), 1) if finite.any() else None,
            "interval_coverage": round(covered / n, 4), "never_estimated": int((~finite).sum()),
            "median_relative_error_by_truth": {b: round(float(np.median(v)), 3) for b, v in sorted(by_band.items())}}
