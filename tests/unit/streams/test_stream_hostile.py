"""StreamCore under hostile or broken input: duplicates, reordering, impossible contents, epoch
jumps, failing batches, and more nodes than it may hold (issue 15)."""

import functools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.contracts.events import EventBatch
from kvguard.contracts.events import EventKind as K
from kvguard.contracts.units import NS_PER_S
from kvguard.streams.core import StreamConfig, StreamCore
from tests.unit.streams.streams_refpool import batches_of
from tests.unit.streams.test_stream_core import drive


@functools.cache
def two_node_stream() -> tuple[EventBatch, ...]:
    """Two nodes' batches interleaved, as a bus delivers them (each node's in order)."""
    out = []
    for node, seed in (("a", 3), ("b", 5)):
        pool, _ = drive(seed=seed, seconds=180)
        events = pool.events()
        cuts = list(range(20, len(events), 20))
        out.append(batches_of(events, node, pool.g, cuts))
    merged = []
    for i in range(max(len(x) for x in out)):
        merged += [x[i] for x in out if i < len(x)]
    return tuple(merged)


def ticks_of(batches, chunk: int | None = None) -> list[dict]:
    core = StreamCore(StreamConfig())
    chunks = [batches] if chunk is None else [batches[i:i + chunk] for i in range(0, len(batches), chunk)]
    ticks = []
    for part in chunks:
        ticks += core.process_many(list(part))[0]
    end = max(int(b.events["ts_ns"].max()) for b in batches if len(b))
    ticks += core.flush(end + 10 * NS_PER_S)[0]
    return sorted((t.to_dict() for t in ticks), key=lambda d: (d["node"], d["ts_ns"]))


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_duplicated_batches_give_the_ticks_of_the_clean_stream(data):
    clean = list(two_node_stream())
    dirty = list(clean)
    for _ in range(data.draw(st.integers(1, 6))):
        i = data.draw(st.integers(0, len(dirty) - 1))
        later = data.draw(st.integers(i + 1, min(len(dirty), i + 12)))
        dirty.insert(later, dirty[i])  # a redelivery soon after the original
    chunk = data.draw(st.sampled_from([None, 1, 5, 16]))
    assert ticks_of(dirty, chunk) == ticks_of(clean, chunk)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_batches_reordered_within_a_call_give_the_ticks_of_the_clean_stream(data):
    clean = list(two_node_stream())
    window = data.draw(st.sampled_from([4, 8, 16]))
    dirty = []
    for i in range(0, len(clean), window):
        part = clean[i:i + window]
        dirty += data.draw(st.permutations(part))
    assert ticks_of(dirty, window) == ticks_of(clean, window)


def test_a_duplicate_at_the_head_of_a_call_does_not_drop_the_batches_after_it():
    clean = list(two_node_stream())
    a = [b for b in clean if b.node == "a"]
    core = StreamCore()
    core.process_many(a[:5])
    # the last batch again, then the rest: the old code merged them all and dropped them as one
    ticks_dirty = core.process_many(a[4:])[0]
    core = StreamCore()
    core.process_many(a[:5])
    ticks_clean = core.process_many(a[5:])[0]
    assert [t.to_dict() for t in ticks_dirty] == [t.to_dict() for t in ticks_clean]
    assert ticks_clean and core.nodes["a"].gaps == 0


def test_a_run_outside_the_region_is_rejected_before_the_node_changes():
    clean = [b for b in two_node_stream() if b.node == "a"]
    bad_events = clean[3].events.copy()
    rows = np.flatnonzero(bad_events["kind"] == K.ALLOC)
    bad_events["offset"][rows[0]] = 10**12
    bad = EventBatch(node="a", seq=3, events=bad_events)
    core = StreamCore()
    core.process_many(clean[:3])
    before = core.nodes["a"].to_bytes()
    ticks, _ = core.process_many([bad])
    assert ticks == [] and core.nodes["a"].to_bytes() == before
    assert [(r.batch is bad, r.reason) for r in core.rejected] == [(True, "invalid")]
    assert "offset 1000000000000" in core.rejected[0].detail and core.counters.batches_rejected == 1
    # the good copy of that batch still applies: the node goes on as if nothing happened
    rest = core.process_many(clean[3:])[0]
    reference = StreamCore()
    reference.process_many(clean[:3])
    assert [t.to_dict() for t in rest] == [t.to_dict() for t in reference.process_many(clean[3:])[0]]


def test_an_absurd_epoch_jump_is_rejected_and_does_not_silence_the_node():
    clean = [b for b in two_node_stream() if b.node == "a"]
    core = StreamCore()
    core.process_many(clean[:4])
    jump = EventBatch(node="a", seq=0, epoch=2**62, events=clean[4].events, geometry=clean[0].geometry)
    core.process_many([jump])
    rejected = list(core.rejected)
    later = core.process_many(clean[4:])[0]  # the old code dropped every one of them as "older"
    assert later and all(t.epoch == 0 and t.synced for t in later)
    assert core.nodes["a"].restarts == 0
    assert core.counters.epoch_jumps_rejected == 1 and "max_epoch_jump" in rejected[0].detail


def test_a_plausible_restart_is_still_a_restart():
    clean = [b for b in two_node_stream() if b.node == "a"]
    core = StreamCore()
    core.process_many(clean[:4])
    epoch = 1_700_000_000_000_000_000  # a wall-clock epoch after a seed one
    core.process_many([EventBatch(node="a", seq=0, epoch=epoch, events=clean[0].events, geometry=clean[0].geometry)])
    assert core.nodes["a"].restarts == 1 and core.nodes["a"].epoch == epoch and not core.rejected


def test_a_batch_whose_application_raises_is_rejected_and_the_other_nodes_go_on(monkeypatch):
    clean = list(two_node_stream())
    core = StreamCore()
    core.process_many(clean[:6])
    mirror = core.nodes["a"].mirror

    def broken(events, state=None):
        raise RuntimeError("allocator layer: double free")

    monkeypatch.setattr(mirror, "apply", broken)
    ticks, _ = core.process_many(clean[6:40])
    assert {t.node for t in ticks} == {"b"}
    assert {r.reason for r in core.rejected} == {"processing_error"}
    assert all(r.batch.node == "a" for r in core.rejected) and "double free" in core.rejected[0].detail
    assert core.counters.batches_failed == len(core.rejected) and not core.nodes["a"].mirror.synced


def test_per_node_state_is_capped_and_idle_nodes_are_forgotten():
    clean = [b for b in two_node_stream() if b.node == "a"]
    core = StreamCore(StreamConfig(max_nodes=3))
    for i in range(10):
        core.process_many([EventBatch(node=f"invented-{i}", seq=0, events=clean[0].events,
                                      geometry=clean[0].geometry)])
    assert sorted(core.nodes) == ["invented-7", "invented-8", "invented-9"]
    assert core.counters.nodes_evicted_cap == 7
    core.process_many([EventBatch(node="invented-7", seq=1, events=clean[1].events)])  # seen again: newest
    core.process_many([EventBatch(node="new", seq=0, events=clean[0].events, geometry=clean[0].geometry)])
    assert sorted(core.nodes) == ["invented-7", "invented-9", "new"]
    assert core.forget("invented-9") and not core.forget("invented-9")
    assert core.counters.nodes_evicted_idle == 1 and "invented-9" not in core.nodes


def test_the_cap_and_the_epoch_bound_come_from_settings():
    from kvguard.config.settings import Settings
    from kvguard.runtime.mapping import stream_config

    s = Settings.load(env={"KVGUARD_STREAMS__MAX_NODES": "7", "KVGUARD_STREAMS__MAX_EPOCH_JUMP": "1000",
                           "KVGUARD_STREAMS__MAX_BATCH_EVENTS": "50"})
    config = stream_config(s)
    assert (config.max_nodes, config.max_epoch_jump, config.limits.max_batch_events) == (7, 1000, 50)
