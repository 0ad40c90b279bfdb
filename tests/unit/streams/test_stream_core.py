"""StreamCore: ticks on event time, exact levels at every boundary, sequencing, persistence, predictor."""

import numpy as np
import pytest

from kvguard.contracts.events import EventBatch
from kvguard.contracts.events import EventKind as K
from kvguard.contracts.tick import Tick
from kvguard.contracts.units import NS_PER_S
from kvguard.streams.core import NodeState, StreamConfig, StreamConfigError, StreamCore
from kvguard.streams.metrics import FEATURE_NAMES
from kvguard.streams.predictor import PredictorMismatch
from tests.unit.streams.streams_refpool import RefPool, batches_of, small_geometry


def drive(seed: int, seconds: float, tick_s: float = 10.0, units: int = 128):
    """Run the reference allocator for ``seconds`` of event time; return it and the exact metrics
    at each tick boundary (the state after every event before the boundary)."""
    pool = RefPool(small_geometry(units), seed=seed)
    tick_ns = int(tick_s * NS_PER_S)
    end = pool.now + int(seconds * NS_PER_S)
    expected: dict[int, dict] = {}
    names, weights = zip(*RefPool.OPS)
    while pool.now < end:
        before = pool.now
        pool.now += pool.rng.randint(0, 200_000_000)
        b = (before // tick_ns + 1) * tick_ns
        while b <= pool.now:
            if pool.rows:
                expected[b] = pool.metrics()
            b += tick_ns
        getattr(pool, pool.rng.choices(names, weights)[0])()
    return pool, expected


def test_ticks_equal_exact_state_at_every_boundary_for_any_batching():
    pool, expected = drive(seed=4, seconds=300)
    events = pool.events()
    results = []
    for cuts in ([], list(range(7, len(events), 7)), list(range(1, len(events)))):
        core = StreamCore(StreamConfig())
        ticks = []
        for batch in batches_of(events, "n0", pool.g, cuts):
            ticks.extend(core.process(batch)[0])
        results.append([t.to_dict() for t in ticks])
        got = {t.ts_ns: t for t in ticks}
        assert set(got) == {b for b in expected if b <= int(events["ts_ns"][-1])}
        for b, t in got.items():
            want = expected[b]
            assert (t.u_kv, t.f_ext, t.f_int, t.psi) == (want["u_kv"], want["f_ext"], want["f_int"], want["psi"])
            assert t.largest_free_run_units == want["largest_free_run"] and t.synced
    assert results[0] == results[1] == results[2]


def test_idle_boundaries_are_ticked_and_counts_cover_their_interval():
    g = small_geometry(32)
    pool = RefPool(g, seed=0)
    pool.now = 5 * NS_PER_S
    r = pool.arrive()
    pool.now = 37 * NS_PER_S
    pool.arrive()
    core = StreamCore(StreamConfig(tick_s=10))
    ticks, _ = core.process(EventBatch("n", 0, pool.events(), geometry=g))
    assert [t.ts_ns for t in ticks] == [10 * NS_PER_S, 20 * NS_PER_S, 30 * NS_PER_S]
    assert [t.arrivals for t in ticks] == [1, 0, 0]
    assert r > 0
    ticks, _ = core.flush(40 * NS_PER_S)
    assert [(t.ts_ns, t.arrivals) for t in ticks] == [(40 * NS_PER_S, 1)]


def test_slope_is_least_squares_of_u_kv_over_trailing_window_per_minute():
    g = small_geometry(100, classes=(1,))
    pool = RefPool(g, seed=0)
    r = pool.arrive()
    pool.requests[r]["running"] = True
    pool.emit(K.ADMIT, req=r)
    for i in range(60):  # one unit more every 10 s: U_kv rises 0.01 per 10 s = 0.06 per minute
        pool.now = (i * 10 + 5) * NS_PER_S
        pool.emit(K.ALLOC, req=r, offset=i, size=1, tokens=4)
    pool.now = 605 * NS_PER_S
    pool.emit(K.STEP, size=1)
    core = StreamCore(StreamConfig(tick_s=10, slope_window_s=300))
    ticks, alerts = core.process(EventBatch("n", 0, pool.events(), geometry=g))
    assert ticks[-1].slope_per_min == pytest.approx(0.06)
    assert ticks[0].slope_per_min == 0.0
    rising = [a for a in alerts if a.rule == "KVCacheUsageRising"]
    assert rising and rising[0].state == "firing"


def test_duplicates_are_skipped_and_gaps_mark_ticks_unsynced_until_a_snapshot_state():
    pool, _ = drive(seed=8, seconds=120)
    n = len(pool.rows)
    state = pool.snapshot()
    for _ in range(50):
        pool.random_op(time_step_ns=100_000_000)
    events = pool.events()
    third = n // 3
    batches = batches_of(events, "n", pool.g, [third, 2 * third, n, n + 1], states={n: state})
    core = StreamCore()
    core.process(batches[0])
    core.process(batches[0])  # redelivery
    st = core.nodes["n"]
    assert st.duplicates == 1
    ticks, _ = core.process(batches[2])  # batch 1 lost
    assert st.gaps == 1 and all(not t.synced for t in ticks)
    core.process(batches[3])  # carries the SNAPSHOT and its state
    assert st.mirror.synced and st.mirror.resync_count == 1
    ticks, _ = core.process(batches[4])
    assert all(t.synced for t in ticks)
    m = st.mirror.metrics()
    assert m.tokens_stored == pool.metrics()["tokens_stored"]
    offs, sizes = pool.free_runs()
    assert st.mirror.free_runs()[0].tolist() == offs.tolist()


def test_node_state_bytes_round_trip_continues_identically():
    pool, _ = drive(seed=2, seconds=200)
    events = pool.events()
    batches = batches_of(events, "n", pool.g, list(range(50, len(events), 50)))
    half = len(batches) // 2
    straight = StreamCore()
    out_a = [straight.process(b) for b in batches]
    resumed = StreamCore()
    out_b = [resumed.process(b) for b in batches[:half]]
    data = resumed.nodes["n"].to_bytes()
    resumed.nodes["n"] = NodeState.from_bytes(data, resumed.config)
    out_b += [resumed.process(b) for b in batches[half:]]
    flat = lambda out: [t.to_dict() for ticks, _ in out for t in ticks]
    assert flat(out_a) == flat(out_b)
    assert len(data) < 64_000


class ConstantPredictor:
    feature_names = FEATURE_NAMES
    window_ticks = 6

    def __init__(self):
        self.calls = []

    def predict(self, windows):
        self.calls.append(windows.shape)
        n = len(windows)
        return np.full(n, 0.75), np.repeat(windows[:, -1:, 0], 3, axis=1)


def test_predictor_is_called_once_per_process_many_with_all_new_ticks():
    pools = [drive(seed=s, seconds=60)[0] for s in (1, 2)]
    pred = ConstantPredictor()
    core = StreamCore(StreamConfig(), predictor=pred)
    batches = [EventBatch(f"n{i}", 0, p.events(), geometry=p.g) for i, p in enumerate(pools)]
    ticks, alerts = core.process_many(batches)
    assert len(pred.calls) == 1 and pred.calls[0][0] == len(ticks) > 2
    assert pred.calls[0][1:] == (6, len(FEATURE_NAMES))
    assert all(t.p_oom == 0.75 and len(t.u_kv_forecast) == 3 for t in ticks)
    assert {a.node for a in alerts if a.rule == "KVCacheOOMPredicted" and a.state == "firing"} == {"n0", "n1"}
    for t in ticks:  # each tick's window ends at that tick, even when one call makes several
        assert t.u_kv_forecast == [pytest.approx(t.u_kv)] * 3


def test_predictor_with_other_features_is_refused():
    class Wrong(ConstantPredictor):
        feature_names = ("u_kv",)
    with pytest.raises(PredictorMismatch, match="FEATURE_NAMES"):
        StreamCore(predictor=Wrong())


def test_config_errors_name_the_field():
    with pytest.raises(StreamConfigError, match="tick_s"):
        StreamConfig(tick_s=0)
    with pytest.raises(StreamConfigError, match="reserved_frac"):
        StreamConfig(reserved_frac=1.5)


def test_candidates_include_the_lru_lowest_priority_and_largest_exclusive_holders():
    g = small_geometry(256, classes=(1, 16))
    pool = RefPool(g, seed=0)
    reqs = []
    for i in range(10):
        pool.now = (i + 1) * NS_PER_S
        r = pool.arrive()
        pool.emit(K.ADMIT, req=r)
        reqs.append(r)
    prios = {r: pool.requests[r]["priority"] for r in reqs}
    offset = 0
    for i, r in enumerate(reqs):  # request i holds i+1 one-unit pages, touched at time 20+i
        pool.now = (20 + i) * NS_PER_S
        for _ in range(i + 1):
            pool.emit(K.ALLOC, req=r, offset=offset, size=1, tokens=2)
            offset += 1
    pool.emit(K.SHARE, req=reqs[0], offset=offset - 1, size=1, tokens=2)  # r0 shares r9's last page
    pool.now = 45 * NS_PER_S
    pool.emit(K.STEP, size=1)
    ticks, _ = StreamCore(StreamConfig(max_candidates=4)).process(EventBatch("n", 0, pool.events(), geometry=g))
    cands = {c.req: c for c in ticks[-1].candidates}
    assert len(cands) == 4
    lowest = min(reqs, key=lambda r: (prios[r], -r))
    assert reqs[1] in cands and lowest in cands and reqs[9] in cands  # LRU (r0 touched last), priority, largest
    assert cands[reqs[9]].units == 10 and cands[reqs[9]].shared_units == 1 and cands[reqs[9]].pages == 10
    assert cands[reqs[1]].prompt_tokens == pool.requests[reqs[1]]["prompt"]
    assert cands[reqs[1]].priority == prios[reqs[1]] and cands[reqs[1]].last_ts_ns == 21 * NS_PER_S


def test_tick_dict_round_trip():
    pool, _ = drive(seed=6, seconds=40)
    ticks, _ = StreamCore().process(EventBatch("n", 0, pool.events(), geometry=pool.g))
    t = ticks[-1]
    assert Tick.from_dict(t.to_dict()) == t


def test_process_many_merges_contiguous_batches_without_changing_ticks():
    pools = {f"n{i}": drive(seed=10 + i, seconds=120)[0] for i in range(3)}
    per_node = {n: batches_of(p.events(), n, p.g, list(range(13, len(p.rows), 13))) for n, p in pools.items()}
    interleaved = [b for group in zip(*per_node.values()) for b in group]
    one_by_one = StreamCore()
    expected = [t.to_dict() for b in interleaved for t in one_by_one.process(b)[0]]
    merged = StreamCore()
    got = []
    for i in range(0, len(interleaved), 10):
        got += [t.to_dict() for t in merged.process_many(interleaved[i:i + 10])[0]]
    key = lambda d: (d["node"], d["ts_ns"])
    assert sorted(got, key=key) == sorted(expected, key=key) and len(got) > 30


def test_config_maps_from_settings():
    from kvguard.config.settings import Settings
    from kvguard.runtime.mapping import stream_config

    settings = Settings.load(env={"KVGUARD_STREAMS__TICK_S": "5", "KVGUARD_STREAMS__FRAG_FOR_S": "60",
                                  "KVGUARD_PREDICTOR__THRESHOLD": "0.4"})
    config = stream_config(settings)
    assert config.tick_s == 5 and config.thresholds.frag_for_s == 60 and config.thresholds.p_oom == 0.4
    assert config.reserved_frac is None  # not set: each geometry's own reserve (Ψ equals the pool's)
    explicit = Settings.load(env={"KVGUARD_STREAMS__RESERVED_FRAC": "0.08"})
    assert stream_config(explicit).reserved_frac == 0.08


def test_metrics_cli_prints_tick_and_alert_lines_for_an_event_log(tmp_path):
    import json

    from typer.testing import CliRunner

    from kvguard.cli import app
    from kvguard.wire.eventlog import write_event_log

    pool, expected = drive(seed=12, seconds=90)
    r = pool.arrive()  # then fill the pool for a minute so the threshold tiers fire
    pool.requests[r]["running"] = True
    pool.emit(K.ADMIT, req=r)
    pool.emit(K.RESET)
    for i in range(pool.D):
        pool.now += 30_000_000
        pool.emit(K.ALLOC, req=r, offset=i, size=1, tokens=4)
    pool.now += 25 * NS_PER_S
    pool.emit(K.STEP, size=1)
    path = tmp_path / "log.jsonl.gz"
    write_event_log(path, batches_of(pool.events(), "n0", pool.g, list(range(100, len(pool.rows), 100))), {})
    result = CliRunner().invoke(app, ["metrics", "--events", str(path), "--alerts", "--json"])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    ticks = [d for d in lines if d["type"] == "tick"]
    alerts = [d for d in lines if d["type"] == "alert"]
    assert [t["ts_s"] for t in ticks][:9] == [float(s) for s in range(10, 100, 10)]
    for t in ticks[:8]:
        want = expected[t["ts_ns"]]
        assert (t["u_kv"], t["f_ext"], t["f_int"], t["psi"]) == (want["u_kv"], want["f_ext"], want["f_int"], want["psi"])
        assert {"node", "slope_per_min", "synced"} <= set(t) and "candidates" not in t
    assert {"KVCacheUsageCritical", "KVCacheUsageHigh", "KVCachePressureCritical"} <= {a["name"] for a in alerts}
    bad = CliRunner().invoke(app, ["metrics", "--events", str(tmp_path / "missing.gz"), "--json"])
    assert bad.exit_code == 2 and "no such file" in bad.output
    assert CliRunner().invoke(app, ["metrics", "--events", str(path), "--tick", "soon"]).exit_code == 2


class SteppingPredictor(ConstantPredictor):
    """Stateful scoring: records which nodes were primed, stepped and forgotten."""

    def __init__(self):
        super().__init__()
        self.log = []

    def prime(self, nodes, windows):
        self.log += [("prime", n) for n in nodes]
        return self.predict(windows)

    def step(self, nodes, x):
        self.log += [("step", n) for n in nodes]
        return np.full(len(nodes), 0.75), np.repeat(x[:, :1], 3, axis=1)

    def forget(self, node):
        self.log.append(("forget", node))


def test_a_producer_restart_with_a_newer_epoch_starts_the_node_over_on_its_new_clock():
    first, _ = drive(seed=3, seconds=300)
    second, expected = drive(seed=5, seconds=120)  # the restarted node: its clock starts at 0 again
    pred = SteppingPredictor()
    core = StreamCore(StreamConfig(), predictor=pred, stateful=True)
    old = batches_of(first.events(), "n", first.g, list(range(40, len(first.rows), 40)), epoch=7)
    ticks_old = [t for b in old for t in core.process(b)[0]]
    st = core.nodes["n"]
    assert ticks_old[-1].ts_ns > 200 * NS_PER_S and {t.epoch for t in ticks_old} == {7}
    new_events = second.events()
    new = batches_of(new_events, "n", second.g, list(range(40, len(second.rows), 40)), epoch=8)
    ticks_new = [t for b in new for t in core.process(b)[0]]
    assert st.restarts == 1 and st.epoch == 8 and st.duplicates == 0
    got = {t.ts_ns: t for t in ticks_new}
    assert set(got) == {b for b in expected if b <= int(new_events["ts_ns"][-1])}
    assert min(got) == 10 * NS_PER_S
    for b, t in got.items():  # a fresh mirror: exactly the new run's state, synced, epoch 8
        assert (t.u_kv, t.f_ext, t.psi) == (expected[b]["u_kv"], expected[b]["f_ext"], expected[b]["psi"])
        assert t.synced and t.epoch == 8
    # slope and features start over: the first new tick has no history of the old run
    assert ticks_new[0].slope_per_min == 0.0 and st.features.count == len(ticks_new)
    assert pred.log.count(("forget", "n")) == 1
    assert pred.log[pred.log.index(("forget", "n")) + 1] == ("prime", "n")
    # a late batch of the old run is stale: dropped, nothing changes
    late = EventBatch("n", len(old), first.events()[-3:], epoch=7)
    assert core.process(late) == ([], []) and st.duplicates == 1 and st.epoch == 8
    # the counter survives the changelog
    assert NodeState.from_bytes(st.to_bytes(), core.config).restarts == 1
