"""Budget ledger: one behaviour suite run against both backends (memory and a real
redis-server), then what only Redis has: several processes, an outage with the server stopped
and restarted on the same port, expiry, and the CLI."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import subprocess
import tempfile
import uuid

import pytest

from kvguard.policy.budget import (
    NS_PER_S,
    BudgetConfig,
    LedgerUnavailable,
    MemoryBudgetLedger,
    week_start_ns,
)
from kvguard.testing.rigs.net import free_port, stop_process, wait_for_port

W48 = week_start_ns("2026-W48")  # Monday 2026-11-23 00:00 UTC
TICK_S = 10.0


def ts(week_start: int, seconds: float) -> int:
    """The stamp of the tick covering [seconds, seconds + TICK_S) after ``week_start``: ticks
    are stamped at the end of their interval, as streams' Tick is."""
    return week_start + int((seconds + TICK_S) * NS_PER_S)


def make_config(**overrides) -> BudgetConfig:
    values = dict(budget_s=60.0, key_prefix=f"test:{uuid.uuid4().hex[:10]}:")
    values.update(overrides)
    return BudgetConfig(**values)


@pytest.fixture(params=["memory", "redis"])
def make_ledger(request):
    """A factory: make_ledger(config) → a fresh ledger of the parametrised backend."""
    made = []

    def make(config: BudgetConfig):
        if request.param == "memory":
            ledger = MemoryBudgetLedger(config)
        else:
            from kvguard.policy.budget_redis import RedisBudgetLedger

            ledger = RedisBudgetLedger(request.getfixturevalue("redis_url"), config)
        made.append(ledger)
        return ledger

    yield make
    for ledger in made:
        ledger.close()


# ----------------------------------------------------------------------------- both backends

def test_only_ticks_above_the_threshold_burn(make_ledger):
    ledger = make_ledger(make_config())
    ledger.debit("gpu0", ts(W48, 10), TICK_S, 0.5)  # at the threshold: not above
    ledger.debit("gpu0", ts(W48, 20), TICK_S, 0.2)
    result = ledger.debit("gpu0", ts(W48, 30), TICK_S, 0.51)
    assert result.counted and result.used_s == 10.0 and result.remaining_s == 50.0
    assert ledger.remaining("gpu0", "2026-W48") == 50.0
    stats = ledger.stats()
    assert (stats.debits, stats.counted, stats.below_threshold) == (3, 1, 2)


def test_replaying_the_same_ticks_twice_leaves_the_same_totals(make_ledger):
    ledger = make_ledger(make_config(budget_s=3600.0))
    ticks = [("gpu0", ts(W48, 10 * i), 0.9 if i % 3 else 0.1) for i in range(50)]
    ticks += [("gpu1", ts(W48, 10 * i + 5), 0.7) for i in range(20)]
    for node, ts_ns, f_ext in ticks:
        ledger.debit(node, ts_ns, TICK_S, f_ext)
    first = ledger.status("2026-W48").to_dict()
    for node, ts_ns, f_ext in ticks:
        assert not ledger.debit(node, ts_ns, TICK_S, f_ext).counted
    assert ledger.status("2026-W48").to_dict() == first
    used = {row["node"]: row["used_s"] for row in first["nodes"]}
    assert used == {"gpu0": 33 * TICK_S, "gpu1": 20 * TICK_S}
    assert first["total_used_s"] == 53 * TICK_S
    assert ledger.stats().duplicates == 53


def test_ticks_around_monday_midnight_go_to_their_own_weeks(make_ledger):
    ledger = make_ledger(make_config(budget_s=3600.0))
    w49 = week_start_ns("2026-W49")
    ledger.debit("gpu0", w49 - 10 * NS_PER_S, TICK_S, 0.9)  # covers Sunday 23:59:40-50
    ledger.debit("gpu0", w49, TICK_S, 0.9)  # stamped Monday 00:00:00, covers Sunday 23:59:50-
    ledger.debit("gpu0", w49 + 10 * NS_PER_S, TICK_S, 0.9)  # covers Monday 00:00:00-10
    assert ledger.status("2026-W48").nodes[0].used_s == 20.0
    assert ledger.status("2026-W49").nodes[0].used_s == 10.0
    assert ledger.remaining("gpu0", "2026-W49") == 3590.0
    assert ledger.weeks()[-2:] == ["2026-W48", "2026-W49"]


def test_week_53_and_the_year_boundary(make_ledger):
    ledger = make_ledger(make_config(budget_s=3600.0))
    w53 = week_start_ns("2026-W53")  # 2026 has 53 ISO weeks: Mon 2026-12-28 .. Sun 2027-01-03
    new_year = w53 + 4 * 86_400 * NS_PER_S  # 2027-01-01 00:00, still 2026-W53
    w01 = week_start_ns("2027-W01")  # Monday 2027-01-04
    ledger.debit("gpu0", new_year, TICK_S, 0.9)
    ledger.debit("gpu0", new_year + 10 * NS_PER_S, TICK_S, 0.9)
    ledger.debit("gpu0", w01, TICK_S, 0.9)  # the last tick of 2026-W53
    ledger.debit("gpu0", w01 + 10 * NS_PER_S, TICK_S, 0.9)  # the first of 2027-W01
    # the other way round: 2021-01-01 (Friday) is in 2020-W53
    ledger.debit("gpu0", week_start_ns("2020-W53") + 4 * 86_400 * NS_PER_S, TICK_S, 0.9)
    assert ledger.status("2026-W53").nodes[0].used_s == 30.0
    assert ledger.status("2027-W01").nodes[0].used_s == 10.0
    assert ledger.status("2020-W53").nodes[0].used_s == 10.0
    assert ledger.status("2027-W02").nodes == ()


def test_exhaustion_raises_one_alert_with_the_intervals_that_burned_most(make_ledger):
    config = make_config(budget_s=60.0, interval_s=3600, top_intervals=2)
    ledger = make_ledger(config)
    # hour 2 burns 40 s, hour 5 burns 20 s → exhausted at 60 s; hour 7 keeps burning after
    plan = [(2 * 3600 + 10 * i, 0.8) for i in range(4)] + [(5 * 3600 + 10 * i, 0.8) for i in range(2)]
    plan += [(7 * 3600 + 10 * i, 0.8) for i in range(5)]
    for seconds, f_ext in plan:
        ledger.debit("gpu3", ts(W48, seconds), TICK_S, f_ext, cluster="eu-1")
    alerts = ledger.take_alerts()
    assert len(alerts) == 1
    alert = alerts[0]
    assert (alert.node, alert.cluster, alert.week, alert.rule) == ("gpu3", "eu-1", "2026-W48",
                                                                 "FragmentationBudgetExhausted")
    assert alert.ts_ns == ts(W48, 5 * 3600 + 10) and alert.used_s == 60.0 and alert.rca_required
    assert [(i.start_s, i.burned_s) for i in alert.top_intervals] == [
        (W48 // NS_PER_S + 2 * 3600, 40.0), (W48 // NS_PER_S + 5 * 3600, 20.0)]
    # replays of the exhausting ticks and more burning do not raise it again
    for seconds, f_ext in plan:
        ledger.debit("gpu3", ts(W48, seconds), TICK_S, f_ext, cluster="eu-1")
    ledger.debit("gpu3", ts(W48, 9 * 3600), TICK_S, 0.9, cluster="eu-1")
    assert ledger.take_alerts() == []
    row = ledger.status("2026-W48", node="gpu3").nodes[0]
    assert row.exhausted and row.alerted and row.used_s == 120.0 and row.remaining_s == 0.0
    assert row.top_intervals[0].burned_s == 50.0  # hour 7 now leads
    assert ledger.remaining("gpu3", "2026-W48") == 0.0
    assert ledger.stats().alerts == 1


def test_each_node_gets_its_own_alert_once_per_week(make_ledger):
    ledger = make_ledger(make_config(budget_s=20.0))
    w49 = week_start_ns("2026-W49")
    for week_start in (W48, w49):
        for node in ("a", "b"):
            for i in range(3):
                ledger.debit(node, ts(week_start, 10 * i), TICK_S, 0.9)
    alerts = ledger.take_alerts()
    assert sorted((a.node, a.week) for a in alerts) == [
        ("a", "2026-W48"), ("a", "2026-W49"), ("b", "2026-W48"), ("b", "2026-W49")]


def test_cluster_totals_add_up_their_nodes(make_ledger):
    ledger = make_ledger(make_config(budget_s=3600.0, cluster="default"))
    for i in range(3):
        ledger.debit("a", ts(W48, 10 * i), TICK_S, 0.9, cluster="eu-1")
        ledger.debit("b", ts(W48, 10 * i), TICK_S, 0.9, cluster="eu-1")
        ledger.debit("c", ts(W48, 10 * i), 2.5, 0.9)
    status = ledger.status("2026-W48")
    assert status.clusters == {"eu-1": 60.0, "default": 7.5}
    assert {n.node: n.cluster for n in status.nodes} == {"a": "eu-1", "b": "eu-1", "c": "default"}
    only_b = ledger.status("2026-W48", node="b")
    assert [n.node for n in only_b.nodes] == ["b"]


def test_debit_tick_reads_node_ts_and_f_ext_from_a_tick(make_ledger):
    from dataclasses import dataclass

    @dataclass
    class FakeTick:  # the attributes of streams' Tick the ledger reads
        node: str
        ts_ns: int
        f_ext: float

        tick_s: float = TICK_S

    ledger = make_ledger(make_config())
    assert ledger.debit_tick(FakeTick("gpu0", ts(W48, 10), 0.8)).counted
    assert not ledger.debit_tick(FakeTick("gpu0", ts(W48, 10), 0.8)).counted
    assert ledger.debit_tick(FakeTick("gpu0", ts(W48, 20), 0.8), tick_s=5.0).counted
    assert ledger.remaining("gpu0", "2026-W48") == 45.0
    with pytest.raises(TypeError, match="f_ext"):
        ledger.debit_tick(object())


# ----------------------------------------------------------------------------- Redis only

def _debit_worker(url: str, prefix: str, node_ticks: list[tuple[str, int]], queue) -> None:
    from kvguard.policy.budget_redis import RedisBudgetLedger

    ledger = RedisBudgetLedger(url, BudgetConfig(budget_s=60.0, key_prefix=prefix))
    counted = sum(ledger.debit(node, ts_ns, TICK_S, 0.9).counted for node, ts_ns in node_ticks)
    queue.put((counted, len(ledger.take_alerts()), ledger.stats().buffered))
    ledger.close()


def test_concurrent_debits_from_several_processes_add_up_exactly(redis_url):
    from kvguard.policy.budget_redis import RedisBudgetLedger

    prefix = f"test:{uuid.uuid4().hex[:10]}:"
    # 4 processes, 2 nodes, 150 distinct ticks each, every tick sent by two processes
    ticks = [(node, ts(W48, 10 * i)) for node in ("a", "b") for i in range(150)]
    shares = [ticks[k::2] for k in range(2)] * 2
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    workers = [context.Process(target=_debit_worker, args=(redis_url, prefix, share, queue))
               for share in shares]
    for worker in workers:
        worker.start()
    results = [queue.get(timeout=120) for _ in workers]
    for worker in workers:
        worker.join(timeout=60)
        assert worker.exitcode == 0
    assert sum(r[0] for r in results) == 300  # each tick counted by exactly one process
    assert sum(r[1] for r in results) == 2  # one exhaustion alert per node
    assert all(r[2] == 0 for r in results)
    status = RedisBudgetLedger(redis_url, BudgetConfig(key_prefix=prefix)).status("2026-W48")
    assert {n.node: n.used_s for n in status.nodes} == {"a": 1500.0, "b": 1500.0}
    assert status.clusters == {"default": 3000.0}


def test_keys_expire_after_the_retention(redis_url):
    import redis

    from kvguard.policy.budget_redis import RedisBudgetLedger, budget_keys

    config = make_config(retention_weeks=2)
    RedisBudgetLedger(redis_url, config).debit("gpu0", ts(W48, 10), TICK_S, 0.9)
    client = redis.Redis.from_url(redis_url)
    ttls = [client.ttl(key) for key in budget_keys(config.key_prefix, "2026-W48", "gpu0")
            if key.endswith(("used", "clusters", "node_cluster")) or "gpu0" in key]
    assert len(ttls) == 5
    assert all(2 * 7 * 86_400 < ttl <= 3 * 7 * 86_400 for ttl in ttls)
    client.close()


class PersistentRedis:
    """A private redis-server that keeps its data across stop/start (append-only file, fsync
    on every write), so a restart looks like an outage rather than a wipe."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="kvguard-budget-redis-")
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://:s3cret@127.0.0.1:{self.port}/0"

    def start(self) -> "PersistentRedis":
        log_path = os.path.join(self.dir, "redis.log")
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes", "--appendfsync", "always", "--dir", self.dir,
             "--logfile", log_path, "--requirepass", "s3cret"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for_port(self.port, timeout_s=10, process=self.process, what="redis-server",
                      log_path=log_path)
        return self

    def stop(self) -> None:
        stop_process(self.process)
        self.process = None


@pytest.fixture
def persistent_redis():
    server = PersistentRedis().start()
    yield server
    server.stop()


def test_outage_buffers_debits_and_replays_them_once_on_reconnect(persistent_redis, caplog):
    from kvguard.policy.budget_redis import RedisBudgetLedger

    config = make_config(budget_s=100.0)
    ledger = RedisBudgetLedger(persistent_redis.url, config, retry_interval_s=0.0)
    for i in range(5):
        assert ledger.debit("gpu0", ts(W48, 10 * i), TICK_S, 0.9).counted
    persistent_redis.stop()
    caplog.set_level(logging.INFO, logger="kvguard.budget")
    during = [ledger.debit("gpu0", ts(W48, 10 * i), TICK_S, 0.9) for i in range(3, 12)]
    assert all(r.buffered and not r.counted for r in during)  # no exception reached us
    # while down, remaining() answers from what this process knows: 50 s seen + 90 s buffered
    assert ledger.remaining("gpu0", "2026-W48") == 0.0
    stats = ledger.stats()
    assert stats.outage and stats.outages == 1 and stats.buffered == 9
    with pytest.raises(LedgerUnavailable, match=r"redis://:\*\*\*@127\.0\.0\.1"):
        ledger.status("2026-W48")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "unreachable" in warnings[0].getMessage()
    assert "s3cret" not in caplog.text

    persistent_redis.start()
    # the next debit reconnects, replays the 9 buffered (2 of them already counted before the
    # outage) and then itself
    assert ledger.debit("gpu0", ts(W48, 120), TICK_S, 0.9).counted
    stats = ledger.stats()
    assert (stats.outage, stats.buffered, stats.replayed, stats.dropped) == (False, 0, 9, 0)
    assert stats.counted == 5 + 7 + 1 and stats.duplicates == 2
    row = ledger.status("2026-W48").nodes[0]
    assert row.used_s == 130.0  # ticks 0..12 once each
    assert [a.ts_ns for a in ledger.take_alerts()] == [ts(W48, 90)]  # claimed during replay
    assert any(r.levelno == logging.INFO and "reachable again" in r.getMessage()
               for r in caplog.records)
    ledger.close()


def test_outage_buffer_drops_the_oldest_past_its_bound(persistent_redis):
    from kvguard.policy.budget_redis import RedisBudgetLedger

    config = make_config(budget_s=3600.0, buffer_max=4)
    ledger = RedisBudgetLedger(persistent_redis.url, config, retry_interval_s=0.0)
    persistent_redis.stop()
    for i in range(10):
        ledger.debit("gpu0", ts(W48, 10 * i), TICK_S, 0.9)
    assert (ledger.stats().buffered, ledger.stats().dropped) == (4, 6)
    persistent_redis.start()
    assert ledger.flush()
    assert ledger.status("2026-W48").nodes[0].used_s == 40.0  # ticks 6..9 survived
    assert ledger.stats().dropped == 6
    ledger.close()


def test_retry_interval_keeps_the_outage_path_off_the_network(persistent_redis):
    from kvguard.policy.budget_redis import RedisBudgetLedger

    now = [0.0]
    ledger = RedisBudgetLedger(persistent_redis.url, make_config(budget_s=3600.0),
                               retry_interval_s=5.0, clock=lambda: now[0])
    ledger.debit("gpu0", ts(W48, 0), TICK_S, 0.9)
    persistent_redis.stop()
    ledger.debit("gpu0", ts(W48, 10), TICK_S, 0.9)  # fails, outage starts at t=0
    persistent_redis.start()
    ledger.debit("gpu0", ts(W48, 20), TICK_S, 0.9)  # t=0: within the retry interval, buffered
    assert ledger.stats().buffered == 2
    now[0] = 6.0
    assert ledger.debit("gpu0", ts(W48, 30), TICK_S, 0.9).counted
    assert ledger.stats().buffered == 0
    assert ledger.status("2026-W48").nodes[0].used_s == 40.0
    ledger.close()


def _raw_client(url: str):
    import redis

    return redis.Redis.from_url(url, decode_responses=True)


def test_a_debit_whose_reply_was_lost_still_raises_its_alert_once(persistent_redis):
    """The exhausting debit runs in Redis but its reply never arrives: the ledger buffers it
    and replays it as a duplicate. The claim is this debit's, so the alert still comes out,
    once; a redelivery, or the same tick from another process, raises no second one."""
    from kvguard.policy.budget import compute_debit
    from kvguard.policy.budget_redis import DEBIT_LUA, RedisBudgetLedger

    config = make_config(budget_s=30.0)
    ledger = RedisBudgetLedger(persistent_redis.url, config, retry_interval_s=0.0)
    for i in range(2):
        assert ledger.debit("gpu0", ts(W48, 10 * i), TICK_S, 0.9).counted
    exhausting = ts(W48, 20)
    call = ledger.script_call(compute_debit(config, "gpu0", exhausting, TICK_S, 0.9))
    raw = _raw_client(persistent_redis.url)
    assert raw.register_script(DEBIT_LUA)(keys=call.keys, args=call.args)[2] == 1  # claimed
    raw.close()
    persistent_redis.stop()  # ...and the reply is lost with the connection
    assert ledger.debit("gpu0", exhausting, TICK_S, 0.9).buffered
    assert ledger.take_alerts() == []
    persistent_redis.start()
    assert ledger.flush()
    alerts = ledger.take_alerts()
    assert [(a.node, a.week, a.ts_ns, a.used_s) for a in alerts] == [
        ("gpu0", "2026-W48", exhausting, 30.0)]
    assert alerts[0].top_intervals and ledger.stats().alerts == 1
    assert ledger.stats().duplicates == 1
    assert not ledger.debit("gpu0", exhausting, TICK_S, 0.9).counted  # redelivered
    assert ledger.take_alerts() == [] and ledger.stats().alerts == 1
    other = RedisBudgetLedger(persistent_redis.url, config)  # another worker, same tick
    assert not other.debit("gpu0", exhausting, TICK_S, 0.9).counted
    assert other.take_alerts() == []
    other.close()
    ledger.close()


def test_a_replica_refusing_writes_buffers_debits_until_it_is_primary_again(persistent_redis,
                                                                          caplog):
    """READONLY (e.g. mid-failover) is transient: the debit is buffered, counted in errors,
    logged once, and replayed when the server accepts writes again."""
    from kvguard.policy.budget_redis import RedisBudgetLedger

    ledger = RedisBudgetLedger(persistent_redis.url, make_config(budget_s=3600.0),
                               retry_interval_s=0.0)
    assert ledger.debit("gpu0", ts(W48, 0), TICK_S, 0.9).counted
    raw = _raw_client(persistent_redis.url)
    raw.replicaof("127.0.0.1", free_port())  # a primary that is not there: read-only
    caplog.set_level(logging.INFO, logger="kvguard.budget")
    first = ledger.debit("gpu0", ts(W48, 10), TICK_S, 0.9)
    second = ledger.debit("gpu0", ts(W48, 20), TICK_S, 0.9)  # its replay is refused too
    assert first.buffered and second.buffered and not (first.failed or second.failed)
    assert first.used_s == 20.0 and second.used_s == 30.0  # local estimate
    stats = ledger.stats()
    assert (stats.outage, stats.buffered, stats.errors) == (True, 2, 2)  # 1 direct, 1 replayed
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "refusing writes" in warnings[0] and "ReadOnly" in warnings[0]
    raw.replicaof("NO", "ONE")
    raw.close()
    assert ledger.debit("gpu0", ts(W48, 30), TICK_S, 0.9).counted
    stats = ledger.stats()
    assert (stats.outage, stats.buffered, stats.replayed, stats.counted) == (False, 0, 2, 4)
    assert ledger.status("2026-W48").nodes[0].used_s == 40.0
    ledger.close()


def test_a_debit_redis_refuses_for_good_is_reported_failed_not_buffered(redis_url, caplog):
    """A key of the wrong type makes the script fail every time: retrying cannot help, so the
    debit is reported failed, logged and counted, and the local estimate does not grow."""
    from kvguard.policy.budget_redis import RedisBudgetLedger, budget_keys

    config = make_config()
    ledger = RedisBudgetLedger(redis_url, config)
    raw = _raw_client(redis_url)
    raw.set(budget_keys(config.key_prefix, "2026-W48", "gpu0")[1], "not a hash")
    raw.close()
    caplog.set_level(logging.INFO, logger="kvguard.budget")
    result = ledger.debit("gpu0", ts(W48, 0), TICK_S, 0.9)
    assert result.failed and not result.buffered and not result.counted
    assert result.used_s == 0.0
    stats = ledger.stats()
    assert (stats.errors, stats.buffered, stats.outage, stats.counted) == (1, 0, False, 0)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "WRONGTYPE" in errors[0] and "dropped" in errors[0]
    ledger.close()


# ----------------------------------------------------------------------------- CLI

def test_budget_status_cli_prints_the_ledger_as_json(redis_url, monkeypatch):
    from typer.testing import CliRunner

    from kvguard.cli.app import app
    from kvguard.policy.budget_redis import RedisBudgetLedger

    prefix = f"test{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("KVGUARD_BUDGET__KEY_PREFIX", prefix)
    monkeypatch.setenv("KVGUARD_BUDGET__MINUTES_PER_WEEK", "1")
    ledger = RedisBudgetLedger(redis_url, BudgetConfig(budget_s=60.0, key_prefix=prefix + ":"))
    for i in range(7):
        ledger.debit("gpu0", ts(W48, 10 * i), TICK_S, 0.9)
    ledger.debit("gpu1", ts(W48, 0), TICK_S, 0.9)
    ledger.close()
    runner = CliRunner()
    result = runner.invoke(app, ["budget", "status", "--redis", redis_url, "--json"])
    assert result.exit_code == 0, result.output
    status = json.loads(result.stdout)
    assert status["week"] == "2026-W48"  # the latest week with data
    assert [(n["node"], n["used_s"], n["exhausted"]) for n in status["nodes"]] == [
        ("gpu0", 70.0, True), ("gpu1", 10.0, False)]
    assert status["total_used_s"] == 80.0
    result = runner.invoke(app, ["budget", "status", "--redis", redis_url, "--node", "gpu0",
                                 "--week", "2026-W48"])
    assert result.exit_code == 0 and "EXHAUSTED" in result.stdout and "gpu1" not in result.stdout


def test_budget_status_cli_says_when_redis_is_unreachable():
    from typer.testing import CliRunner

    from kvguard.cli.app import app

    url = f"redis://:pw@127.0.0.1:{free_port()}/0"
    result = CliRunner().invoke(app, ["budget", "status", "--redis", url])
    assert result.exit_code == 1
    assert "unreachable" in result.stderr and "pw@" not in result.stderr
    result = CliRunner().invoke(app, ["budget", "status", "--redis", url, "--week", "2026-48"])
    assert result.exit_code == 2 and "2026-W48" in result.output


def test_tls_and_password_from_settings(tmp_path):
    """rediss:// with a CA file and a password, as the settings' redis section gives them."""
    import shutil

    from kvguard.config.settings import RedisSettings
    from kvguard.policy.budget_redis import RedisBudgetLedger
    from kvguard.runtime.mapping import redis_target

    if not shutil.which("openssl"):
        pytest.skip("openssl is needed to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    port = free_port()
    process = subprocess.Popen(
        ["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert),
         "--tls-auth-clients", "no", "--requirepass", "p@ss:word", "--save", "",
         "--appendonly", "no", "--dir", str(tmp_path), "--logfile", str(tmp_path / "redis.log")],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        try:
            wait_for_port(port, timeout_s=10, process=process, what="redis-server (TLS)",
                          log_path=str(tmp_path / "redis.log"))
        except RuntimeError as exc:
            pytest.skip(f"this redis-server has no TLS: {exc}")
        section = RedisSettings(url=f"redis://127.0.0.1:{port}/0", password="p@ss:word",
                                tls=True, ssl_cafile=str(cert))
        url, options = redis_target(section)
        assert url.startswith("rediss://:p%40ss%3Aword@")
        ledger = RedisBudgetLedger(url, make_config(), **options)
        assert ledger.debit("gpu0", ts(W48, 0), TICK_S, 0.9).counted
        assert ledger.status("2026-W48").nodes[0].used_s == 10.0
        ledger.close()
        plain = RedisBudgetLedger(f"redis://:p%40ss%3Aword@127.0.0.1:{port}/0", make_config())
        assert plain.debit("gpu0", ts(W48, 0), TICK_S, 0.9).buffered  # no TLS: refused
        plain.close()
    finally:
        stop_process(process)


def test_budget_status_agrees_with_the_ticks_of_a_simulated_fleet(redis_url):
    """Real ticks from the shadow fleet through the stream core, debited into Redis: the CLI's
    per-node usage equals the seconds of the ticks with F_ext above the threshold."""
    from typer.testing import CliRunner

    from kvguard.cli.app import app
    from kvguard.policy.budget_redis import RedisBudgetLedger
    from kvguard.producers.sim.fleet import Fleet
    from kvguard.producers.sim.profiles import load_profile
    from kvguard.producers.sim.workloads import load_workload
    from kvguard.streams.core import StreamCore

    # one GPU under the drill: its 32K-token prompts fragment the pool within minutes
    fleet = Fleet(1, load_profile("llama3-8b-24gb"), seed=1)  # the seed engine: its arena fragments
    fleet.submit_workload(load_workload("drill", seed=1, window=600))
    core = StreamCore()
    prefix = f"test{uuid.uuid4().hex[:8]}"
    ledger = RedisBudgetLedger(redis_url, BudgetConfig(key_prefix=prefix + ":"))
    expected: dict[str, float] = {}
    for step in range(1, 41):
        now_ns = step * 10 * NS_PER_S
        fleet.advance(now_ns)
        ticks, _ = core.process_many(fleet.take_batches(now_ns))
        for tick in ticks:
            ledger.debit_tick(tick)
            ledger.debit_tick(tick)  # at-least-once redelivery
            if tick.f_ext > 0.5:
                expected[tick.node] = expected.get(tick.node, 0.0) + tick.tick_s
    ledger.close()
    assert expected, "the drill should fragment at least one GPU"
    result = CliRunner().invoke(app, ["budget", "status", "--redis", redis_url, "--json"],
                                env={"KVGUARD_BUDGET__KEY_PREFIX": prefix})
    assert result.exit_code == 0, result.output
    status = json.loads(result.stdout)
    assert status["week"] == "1970-W01"  # the simulation's clock starts at the epoch
    assert {n["node"]: n["used_s"] for n in status["nodes"]} == pytest.approx(expected)


def test_cli_refuses_the_default_redis_without_an_explicit_url(redis_url, monkeypatch, tmp_path):
    """Without --redis and without redis.url set in file or env, neither command touches
    the built-in default (127.0.0.1:6379, often a shared server): exit 2 and say what to do."""
    from typer.testing import CliRunner

    from kvguard.cli.app import app

    monkeypatch.delenv("KVGUARD_REDIS__URL", raising=False)
    monkeypatch.delenv("KVGUARD_CONFIG", raising=False)
    monkeypatch.setenv("KVGUARD_REDIS__PASSWORD", "pw")  # a redis section, but no url in it
    runner = CliRunner()
    for command in (["budget", "status"], ["slo", "report", "--json"]):
        result = runner.invoke(app, command)
        assert result.exit_code == 2, (command, result.output)
        assert "pass --redis URL or set redis.url" in result.stderr
    monkeypatch.delenv("KVGUARD_REDIS__PASSWORD")
    prefix = f"test{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("KVGUARD_BUDGET__KEY_PREFIX", prefix)
    monkeypatch.setenv("KVGUARD_REDIS__URL", redis_url)  # set explicitly: used
    result = runner.invoke(app, ["budget", "status", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["nodes"] == []
    monkeypatch.delenv("KVGUARD_REDIS__URL")
    config_file = tmp_path / "kvguard.toml"
    config_file.write_text(f'[redis]\nurl = "{redis_url}"\n')
    monkeypatch.setenv("KVGUARD_CONFIG", str(config_file))  # or set in the config file
    result = runner.invoke(app, ["slo", "report", "--json"])
    assert result.exit_code == 0, result.output


def test_budget_status_defaults_to_the_latest_week_with_data_and_says_so(redis_url, monkeypatch):
    from typer.testing import CliRunner

    from kvguard.cli.app import app
    from kvguard.policy.budget_redis import RedisBudgetLedger

    prefix = f"test{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("KVGUARD_BUDGET__KEY_PREFIX", prefix)
    runner = CliRunner()
    result = runner.invoke(app, ["budget", "status", "--redis", redis_url, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["week_source"] == "current"  # nothing anywhere yet
    ledger = RedisBudgetLedger(redis_url, BudgetConfig(key_prefix=prefix + ":"))
    for week in ("2026-W12", "2026-W10"):  # long past: not the current week
        ledger.debit("gpu0", ts(week_start_ns(week), 0), TICK_S, 0.9)
    ledger.close()
    result = runner.invoke(app, ["budget", "status", "--redis", redis_url, "--json"])
    status = json.loads(result.stdout)
    assert (status["week"], status["week_source"]) == ("2026-W12", "latest")
    result = runner.invoke(app, ["budget", "status", "--redis", redis_url])
    assert "week 2026-W12 (latest week with data)" in result.stdout
    result = runner.invoke(app, ["budget", "status", "--redis", redis_url, "--week", "2026-W10",
                                 "--json"])
    status = json.loads(result.stdout)
    assert (status["week"], status["week_source"], status["total_used_s"]) == (
        "2026-W10", "given", 10.0)
