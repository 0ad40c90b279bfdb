"""A short, deterministic vLLM-faithful event log with what breaks a stream core: allocator OOMs,
GPUs down while their engine restarts, a producer restart (a new epoch whose clock starts over) and
a seq gap (the node unsynced until its next snapshot with state).

Prompt logprobs on 30 % of the requests at ``--gpu-memory-utilization 0.95`` make the sampler's
logits outgrow what vLLM's profiling run left on the V1 model runner (issue 27's run, compressed;
Model Runner V2 computes them 1,024 positions at a time): each GPU meets its
first allocator OOM within the first minute."""

from __future__ import annotations

from kvguard.contracts.events import EventBatch, EventKind
from kvguard.contracts.units import NS_PER_S

GPUS = 2
SECONDS = 60
STEP_S = 10


def vllm_run(seed: int, *, seconds: int = SECONDS, gpus: int = GPUS) -> list[EventBatch]:
    """One producer run of the default (vLLM-faithful) engine; its epoch is ``seed``."""
    from kvguard.producers.sim.fleet import Fleet
    from kvguard.producers.sim.profiles import EngineKnobs, load_profile, prompt_cap_tokens
    from kvguard.producers.sim.vllm.engine import VllmEngineConfig
    from kvguard.producers.sim.workloads import load_workload

    profile = load_profile(None, knobs=EngineKnobs(gpu_memory_utilization=0.95, model_runner="v1"))
    fleet = Fleet(gpus, profile, seed=seed, config=VllmEngineConfig(prompt_logprobs_frac=0.3))
    fleet.submit_workload(load_workload("azure-conv", window=seconds, seed=seed,
                                        max_prompt_tokens=prompt_cap_tokens(profile)))
    batches: list[EventBatch] = []
    for _, step in fleet.steps(seconds * NS_PER_S, step_ns=STEP_S * NS_PER_S):
        batches.extend(step)
    return batches


def vllm_oom_log() -> list[EventBatch]:
    """Run 0, then run 1 of the same nodes (a producer restart), with one batch of the second
    run's last node missing (a seq gap)."""
    first, second = vllm_run(0), vllm_run(1)
    last_node = second[-1].node
    mine = [b for b in second if b.node == last_node]
    missing = mine[len(mine) // 2]
    return first + [b for b in second if b is not missing]


def ooms(batches: list[EventBatch]) -> int:
    return sum(int((b.events["kind"] == int(EventKind.OOM)).sum()) for b in batches)
