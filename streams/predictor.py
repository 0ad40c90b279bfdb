"""The tier-3 predictor seam: what the stream core expects from a model, and how it builds windows.

Pure (numpy + stdlib). A predictor reads, per node, the last ``window_ticks`` tick feature
vectors (``streams.metrics.tick_features``, columns ``FEATURE_NAMES``) and returns P(OOM within the
horizon) and the forecast U_kv trajectory. The core calls ``predict`` once per call of
``StreamCore.process_many``, batched over every tick produced by that call (all nodes it owns).

Windows: row ``T-1`` is the tick being scored; a node with fewer than ``window_ticks`` ticks of
history is left-padded by repeating its oldest tick (``window_from_history``). Training data must
be built with the same function so the model sees the same padding.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from kvguard.streams.metrics import FEATURE_NAMES

DEFAULT_WINDOW_TICKS = 180  # 30 minutes of 10 s ticks


@runtime_checkable
class Predictor(Protocol):
    feature_names: tuple[str, ...]
    window_ticks: int

    def predict(self, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``windows``: float32 [n, T, F]. Returns (p_oom [n] in [0, 1], u_kv_traj [n, H])."""
        ...


class ModelError(ValueError):
    """A model artifact is missing, unreadable or inconsistent; names the file and the field."""


class ModelFeatureMismatch(ModelError):
    """The model was trained on other tick features than the ones the caller provides."""

    def __init__(self, path: str, model_features: list[str], expected_features: list[str]):
        self.path = path
        self.missing = [f for f in expected_features if f not in model_features]
        self.extra = [f for f in model_features if f not in expected_features]
        detail = []
        if self.extra:
            detail.append(f"model has features the stream does not compute: {self.extra}")
        if self.missing:
            detail.append(f"stream computes features the model was not trained on: {self.missing}")
        if not detail:
            first = next(i for i, (a, b) in enumerate(zip(model_features, expected_features)) if a != b)
            detail.append(f"same features in another order (position {first}: model {model_features[first]!r}, "
                          f"stream {expected_features[first]!r})")
        super().__init__(f"{path}: feature_names do not match FEATURE_NAMES: " + "; ".join(detail)
                         + ". Retrain with `kvguard dataset` + `kvguard train`.")


class PredictorMismatch(ValueError):
    """The predictor was trained on other features than the stream computes."""


def check_predictor(predictor: Predictor) -> None:
    names = tuple(predictor.feature_names)
    if names != FEATURE_NAMES:
        missing = [n for n in FEATURE_NAMES if n not in names]
        extra = [n for n in names if n not in FEATURE_NAMES]
        raise PredictorMismatch(
            f"predictor.feature_names differ from streams.metrics.FEATURE_NAMES "
            f"(missing {missing}, unexpected {extra}, or another order); retrain on tick_features()")
    if int(predictor.window_ticks) <= 0:
        raise PredictorMismatch(f"predictor.window_ticks must be > 0, got {predictor.window_ticks}")


def window_from_history(history: np.ndarray, window_ticks: int) -> np.ndarray:
    """The last ``window_ticks`` rows of ``history`` [t, F], left-padded with its first row; always a
    new array, never a view of ``history`` (a ring buffer's later pushes would overwrite it)."""
    if len(history) == 0:
        raise ValueError("window_from_history needs at least one tick of history")
    if len(history) >= window_ticks:
        return np.array(history[-window_ticks:], dtype=np.float32)
    pad = np.repeat(history[:1], window_ticks - len(history), axis=0)
    return np.concatenate([pad, history]).astype(np.float32)


class FeatureHistory:
    """A node's last ``capacity`` feature vectors in a ring buffer (fixed memory, no list growth)."""

    __slots__ = ("buffer", "count")

    def __init__(self, capacity: int, n_features: int = len(FEATURE_NAMES)):
        self.buffer = np.zeros((capacity, n_features), dtype=np.float32)
        self.count = 0

    def push(self, features: np.ndarray) -> None:
        self.buffer[self.count % len(self.buffer)] = features
        self.count += 1

    def ordered(self) -> np.ndarray:
        cap = len(self.buffer)
        if self.count <= cap:
            return self.buffer[:self.count]
        start = self.count % cap
        return np.concatenate([self.buffer[start:], self.buffer[:start]])

    def window(self, window_ticks: int, lag: int = 0) -> np.ndarray:
        """The window ending ``lag`` ticks before the newest one."""
        history = self.ordered()
        return window_from_history(history[:len(history) - lag] if lag else history, window_ticks)
