"""Event time going backwards (issue 28, item 8): inside a batch or across batches, an event more
than ``streams.max_ts_backwards_s`` (default: one tick) behind its node's clock is still applied
in order — the mirror's state is a fold over every batch — but at the clock's time, and the tick
that holds it says so in ``late_events``. Nothing is dropped, the node stays synced."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kvguard.config.settings import ConfigError, Settings
from kvguard.contracts.units import NS_PER_S
from kvguard.runtime.mapping import stream_config
from kvguard.streams.core import NodeState, StreamConfig, StreamConfigError, StreamCore
from kvguard.streams.outputs import encode_tick
from kvguard.wire.schemas import decode
from tests.unit.streams.streams_refpool import batches_of
from tests.unit.streams.test_stream_core import drive


def clean_batches():
    pool, _ = drive(seed=6, seconds=300)
    events = pool.events()
    return batches_of(events, "n", pool.g, list(range(60, len(events), 60)))


def run(batches, config=None):
    core = StreamCore(config or StreamConfig())
    ticks = [t for b in batches for t in core.process(b)[0]] + core.finish()[0]
    return core, ticks


def shifted(batch, rows, by_ns):
    """The batch with the event times of ``rows`` moved ``by_ns`` back."""
    events = batch.events.copy()
    events["ts_ns"][rows] -= by_ns
    return replace(batch, events=events)


def same_mirror(a: StreamCore, b: StreamCore) -> bool:
    """The same allocator state (levels, runs, each request's pages), event times aside."""
    x, y = a.nodes["n"].mirror, b.nodes["n"].mirror
    tx, ty = x.request_table(), y.request_table()
    return (x.metrics() == y.metrics() and all(np.array_equal(p, q) for p, q in zip(x.free_runs(), y.free_runs()))
            and all(np.array_equal(getattr(tx, f), getattr(ty, f)) for f in ("req", "pages", "units", "shared_units")))


def test_a_clean_stream_has_no_late_events():
    _, ticks = run(clean_batches())
    assert ticks and all(t.late_events == 0 for t in ticks)


def test_events_running_backwards_inside_a_batch_are_applied_in_order_and_counted_late():
    batches = clean_batches()
    clean_core, clean = run(batches)
    k = len(batches) // 2
    late_rows = [10, 11, 40]
    batches[k] = shifted(batches[k], late_rows, 25 * NS_PER_S)  # two and a half ticks back
    core, ticks = run(batches)
    assert not core.rejected and all(t.synced for t in ticks)
    assert sum(t.late_events for t in ticks) == len(late_rows) == core.nodes["n"].late_events
    assert [t.ts_ns for t in ticks] == [t.ts_ns for t in clean]  # the clock did not go back
    assert same_mirror(core, clean_core)  # every event applied, in order


def test_a_batch_behind_the_nodes_clock_is_applied_and_the_tick_it_lands_in_says_so():
    batches = clean_batches()
    clean_core, clean = run(batches)
    k = len(batches) // 2
    batches[k] = shifted(batches[k], slice(None), 30 * NS_PER_S)  # a producer clock stepped back 30 s
    core, ticks = run(batches)
    late = [t for t in ticks if t.late_events]
    assert not core.rejected and late and sum(t.late_events for t in late) == len(batches[k].events)
    assert same_mirror(core, clean_core) and [t.ts_ns for t in ticks] == [t.ts_ns for t in clean]
    # the mark travels on the wire: the policy and the exporter read it from kvguard.metrics
    assert decode("metrics", encode_tick(late[0])).to_tick().late_events == late[0].late_events


def test_going_back_within_the_tolerance_is_not_late():
    batches = clean_batches()
    k = len(batches) // 2
    batches[k] = shifted(batches[k], slice(None), 30 * NS_PER_S)
    _, ticks = run(batches, StreamConfig(max_ts_backwards_s=60.0))
    assert all(t.late_events == 0 for t in ticks)
    _, ticks = run(batches, StreamConfig(max_ts_backwards_s=0.0))
    assert sum(t.late_events for t in ticks) >= len(batches[k].events)


def test_the_late_count_of_an_open_interval_survives_the_checkpoint():
    batches = clean_batches()
    k = len(batches) // 2
    batches[k] = shifted(batches[k], [-1], 25 * NS_PER_S)  # its last event: no boundary after it in the batch
    _, straight = run(batches)
    core = StreamCore()
    resumed = [t for b in batches[:k + 1] for t in core.process(b)[0]]
    assert core.nodes["n"].late_since_tick == 1  # the late event's tick is not out yet
    core.nodes["n"] = NodeState.from_bytes(core.nodes["n"].to_bytes(), core.config)
    resumed += [t for b in batches[k + 1:] for t in core.process(b)[0]] + core.finish()[0]
    assert [t.to_dict() for t in resumed] == [t.to_dict() for t in straight]


def test_the_tolerance_defaults_to_one_tick_comes_from_settings_and_is_checked():
    assert StreamConfig(tick_s=5.0).max_ts_backwards_ns == 5 * NS_PER_S
    s = Settings.load(env={"KVGUARD_STREAMS__MAX_TS_BACKWARDS_S": "45"})
    assert stream_config(s).max_ts_backwards_ns == 45 * NS_PER_S
    assert stream_config(Settings()).max_ts_backwards_s is None
    with pytest.raises(StreamConfigError) as err:
        StreamConfig(max_ts_backwards_s=-1.0)
    assert err.value.field_name == "max_ts_backwards_s"
    with pytest.raises(ConfigError, match="max_ts_backwards_s"):
        Settings.load(env={"KVGUARD_STREAMS__MAX_TS_BACKWARDS_S": "-1"})
