"""Every tick the core emits is inside its wire contract (issue 28, item 9): ``MetricTick`` with
``kvguard.wire.validate``'s checks, as the exporter and the policy decode it, also while a node is
unsynced after a gap, when the mirror's own fractions leave [0, 1]."""

from __future__ import annotations

import logging

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.contracts import pressure
from kvguard.streams.core import StreamConfig, StreamCore
from kvguard.streams.loader import load_predictor
from kvguard.streams.outputs import output_records
from kvguard.wire.schemas import decode
from tests.unit.streams.streams_refpool import RefPool, batches_of, small_geometry

SHIPPED = load_predictor()


def lossy_stream(seed: int, n_ops: int, n_cuts: int, lost: list[bool], snapshot_every: int):
    """One node's batches with some lost (seq gaps, the node unsynced until a snapshot with state)."""
    pool = RefPool(small_geometry(64), seed=seed)
    states = {}
    for i in range(n_ops):
        pool.random_op(time_step_ns=100_000_000)
        if snapshot_every and i % snapshot_every == snapshot_every - 1:
            states[len(pool.rows)] = pool.snapshot()
    events = pool.events()
    cuts = np.linspace(0, len(events), n_cuts + 2, dtype=int)[1:-1].tolist()
    batches = batches_of(events, "n", pool.g, cuts, states=states)
    return [b for i, b in enumerate(batches) if i == 0 or not lost[i % len(lost)]]


def emitted(batches, predictor=None, chunk: int = 1):
    core = StreamCore(StreamConfig(window_ticks=predictor.window_ticks) if predictor else StreamConfig(), predictor=predictor)
    ticks = []
    for i in range(0, len(batches), chunk):
        ticks += core.process_many(batches[i:i + chunk])[0]
    return ticks + core.finish()[0]


def assert_inside_the_contract(ticks) -> None:
    for record in output_records(ticks, []):  # the bytes the worker publishes, decoded as consumers do
        tick = decode("metrics", record.value, record.headers).to_tick()
        assert 0.0 <= tick.u_kv <= 1.0 and 0.0 <= tick.f_ext <= 1.0 and 0.0 <= tick.f_int <= 1.0


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n_ops=st.integers(200, 1500), n_cuts=st.integers(3, 60),
       lost=st.lists(st.booleans(), min_size=1, max_size=8), snapshot_every=st.sampled_from([0, 97, 400]),
       chunk=st.sampled_from([1, 5]), scored=st.booleans())
def test_every_emitted_tick_validates_against_the_wire_model_through_gaps_and_unsynced_nodes(
        seed, n_ops, n_cuts, lost, snapshot_every, chunk, scored):
    logging.disable(logging.WARNING)  # every lost batch logs its gap
    try:
        ticks = emitted(lossy_stream(seed, n_ops, n_cuts, lost, snapshot_every), SHIPPED if scored else None, chunk)
    finally:
        logging.disable(logging.NOTSET)
    assert_inside_the_contract(ticks)


def test_an_unsynced_ticks_fractions_are_clamped_and_its_psi_follows_them():
    """A gap that leaves the mirror with more stored tokens than live slots: F_int, worked out from
    the tick's own counts, is above 1; the tick carries 1 and a Ψ of the fractions it carries."""
    for seed in range(200):
        batches = lossy_stream(seed, 1500, 40, [False, True, False, False, False], 0)
        for tick in emitted(batches):
            raw = pressure.f_int(tick.tokens_stored, tick.live_units, batches[0].geometry.unit_tokens)
            if raw > 1.0:
                assert not tick.synced and tick.f_int == 1.0
                assert tick.psi == pressure.psi(tick.live_units, tick.workspace_units, tick.dynamic_units,
                                                tick.f_ext, tick.f_int, tick.reserved_frac)
                assert_inside_the_contract([tick])
                return
    raise AssertionError("no tick with F_int above 1 in 200 lossy streams")
