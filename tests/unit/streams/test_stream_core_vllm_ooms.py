"""The stream core with the shipped predictor over a vLLM-faithful log (issue 27): allocator OOMs,
GPUs down while their engine restarts, a producer restart and a seq gap. Every tick is produced
and scored; a node whose scoring fails loses its own P(OOM), never the stream or another node."""

from __future__ import annotations

import numpy as np
import pytest

from kvguard.contracts.events import EventBatch, EventKind
from kvguard.runtime.bootstrap import bootstrap
from kvguard.streams.core import StreamConfig, StreamCore
from kvguard.streams.metrics import FEATURE_NAMES
from tests.unit.streams.streams_refpool import RefPool, batches_of, small_geometry
from tests.unit.streams.test_stream_core import drive
from tests.unit.streams.vllm_oom_log import ooms, vllm_oom_log


@pytest.fixture(scope="module")
def log() -> list[EventBatch]:
    return vllm_oom_log()


def expected_ticks(batches: list[EventBatch], tick_ns: int) -> set[tuple[str, int, int]]:
    """(node, epoch, boundary) of every tick the log's events cross, worked out from the batches alone:
    each boundary after a run's first event up to its last one, and the partial tick ``finish`` adds
    after the last run of each node (a restart drops the old run's unfinished interval)."""
    spans: dict[tuple[str, int], list[int]] = {}
    for b in batches:
        if len(b.events):
            span = spans.setdefault((b.node, b.epoch), [int(b.events["ts_ns"][0]), 0])
            span[1] = max(span[1], int(b.events["ts_ns"].max()))
    last_epoch = {node: epoch for node, epoch in sorted(spans)}
    out = set()
    for (node, epoch), (first, last) in spans.items():
        end = last // tick_ns + (2 if epoch == last_epoch[node] else 1)
        out |= {(node, epoch, k * tick_ns) for k in range(first // tick_ns + 1, end)}
    return out


def ticked_ooms(batches: list[EventBatch], tick_ns: int) -> int:
    """The log's OOM events that fall in a ticked interval: all but those after the last boundary of
    a run that a restart ended (a restart starts the node over, its unfinished interval with it)."""
    last = {}
    for b in batches:
        if len(b.events):
            last[(b.node, b.epoch)] = max(last.get((b.node, b.epoch), 0), int(b.events["ts_ns"].max()))
    final = {node: epoch for node, epoch in sorted(last)}
    count = 0
    for b in batches:
        ts = b.events["ts_ns"][b.events["kind"] == int(EventKind.OOM)]
        if b.epoch != final[b.node]:
            ts = ts[ts < last[(b.node, b.epoch)] // tick_ns * tick_ns]
        count += len(ts)
    return count


def by_key(ticks) -> dict:
    return {(t.node, t.epoch, t.ts_ns): t.to_dict() for t in ticks}


def one_at_a_time(core: StreamCore, batches: list[EventBatch]):
    ticks = []
    for b in batches:
        ticks += core.process_many([b])[0]
        assert not core.rejected
    return ticks + core.finish()[0]


def test_the_shipped_predictor_scores_every_tick_of_a_vllm_log_with_ooms_restarts_and_gaps(log):
    core = bootstrap().stream_core()
    assert core.predictor is not None  # the shipped model, as the deployed worker runs it
    ticks = one_at_a_time(core, log)
    keys = [(t.node, t.epoch, t.ts_ns) for t in ticks]
    assert len(keys) == len(set(keys))
    assert set(keys) == expected_ticks(log, core.config.tick_ns)
    assert sum(t.ooms for t in ticks) == ticked_ooms(log, core.config.tick_ns) >= 2 and ooms(log) >= 4
    assert any(not t.synced for t in ticks) and {t.epoch for t in ticks} == {0, 1}
    assert all(t.p_oom is not None and 0.0 <= t.p_oom <= 1.0 for t in ticks)
    assert core.counters.ticks_unscored == 0
    # the same ticks, P(OOM) included, however the log is cut into calls (one call orders them by node)
    whole = bootstrap().stream_core()
    assert by_key(whole.process_many(log)[0] + whole.finish()[0]) == by_key(ticks)
    # and the same ticks a core without predictor makes, but for the prediction
    plain = one_at_a_time(bootstrap().stream_core(with_predictor=False), log)
    assert [t.to_dict() | {"p_oom": None, "u_kv_forecast": None} for t in ticks] == [t.to_dict() for t in plain]


def test_each_tick_is_scored_on_the_window_ending_at_it_when_one_call_makes_more_ticks_than_the_window():
    class LastRow:
        feature_names, window_ticks = FEATURE_NAMES, 2

        def __init__(self):
            self.seen: list[np.ndarray] = []

        def predict(self, windows):
            self.seen.append(windows)
            return np.full(len(windows), 0.5), windows[:, :, 0]

    pool = RefPool(small_geometry(64), seed=3)
    for _ in range(600):
        pool.random_op(time_step_ns=200_000_000)  # ~2 minutes: a dozen ticks in one call
    predictor = LastRow()
    core = StreamCore(StreamConfig(window_ticks=2), predictor=predictor)
    ticks, _ = core.process_many(batches_of(pool.events(), "n", pool.g, []))
    assert len(ticks) > 4 and len(predictor.seen) == 1
    u_kv = [t.u_kv for t in ticks]
    # tick i reads ticks i-1 and i (the first one padded with itself), not the call's last two
    assert [t.u_kv_forecast for t in ticks] == [pytest.approx([u_kv[max(i - 1, 0)], u_kv[i]], abs=1e-6)
                                                for i in range(len(ticks))]


def two_nodes() -> tuple[list[EventBatch], list[EventBatch]]:
    """Two nodes' batches, about a tick each, over three minutes."""
    out = []
    for node, seed in (("good", 1), ("bad", 2)):
        pool, _ = drive(seed=seed, seconds=180)
        events = pool.events()
        out.append(batches_of(events, node, pool.g, list(range(50, len(events), 50))))
    return out[0], out[1]


class StrictPredictor:
    """Refuses non-finite input, as a model checking its input would."""

    feature_names, window_ticks = FEATURE_NAMES, 3

    def predict(self, windows):
        if not np.isfinite(windows).all():
            raise ValueError("non-finite features")
        return np.full(len(windows), 0.25), windows[:, -1:, 0]


def test_a_node_whose_scoring_raises_gets_no_prediction_and_the_other_nodes_do():
    good_batches, bad_batches = two_nodes()
    predictor = StrictPredictor()
    core = StreamCore(StreamConfig(window_ticks=3), predictor=predictor)
    core.process_many(good_batches[:4] + bad_batches[:4])
    core.nodes["bad"].features.buffer[:] = np.nan  # a corrupt history: its next windows are non-finite
    ticks, _ = core.process_many(good_batches[4:] + bad_batches[4:])
    good = [t for t in ticks if t.node == "good"]
    bad = [t for t in ticks if t.node == "bad"]
    assert good and bad and not core.rejected
    assert all(t.p_oom == 0.25 for t in good)
    assert all(t.p_oom is None for t in bad[:2]) and bad[-1].p_oom == 0.25  # its window heals as ticks push
    assert core.counters.ticks_unscored == sum(t.p_oom is None for t in bad) >= 2


class StatefulPredictor:
    """prime/step/forget over node names; raises for the nodes in ``broken``."""

    feature_names, window_ticks = FEATURE_NAMES, 3

    def __init__(self):
        self.broken: set[str] = set()
        self.primed: list[str] = []

    def _answer(self, nodes, n):
        if self.broken & set(nodes):
            raise RuntimeError(f"state of {sorted(self.broken & set(nodes))} is gone")
        return np.full(n, 0.5), np.zeros((n, 1))

    def predict(self, windows):
        return self._answer([], len(windows))

    def prime(self, nodes, windows):
        self.primed += nodes
        return self._answer(nodes, len(nodes))

    def step(self, nodes, rows):
        return self._answer(nodes, len(nodes))

    def forget(self, node):
        pass


def test_a_stateful_predictor_failing_for_one_node_costs_that_nodes_ticks_only_and_reprimes_it():
    good_batches, bad_batches = two_nodes()
    predictor = StatefulPredictor()
    core = StreamCore(StreamConfig(window_ticks=3), predictor=predictor)
    assert core.stateful
    core.process_many(good_batches[:4] + bad_batches[:4])
    predictor.broken = {"bad"}
    ticks, _ = core.process_many(good_batches[4:12] + bad_batches[4:12])
    assert all(t.p_oom == 0.5 for t in ticks if t.node == "good")
    assert [t.p_oom for t in ticks if t.node == "bad"] == [None] * sum(t.node == "bad" for t in ticks) != []
    predictor.broken, predictor.primed = set(), []
    ticks, _ = core.process_many(good_batches[12:] + bad_batches[12:])
    assert all(t.p_oom == 0.5 for t in ticks)
    assert "bad" in predictor.primed  # its state was lost: primed afresh from its window


def test_a_prediction_outside_the_ticks_contract_is_dropped_not_published():
    class Wild:
        feature_names, window_ticks = FEATURE_NAMES, 1

        def predict(self, windows):
            p = np.full(len(windows), 0.5)
            p[::2] = np.nan
            return p, np.zeros((len(windows), 1))

    pool = RefPool(small_geometry(64), seed=3)
    for _ in range(600):
        pool.random_op(time_step_ns=200_000_000)
    core = StreamCore(StreamConfig(window_ticks=1), predictor=Wild())
    ticks, _ = core.process_many(batches_of(pool.events(), "n", pool.g, []))
    assert [t.p_oom for t in ticks] == [None if i % 2 == 0 else 0.5 for i in range(len(ticks))]
    assert core.counters.ticks_unscored == (len(ticks) + 1) // 2
