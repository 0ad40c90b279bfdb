"""Faults one record or one silent fleet can cause (issue 15): an event time far in the future,
a node's first batch with a bogus epoch, and per-node state of the SLO outcome tracker."""

import dataclasses

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvguard.contracts.events import EventBatch
from kvguard.contracts.units import NS_PER_S
from kvguard.policy import service
from kvguard.policy.slo import MemorySloLedger, OutcomeTracker, PredictionOutcome, SloConfigError
from kvguard.streams.core import NodeState, StreamConfig, StreamConfigError, StreamCore
from tests.unit.streams.test_stream_hostile import two_node_stream

FAR = 10**18  # ns: ~31 years ahead
HOUR_NS = 3600 * NS_PER_S


def node_a() -> list[EventBatch]:
    return [b for b in two_node_stream() if b.node == "a"]


def shifted(batch: EventBatch, by_ns: int, *, last_row_only: bool = False) -> EventBatch:
    events = batch.events.copy()
    if last_row_only:
        events["ts_ns"][-1] += by_ns
    else:
        events["ts_ns"] += by_ns
    return dataclasses.replace(batch, events=events)


def tick_dicts(ticks) -> list[dict]:
    return [t.to_dict() for t in ticks]


# ---- event time jumps ----------------------------------------------------------------------------


@pytest.mark.parametrize("last_row_only", [False, True], ids=["whole-batch", "one-row"])
def test_a_batch_far_in_the_future_is_rejected_and_the_node_keeps_ticking(last_row_only):
    clean = node_a()
    core = StreamCore()
    core.process_many(clean[:4])
    core.process_many([shifted(clean[4], FAR, last_row_only=last_row_only)])
    rejected = list(core.rejected)
    later = core.process_many(clean[4:])[0]  # the old code took the jump: these were all "in the past"
    reference = StreamCore()
    reference.process_many(clean[:4])
    assert later and tick_dicts(later) == tick_dicts(reference.process_many(clean[4:])[0])
    assert [r.reason for r in rejected] == ["invalid"] and "max_ts_skew_s" in rejected[0].detail
    assert core.counters.ts_jumps_rejected == 1 and core.nodes["a"].off_clock is None


def test_a_jump_that_the_next_batch_goes_on_from_is_taken():
    """A GPU idle longer than the skew: its first batch after the silence is rejected, the second,
    going on from it, confirms the jump and is taken."""
    clean = node_a()
    core = StreamCore()
    core.process_many(clean[:10])
    resumed = [shifted(b, 2 * HOUR_NS) for b in clean[10:]]
    assert core.process_many(resumed[:1])[0] == [] and [r.batch.seq for r in core.rejected] == [10]
    ticks = core.process_many(resumed[1:])[0]
    jumped = min(int(b.events["ts_ns"].min()) for b in resumed)
    assert not core.rejected and core.counters.ts_jumps_rejected == 1
    assert ticks and ticks[-1].ts_ns > jumped  # the clock moved on with the node
    assert core.nodes["a"].gaps == 1 and not ticks[-1].synced  # the rejected batch is a seq gap


def test_a_node_whose_first_batch_is_far_in_the_future_gets_its_clock_back():
    clean = node_a()
    core = StreamCore()
    core.process_many([shifted(clean[0], FAR)])
    ticks = core.process_many(clean[1:5])[0] + core.process_many(clean[5:])[0]
    assert ticks and all(t.ts_ns < FAR for t in ticks)  # the old code emitted none of these
    assert core.counters.clock_rebases == 1
    assert [t.ts_ns for t in ticks] == sorted({t.ts_ns for t in ticks})


def test_one_batch_behind_the_clock_does_not_rebase_it():
    clean = node_a()
    core = StreamCore(StreamConfig(max_ts_skew_s=10.0))
    core.process_many(clean[:10])
    core.process_many([shifted(clean[10], -int(clean[10].events["ts_ns"].min()))])  # at ts 0
    assert core.nodes["a"].off_clock is not None and not core.nodes["a"].off_clock.ahead
    later = core.process_many(clean[11:])[0]
    assert later and core.counters.clock_rebases == 0
    assert min(t.ts_ns for t in later) > int(clean[9].events["ts_ns"].max())


def test_the_skew_is_configured_and_checked():
    from kvguard.config.settings import Settings
    from kvguard.runtime.mapping import stream_config

    s = Settings.load(env={"KVGUARD_STREAMS__MAX_TS_SKEW_S": "120"})
    assert stream_config(s).max_ts_skew_ns == 120 * NS_PER_S
    with pytest.raises(StreamConfigError, match="max_ts_skew_s"):
        StreamConfig(tick_s=10.0, max_ts_skew_s=5.0)


# ---- a bogus first epoch ---------------------------------------------------------------------------


def test_a_first_batch_with_epoch_2_62_does_not_silence_the_node():
    clean = node_a()
    core = StreamCore()
    bogus = EventBatch(node="a", seq=0, epoch=2**62, events=clean[0].events, geometry=clean[0].geometry)
    core.process_many([bogus])
    ticks = core.process_many(clean[:30])[0] + core.process_many(clean[30:])[0]
    reference = StreamCore()
    expected = reference.process_many(clean[:30])[0] + reference.process_many(clean[30:])[0]
    assert ticks and tick_dicts(ticks) == tick_dicts(expected)  # the old code dropped them all as "older"
    assert core.counters.epochs_retracted == 1 and core.nodes["a"].epoch == 0


def test_a_bogus_restart_within_the_jump_bound_is_retracted_by_the_next_real_batch():
    clean = node_a()
    core = StreamCore()
    core.process_many(clean[:4])
    core.process_many([dataclasses.replace(clean[4], epoch=2**60, seq=0)])  # within max_epoch_jump
    later = core.process_many(clean[4:])[0]  # the old code dropped them all as "older"
    assert later and all(t.epoch == 0 for t in later) and core.nodes["a"].epoch == 0
    assert core.counters.epochs_retracted == 1 and core.nodes["a"].restarts == 2


def test_a_real_restart_is_taken_at_once_and_then_holds_against_the_old_epoch():
    clean = node_a()
    core = StreamCore()
    core.process_many(clean[:4])
    epoch = 1_700_000_000_000_000_000
    restart = [dataclasses.replace(b, epoch=epoch) for b in clean[:3]]
    core.process_many(restart[:1])
    assert core.nodes["a"].epoch == epoch and core.nodes["a"].restarts == 1
    core.process_many(restart[1:])
    core.process_many([clean[4]])  # a late copy from the old run
    assert core.nodes["a"].epoch == epoch and core.counters.epochs_retracted == 0
    assert core.nodes["a"].duplicates == 1


def test_a_second_batch_merged_into_one_confirms_the_epoch():
    clean = node_a()
    core = StreamCore()
    core.process_many(clean[:3])
    st_ = core.nodes["a"]
    assert st_.epoch_confirmed and st_.seq == 2


def test_the_checkpoint_keeps_the_epoch_confirmation_and_the_off_clock_mark():
    clean = node_a()
    core = StreamCore()
    core.process_many(clean[:4])
    core.process_many([shifted(clean[4], FAR)])
    before = core.nodes["a"]
    after = NodeState.from_bytes(before.to_bytes(), core.config)
    assert (after.epoch_confirmed, after.off_clock) == (True, before.off_clock) and after.off_clock.ahead


# ---- the SLO outcome tracker's per-node state ----------------------------------------------------------


def test_the_outcome_tracker_holds_at_most_max_nodes():
    tracker = OutcomeTracker(0.5, horizon_s=300.0, max_nodes=3)
    for i in range(10):
        tracker.observe_tick(f"invented-{i}", FAR + i, 0.9)  # never resolved: far in the future
    assert tracker.nodes == 3 and tracker.nodes_evicted == 7
    with pytest.raises(SloConfigError, match="max_nodes"):
        OutcomeTracker(0.5, max_nodes=0)


def test_the_outcome_tracker_drops_nodes_with_nothing_to_label():
    tracker = OutcomeTracker(0.5, horizon_s=10.0)
    for i in range(1000):
        tracker.observe_oom(f"n{i % 7}", i * NS_PER_S)  # OOMs but no prediction: nothing to label
        tracker.observe_tick(f"m{i}", i * NS_PER_S, 0.1)
        tracker.resolve(i * NS_PER_S)
    assert tracker.nodes <= 11 and not tracker._ooms  # the old one held all 1007 nodes and every OOM


events_per_node = st.lists(st.tuples(st.integers(0, 40), st.sampled_from(["tick", "oom"]), st.floats(0, 1)),
                           max_size=30)


@settings(max_examples=60, deadline=None)
@given(streams=st.lists(events_per_node, min_size=1, max_size=4), max_nodes=st.integers(4, 8))
# found by CI: node 1's OOM at exactly its tick's horizon end, fed after node 0's tick of that instant
@example(streams=[[(24, "tick", 0.0)], [(19, "tick", 0.0), (24, "oom", 0.0)]], max_nodes=4)
def test_the_outcome_tracker_labels_every_tick_as_the_definition_says(streams, max_nodes):
    """Positive iff an OOM of the node lies in (t, t + horizon]; fed in event time, resolved as the
    policy does (at every tick's time), then at the end."""
    horizon_s = 5.0
    feed = sorted(((ts * NS_PER_S, n, kind, p) for n, evs in enumerate(streams) for ts, kind, p in evs),
                  key=lambda x: (x[0], x[1], x[2] == "tick"))
    tracker = OutcomeTracker(0.5, horizon_s=horizon_s, max_nodes=max_nodes)
    got = []
    for ts, n, kind, p in feed:
        if kind == "oom":
            tracker.observe_oom(str(n), ts)
        else:
            tracker.observe_tick(str(n), ts, p)
            got += tracker.resolve(ts)
    got += tracker.resolve(10**12 * NS_PER_S)
    ooms = {(str(n), ts) for ts, n, kind, _ in feed if kind == "oom"}
    expected = [PredictionOutcome(str(n), ts, p >= 0.5,
                                  any(node == str(n) and ts < o <= ts + horizon_s * NS_PER_S for node, o in ooms))
                for ts, n, kind, p in feed if kind == "tick"]
    key = lambda o: (o.node, o.ts_ns, o.predicted, o.actual)  # noqa: E731
    assert sorted(got, key=key) == sorted(expected, key=key)
    assert tracker.nodes == 0  # every tick labelled: nothing held


def test_the_slo_recorders_pending_commands_and_evictions_are_bounded(monkeypatch):
    monkeypatch.setattr(service, "MAX_PENDING", 3)
    recorder = service.SloRecorder(MemorySloLedger(), threshold=0.5, horizon_s=300.0)
    recorder._record_evictions("n/gpu0", 10**9, tuple(range(10)))  # evicted requests whose FINISH never comes
    assert list(recorder._evicted) == [("n/gpu0", 7), ("n/gpu0", 8), ("n/gpu0", 9)]
    assert recorder.counters.pending_dropped == 7


def test_one_far_future_record_does_not_expire_the_real_weeks_of_the_slo_ledger():
    week_ns = 7 * 86_400 * NS_PER_S
    ledger = MemorySloLedger()
    for w in range(3):
        ledger.record_oom("n/gpu0", w * week_ns + NS_PER_S, {})
    ledger.record_oom("n/gpu0", 1 << 62, {})  # year ~2116
    assert len(ledger.weeks()) == 4  # the real weeks are still there
    for w in range(3, 12):
        ledger.record_oom("n/gpu0", w * week_ns + NS_PER_S, {})
    assert len(ledger.weeks()) == ledger.config.retention_weeks + 1  # still bounded
