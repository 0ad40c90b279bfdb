"""Pure budget and SLO core: week arithmetic, debits, the in-memory ledger's invariants,
the outage buffer, outcome labelling."""

from __future__ import annotations

import datetime as dt
import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.policy.budget import (
    NS_PER_S,
    BudgetConfig,
    BudgetConfigError,
    MemoryBudgetLedger,
    OutageBuffer,
    OutageTracker,
    WeekFormatError,
    compute_debit,
    interval_start_s,
    iso_week,
    parse_week,
    shift_week,
    week_bounds_ns,
    week_start_ns,
)
from kvguard.policy.slo import MemorySloLedger, OutcomeTracker, SloReport

# 1950 .. 2100 in ns
timestamps = st.integers(min_value=-20 * 365 * 86_400 * NS_PER_S, max_value=130 * 365 * 86_400 * NS_PER_S)


@given(timestamps)
def test_iso_week_matches_the_calendar_and_lies_inside_its_bounds(ts_ns):
    day = dt.datetime.fromtimestamp(ts_ns // NS_PER_S, dt.timezone.utc).date()
    year, week, _ = day.isocalendar()
    label = iso_week(ts_ns)
    assert label == f"{year:04d}-W{week:02d}"
    start, end = week_bounds_ns(label)
    assert start <= ts_ns < end
    assert dt.datetime.fromtimestamp(start // NS_PER_S, dt.timezone.utc).weekday() == 0


@pytest.mark.parametrize("ts_text, week", [
    ("2026-11-29T23:59:59", "2026-W48"),  # Sunday
    ("2026-11-30T00:00:00", "2026-W49"),  # Monday
    ("2026-12-31T12:00:00", "2026-W53"),
    ("2027-01-03T23:59:59", "2026-W53"),
    ("2027-01-04T00:00:00", "2027-W01"),
    ("2021-01-01T00:00:00", "2020-W53"),
    ("2024-12-30T00:00:00", "2025-W01"),  # a Monday in December opening next year's week 1
    ("1970-01-01T00:00:00", "1970-W01"),
])
def test_known_week_labels(ts_text, week):
    moment = dt.datetime.fromisoformat(ts_text).replace(tzinfo=dt.timezone.utc)
    assert iso_week(int(moment.timestamp()) * NS_PER_S) == week


@pytest.mark.parametrize("bad", ["2026-48", "2026-W00", "2026-W54", "2025-W53", "26-W01", "", "2026-w48"])
def test_parse_week_rejects_labels_that_are_not_iso_weeks(bad):
    with pytest.raises(WeekFormatError, match="2026-W48"):
        parse_week(bad)


def test_shift_week_crosses_week_53():
    assert shift_week("2026-W52", 1) == "2026-W53"
    assert shift_week("2026-W53", 1) == "2027-W01"
    assert shift_week("2027-W01", -1) == "2026-W53"


@pytest.mark.parametrize("interval_s", [600, 900, 3600, 86_400])
def test_burn_buckets_align_to_monday_midnight(interval_s):
    start = week_start_ns("2026-W48")
    assert interval_start_s(start, interval_s) == start // NS_PER_S
    assert interval_start_s(start - 1, interval_s) == start // NS_PER_S - interval_s
    assert interval_start_s(start + interval_s * NS_PER_S - 1, interval_s) == start // NS_PER_S


def test_compute_debit_burns_only_above_the_threshold():
    config = BudgetConfig(threshold=0.5)
    ts_ns = week_start_ns("2026-W48")
    assert compute_debit(config, "n", ts_ns, 10.0, 0.5) is None
    assert compute_debit(config, "n", ts_ns, 10.0, math.nan) is None
    debit = compute_debit(config, "n", ts_ns, 2.5, 0.75)  # covers the last 2.5 s of W47
    assert (debit.ms, debit.week, debit.cluster) == (2500, "2026-W47", "default")
    assert compute_debit(config, "n", ts_ns + 1, 2.5, 0.75).week == "2026-W48"
    with pytest.raises(ValueError, match="tick_s"):
        compute_debit(config, "n", ts_ns, 0.0, 0.9)
    with pytest.raises(ValueError, match="node"):
        compute_debit(config, "", ts_ns, 10.0, 0.9)


@pytest.mark.parametrize("field, value", [("budget_s", 0), ("threshold", 1.0), ("retention_weeks", 0),
                                          ("interval_s", 11), ("buffer_max", 0), ("cluster", "")])
def test_config_errors_name_the_field(field, value):
    with pytest.raises(BudgetConfigError, match=f"budget.{field}="):
        BudgetConfig(**{field: value})


def test_config_from_kvguard_settings():
    from kvguard.config.settings import Settings
    from kvguard.runtime.mapping import budget_config

    settings = Settings(budget={"minutes_per_week": 30, "f_ext_threshold": 0.6,
                                "retention_weeks": 3, "key_prefix": "prod:budget"})
    config = budget_config(settings)
    assert (config.budget_s, config.threshold, config.retention_weeks, config.key_prefix) == (
        1800.0, 0.6, 3, "prod:budget:")


def test_outage_buffer_drops_the_oldest_and_keeps_unconfirmed_items():
    buffer = OutageBuffer(3)
    for item in range(5):
        buffer.append(item)
    assert list(buffer.items()) == [2, 3, 4] and buffer.dropped == 2
    assert buffer.peek(2) == [2, 3] and len(buffer) == 3  # peek removes nothing
    buffer.commit(2)
    assert list(buffer.items()) == [4]


def test_outage_buffer_puts_refused_items_back_in_front_in_order():
    buffer = OutageBuffer(4)
    for item in range(4):
        buffer.append(item)
    sent = buffer.peek(3)
    buffer.commit(3)
    buffer.append(4)
    buffer.push_front([sent[0], sent[2]])  # 1 went through, 0 and 2 were refused
    assert list(buffer.items()) == [0, 2, 3, 4] and buffer.dropped == 0
    buffer.push_front([9])  # past the bound the oldest goes, as with append: here 9 itself
    assert list(buffer.items()) == [0, 2, 3, 4] and buffer.dropped == 1


def test_a_ledger_passes_one_alert_per_node_and_week_however_often_it_is_claimed():
    from kvguard.policy.budget import BudgetAlert

    ledger = MemoryBudgetLedger(BudgetConfig(budget_s=10.0))
    alert = BudgetAlert(node="gpu0", cluster="c", week="2026-W48", ts_ns=1, used_s=10.0,
                        budget_s=10.0, top_intervals=())
    assert ledger._emit(alert) and not ledger._emit(alert)
    assert ledger._emit(BudgetAlert(**{**_fields(alert), "week": "2026-W49"}))
    assert [a.week for a in ledger.take_alerts()] == ["2026-W48", "2026-W49"]
    assert ledger.stats().alerts == 2


def _fields(alert) -> dict:
    return {name: getattr(alert, name) for name in alert.__slots__}


def test_redis_refusals_that_pass_are_told_from_those_that_do_not():
    import redis.exceptions as rex

    from kvguard.policy.budget_redis import is_transient_refusal

    for exc in (rex.ReadOnlyError("READONLY"), rex.OutOfMemoryError("OOM"),
                rex.TryAgainError("TRYAGAIN"), rex.MasterDownError("MASTERDOWN"),
                rex.ResponseError("BUSY Redis is busy running a script")):
        assert is_transient_refusal(exc), exc
    for exc in (rex.ResponseError("WRONGTYPE Operation against a key"),
                rex.ResponseError("ERR user_script:3: bad argument"), rex.DataError("bad arg"),
                rex.NoPermissionError("NOPERM")):
        assert not is_transient_refusal(exc), exc


def test_outage_tracker_reports_each_transition_once():
    tracker = OutageTracker()
    assert not tracker.succeeded()
    assert tracker.failed() and not tracker.failed() and not tracker.failed()
    assert tracker.succeeded() and not tracker.succeeded()
    assert tracker.failed() and tracker.outages == 2


ticks = st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 2000),
                           st.floats(0.0, 1.0)), max_size=120)


@settings(max_examples=60, deadline=None)
@given(ticks, st.randoms(use_true_random=False))
def test_memory_ledger_totals_ignore_order_and_duplicates(tick_list, rng):
    config = BudgetConfig(budget_s=200.0, interval_s=600)
    start = week_start_ns("2026-W48")
    first_value: dict[tuple[str, int], float] = {}
    for node, second, f_ext in tick_list:
        first_value.setdefault((node, second), f_ext)
    shuffled = [(node, second, first_value[(node, second)]) for node, second, _ in tick_list]
    shuffled = shuffled + shuffled[: len(shuffled) // 2]
    rng.shuffle(shuffled)
    ledger = MemoryBudgetLedger(config)
    for node, second, f_ext in shuffled:
        ledger.debit(node, start + (second + 1) * 10 * NS_PER_S, 10.0, f_ext)
    expected: dict[str, float] = {}
    for (node, _), f_ext in first_value.items():
        if f_ext > 0.5:
            expected[node] = expected.get(node, 0.0) + 10.0
    status = ledger.status("2026-W48")
    assert {n.node: n.used_s for n in status.nodes} == expected
    assert sum(status.clusters.values()) == pytest.approx(sum(expected.values()))
    alerts = ledger.take_alerts()
    assert sorted(a.node for a in alerts) == sorted(n for n, s in expected.items() if s >= 200.0)
    for node in status.nodes:
        assert sum(i.burned_s for i in node.top_intervals) <= node.used_s


def test_memory_ledger_forgets_weeks_past_the_retention():
    ledger = MemoryBudgetLedger(BudgetConfig(retention_weeks=2))
    for week in ("2026-W40", "2026-W41", "2026-W42", "2026-W43"):
        ledger.debit("a", week_start_ns(week) + 10 * NS_PER_S, 10.0, 0.9)
    assert ledger.weeks() == ["2026-W41", "2026-W42", "2026-W43"]
    ledger.debit("a", week_start_ns("2026-W30") + 10 * NS_PER_S, 10.0, 0.9)  # a late replay is still kept
    assert "2026-W30" in ledger.weeks()


def test_outcome_tracker_labels_ticks_by_an_oom_within_the_horizon():
    tracker = OutcomeTracker(threshold=0.5, horizon_s=300)
    s = NS_PER_S
    for t in (0, 100, 200, 300, 400):
        tracker.observe_tick("a", t * s, 0.9 if t >= 200 else 0.1)
    tracker.observe_tick("a", 500 * s, None)  # no prediction yet: no outcome
    tracker.observe_oom("a", 450 * s)
    # tick 100's horizon (100, 400] ends at 400: an OOM stamped 400 s could still come, so it waits
    assert tracker.resolve(400 * s) == [tracker_outcome("a", 0, False, False)]
    assert tracker.resolve(400 * s + 1) == [tracker_outcome("a", 100, False, False)]
    rest = tracker.resolve(10_000 * s)
    assert [(o.ts_ns // s, o.predicted, o.actual) for o in rest] == [
        (200, True, True), (300, True, True), (400, True, True)]
    assert tracker.resolve(20_000 * s) == []


def tracker_outcome(node, t, predicted, actual):
    from kvguard.policy.slo import PredictionOutcome

    return PredictionOutcome(node, t * NS_PER_S, predicted, actual)


def test_slo_report_without_data_neither_meets_nor_misses():
    report = MemorySloLedger().report("2026-W48")
    assert isinstance(report, SloReport)
    assert report.recall is None and report.slo_met is None and report.completion_rate is None


def test_pure_core_imports_no_redis_pydantic_faust_or_aiokafka():
    code = ("import sys, policy.budget, policy.slo; "
            "print(sorted(m for m in ('redis', 'pydantic', 'faust', 'aiokafka') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_budget_alert_maps_onto_the_wire_alert():
    from kvguard.wire.schemas import Alert

    ledger = MemoryBudgetLedger(BudgetConfig(budget_s=20.0))
    start = week_start_ns("2026-W48")
    for i in (1, 2):
        ledger.debit("gpu0", start + i * 10 * NS_PER_S, 10.0, 0.9, cluster="eu-1")
    (alert,) = ledger.take_alerts()
    wire = Alert(**alert.alert_fields())
    assert (wire.name, wire.node, wire.severity, wire.value, wire.threshold) == (
        "FragmentationBudgetExhausted", "gpu0", "critical", 20.0, 20.0)
    assert wire.labels == {"cluster": "eu-1", "week": "2026-W48", "rca_required": "true"}
    assert wire.annotations["top_intervals"] == f"{start // NS_PER_S}:20s"


# ---- the layer that fragments (issue 20) -------------------------------------------------------------


def test_the_budget_debits_the_caching_allocators_f_ext_where_the_kv_layer_cannot_fragment():
    from dataclasses import replace

    from kvguard.policy.budget import fragmented_f_ext, tick_week
    from tests.unit.policy.test_planner import tick_record

    ledger = MemoryBudgetLedger(BudgetConfig(threshold=0.5))
    # a uniform-block (vLLM) node: the KV layer's F_ext is 0, the caching allocator's is not
    uniform = replace(tick_record(600, epoch=0, f_ext=0.0, alloc_f_ext=0.76, alloc_reserved_bytes=1 << 30),
                      node="vllm/gpu0")
    assert ledger.debit_tick(uniform, tick_s=10.0).counted
    assert [n.node for n in ledger.status(tick_week(uniform.ts_ns)).nodes] == ["vllm/gpu0"]
    # no allocator layer reported: its F_ext field means nothing, the KV layer's is debited
    no_layer = replace(uniform, node="seed/gpu0", alloc_reserved_bytes=0)
    assert not ledger.debit_tick(no_layer, tick_s=10.0).counted
    assert ledger.debit_tick(replace(no_layer, f_ext=0.6), tick_s=10.0).counted
    assert fragmented_f_ext(0.7, 0.2, 1 << 30) == 0.7 and fragmented_f_ext(0.1, 0.6, 0) == 0.1
    assert math.isnan(fragmented_f_ext(float("nan")))
