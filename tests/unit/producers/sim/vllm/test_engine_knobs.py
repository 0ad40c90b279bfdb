"""Engine knobs over a vLLM profile (re-measured start-up), prompt-logprobs OOMs, and the SLO fields
that count every request (issues 11 and 12)."""

from __future__ import annotations

import pytest

from kvguard.contracts.units import NS_PER_S
from kvguard.producers.sim.profiles import EngineKnobs, ProfileError, load_profile
from kvguard.producers.sim.run import SloTargets, slo_fields

VLLM = "llama3-8b-24gb-vllm"


def test_knobs_re_measure_the_kv_cache_as_vllm_does():
    base = load_profile(VLLM)
    higher = load_profile(VLLM, knobs=EngineKnobs(gpu_memory_utilization=0.95))
    # 3 % more of 24 GiB than vLLM 0.33's default 0.92, all of it KV: 0.72 GiB / (16 tokens x 128 KiB) = 369 blocks
    assert higher.memory.num_gpu_blocks - base.memory.num_gpu_blocks == pytest.approx(369, abs=2)
    assert higher.name == f"{VLLM}@util0.95"
    smaller = load_profile(VLLM, knobs=EngineKnobs(max_num_batched_tokens=1024))
    assert smaller.max_batched_tokens == 1024
    assert smaller.memory.profile_peak_bytes < base.memory.profile_peak_bytes  # a smaller profiling step
    expandable = load_profile(VLLM, knobs=EngineKnobs(allocator_conf="expandable_segments:True"))
    assert expandable.vllm.allocator_conf == "expandable_segments:True"
    assert load_profile(VLLM, knobs=EngineKnobs(watermark=0.05)).vllm.watermark == 0.05
    assert load_profile(VLLM, knobs=EngineKnobs()) == base


def test_bad_knobs_name_the_field():
    with pytest.raises(ProfileError, match="'gpu_memory_utilization'"):
        load_profile(VLLM, knobs=EngineKnobs(gpu_memory_utilization=1.5))
    with pytest.raises(ProfileError, match="'engine'"):
        load_profile("llama3-8b-24gb", knobs=EngineKnobs(watermark=0.1))  # the seed engine has no such knob
    with pytest.raises(ProfileError, match="'vllm'"):
        load_profile(VLLM, knobs=EngineKnobs(allocator_conf="expandable_segments:Maybe"))


def test_slo_fields_count_every_request():
    s, ms = NS_PER_S, NS_PER_S // 1000
    served = [(1 * s, 50 * ms, 10), (3 * s, 50 * ms, 10), (1 * s, 150 * ms, 10)]  # met, slow TTFT, slow TPOT
    out = slo_fields(served, requests=4, sim_s=10.0, slo=SloTargets(2.0, 0.1))  # one more request failed
    assert out["slo_met"] == 1 and out["slo_attainment"] == 0.25
    assert out["slo_goodput_tokens_per_s"] == 1.0
    assert out["ttft_p99_all_s"] is None  # the p99 of 4 requests is the failed one: a miss
    many = [(k * ms, 0.0, 1) for k in range(1, 201)]
    out = slo_fields(many, requests=201, sim_s=1.0)  # 200 served, 1 miss: the p99 (rank 199) is served
    assert out["ttft_p99_all_s"] == pytest.approx(0.199)
    assert slo_fields([], requests=0, sim_s=0.0)["slo_attainment"] is None


def test_prompt_logprobs_beyond_the_profiled_peak_oom_in_the_allocator_and_expandable_segments_helps():
    """vllm#5907 / #5067: vLLM's profiling run has no prompt logprobs, so at a tight
    gpu_memory_utilization their logits (tokens x vocab x 6 B) find no room; the OOMs are the
    allocator's, each with its cause (the prompt-logprob class), and never a KV shortage. The V1 model
    runner (``VLLM_USE_V2_MODEL_RUNNER=0``): it makes a request's whole chunk of prompt logits at once."""
    from kvguard.runtime.simulation import run_simulation

    runs = {conf: run_simulation("azure-conv", gpus=2, duration_s=300.0, rate_scale=2.0, profile_name=VLLM,
                                 knobs=EngineKnobs(gpu_memory_utilization=0.95, allocator_conf=conf,
                                                   model_runner="v1"),
                                 prompt_logprobs_frac=0.05, drain=False)
            for conf in ("", "expandable_segments:True")}
    plain = runs[""]
    assert plain["ooms"] > 0 and plain["failed"] > 0
    assert sum(plain["ooms_by_cause"].values()) == plain["ooms"]
    assert set(plain["ooms_by_cause"]) <= {"allocator:peak", "allocator:fragmentation", "allocator:prompt_logprobs"}
    assert plain["slo_attainment"] < 1.0
    assert runs["expandable_segments:True"]["ooms"] < plain["ooms"]
    default = run_simulation("azure-conv", gpus=2, duration_s=300.0, rate_scale=2.0, profile_name=VLLM,
                             prompt_logprobs_frac=0.05, drain=False, knobs=EngineKnobs(model_runner="v1",
                                                                                       gpu_memory_utilization=0.9))
    assert default["ooms"] == 0  # 0.9 leaves room for them here
    v2 = run_simulation("azure-conv", gpus=2, duration_s=300.0, rate_scale=2.0, profile_name=VLLM,
                        knobs=EngineKnobs(gpu_memory_utilization=0.95), prompt_logprobs_frac=0.05, drain=False)
    assert v2["ooms"] < plain["ooms"]  # 0.33's runner chunks prompt logprobs (1024 positions at a time)


def test_an_allocator_oom_restart_keeps_the_stream_mirror_of_the_allocator_exact():
    """The dead worker's allocator rows (its blocks and segments released) come before the RESET row:
    a mirror resets on RESET, so rows after it would free blocks it no longer holds (the batch was
    rejected and the node marked unsynced)."""
    from kvguard.producers.sim.fleet import Fleet
    from kvguard.producers.sim.vllm.engine import VllmEngineConfig
    from kvguard.producers.sim.workloads import load_workload
    from kvguard.streams.core import StreamCore

    fleet = Fleet(1, load_profile(VLLM, knobs=EngineKnobs(gpu_memory_utilization=0.95, model_runner="v1")),
                  config=VllmEngineConfig(prompt_logprobs_frac=0.05))
    fleet.submit_workload(load_workload("mixed", rate_scale=2.25, window=120))
    core = StreamCore()
    engine = fleet.engines[0]
    for t in range(10, 200, 10):
        fleet.advance(t * NS_PER_S)
        core.process_many(fleet.take_batches(t * NS_PER_S))
        if engine.memory is not None:  # the worker is up: the mirror holds what the twin reserves
            layer = core.nodes[engine.node].mirror.allocator.metrics()
            assert layer.reserved_bytes == engine.memory.stats()["reserved_bytes"]
    assert engine.ooms > 0
    assert core.counters.batches_failed == 0
