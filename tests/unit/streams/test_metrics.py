"""Tick feature vector, slope and percentiles."""

import numpy as np
import pytest

from kvguard.streams.metrics import FEATURE_NAMES, least_squares_slope, percentiles, tick_features
from kvguard.streams.predictor import FeatureHistory, window_from_history
from tests.unit.streams.test_alerts import tick


def test_feature_vector_has_one_column_per_name_and_is_float32():
    f = tick_features(tick(0, u_kv=0.7, f_ext=0.3, psi=0.9))
    assert f.shape == (len(FEATURE_NAMES),) and f.dtype == np.float32
    assert f[FEATURE_NAMES.index("u_kv")] == np.float32(0.7)
    assert f[FEATURE_NAMES.index("f_ext")] == np.float32(0.3)
    assert np.isfinite(f).all()


def test_slope_is_per_minute_and_zero_without_two_points():
    ts = np.array([0, 60, 120]) * 1_000_000_000
    assert least_squares_slope(ts, np.array([0.1, 0.2, 0.3])) == pytest.approx(0.1)
    assert least_squares_slope(ts[:1], np.array([0.5])) == 0.0


def test_percentiles_of_empty_are_zero():
    assert percentiles(np.array([])) == (0.0, 0.0, 0.0)
    assert percentiles(np.arange(1, 101))[0] == pytest.approx(50.5)


def test_windows_are_left_padded_with_the_oldest_tick_and_ring_buffer_keeps_order():
    hist = FeatureHistory(4, n_features=1)
    for v in range(1, 7):
        hist.push(np.array([v], dtype=np.float32))
    assert hist.ordered()[:, 0].tolist() == [3, 4, 5, 6]
    assert hist.window(4, lag=1)[:, 0].tolist() == [3, 3, 4, 5]
    assert window_from_history(np.array([[7.0]]), 3)[:, 0].tolist() == [7, 7, 7]
