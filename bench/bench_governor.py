"""The step governor's per-step cost at 256 running sequences (target <= 50 us per step), on CPU.

Prints one JSON object:

- ``shadow_engine``: ``SimGovernor.before_schedule`` on the vLLM-faithful engine (``llama3-8b-24gb-vllm``
  at vLLM 0.33's defaults: Model Runner V2, 0.92) with 256 decoding requests: the candidates read from the scheduler, the headroom from
  the allocator twin, the decision (cached plan lookups); ``cold`` is the first call (plans computed),
  ``fast_path`` every later call of a step that fits, ``prompt_logprob_waiting`` a step with a prompt-logprob request
  prefilling (the bisection, then its cached decision);
- ``plugin``: ``VllmActions.before_schedule`` + ``after_schedule`` + ``step_started`` + ``step_finished``
  (the governor and its calibration) on vLLM 0.33's real v1 ``Scheduler`` (CPU, the conformance rig's
  tiny model) with 256 running requests and a ``torch.cuda`` stand-in that returns constants, so what is
  timed is kvguard's own work, not CUDA's (on a GPU ``mem_get_info`` and ``memory_stats`` add their
  driver and allocator calls).

Usage: nice .venv/bin/python bench/bench_governor.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvguard.contracts.units import NS_PER_S
from kvguard.producers.sim.profiles import EngineKnobs, load_profile
from kvguard.producers.sim.vllm.engine import VllmEngine, VllmEngineConfig
from kvguard.producers.sim.workloads import Request

SEQS = 256


def per_call_us(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def shadow(calls: int) -> dict:
    profile = load_profile("llama3-8b-24gb-vllm", knobs=EngineKnobs(gpu_memory_utilization=0.92))
    e = VllmEngine(profile, config=VllmEngineConfig(governor=True, prompt_logprobs_frac=0.0))
    for i in range(SEQS):
        e.submit(Request(i, 0, 32, 4000))
    for _ in range(100):
        if len(e.scheduler.running) >= SEQS:
            break
        e.advance(e.now_ns + NS_PER_S // 10)
    sched, gov = e.scheduler, e.governor
    budget = sched.max_num_scheduled_tokens

    def once():
        gov.before_schedule(sched)
        sched.max_num_scheduled_tokens = budget

    t0 = time.perf_counter()
    once()
    cold = (time.perf_counter() - t0) * 1e6
    fast = per_call_us(once, calls)
    # a prompt-logprob request waiting to prefill 8K positions: the governed path
    e._prompt_logprobs.add(10_000)
    sched.add_request(10_000, num_prompt_tokens=8000, max_tokens=4, arrival_ns=e.now_ns, priority=5)
    governed = per_call_us(once, calls)
    return {"running": len(sched.running), "cold_us": round(cold, 1), "fast_path_us": round(fast, 2),
            "prompt_logprob_waiting_us": round(governed, 2), "governed_steps": gov.governor.governed_steps,
            "plans_cached": len(gov.governor._peaks)}


class _Cuda:
    """Constant answers: the timing is kvguard's work around the calls."""

    def is_available(self):
        return True

    def is_initialized(self):
        return True

    def mem_get_info(self):
        return 2 << 30, 24 << 30

    def memory_stats(self):
        return {"reserved_bytes.all.current": 20 << 30, "allocated_bytes.all.current": 19 << 30,
                "inactive_split_bytes.all.current": 0}

    def memory_allocated(self):
        return 19 << 30

    def max_memory_allocated(self):
        return (19 << 30) + (300 << 20)

    def reset_peak_memory_stats(self):
        pass

    def empty_cache(self):
        pass


class _Torch:
    cuda = _Cuda()


def plugin(calls: int) -> dict:
    from kvguard.producers.sim.vllm.conformance import ConformanceRequest, VllmSide, synth_prompt_token_ids
    from kvguard.producers.sim.vllm.scheduler import SchedulerConfig
    from kvguard.producers.vllm.plugin import PluginConfig, VllmPlugin
    from kvguard.producers.vllm.translator import ListSink

    side = VllmSide(SchedulerConfig(num_gpu_blocks=8000, max_model_len=8192, block_size=16, max_num_seqs=SEQS,
                                    max_num_batched_tokens=8192))
    sched = side.scheduler
    p = VllmPlugin(sched, config=PluginConfig(node_id="bench/gpu0", snapshot_every_s=3600), sink=ListSink()).attach()
    actions = p.actions
    actions.torch = actions.governor.torch = _Torch()
    for i in range(SEQS):
        salt = i + 1
        side.add(ConformanceRequest(f"r{i}", 0, 0, 0, 4000, salt, synth_prompt_token_ids(32, (), salt, 16), ()))
    out = sched.schedule()  # everyone admitted and prefilled in one step
    running = len(sched.running)

    def once():
        actions.before_schedule()
        actions.after_schedule()
        actions.step_started(out)
        actions.step_finished()

    t0 = time.perf_counter()
    once()
    cold = (time.perf_counter() - t0) * 1e6
    warm = per_call_us(once, calls)
    p.close()
    return {"running": running, "cold_us": round(cold, 1), "per_step_us": round(warm, 2),
            "calibration_steps": actions.governor.calibration.steps}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args(argv)
    out = {"bench": "governor", "sequences": SEQS, "target_us": 50, "shadow_engine": shadow(args.calls),
           "plugin": plugin(args.calls)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
