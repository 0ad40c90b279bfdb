"""The SGLang-faithful shadow engine: its start-up budget, retraction under KV pressure, the mirror
following its pages, the catalogue and fleet running it (the scheduler's fidelity is the conformance
test's, tests/integration/test_sglang_conformance.py)."""

from __future__ import annotations

import pytest

from kvguard.contracts.events import EventKind, Outcome
from kvguard.contracts.units import NS_PER_S
from kvguard.producers.sim.fleet import Fleet
from kvguard.producers.sim.profiles import ProfileError, load_profile, profile_from_dict
from kvguard.producers.sim.registry import make_engine
from kvguard.producers.sim.sglang.engine import SglangEngine
from kvguard.producers.sim.sglang.memory import cell_bytes, size_pool
from kvguard.producers.sim.workloads import Request, load_workload
from kvguard.producers.vllm.step_memory import ModelShape
from kvguard.streams.mirror import AllocatorMirror

MIB = 1 << 20
HF = {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
      "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 32000, "max_position_embeddings": 8192,
      "torch_dtype": "bfloat16"}


def tiny_sglang_profile(*, total_mib: int = 64, **section):
    d = {"engine": "sglang", "total_bytes": total_mib * MIB, "weights_bytes": 16 * MIB, "context_bytes": 8 * MIB,
         "step_base_s": 0.01, "step_prefill_token_s": 1e-5, "step_decode_seq_s": 1e-4,
         "sglang": {"hf_config": HF, "page_size": 4, "mem_fraction_static": 0.7, "chunked_prefill_size": 1024,
                    "max_running_requests": 32, "context_length": 8192} | section}
    return profile_from_dict("tiny-sglang", d)


def test_the_pool_is_sized_from_mem_fraction_static_as_sglang_sizes_it():
    shape = ModelShape.from_hf_config(HF)
    assert cell_bytes(shape) == 2 * (64 + 64) * 2 * 2  # kv heads x (head_dim + v_head_dim) x layers x bf16
    ledger = size_pool(shape, total_bytes=64 * MIB, weights_bytes=16 * MIB, context_bytes=8 * MIB, page_size=4,
                       context_len=8192, mem_fraction_static=0.7)
    pre = 56 * MIB
    rest = pre - 16 * MIB - int(pre * 0.3)
    assert ledger.max_total_num_tokens == rest // 1024 // 4 * 4 and ledger.slack_bytes == int(pre * 0.3)
    assert ledger.chunked_prefill_size == 2048  # SGLang's default under 20 GiB
    # max_running_requests: derived from the pool when not given (at least 2048, at most half the pool)
    assert ledger.max_running_requests == min(max(min(int(ledger.max_total_num_tokens / 8192 * 512), 4096), 2048),
                                              ledger.max_total_num_tokens // 2)


def test_sglangs_default_mem_fraction_static_on_a_24_gb_gpu():
    p = load_profile("llama3-8b-24gb-sglang")
    assert p.engine == "sglang" and p.memory.mem_fraction_static == 0.72
    assert p.memory.chunked_prefill_size == 4096 and p.sglang.page_size == 1
    assert p.geometry.dynamic_units == p.memory.max_total_num_tokens > 10_000


def test_weights_that_leave_no_room_are_refused_at_start_up_with_the_field():
    with pytest.raises(ProfileError, match="mem_fraction_static.*above 0\\.28"):
        tiny_sglang_profile(mem_fraction_static=0.2)


@pytest.mark.parametrize("field, value", [("page_size", 0), ("chunked_prefill_size", -5), ("mem_fraction_static", 1.5)])
def test_bad_settings_are_named(field, value):
    with pytest.raises(ProfileError, match=field):
        tiny_sglang_profile(**{field: value})


def _long_outputs(n: int, spacing_s: float = 0.02) -> list[Request]:
    return [Request(i + 1, int(i * spacing_s * NS_PER_S), 300 + 37 * (i % 7), 1500, 5) for i in range(n)]


def test_kv_pressure_retracts_decode_requests_and_every_request_still_completes():
    profile = tiny_sglang_profile(max_total_tokens=6000)
    engine = make_engine(profile, "n/gpu0")
    assert isinstance(engine, SglangEngine)
    for r in _long_outputs(40):
        engine.submit(r)
    engine.advance(600 * NS_PER_S)
    rows = engine.take_events()
    preempts = rows[rows["kind"] == int(EventKind.PREEMPT)]
    finish = rows[rows["kind"] == int(EventKind.FINISH)]
    s = engine.summary()
    assert s.preemptions == engine.scheduler.num_retracted == len(preempts) > 0
    assert s.completed == 40 and s.ooms == 0 and s.failed == 0
    assert set(finish["flags"].tolist()) == {int(Outcome.COMPLETED)}
    # a retracted request goes back to the queue and is admitted again, its prompt found in the radix cache
    again = rows[(rows["kind"] == int(EventKind.ADMIT)) & (rows["req"] == int(preempts["req"][0]))]
    assert len(again) >= 2


def test_the_mirror_follows_the_pages_at_every_snapshot():
    profile = tiny_sglang_profile(max_total_tokens=8000)
    fleet = Fleet(2, profile, seed=3, snapshot_every_s=5.0)
    fleet.submit_workload(load_workload("rag", window=60, seed=3, rate_scale=3.0))
    mirrors = {n: AllocatorMirror(profile.geometry) for n in fleet.nodes}
    engines = {e.node: e for e in fleet.engines}
    checked = 0
    for t in range(1, 120):
        fleet.advance(t * NS_PER_S)
        for b in fleet.take_batches(t * NS_PER_S):
            mirrors[b.node].apply(b.events, b.state)
            if b.state is not None:
                m, c = mirrors[b.node].metrics(), engines[b.node].pool.counts()
                assert (m.live_units, m.cached_units, m.free_units) == (
                    c["live_units"], c["cached_units"], c["free_units"]), t
                checked += 1
    assert checked > 20
    assert all(m.drift_count == 0 and m.synced for m in mirrors.values())
    kinds = sum((m.kind_counts for m in mirrors.values()), start=0)
    assert kinds[EventKind.SHARE] > 0 and kinds[EventKind.RECLAIM] > 0  # prefix hits and tree evictions


def test_prompts_sglang_refuses_are_rejected_at_arrival_and_counted():
    engine = make_engine(tiny_sglang_profile(max_total_tokens=2000), "n/gpu0")
    engine.submit(Request(1, 0, 1995, 10, 5))  # max_req_input_len = min(8191, 1999) - 5 = 1994
    engine.submit(Request(2, 0, 100, 10, 5))
    engine.advance(10 * NS_PER_S)
    assert engine.rejected == 1 and engine.rejected_by_reason == {"prompt_too_long": 1} and engine.completed == 1


def test_the_fleet_runs_the_bundled_sglang_profile():
    fleet = Fleet(1, load_profile("llama3-8b-24gb-sglang"), seed=0)
    fleet.submit_workload(load_workload("azure-conv", window=60, rate_scale=2.0))
    for _ in fleet.steps(70 * NS_PER_S, step_ns=10 * NS_PER_S, drain=True, drain_cap_ns=400 * NS_PER_S):
        pass
    s = fleet.summary()
    assert s.requests > 50 and s.completed == s.requests and s.ooms == 0
