"""The step governor's rows downstream: the mirror counts GOVERN rows and never-fit refusals, the tick
carries them per interval, the exporter exposes them as counters."""

from __future__ import annotations

from types import SimpleNamespace

from kvguard.contracts.units import NS_PER_S
from kvguard.ops.exporter import TICK_COUNTERS, tick_counts
from kvguard.producers.sim.profiles import EngineKnobs, load_profile
from kvguard.producers.sim.vllm.engine import VllmEngine, VllmEngineConfig
from kvguard.producers.sim.workloads import Request
from kvguard.streams.mirror import AllocatorMirror
from kvguard.streams.tick_builder import Counts


def engine(**config) -> VllmEngine:
    return VllmEngine(load_profile("llama3-8b-24gb-vllm", knobs=EngineKnobs(gpu_memory_utilization=0.97,
                                                                            model_runner="v1")),
                      config=VllmEngineConfig(governor=True, **config))


def mirrored(e: VllmEngine) -> AllocatorMirror:
    m = AllocatorMirror(e.profile.geometry)
    m.apply(e.take_events())
    return m


def test_the_mirror_counts_shrunk_steps_and_refusals_separately():
    e = engine(prompt_logprobs_frac=1.0)
    e.submit(Request(1, 0, 9000, 4))
    e.advance(30 * NS_PER_S)
    c = Counts.of_mirror(mirrored(e))
    assert c.governed == e.logprobs_guard_steps > 0 and c.never_fits == 0
    refusing = engine(governor_margin_bytes=1 << 40)
    for i in range(3):
        refusing.submit(Request(i, 0, 100, 4))
    refusing.advance(5 * NS_PER_S)
    m = mirrored(refusing)
    c = Counts.of_mirror(m)
    assert c.never_fits == 3 == c.governed
    restored = AllocatorMirror.from_state_arrays(refusing.profile.geometry, m.state_arrays())
    assert restored.never_fits_total == 3  # kept across a checkpoint


def test_the_exporter_has_a_counter_for_each():
    assert TICK_COUNTERS["kvguard_requests_never_fit_total"][0] == "never_fits"
    tick = SimpleNamespace(tick_s=1.0, node="n", ts_ns=0, governed=7, never_fits=2)
    counts = tick_counts(tick)
    assert counts["kvguard_governor_decisions_total"] == 7.0 and counts["kvguard_requests_never_fit_total"] == 2.0
