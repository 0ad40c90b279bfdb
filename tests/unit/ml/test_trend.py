"""TREND data and baselines: the ramp, storms, predict_linear, the Kalman forecast, time to exhaustion."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.ml.dataset import RunSpec
from kvguard.ml.trend import (STORM_PER_MIN, preset_trend, ramp_time, storm_episodes, trend_workload)
from kvguard.ml.trend_eval import kalman_forecast, linear_forecast, time_to_exhaustion


@given(st.floats(1.5, 10.0), st.floats(0.0, 1.0))
def test_ramp_time_inverts_the_cumulative_rate(ramp, frac):
    T = 1800.0
    t = frac * T
    lam = t + (ramp - 1.0) * t * t / (2 * T)
    assert ramp_time(lam, ramp, T) == pytest.approx(t, abs=1e-6)


def test_ramp_raises_the_arrival_rate_towards_the_end():
    base = RunSpec("sharegpt-sample", 0.25, "llama3-8b-24gb-vllm", seed=0, duration_s=1800.0)
    ramped = RunSpec("sharegpt-sample", 0.25, "llama3-8b-24gb-vllm", seed=0, duration_s=1800.0, ramp=5.0)
    flat, up = trend_workload(base), trend_workload(ramped)

    def quarter_counts(wl):
        t = np.array([r.arrival_ns for r in wl.requests]) / 1e9
        return (t < 450).sum(), (t >= 1350).sum()

    f_first, f_last = quarter_counts(flat)
    u_first, u_last = quarter_counts(up)
    # the rate climbs from 1x to 5x: against the base's own shape, the last quarter holds ~4x the first's
    assert (u_last / u_first) / (f_last / f_first) > 2.5
    assert max(r.arrival_ns for r in up.requests) < 1800e9


def test_storm_episodes_find_onset_end_and_merge():
    ts = np.arange(200, dtype=np.int64) * 10_000_000_000
    pre = np.zeros(200)
    pre[50:60] = 3  # 18 a minute over a trailing minute: a storm
    pre[70:75] = 3  # 70 s later: the same storm (merged)
    pre[150:152] = 1  # 2 in a minute: not a storm
    on, end = storm_episodes(ts, pre)
    assert len(on) == 1
    first_hot = 50 + int(np.ceil(STORM_PER_MIN / 3)) - 1  # the trailing count reaches 10 at the 4th tick
    assert on[0] == ts[first_hot]
    assert end[0] > ts[74]
    on2, _ = storm_episodes(ts, pre, merge_s=30.0)
    assert len(on2) == 2


def test_preset_splits_share_neither_workload_nor_seed():
    specs = preset_trend(600.0)
    by = {s: {(r.workload, r.seed) for r in specs if r.split == s} for s in ("train", "val", "test")}
    for a in ("train", "val"):
        assert not {w for w, _ in by[a]} & {w for w, _ in by["test"]}
        assert not {x for _, x in by[a]} & {x for _, x in by["test"]}
    assert any(r.leak for r in specs) and any(r.neighbour for r in specs) and any(r.ramp != 1 for r in specs)
    assert any(not (r.leak or r.neighbour or r.ramp != 1) and r.split == "test" for r in specs)  # calm held-out runs


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 40), st.integers(0, 40), st.integers(0, 2**31 - 1))
def test_linear_forecast_is_predict_linear(k, ahead, seed):
    y = np.random.default_rng(seed).standard_normal(60).cumsum()
    got = linear_forecast(y, k, ahead)
    p = np.r_[np.full(k - 1, y[0]), y]
    for i in (0, 7, 59):
        w = p[i:i + k]
        b, a = np.polyfit(np.arange(k), w, 1)
        assert got[i] == pytest.approx(a + b * (k - 1 + ahead), rel=1e-6, abs=1e-6)


def test_kalman_follows_a_ramp():
    y = 0.1 + 0.001 * np.arange(400)
    f = kalman_forecast(y, 30)
    assert f[-1] == pytest.approx(y[-1] + 0.03, abs=2e-3)
    assert abs(f[-1] - y[-1]) > 0.02  # it extrapolates, it does not just follow the level


def test_time_to_exhaustion_exact_on_a_line_and_wider_with_noise():
    t = np.arange(0, 900, 10.0)
    used = 0.5 + 1e-4 * t
    est, lo, hi = time_to_exhaustion(t, used, capacity=0.7)
    gap = 0.7 - used[-1]
    assert est == pytest.approx(gap / 1e-4, rel=1e-6)
    assert lo == pytest.approx(est, rel=1e-6) and hi == pytest.approx(est, rel=1e-6)
    noisy = used + np.random.default_rng(0).normal(0, 0.01, len(t))
    est2, lo2, hi2 = time_to_exhaustion(t, noisy, capacity=0.7)
    assert lo2 < est2 < hi2
    assert time_to_exhaustion(t, 0.5 - 1e-4 * t, 0.7)[0] == float("inf")  # falling: never
    assert time_to_exhaustion(t, used + 1.0, 0.7)[0] == 0.0  # already past
