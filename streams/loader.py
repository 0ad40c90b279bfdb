"""Load the tier-3 predictor (default: the shipped one): trend trees, one-tick trees or the LSTM.

The shipped model is the trend trees (``streams/models/oom_trees.*``, ``streams.trend_model``: trees
over 5/15/30-minute levels and slopes, trained on the vLLM engine's TREND runs); a one-tick trees
artifact (``streams.tick_model``) loads too. Either needs numpy only. torch is imported only when the artifact is an LSTM (``streams.lstm``)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from kvguard.streams.predictor import ModelError, Predictor
from kvguard.streams.tick_model import is_tick_model, load_tick_model
from kvguard.streams.trend_model import is_trend_model, load_trend_model

SHIPPED_DIR = Path(__file__).with_name("models")

__all__ = ["ModelError", "SHIPPED_DIR", "load_predictor", "with_model_threshold"]


def load_predictor(path: str | Path | None = None, *, expected_features: list[str] | None = None,
                   threads: int | None = 1) -> Predictor:
    """The artifact at ``path`` (a directory, a stem or either file; default: the shipped one), its
    features checked against ``expected_features``; ``ModelError`` naming the file otherwise.
    ``threads``: torch's CPU threads, for an LSTM."""
    target = path if path is not None else SHIPPED_DIR
    if is_trend_model(target):
        return load_trend_model(target, expected_features=expected_features)
    if is_tick_model(target):
        return load_tick_model(target, expected_features=expected_features)
    # torch takes seconds to import and only an LSTM artifact needs it
    from kvguard.streams.lstm import load_model

    return load_model(target, expected_features=expected_features, threads=threads)


def with_model_threshold(config: Any, predictor: Any) -> Any:
    """A ``streams.core.StreamConfig`` whose tier-3 rule fires at the model's calibrated threshold
    (``AlertThresholds.p_oom``), which is what the held-out metrics in its metadata assume."""
    return replace(config, thresholds=replace(config.thresholds, p_oom=float(predictor.threshold)))
