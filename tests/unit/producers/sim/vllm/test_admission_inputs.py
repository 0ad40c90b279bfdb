"""Per-request admission inputs on the event stream (issue 13): a request asking for prompt logprobs is
flagged on its ARRIVE row (F_PROMPT_LOGPROBS) by the vLLM-faithful engine and by the plugin, and the
stream counts the prompt positions such requests still have to compute."""

from __future__ import annotations

import numpy as np

from kvguard.contracts.events import F_PROMPT_LOGPROBS, EventKind
from kvguard.contracts.units import NS_PER_S
from kvguard.producers.sim.fleet import Fleet
from kvguard.producers.sim.profiles import load_profile
from kvguard.producers.sim.vllm.engine import VllmEngineConfig
from kvguard.producers.sim.workloads import Request
from kvguard.streams.core import StreamConfig, StreamCore
from kvguard.streams.metrics import FEATURE_NAMES, tick_features
from kvguard.streams.mirror import AllocatorMirror

VLLM = "llama3-8b-24gb-vllm"


def test_the_engine_flags_exactly_the_requests_that_ask_for_prompt_logprobs():
    fleet = Fleet(1, load_profile(VLLM), config=VllmEngineConfig(prompt_logprobs_frac=0.3))
    engine = fleet.engines[0]
    for r in range(200):
        engine.submit(Request(r, r * NS_PER_S // 10, 300, 2))
    engine.hold_admissions(0)  # nothing runs: every request stays with its prompt-logprob mark
    engine.advance(30 * NS_PER_S)
    rows = engine.take_events()
    arrive = rows[rows["kind"] == int(EventKind.ARRIVE)]
    flagged = {int(r) for r, f in zip(arrive["req"], arrive["flags"]) if f & F_PROMPT_LOGPROBS}
    assert len(arrive) == 200 and flagged == engine._prompt_logprobs  # what the engine computes logits for
    assert 0.15 < len(flagged) / len(arrive) < 0.45


def test_the_tick_counts_prompt_positions_still_to_compute_for_prompt_logprob_requests():
    fleet = Fleet(1, load_profile(VLLM), config=VllmEngineConfig(prompt_logprobs_frac=1.0))
    engine = fleet.engines[0]
    core = StreamCore(StreamConfig(tick_s=1.0))
    engine.hold_admissions(5000)  # keep the long one waiting
    engine.submit(Request(1, 0, 9000, 2))
    engine.submit(Request(2, 0, 300, 200))
    ticks = []
    for s in range(1, 4):
        fleet.advance(s * NS_PER_S)
        ticks += core.process_many(fleet.take_batches(s * NS_PER_S))[0]
    assert (ticks[-1].logprob_requests_pending, ticks[-1].logprob_prompt_tokens_pending) == (1, 9000)
    features = dict(zip(FEATURE_NAMES, tick_features(ticks[-1])))
    assert features["log_logprob_prompt_tokens_pending"] == np.float32(np.log1p(9000))
    engine.release_admissions()
    for s in range(4, 12):
        fleet.advance(s * NS_PER_S)
        ticks += core.process_many(fleet.take_batches(s * NS_PER_S))[0]
    ticks += core.flush(12 * NS_PER_S)[0]  # the node went quiet: its last ticks
    assert engine.completed == 2 and engine.ooms == 0
    assert (ticks[-1].logprob_requests_pending, ticks[-1].logprob_prompt_tokens_pending) == (0, 0)


def test_the_flags_survive_the_mirrors_checkpoint():
    fleet = Fleet(1, load_profile(VLLM), config=VllmEngineConfig(prompt_logprobs_frac=1.0))
    engine = fleet.engines[0]
    engine.hold_admissions(0)
    engine.submit(Request(7, 0, 400, 2))
    fleet.advance(NS_PER_S)
    batch = fleet.take_batches(NS_PER_S)[0]
    mirror = AllocatorMirror(batch.geometry)
    mirror.apply(batch.events, batch.state)
    back = AllocatorMirror.from_state_arrays(batch.geometry, mirror.state_arrays())
    table = back.request_table()
    assert int(table.arrive_flags[table.req == 7][0]) & F_PROMPT_LOGPROBS
