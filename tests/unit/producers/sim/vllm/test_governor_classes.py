"""The step governor in the shadow engine (producers.sim.vllm.governed): each STEP class's run built to OOM
(test_failure_classes, test_logprobs_guard) completes with the governor on, with its steps shrunk and
published as GOVERN rows naming the class; TREND classes stay (the governor does not claim them)."""

from __future__ import annotations

import numpy as np
import pytest

from kvguard.contracts.events import EventKind, OomCause, Outcome
from kvguard.contracts.units import NS_PER_S
from kvguard.producers.sim.engine_args import EngineArgs
from kvguard.producers.sim.profiles import EngineKnobs, load_profile
from kvguard.producers.sim.vllm.engine import VllmEngine, VllmEngineConfig
from kvguard.producers.sim.vllm.governed import REJECTED_NEVER_FITS
from kvguard.producers.sim.workloads import Request
from kvguard.producers.vllm.governor import F_GOV_REFUSED, F_GOV_TOKENS
from kvguard.runtime.simulation import run_simulation
from tests.unit.producers.sim.vllm.test_failure_classes import C3_TRAFFIC, LLAMA, QWEN06, QWEN8, bench


def test_long_context_prefills_fit_with_the_governor():
    args = EngineArgs(LLAMA, gpu="h100-80gb", gpu_memory_utilization=0.97, attention_lse="max_seq_len")
    out = run_simulation("random", engine_args=args, long_context_frac=0.02, long_context_len=100_000,
                         logprobs_guard=True, **C3_TRAFFIC)
    assert out["ooms"] == 0 and out["failed"] == 0  # 1 allocator:long_context without it (test_failure_classes)
    gov = out["governor"]
    assert gov["by_cause"].get("long_context", 0) + gov["cache_releases"] > 0


def test_speculative_verification_fits_with_the_governor():
    traffic = bench(1200, 200, 400, 0.2)
    out = run_simulation("random", bench=traffic, logprobs_guard=True, engine_args=EngineArgs(
        QWEN8, gpu="h100-80gb", gpu_memory_utilization=0.97, speculative_model_config=QWEN06, num_speculative_tokens=7))
    assert out["ooms"] == 0 and out["completed"] == 1200  # 1 allocator:spec_decode without it
    assert out["governor"]["steps_governed"] + out["governor"]["cache_releases"] > 0


def v1(util: float, governor: bool, **config) -> VllmEngine:
    return VllmEngine(load_profile("llama3-8b-24gb-vllm", knobs=EngineKnobs(gpu_memory_utilization=util,
                                                                            model_runner="v1")),
                      config=VllmEngineConfig(governor=governor, **config))


def test_shrunk_steps_are_published_as_govern_rows_and_no_work_is_dropped():
    e = v1(0.97, True, prompt_logprobs_frac=1.0)
    for i in range(3):
        e.submit(Request(i, i * NS_PER_S // 10, 9000, 8))
    e.advance(60 * NS_PER_S)
    rows = e.take_events()
    gov = rows[rows["kind"] == int(EventKind.GOVERN)]
    assert e.ooms == 0 and e.completed == 3 and len(gov) == e.logprobs_guard_steps > 0
    assert set(gov["cls"].tolist()) == {int(OomCause.PROMPT_LOGPROBS)}
    assert np.all(gov["flags"] & F_GOV_TOKENS) and np.all(gov["tokens"] + gov["aux"] == e.profile.max_batched_tokens)
    assert np.all(gov["size"] > gov["offset"])  # shrunk because the unshrunk step's peak exceeded the headroom


def test_a_request_that_can_never_fit_is_refused_at_arrival_with_its_need():
    e = v1(0.95, True, governor_margin_bytes=(1 << 40))  # no worker could give a margin this large
    e.submit(Request(1, 0, 100, 4))
    e.advance(5 * NS_PER_S)
    rows = e.take_events()
    fin = rows[rows["kind"] == int(EventKind.FINISH)]
    assert e.rejected_by_reason == {REJECTED_NEVER_FITS: 1} and e.completed == 0
    assert fin["flags"].tolist() == [int(Outcome.NEVER_FITS)]
    gov = rows[rows["kind"] == int(EventKind.GOVERN)]
    assert gov["flags"].tolist() == [F_GOV_REFUSED] and gov["req"].tolist() == [1] and gov["size"][0] > 0
    assert "never fit" in e.governor.refusals[0] and "GiB" in e.governor.refusals[0]
    fine = v1(0.95, True)
    fine.submit(Request(1, 0, 100, 4))
    fine.advance(5 * NS_PER_S)
    assert fine.completed == 1 and fine.governor.governor.refused == 0


@pytest.mark.parametrize("util", [0.95, 0.97])
def test_eval_traffic_on_the_v1_runner_ooms_without_and_not_with_the_governor(util):
    from kvguard.producers.sim.workloads import load_workload, with_long_context

    results = {}
    for g in (False, True):
        e = v1(util, g, prompt_logprobs_frac=0.05)
        wl = with_long_context(load_workload("azure-conv", rate_scale=2, window=40, seed=0), 0.02, 16000, 0)
        for r in wl.requests:
            e.submit(r)
        e.advance(60 * NS_PER_S)
        results[g] = e
    assert results[False].ooms_by_cause.get("allocator:prompt_logprobs", 0) >= 1
    assert results[True].ooms == 0 and results[True].failed == 0
