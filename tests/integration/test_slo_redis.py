"""SLO ledger: one behaviour suite against both backends (memory and a real redis-server),
then the Redis outage path and the `kvguard slo report` CLI."""

from __future__ import annotations

import json
import uuid

import pytest

from kvguard.contracts.units import NS_PER_S
from kvguard.policy.budget import week_start_ns
from kvguard.policy.slo import MemorySloLedger, SloConfig
from kvguard.testing.rigs.net import free_port
from tests.integration.test_budget_redis import PersistentRedis

W48 = week_start_ns("2026-W48")


def ts(seconds: float, week_start: int = W48) -> int:
    return week_start + int(seconds * NS_PER_S)


def make_config() -> SloConfig:
    return SloConfig(key_prefix=f"test:{uuid.uuid4().hex[:10]}:")


@pytest.fixture(params=["memory", "redis"])
def slo_ledger(request):
    config = make_config()
    if request.param == "memory":
        ledger = MemorySloLedger(config)
    else:
        from kvguard.policy.slo_redis import RedisSloLedger

        ledger = RedisSloLedger(request.getfixturevalue("redis_url"), config)
    yield ledger
    ledger.close()


def record_outcomes(ledger, node: str, counts: dict[str, int], start_s: float = 0.0) -> float:
    """Records tp/fp/tn/fn outcomes on consecutive 10 s ticks; returns the next tick's time."""
    flags = {"tp": (True, True), "fp": (True, False), "tn": (False, False), "fn": (False, True)}
    t = start_s
    for name, count in counts.items():
        for _ in range(count):
            ledger.record_prediction(node, ts(t), *flags[name])
            t += 10
    return t


def test_prediction_counts_give_precision_recall_and_fpr(slo_ledger):
    record_outcomes(slo_ledger, "gpu0", {"tp": 18, "fp": 3, "tn": 97, "fn": 2})
    report = slo_ledger.report("2026-W48")
    assert (report.tp, report.fp, report.tn, report.fn) == (18, 3, 97, 2)
    assert report.precision == pytest.approx(18 / 21)
    assert report.recall == pytest.approx(0.9) and report.recall_met
    assert report.fpr == pytest.approx(0.03) and report.fpr_met
    assert report.slo_met is True


def test_slo_is_missed_when_recall_falls_short(slo_ledger):
    record_outcomes(slo_ledger, "gpu0", {"tp": 17, "fp": 1, "tn": 99, "fn": 3})
    report = slo_ledger.report("2026-W48")
    assert report.recall == pytest.approx(0.85) and report.recall_met is False
    assert report.slo_met is False


def test_replayed_predictions_count_once(slo_ledger):
    end = record_outcomes(slo_ledger, "gpu0", {"tp": 5, "tn": 5})
    record_outcomes(slo_ledger, "gpu1", {"fp": 2})
    first = slo_ledger.report("2026-W48").to_dict()
    assert not slo_ledger.record_prediction("gpu0", ts(0), True, True)
    record_outcomes(slo_ledger, "gpu0", {"tp": 5, "tn": 5})  # the same ticks again
    assert slo_ledger.report("2026-W48").to_dict() == first
    assert slo_ledger.record_prediction("gpu0", ts(end), False, False)  # a new tick counts
    assert slo_ledger.report("2026-W48").tn == 6


def test_ooms_keep_lead_times_per_tier_once_each(slo_ledger):
    leads = [{"threshold": 60.0, "slope": 0.0, "lstm": 300.0},
             {"threshold": 120.0, "slope": 30.0, "lstm": 240.0, "fragmentation": 90.0},
             {"threshold": 0.0, "slope": 0.0, "lstm": 0.0}]
    for i, lead in enumerate(leads):
        assert slo_ledger.record_oom(f"gpu{i}", ts(3600 * i), lead)
    assert not slo_ledger.record_oom("gpu0", ts(0), {"threshold": 999.0})  # redelivered
    report = slo_ledger.report("2026-W48")
    assert report.ooms == 3
    tiers = {t.tier: t for t in report.tiers}
    assert [t.tier for t in report.tiers] == ["threshold", "slope", "fragmentation", "lstm"]
    assert tiers["threshold"].detected == 2 and tiers["threshold"].median_lead_s == 90.0
    assert tiers["lstm"].median_lead_s == 270.0 and len(tiers["lstm"].lead_times_s) == 3
    assert tiers["slope"].detected == 1 and tiers["fragmentation"].detected == 1


def test_evicted_requests_completion_rate_counts_first_outcomes(slo_ledger):
    for req in ("r1", "r2", "r3", "r4"):
        assert slo_ledger.record_eviction("gpu0", req, ts(100))
    assert slo_ledger.record_eviction("gpu0", "r1", ts(200))  # evicted a second time
    assert not slo_ledger.record_eviction("gpu0", "r1", ts(200))  # redelivered
    assert slo_ledger.record_eviction_outcome("gpu0", "r1", completed=True)
    assert slo_ledger.record_eviction_outcome("gpu0", "r2", completed=True)
    assert slo_ledger.record_eviction_outcome("gpu0", "r3", completed=False)
    assert not slo_ledger.record_eviction_outcome("gpu0", "r3", completed=True)  # first wins
    assert not slo_ledger.record_eviction_outcome("gpu0", "never-evicted", completed=True)
    report = slo_ledger.report("2026-W48")
    assert (report.evictions, report.evicted_requests) == (5, 4)
    assert (report.completed, report.failed, report.pending) == (2, 1, 1)
    assert report.completion_rate == pytest.approx(2 / 3)


def test_an_outcome_counts_in_its_eviction_week(slo_ledger):
    w49 = week_start_ns("2026-W49")
    slo_ledger.record_eviction("gpu0", "r1", w49 - NS_PER_S)  # Sunday night
    slo_ledger.record_eviction_outcome("gpu0", "r1", completed=True)  # done on Monday
    assert slo_ledger.report("2026-W48").completed == 1
    assert slo_ledger.report("2026-W49").evicted_requests == 0
    assert "2026-W48" in slo_ledger.weeks()


def test_outage_buffers_slo_records_and_replays_them():
    from kvguard.policy.slo_redis import RedisSloLedger

    server = PersistentRedis().start()
    try:
        ledger = RedisSloLedger(server.url, make_config(), retry_interval_s=0.0)
        record_outcomes(ledger, "gpu0", {"tp": 2})
        server.stop()
        record_outcomes(ledger, "gpu0", {"tp": 2, "fn": 1})  # 2 already counted, 1 new
        ledger.record_oom("gpu0", ts(500), {"lstm": 120.0})
        ledger.record_eviction("gpu0", "r1", ts(400))
        ledger.record_eviction_outcome("gpu0", "r1", completed=False)
        stats = ledger.stats()
        assert stats.outage and stats.buffered == 6
        server.start()
        assert ledger.flush()
        report = ledger.report("2026-W48")
        assert (report.tp, report.fn, report.ooms, report.failed) == (2, 1, 1, 1)
        assert ledger.stats().replayed == 6
        ledger.close()
    finally:
        server.stop()


def test_slo_report_cli(redis_url, monkeypatch):
    from typer.testing import CliRunner

    from kvguard.cli.app import app
    from kvguard.policy.slo_redis import RedisSloLedger

    prefix = f"test{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("KVGUARD_BUDGET__KEY_PREFIX", prefix)
    ledger = RedisSloLedger(redis_url, SloConfig(key_prefix=prefix + ":"))
    record_outcomes(ledger, "gpu0", {"tp": 9, "fn": 1, "tn": 90, "fp": 10})
    ledger.record_oom("gpu0", ts(9000), {"threshold": 60.0, "lstm": 240.0})
    ledger.close()
    runner = CliRunner()
    result = runner.invoke(app, ["slo", "report", "--redis", redis_url, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["week"] == "2026-W48"
    assert report["predictions"]["recall"] == pytest.approx(0.9)
    assert report["predictions"]["fpr"] == pytest.approx(0.1)
    assert report["slo"] == {"recall_target": 0.9, "fpr_target": 0.05, "recall_met": True,
                             "fpr_met": False, "met": False}
    assert [t["median_lead_s"] for t in report["tiers"]] == [60.0, 240.0]
    result = runner.invoke(app, ["slo", "report", "--redis", redis_url, "--week", "2026-W48"])
    assert result.exit_code == 0 and "missed" in result.stdout and "lstm" in result.stdout
    result = runner.invoke(app, ["slo", "report", "--redis", f"redis://127.0.0.1:{free_port()}/0"])
    assert result.exit_code == 1 and "unreachable" in result.stderr


def test_slo_report_defaults_to_the_latest_week_with_data_and_says_so(redis_url, monkeypatch):
    from typer.testing import CliRunner

    from kvguard.cli.app import app
    from kvguard.policy.slo_redis import RedisSloLedger

    prefix = f"test{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("KVGUARD_BUDGET__KEY_PREFIX", prefix)
    ledger = RedisSloLedger(redis_url, SloConfig(key_prefix=prefix + ":"))
    ledger.record_prediction("gpu0", ts(0, week_start_ns("2026-W10")), True, True)
    ledger.record_prediction("gpu0", ts(0, week_start_ns("2026-W12")), False, True)
    ledger.close()
    runner = CliRunner()
    result = runner.invoke(app, ["slo", "report", "--redis", redis_url, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["week"], report["week_source"]) == ("2026-W12", "latest")
    assert report["predictions"]["recall"] == 0.0  # W12's one miss, not W10's hit
    result = runner.invoke(app, ["slo", "report", "--redis", redis_url])
    assert "week 2026-W12 (latest week with data)" in result.stdout


def test_an_slo_record_redis_refuses_for_good_is_counted_as_an_error_not_buffered(redis_url):
    import redis

    from kvguard.policy.slo_redis import RedisSloLedger

    config = make_config()
    ledger = RedisSloLedger(redis_url, config)
    raw = redis.Redis.from_url(redis_url)
    raw.set(f"{config.key_prefix}slo:{{2026-W48}}:pred", "not a hash")
    raw.close()
    assert not ledger.record_prediction("gpu0", ts(0), True, True)
    stats = ledger.stats()
    assert (stats.errors, stats.buffered, stats.counted, stats.outage) == (1, 0, 0, False)
    assert ledger.record_oom("gpu0", ts(10), {"lstm": 60.0})  # other records still count
    ledger.close()
