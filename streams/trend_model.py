"""A trend predictor: gradient-boosted trees over levels and slopes of a node's last 30 minutes.

The TREND failure classes (slow growth C7, a neighbour C4, a preemption storm C6 in
``notes/oom-classes.md``) build up over minutes, so what a model needs is how fast a level moves, not
one tick: ``derive`` turns each window [T, F] of tick features (``streams.metrics.FEATURE_NAMES``,
left-padded as ``streams.predictor.window_from_history`` pads) into, per base column, its last
value, its mean over the last minute and its least-squares slope per minute over the last 5, 15 and
30 minutes (the windows of Prometheus's ``predict_linear`` that operators alert on), plus its rise
over the window's minimum. ``nonkv_reserved`` is the caching allocator's reserved bytes outside the
KV pool as a share of M (``util_activation + util_reserved_unused``): where a leak shows up.

The trees are scored exactly as ``streams.tick_model.TreeArrays`` scores scikit-learn's
``HistGradientBoostingClassifier`` (the same export), over the derived columns. The artifact is
``<stem>.npz`` (the tree arrays) and ``<stem>.json`` (metadata: the base columns, the windows, the
target — ``oom`` or ``storm`` — and the threshold calibrated on validation runs); loading it needs
numpy only and runs no code. Pure: numpy and the standard library.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from kvguard.streams.predictor import ModelError, ModelFeatureMismatch
from kvguard.streams.tick_model import TreeArrays, paths, read_trees, save_trees

TREND_FORMAT = "kvguard-trend-trees/1"
BASE_COLUMNS = ("nonkv_reserved", "util_activation", "util_reserved_unused", "u_kv", "free_frac",
                "log_preemptions", "log_requests_waiting", "log_requests_running", "log_alloc_retries",
                "log_arrivals", "token_turnover", "alloc_f_ext")
SLOPE_WINDOWS_S = (300.0, 900.0, 1800.0)
MEAN_WINDOW_S = 60.0
DEFAULT_TREND_WINDOW_TICKS = 180  # 30 minutes of 10 s ticks


class TrendModelError(ModelError):
    """A trend-model artifact is missing, malformed or for other features; names the file."""


def base_series(windows: np.ndarray, feature_names: list[str] | tuple[str, ...],
                base: tuple[str, ...] = BASE_COLUMNS) -> np.ndarray:
    """[n, T, B] the base columns of ``windows`` [n, T, F]; ``nonkv_reserved`` is derived."""
    idx = {name: i for i, name in enumerate(feature_names)}
    cols = []
    for name in base:
        if name == "nonkv_reserved":
            cols.append(windows[:, :, idx["util_activation"]] + windows[:, :, idx["util_reserved_unused"]])
        else:
            cols.append(windows[:, :, idx[name]])
    return np.stack(cols, axis=2).astype(np.float64)


def ls_slope(x: np.ndarray, k: int, tick_s: float) -> np.ndarray:
    """Least-squares slope per minute of the last ``k`` rows of ``x`` [n, T, B] -> [n, B]."""
    k = max(2, min(k, x.shape[1]))
    t = np.arange(k, dtype=np.float64) * tick_s / 60.0
    tc = t - t.mean()
    seg = x[:, -k:, :]
    return np.einsum("t,ntb->nb", tc, seg - seg.mean(axis=1, keepdims=True)) / float((tc ** 2).sum())


def derive(windows: np.ndarray, feature_names, *, tick_s: float = 10.0, base: tuple[str, ...] = BASE_COLUMNS,
           slope_windows_s: tuple[float, ...] = SLOPE_WINDOWS_S, mean_window_s: float = MEAN_WINDOW_S) -> np.ndarray:
    """[n, D] derived features of ``windows`` [n, T, F] (order of ``derived_names``)."""
    w = np.asarray(windows, dtype=np.float64)
    w = np.where(np.isfinite(w), w, 0.0)
    x = base_series(w, feature_names, base)
    parts = [x[:, -1, :], x[:, -max(1, int(round(mean_window_s / tick_s))):, :].mean(axis=1)]
    parts += [ls_slope(x, int(round(s / tick_s)), tick_s) for s in slope_windows_s]
    parts.append(x[:, -1, :] - x.min(axis=1))
    return np.concatenate(parts, axis=1)


def derived_names(base: tuple[str, ...] = BASE_COLUMNS, slope_windows_s: tuple[float, ...] = SLOPE_WINDOWS_S) -> list[str]:
    kinds = ["last", "mean1m"] + [f"slope{int(s // 60)}m" for s in slope_windows_s] + ["rise"]
    return [f"{b}@{k}" for k in kinds for b in base]


def derive_sequence(features: np.ndarray, feature_names, window_ticks: int, *, tick_s: float = 10.0,
                    chunk: int = 512) -> np.ndarray:
    """``derive`` of every tick of one node's sequence [L, F], each over the window ending at it,
    left-padded with the first row (``window_from_history``'s padding): [L, D]."""
    f = np.asarray(features, dtype=np.float32)
    if not len(f):
        return np.zeros((0, len(derived_names())))
    padded = np.concatenate([np.repeat(f[:1], window_ticks - 1, axis=0), f])
    view = np.lib.stride_tricks.sliding_window_view(padded, window_ticks, axis=0)  # [L, F, T]
    out = [derive(np.transpose(view[a:a + chunk], (0, 2, 1)), feature_names, tick_s=tick_s)
           for a in range(0, len(f), chunk)]
    return np.concatenate(out)


@dataclass(slots=True)
class TrendModelMetadata:
    feature_names: list[str]
    threshold: float
    baseline: float
    max_depth: int
    target: str = "oom"  # "oom": an OOM within horizon_s; "storm": a preemption storm begins within it
    base_columns: list[str] = field(default_factory=lambda: list(BASE_COLUMNS))
    slope_windows_s: list[float] = field(default_factory=lambda: list(SLOPE_WINDOWS_S))
    kind: str = "trend-boosting"
    format: str = TREND_FORMAT
    window_ticks: int = DEFAULT_TREND_WINDOW_TICKS
    traj_steps: int = 0
    tick_s: float = 10.0
    horizon_s: float = 300.0
    resolve_after_s: float = 60.0
    version: str = ""
    created: str = ""
    trained_with: str = ""
    training: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, path: str = "<metadata>") -> "TrendModelMetadata":
        if d.get("format") != TREND_FORMAT:
            raise TrendModelError(f"{path}: format {d.get('format')!r}, expected {TREND_FORMAT!r}")
        try:
            return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})
        except TypeError as exc:
            raise TrendModelError(f"{path}: {exc}") from exc


class TrendPredictor:
    """``streams.predictor.Predictor``: P(target within the horizon) from each window's trends."""

    def __init__(self, trees: TreeArrays, metadata: TrendModelMetadata):
        self.trees = trees
        self.metadata = metadata
        self._base = tuple(metadata.base_columns)
        self._windows = tuple(float(s) for s in metadata.slope_windows_s)

    @property
    def feature_names(self) -> tuple[str, ...]:
        return tuple(self.metadata.feature_names)

    @property
    def window_ticks(self) -> int:
        return int(self.metadata.window_ticks)

    @property
    def horizon_ticks(self) -> int:
        return 0

    @property
    def threshold(self) -> float:
        return self.metadata.threshold

    def score_derived(self, derived: np.ndarray) -> np.ndarray:
        raw = self.trees.raw(np.asarray(derived, dtype=np.float64), self.metadata.baseline, self.metadata.max_depth)
        return 1.0 / (1.0 + np.exp(-raw))

    def predict(self, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        d = derive(np.asarray(windows), self.feature_names, tick_s=self.metadata.tick_s, base=self._base,
                   slope_windows_s=self._windows)
        return self.score_derived(d).astype(np.float32), np.zeros((len(d), 0), dtype=np.float32)


def is_trend_model(path: str | Path) -> bool:
    _, meta_path = paths(path)
    try:
        return json.loads(meta_path.read_text()).get("format") == TREND_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def save_trend_model(trees: TreeArrays, metadata: TrendModelMetadata, path: str | Path) -> tuple[Path, Path]:
    return save_trees(trees, metadata, path)


def load_trend_model(path: str | Path, *, expected_features: list[str] | None = None) -> TrendPredictor:
    npz, meta_path = paths(path)
    for p in (npz, meta_path):
        if not p.exists():
            raise TrendModelError(f"{p}: model file not found (build one with `kvguard train --model trend`)")
    try:
        meta = TrendModelMetadata.from_dict(json.loads(meta_path.read_text()), str(meta_path))
    except json.JSONDecodeError as exc:
        raise TrendModelError(f"{meta_path}: not JSON: line {exc.lineno}: {exc.msg}") from exc
    if expected_features is not None and list(expected_features) != list(meta.feature_names):
        raise ModelFeatureMismatch(str(meta_path), list(meta.feature_names), list(expected_features))
    unknown = [b for b in meta.base_columns if b != "nonkv_reserved" and b not in meta.feature_names]
    if unknown:
        raise TrendModelError(f"{meta_path}: base_columns {unknown} are not tick features")
    trees = read_trees(npz, TrendModelError, "trend-trees")
    n_derived = len(meta.base_columns) * (3 + len(meta.slope_windows_s))
    trees.check(n_derived, str(npz))
    return TrendPredictor(trees, meta)
