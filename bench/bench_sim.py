"""Shadow-engine speed: simulated seconds per wall second for ONE GPU at >= 64 concurrent requests.

Prints one JSON object. Two engines on the same workload, Llama-3-70B TP8 (one H100 shard) on the
Azure conversation trace at x2 its rate, which keeps about 100 requests running:

- ``vllm``: the vLLM-faithful engine (``llama3-70b-tp8-80gb-vllm``: vLLM's scheduler and 16-token
  blocks, every step's activations through the caching-allocator twin), and the same engine with
  its exact shortcuts off (``fuse_decode``, ``fast_memory``: one scheduler call and a full allocator
  replay per step), so the gain of each is measured, not assumed;
- ``main``: the seed's engine (``llama3-70b-tp8-80gb``, dual 4/64-token pages), as before; with
  vLLM-like 16-token pages, and the 8B/24GB case at a light x0.25 load, for comparison;
- ``vllm_classes_on``: the vLLM case with every failure class's trigger on (a neighbour, a leak, long
  prompts, prompt logprobs), and ``vllm_spec_decode``: speculative decoding with a draft model.

Usage: .venv/bin/python bench/bench_sim.py [--seconds 300] [--rate-scale 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvguard.contracts.units import NS_PER_S
from kvguard.producers.sim.engine_args import EngineArgs
from kvguard.producers.sim.fleet import Fleet
from kvguard.producers.sim.profiles import load_profile, prompt_cap_tokens
from kvguard.producers.sim.vllm.engine import VllmEngineConfig
from kvguard.producers.sim.vllm.external import Leak, Neighbour
from kvguard.producers.sim.workloads import load_workload, with_long_context


def run_case(profile_name: str, workload: str, rate_scale: float, seconds: float, config=None, *, profile=None,
             long_context=(0.0, 0)) -> dict:
    profile = profile or load_profile(profile_name)
    cap = prompt_cap_tokens(profile)
    wl = load_workload(workload, rate_scale=rate_scale, window=seconds, max_prompt_tokens=cap)
    if long_context[0]:
        wl = with_long_context(wl, *long_context)
    fleet = Fleet(1, profile, seed=0, config=config)
    fleet.submit_workload(wl)
    engine = fleet.engines[0]
    running = []
    events = 0
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    for t in range(1, int(seconds) + 1):
        fleet.advance(t * NS_PER_S)
        running.append(engine.queue_lengths()["running"])
        if t % 10 == 0:
            events += sum(len(b) for b in fleet.take_batches(t * NS_PER_S))
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    events += sum(len(b) for b in fleet.take_batches(int(seconds) * NS_PER_S))
    s = fleet.summary()
    busy = [r for r in running if r > 0]
    return {
        "profile": profile_name, "engine": profile.engine, "workload": workload, "rate_scale": rate_scale,
        "sim_seconds": round(engine.now_ns / NS_PER_S, 1), "wall_seconds": round(wall, 3),
        "sim_seconds_per_wall_second": round(engine.now_ns / NS_PER_S / wall, 1),
        "cpu_seconds": round(cpu, 3),
        "sim_seconds_per_cpu_second": round(engine.now_ns / NS_PER_S / cpu, 1),
        "concurrent_mean": round(sum(running) / len(running), 1),
        "concurrent_mean_busy": round(sum(busy) / len(busy), 1) if busy else 0.0,
        "concurrent_max": max(running), "events": events, "events_per_wall_second": round(events / wall),
        "events_per_cpu_second": round(events / cpu),
        "steps": engine.steps, "requests": s.requests, "completed": s.completed, "failed": s.failed,
        "rejected": s.rejected, "unfinished": s.unfinished, "ooms": s.ooms,
        "preemptions": s.preemptions,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=300.0, help="simulated seconds per case")
    ap.add_argument("--rate-scale", type=float, default=2.0)
    args = ap.parse_args()
    vllm_case = run_case("llama3-70b-tp8-80gb-vllm", "azure-conv", args.rate_scale, args.seconds)
    vllm_plain = run_case("llama3-70b-tp8-80gb-vllm", "azure-conv", args.rate_scale, args.seconds,
                          VllmEngineConfig(fuse_decode=False, fast_memory=False))
    vllm_small = run_case("llama3-8b-24gb-vllm", "azure-conv", 0.25, args.seconds)
    # every failure class with a trigger, on the same 70B shard: a neighbour growing 1 GiB/h from 1 GiB, a
    # 1 GiB/h leak, 2 % of prompts 60K tokens long, 2 % asking for prompt logprobs
    classes = run_case("llama3-70b-tp8-80gb-vllm", "azure-conv", args.rate_scale, args.seconds,
                       VllmEngineConfig(neighbour=Neighbour.parse("1GiB:+1GiB/h"), leak=Leak.parse("1GiB/h"),
                                        prompt_logprobs_frac=0.02), long_context=(0.02, 60000))
    # speculative decoding (Qwen3-8B, a Qwen3-0.6B draft, 4 tokens) on one H100 from the configs in tests/data
    configs = Path(__file__).resolve().parents[1] / "tests" / "data" / "model_configs"
    spec = run_case("byo-qwen3-8b-spec", "azure-conv", args.rate_scale, args.seconds, profile=EngineArgs(
        str(configs / "qwen3-8b.json"), gpu="h100-80gb", speculative_model_config=str(configs / "qwen3-0.6b.json"),
        num_speculative_tokens=4).profile())
    main_case = run_case("llama3-70b-tp8-80gb", "azure-conv", args.rate_scale, args.seconds)
    p16 = run_case("llama3-70b-tp8-80gb-p16", "azure-conv", args.rate_scale, args.seconds)
    small = run_case("llama3-8b-24gb", "azure-conv", 0.25, args.seconds)
    print(json.dumps({
        "bench": "sim",
        "target_x_real_time": 1000,
        "sim_seconds_per_wall_second": main_case["sim_seconds_per_wall_second"],
        "sim_seconds_per_cpu_second": main_case["sim_seconds_per_cpu_second"],
        "concurrent_mean": main_case["concurrent_mean"],
        "vllm_sim_seconds_per_wall_second": vllm_case["sim_seconds_per_wall_second"],
        "vllm_sim_seconds_per_cpu_second": vllm_case["sim_seconds_per_cpu_second"],
        "vllm_concurrent_mean": vllm_case["concurrent_mean"],
        "vllm_classes_on_sim_seconds_per_cpu_second": classes["sim_seconds_per_cpu_second"],
        "vllm_spec_decode_sim_seconds_per_cpu_second": spec["sim_seconds_per_cpu_second"],
        "vllm": vllm_case,
        "vllm_without_fusion_or_memo": vllm_plain,
        "vllm_classes_on": classes,
        "vllm_spec_decode": spec,
        "llama3_8b_24gb_vllm": vllm_small,
        "main": main_case,
        "llama3_70b_tp8_80gb_p16": p16,
        "llama3_8b_24gb": small,
    }))


if __name__ == "__main__":
    main()
