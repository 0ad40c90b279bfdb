"""Evaluation metrics: labels, AUC, ROC, recall at FPR, lead time (docs/ARCHITECTURE.md, "Alerts and prediction"), false alarms, plots."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.ml import evaluation as ev

S = ev.NS_PER_S


def ticks(n, step_s=10):
    return np.arange(n, dtype=np.int64) * step_s * S


def test_labels_are_positive_only_within_the_horizon_after_the_tick():
    ts = ticks(100)
    labels = ev.labels_for_ticks(ts, np.array([500 * S]), horizon_s=300)
    positive_times = ts[labels == 1] // S
    # (t, t+300] contains 500 for t in [200, 500): the OOM tick itself is not positive
    assert positive_times.tolist() == list(range(200, 500, 10))


def test_labels_without_ooms_are_all_negative():
    assert ev.labels_for_ticks(ticks(10), np.array([], np.int64)).sum() == 0


def brute_auc(y, s):
    pos, neg = s[y == 1], s[y == 0]
    total = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return total / (len(pos) * len(neg))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5)), min_size=2, max_size=40))
def test_auc_matches_pairwise_definition_with_ties(rows):
    y = np.array([r[0] for r in rows], dtype=int)
    s = np.array([r[1] for r in rows], dtype=float)
    if y.min() == y.max():
        assert np.isnan(ev.auc(y, s))
        return
    assert ev.auc(y, s) == pytest.approx(brute_auc(y, s))


def test_auc_of_perfect_and_inverted_scores():
    y = np.array([0, 0, 1, 1])
    assert ev.auc(y, np.array([0.1, 0.2, 0.8, 0.9])) == 1.0
    assert ev.auc(y, np.array([0.9, 0.8, 0.2, 0.1])) == 0.0


def test_roc_area_by_trapezoid_equals_rank_auc():
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, 500)
    s = rng.normal(size=500) + y + np.round(rng.normal(size=500), 1)
    fpr, tpr, thr = ev.roc_curve(y, s)
    assert fpr[0] == 0 and tpr[0] == 0 and fpr[-1] == 1 and tpr[-1] == 1
    assert np.all(np.diff(fpr) >= 0) and np.all(np.diff(tpr) >= 0)
    assert np.trapezoid(tpr, fpr) == pytest.approx(ev.auc(y, s))


def test_recall_at_fpr_uses_only_thresholds_within_budget():
    y = np.array([0] * 20 + [1] * 10)
    s = np.r_[np.linspace(0, 0.5, 19), 0.95, np.linspace(0.6, 1.0, 10)]
    recall, threshold = ev.recall_at_fpr(y, s, 0.05)
    # one negative (0.95) outranks 1 positive; allowing it (FPR 1/20) yields all positives >= 0.6
    assert recall == 1.0 and threshold == pytest.approx(0.6)
    predicted = s >= threshold
    assert (predicted & (y == 0)).sum() / 20 <= 0.05
    recall0, _ = ev.recall_at_fpr(y, s, 0.0)
    assert recall0 == pytest.approx(0.2)  # only 0.956 and 1.0 beat the 0.95 negative


def test_threshold_for_fpr_keeps_validation_fpr_in_budget():
    rng = np.random.default_rng(2)
    y = rng.integers(0, 2, 2000)
    s = rng.random(2000) + 0.5 * y
    thr = ev.threshold_for_fpr(y, s, 0.05)
    fpr = ((s >= thr) & (y == 0)).sum() / (y == 0).sum()
    assert fpr <= 0.05
    assert ((s >= np.nextafter(thr, -np.inf) - 0.01) & (y == 0)).sum() / (y == 0).sum() > 0.05 - 0.01


def test_lead_time_is_start_of_unbroken_firing_run_reaching_the_oom():
    ts = ticks(60)  # 0..590 s
    fire = np.zeros(60, bool)
    fire[10:20] = True  # 100..190, broken before the OOM: does not count
    fire[30:45] = True  # 300..440, reaches the OOM at 445
    lead = ev.lead_times_s(ts, fire, np.array([445 * S]))
    assert lead.tolist() == [145.0]


def test_tier_not_firing_just_before_the_oom_is_a_miss():
    ts = ticks(60)
    fire = np.zeros(60, bool)
    fire[30:40] = True  # stops at 390, OOM at 445
    assert ev.lead_times_s(ts, fire, np.array([445 * S])).tolist() == [0.0]


def test_lead_time_walk_back_stops_at_the_previous_oom():
    ts = ticks(100)
    fire = np.ones(100, bool)
    leads = ev.lead_times_s(ts, fire, np.array([305 * S, 705 * S]))
    assert leads.tolist() == [305.0, 705.0 - 310.0]


def test_false_alarm_episodes_without_a_following_oom():
    ts = ticks(200)
    fire = np.zeros(200, bool)
    fire[10:15] = True  # 100..140: no OOM by 440 -> false
    fire[100:110] = True  # 1000..1090, OOM at 1200 within 1090 + 300 -> true
    false, episodes = ev.count_false_alarms(ts, fire, np.array([1200 * S]), horizon_s=300)
    assert (false, episodes) == (1, 2)


def make_trace(node="n0", n=400, oom_at=(2000, 3500)):
    ts = ticks(n)
    ooms = np.array(oom_at, dtype=np.int64) * S
    y = ev.labels_for_ticks(ts, ooms)
    p = np.where(y == 1, 0.9, 0.1)
    firing = {"threshold": np.roll(y, 25).astype(bool), "slope": y.astype(bool), "lstm": p > 0.5}
    return ev.NodeTrace(node=node, ts_ns=ts, p_oom=p, firing=firing, oom_ts_ns=ooms)


def test_evaluate_traces_reports_per_tier_leads_and_alarms():
    result = ev.evaluate_traces([make_trace("a"), make_trace("b")])
    d = result.to_dict()
    assert d["auc"] == 1.0 and d["recall_at_fpr_5pct"] == 1.0 and d["ooms"] == 4
    # labels go positive at T-300 exactly on tick boundaries: the LSTM fires from T-300 (tick 1700 for 2000)
    assert d["lead_time_median_s"]["lstm"] == 300.0
    assert d["lead_time_median_s"]["threshold"] == pytest.approx(300.0 - 250.0)
    assert d["false_alarms_per_hour"] == {"threshold": 0.0, "slope": 0.0, "lstm": 0.0}
    assert result.node_hours == pytest.approx(2 * 400 * 10 / 3600)


def test_isolated_ooms_have_no_crash_within_the_isolation_window_before_them():
    ooms = np.array([100, 200, 900, 1000, 2000]) * S
    assert ev.isolated_ooms(ooms, 600).tolist() == [True, False, True, False, True]


def test_isolated_lead_times_are_reported_separately():
    result = ev.evaluate_traces([make_trace(oom_at=(2000, 2100, 3500))])
    d = result.to_dict()
    assert d["isolated_ooms"] == 2
    assert d["isolated_lead_time_median_s"]["lstm"] == 300.0


def test_operating_point_reports_rates_at_the_given_threshold():
    tr = make_trace()
    d = ev.evaluate_traces([tr], threshold=0.95).to_dict()
    assert d["at_operating_threshold"] == {"threshold": 0.95, "tpr": 0.0, "fpr": 0.0}
    d = ev.evaluate_traces([tr], threshold=0.5).to_dict()
    assert d["at_operating_threshold"]["tpr"] == 1.0 and d["at_operating_threshold"]["fpr"] == 0.0


def test_evaluate_traces_names_a_missing_tier():
    tr = make_trace()
    del tr.firing["slope"]
    with pytest.raises(KeyError, match="slope"):
        ev.evaluate_traces([tr])


def test_plots_are_written(tmp_path):
    result = ev.evaluate_traces([make_trace()])
    ev.plot_roc(result, str(tmp_path / "roc.png"))
    ev.plot_lead_times(result, str(tmp_path / "lead.png"))
    for name in ("roc.png", "lead.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_auc_is_withheld_when_one_class_has_too_few_ticks():
    ts = np.arange(397) * 10 * S  # ticks 0 .. 3960 s
    ooms = np.array([3985]) * S  # one OOM just after the end: 28 positive ticks (3690 .. 3960 s)
    p = np.linspace(0, 1, 397)
    tr = ev.NodeTrace(node="n", ts_ns=ts, p_oom=p, firing={t: p > 0.9 for t in ("threshold", "slope", "lstm")},
                      oom_ts_ns=ooms)
    d = ev.evaluate_traces([tr]).to_dict()
    assert d["positive_ticks"] == 28 and d["negative_ticks"] == 369
    assert d["auc"] is None and d["recall_at_fpr_5pct"] is None and d["auc_valid"] is False
    assert "28 positive and 369 negative" in d["auc_note"]
    d = ev.evaluate_traces([make_trace("a")]).to_dict()
    assert d["auc_valid"] is True and d["auc"] == 1.0 and d["auc_note"] is None


def test_eval_cli_accepts_durations_like_the_other_commands():
    from typer.testing import CliRunner

    from kvguard.cli import app

    result = CliRunner().invoke(app, ["eval", "--workload", "mixed", "--duration", "five minutes", "--json"])
    assert result.exit_code == 2 and "expected a duration like 30m" in result.output
