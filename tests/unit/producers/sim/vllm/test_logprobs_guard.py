"""kvguard's node-side logprob guard (issue 12: an admission-time rule for prompt-logprob requests).

A request asking for prompt logprobs allocates a logits row and a float32 log-softmax row per prompt
position it computes, outside vLLM's profiled peak (vllm#5067, #5907); on a GPU run near its memory
limit its first chunk can be a CUDA OOM. The guard caps the step's token budget, only while such a
request prefills, so those rows fit the allocator's headroom (vLLM's own workaround, #5424)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kvguard.cli.app import app
from kvguard.contracts.units import NS_PER_S
from kvguard.producers.sim.profiles import EngineKnobs, load_profile
from kvguard.producers.sim.vllm.engine import VllmEngine, VllmEngineConfig
from kvguard.producers.sim.workloads import Request
from kvguard.producers.vllm.step_memory import prompt_logprobs_bytes_per_token

VLLM = "llama3-8b-24gb-vllm"


def engine(util: float, *, guard: bool, frac: float = 1.0) -> VllmEngine:
    """The V1 model runner (``VLLM_USE_V2_MODEL_RUNNER=0``): its ``_get_prompt_logprobs_dict`` makes a
    request's whole chunk of logits at once, the OOM the guard prevents; 0.33's default runner computes
    prompt logprobs in 1024-position chunks (``model_runner_v2``)."""
    return VllmEngine(load_profile(VLLM, knobs=EngineKnobs(gpu_memory_utilization=util, model_runner="v1")),
                      config=VllmEngineConfig(prompt_logprobs_frac=frac, logprobs_guard=guard))


def test_a_long_prompt_logprob_request_ooms_near_the_limit_and_the_guard_lets_it_complete():
    bare, guarded = engine(0.97, guard=False), engine(0.97, guard=True)
    for e in (bare, guarded):
        e.submit(Request(1, 0, 12000, 4))
        e.advance(30 * NS_PER_S)
    assert bare.ooms == 1 and bare.failed == 1
    assert guarded.ooms == 0 and guarded.completed == 1 and guarded.logprobs_guard_steps > 0


def test_each_guarded_step_keeps_its_planned_peak_within_the_headroom():
    """The guard is now the step governor's prompt-logprob case: every step's planned non-KV peak (the
    plan the allocator twin replays) fits what the allocator could give, less the margin."""
    e = engine(0.97, guard=True)
    margin = e.config.governor_margin_bytes
    seen = []
    real_schedule = e.scheduler.schedule

    def schedule():
        stats = e.memory.stats()
        headroom = stats["device_free_bytes"] + stats["reserved_bytes"] - stats["allocated_bytes"]
        out = real_schedule()
        tokens = sum(out.num_scheduled_tokens.values())
        batch = e._prompt_logprobs_batch(out)
        seen.append((tokens, e.memory.step_plan(tokens, len(out.num_scheduled_tokens), batch).peak_bytes, headroom))
        return out

    e.scheduler.schedule = schedule
    e.submit(Request(1, 0, 12000, 4))
    e.advance(30 * NS_PER_S)
    assert e.completed == 1 and len(seen) > 6  # chunked finer than the 2048-token budget
    assert all(peak <= headroom - margin for tokens, peak, headroom in seen if tokens > 1)
    assert max(t for t, _, _ in seen) < e.profile.max_batched_tokens
    assert e.scheduler.max_num_scheduled_tokens == e.profile.max_batched_tokens  # restored after every step


def test_without_prompt_logprob_traffic_the_guard_changes_nothing():
    bare, guarded = engine(0.97, guard=False, frac=0.0), engine(0.97, guard=True, frac=0.0)
    for e in (bare, guarded):
        for r in range(6):
            e.submit(Request(r, r * NS_PER_S // 2, 3000, 50))
        e.advance(60 * NS_PER_S)
    assert guarded.logprobs_guard_steps == 0
    assert (guarded.steps, guarded.completed, guarded.summary().ttft_p99_s) == \
        (bare.steps, bare.completed, bare.summary().ttft_p99_s)


def test_simulate_takes_the_guard_on_vllm_profiles_and_refuses_it_on_the_seed_engine():
    args = ["simulate", "-w", "mixed", "--duration", "60s", "--gpu-memory-utilization", "0.97",
            "--prompt-logprobs-frac", "0.2", "--logprobs-guard", "--model-runner", "v1", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    import json

    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["logprobs_guard"] is True and out["logprobs_guard_steps"] > 0
    seed = CliRunner().invoke(app, ["simulate", "-w", "mixed", "--duration", "60s", "--profile", "llama3-8b-24gb",
                                    "--logprobs-guard"])
    assert seed.exit_code == 2 and "--logprobs-guard" in seed.output


@pytest.mark.parametrize("util", [0.9, 0.95])
def test_the_per_token_cost_is_what_the_step_plan_allocates(util):
    from kvguard.producers.vllm.step_memory import Batch, step_plan_for

    e = engine(util, guard=False)
    shape = e.spec.shape
    base = step_plan_for(shape, Batch((512,), (512,), sampling=e.spec.sampling, prompt_lens=(512,)))
    with_lp = step_plan_for(shape, Batch((512,), (512,), sampling=e.spec.sampling, prompt_lens=(512,),
                                         prompt_logprobs_tokens=(512,)))
    extra = with_lp.peak_bytes - base.peak_bytes
    assert 0 < extra <= 512 * prompt_logprobs_bytes_per_token(shape)
