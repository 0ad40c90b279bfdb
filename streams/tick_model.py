"""A per-tick OOM predictor: gradient-boosted trees over one tick's features, scored with numpy.

Issue 13's protocol found that one tick's features carry what the models can use: on held-out
workloads histogram gradient boosting (scikit-learn, fitted by ``kvguard train --model boosting``)
scored above the 30-minute LSTM. This module is its inference side, in the stream worker: the trees
are exported to plain arrays (``<stem>.npz``) with a JSON metadata file (``<stem>.json``), so the
worker loads no pickle, imports neither scikit-learn nor torch, and the artifact cannot run code.

Scoring is exactly scikit-learn's (``HistGradientBoostingClassifier.predict_proba`` for numerical
features; ``tests/unit/streams/test_tick_model.py`` checks equality): the raw score is the baseline plus each
tree's leaf value, a feature value goes left when it is ``<= num_threshold`` (a missing one where
the tree learnt missing values go), and P(OOM) is the logistic of the raw score. Non-finite
features are fed as 0, as in training.

The model reads only the tick being scored (``window_ticks`` = 1) and has no U_kv forecast: the
trajectory it returns is empty, so the planner's predicted trajectory is the tick's own.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from kvguard.streams.predictor import ModelError, ModelFeatureMismatch

TREES_FORMAT = "kvguard-tick-trees/1"
_ARRAYS = ("feature", "threshold", "left", "right", "is_leaf", "value", "missing_left", "roots")


class TickModelError(ModelError):
    """A tick-model artifact is missing, malformed or for other features; names the file."""


@dataclass(slots=True)
class TickModelMetadata:
    """What ``<stem>.json`` holds; the fields the evaluation reads match ``streams.lstm.ModelMetadata``."""

    feature_names: list[str]
    threshold: float  # operating point: FPR <= 5 % on the validation runs' scored ticks
    baseline: float  # the raw score before any tree
    max_depth: int
    kind: str = "boosting"
    format: str = TREES_FORMAT
    window_ticks: int = 1
    traj_steps: int = 0
    tick_s: float = 10.0
    horizon_s: float = 300.0
    resolve_after_s: float = 60.0
    version: str = ""
    created: str = ""
    trained_with: str = ""  # e.g. "scikit-learn 1.9.1 HistGradientBoostingClassifier(max_iter=200, …)"
    training: dict = field(default_factory=dict)  # dataset summary, runs, calibration
    metrics: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, path: str = "<metadata>") -> "TickModelMetadata":
        if d.get("format") != TREES_FORMAT:
            raise TickModelError(f"{path}: format {d.get('format')!r}, expected {TREES_FORMAT!r}")
        try:
            return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})
        except TypeError as exc:
            raise TickModelError(f"{path}: {exc}") from exc


@dataclass(slots=True)
class TreeArrays:
    """Every tree's nodes in flat arrays; tree ``t`` starts at node ``roots[t]``; child indices are global."""

    feature: np.ndarray  # int32 [N]
    threshold: np.ndarray  # float64 [N]
    left: np.ndarray  # int32 [N]
    right: np.ndarray  # int32 [N]
    is_leaf: np.ndarray  # bool [N]
    value: np.ndarray  # float64 [N]: the leaf's contribution to the raw score
    missing_left: np.ndarray  # bool [N]
    roots: np.ndarray  # int32 [T]

    def check(self, n_features: int, where: str) -> None:
        n = len(self.feature)
        if any(len(getattr(self, name)) != n for name in _ARRAYS[:-1]):
            raise TickModelError(f"{where}: node arrays of different lengths")
        inner = ~self.is_leaf
        for name in ("left", "right"):
            child = getattr(self, name)[inner]
            if len(child) and (child.min() < 0 or child.max() >= n):
                raise TickModelError(f"{where}: {name} child index out of range")
        if inner.any() and (self.feature[inner].min() < 0 or self.feature[inner].max() >= n_features):
            raise TickModelError(f"{where}: a split on a feature index outside 0..{n_features - 1}")
        if len(self.roots) and (self.roots.min() < 0 or self.roots.max() >= n):
            raise TickModelError(f"{where}: root index out of range")

    def raw(self, x: np.ndarray, baseline: float, max_depth: int) -> np.ndarray:
        """Raw scores [n] for features ``x`` [n, F]: every (row, tree) pair walks down together, one
        level per pass, and pairs that reached a leaf drop out of the next pass."""
        if not len(x):
            return np.zeros(0)
        n, n_trees, n_features = len(x), len(self.roots), x.shape[1]
        node = np.tile(self.roots, n)  # flat [n * T]: row r's tree t at r * T + t
        offset = np.repeat(np.arange(n) * n_features, n_trees)
        flat = np.ascontiguousarray(x, dtype=np.float64).ravel()
        active = np.flatnonzero(~self.is_leaf[node])
        for _ in range(max_depth + 1):
            if not len(active):
                break
            at = node[active]
            v = flat[offset[active] + self.feature[at]]
            go_left = np.where(np.isnan(v), self.missing_left[at], v <= self.threshold[at])
            at = np.where(go_left, self.left[at], self.right[at])
            node[active] = at
            active = active[~self.is_leaf[at]]
        return baseline + self.value[node].reshape(n, n_trees).sum(axis=1)


class TickModelPredictor:
    """``streams.predictor.Predictor`` over exported trees: P(OOM) from the last tick of each window."""

    def __init__(self, trees: TreeArrays, metadata: TickModelMetadata):
        self.trees = trees
        self.metadata = metadata

    @property
    def feature_names(self) -> tuple[str, ...]:
        return tuple(self.metadata.feature_names)

    @property
    def window_ticks(self) -> int:
        return 1

    @property
    def horizon_ticks(self) -> int:
        return 0

    @property
    def threshold(self) -> float:
        return self.metadata.threshold

    def score(self, features: np.ndarray) -> np.ndarray:
        """P(OOM) [n] for one tick's features [n, F]."""
        x = np.asarray(features, dtype=np.float64)
        x = np.where(np.isfinite(x), x, 0.0)
        raw = self.trees.raw(x, self.metadata.baseline, self.metadata.max_depth)
        return 1.0 / (1.0 + np.exp(-raw))

    def predict(self, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        windows = np.asarray(windows)
        p = self.score(windows[:, -1, :]).astype(np.float32)
        return p, np.zeros((len(windows), 0), dtype=np.float32)


def paths(path: str | Path, stem: str = "oom_trees") -> tuple[Path, Path]:
    """``(<stem>.npz, <stem>.json)`` for a stem, either file, or a directory holding ``stem``."""
    p = Path(path)
    if p.is_dir():
        p = p / stem
    if p.suffix in (".npz", ".json"):
        p = p.with_suffix("")
    return p.with_suffix(".npz"), p.with_suffix(".json")


def is_tick_model(path: str | Path) -> bool:
    """Whether ``path`` names a tick-trees artifact (its JSON says so)."""
    _, meta_path = paths(path)
    try:
        return json.loads(meta_path.read_text()).get("format") == TREES_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def save_trees(trees: TreeArrays, metadata, path: str | Path) -> tuple[Path, Path]:
    """Write a tree artifact: the arrays as ``.npz``, ``metadata.to_dict()`` as ``.json`` (no pickle)."""
    npz, meta_path = paths(path)
    npz.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(npz, **{name: getattr(trees, name) for name in _ARRAYS})
    meta_path.write_text(json.dumps(metadata.to_dict(), indent=1, sort_keys=True) + "\n")
    return npz, meta_path


def save_tick_model(trees: TreeArrays, metadata: TickModelMetadata, path: str | Path) -> tuple[Path, Path]:
    return save_trees(trees, metadata, path)


def read_trees(npz: Path, error: type[Exception], what: str) -> TreeArrays:
    """The tree arrays of ``npz`` with their dtypes; ``error`` (naming ``what``) when it is not one."""
    try:
        with np.load(npz, allow_pickle=False) as data:
            arrays = {name: data[name] for name in _ARRAYS}
    except (OSError, KeyError, ValueError) as exc:
        raise error(f"{npz}: not a {what} array file: {exc}") from exc
    return TreeArrays(feature=arrays["feature"].astype(np.int32), threshold=arrays["threshold"].astype(np.float64),
                      left=arrays["left"].astype(np.int32), right=arrays["right"].astype(np.int32),
                      is_leaf=arrays["is_leaf"].astype(bool), value=arrays["value"].astype(np.float64),
                      missing_left=arrays["missing_left"].astype(bool), roots=arrays["roots"].astype(np.int32))


def load_tick_model(path: str | Path, *, expected_features: list[str] | None = None) -> TickModelPredictor:
    npz, meta_path = paths(path)
    for p in (npz, meta_path):
        if not p.exists():
            raise TickModelError(f"{p}: model file not found (build one with `kvguard train --model boosting`)")
    try:
        meta = TickModelMetadata.from_dict(json.loads(meta_path.read_text()), str(meta_path))
    except json.JSONDecodeError as exc:
        raise TickModelError(f"{meta_path}: not JSON: line {exc.lineno}: {exc.msg}") from exc
    if expected_features is not None and list(expected_features) != list(meta.feature_names):
        raise ModelFeatureMismatch(str(meta_path), list(meta.feature_names), list(expected_features))
    trees = read_trees(npz, TickModelError, "tick-trees")
    trees.check(len(meta.feature_names), str(npz))
    return TickModelPredictor(trees, meta)
