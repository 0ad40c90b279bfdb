"""The closed loop against the strongest baselines on held-out workloads (issue 12).

    python bench/bench_arms.py [--seeds 5] [--gpus 4] [--duration-s 600] [--rate-mult 1] [--workers 2] [--no-lstm]

Per held-out workload (never used by the static sweep, kvguard/ops/static_sweep.py) and seed, the
same requests run six times on the vLLM-faithful engine, every request counted:

- ``vllm_default``: the profile as shipped (vLLM's defaults: gpu_memory_utilization 0.9, …);
- ``tuned_static``: the sweep's winner on the training workloads (kvguard/ops/tuned_static.json);
- ``static_expandable``: the operator's knobs with ``expandable_segments:True`` (a static fix that
  was not the sweep's winner on the training workloads, shown because it is the strongest here);
- ``baseline``: the operator's knobs (gpu_memory_utilization 0.95), no kvguard;
- ``kvguard``: the operator's knobs with kvguard (closed loop: policy + actuators, embedded; node
  side: the logprob guard);
- ``kvguard_0.97``: the same at gpu_memory_utilization 0.97, a KV cache the guard makes safe to run
  (statically, 0.97 OOMs on every prompt-logprob request whose chunk does not fit).

``--rate-mult`` scales every workload's rate (2.5: an overloaded fleet, where the KV cache size
decides preemptions and SLO attainment).

Every arm sees the same share of requests asking for prompt logprobs (``--prompt-logprobs-frac``,
default 0.05: eval traffic, vllm#5907), chosen per seed. Prints one JSON object: per workload and
arm the mean and the spread (min, max) over seeds of OOMs, preemptions, failed, rejected, SLO
attainment (TTFT <= 2 s and mean TPOT <= 100 ms), SLO goodput and TTFT p99 over served requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from rich.progress import Progress

HELD_OUT = (("azure-conv", 1.0), ("azure-code", 1.0), ("mooncake-sample", 0.05), ("sharegpt-sample", 1.0),
            ("sessions", 1.5))
OPERATOR_UTILIZATION = 0.95
GUARDED_UTILIZATION = 0.97
ARMS = ("vllm_default", "tuned_static", "static_expandable", "baseline", "kvguard", "kvguard_0.97")
FIELDS = ("ooms", "preemptions", "failed", "rejected", "refused", "slo_attainment", "slo_goodput_tokens_per_s",
          "ttft_p99_s")


def run_seed(job: tuple) -> dict:
    """All four arms of one (workload, rate, seed)."""
    from kvguard.producers.sim.profiles import EngineKnobs, load_profile
    from kvguard.producers.sim.vllm.engine import VllmEngineConfig
    from kvguard.runtime.bootstrap import bootstrap
    from kvguard.runtime.embedded import demo_workload, run_embedded, static_arms

    workload, rate, seed, gpus, duration_s, frac, lstm, *rest = job
    mix = rest[0] if rest else None
    logging.disable(logging.WARNING)  # mode changes and outages are the runs' own business here
    node_config = VllmEngineConfig(prompt_logprobs_frac=frac)
    operator = EngineKnobs(gpu_memory_utilization=OPERATOR_UTILIZATION)
    graph = bootstrap(knobs=operator, node_config=node_config, predictor="shipped" if lstm else None)
    wl = demo_workload(graph.profile, workload=workload, rate_scale=rate, duration_s=duration_s, seed=seed,
                       priority_mix=mix)
    arms = {name: (g, False) for name, g in static_arms(graph, None, node_config).items()}
    expandable = EngineKnobs(gpu_memory_utilization=OPERATOR_UTILIZATION, allocator_conf="expandable_segments:True")
    higher = EngineKnobs(gpu_memory_utilization=GUARDED_UTILIZATION)
    arms |= {"static_expandable": (graph.with_node(load_profile(None, knobs=expandable), node_config), False),
             "baseline": (graph, False), "kvguard": (graph, True),
             "kvguard_0.97": (graph.with_node(load_profile(None, knobs=higher), node_config), True)}
    out = {}
    for name, (g, guarded) in arms.items():
        result = asyncio.run(run_embedded(g, wl, n_gpus=gpus, duration_s=duration_s, seed=seed, guarded=guarded))
        out[name] = {k: result.summary.get(k) for k in FIELDS} | {"requests": result.summary["requests"]}
    return {"workload": workload, "rate_scale": rate, "seed": seed, "arms": out}


def spread(rows: list[dict], key: str) -> dict:
    values = [r[key] for r in rows if r[key] is not None]
    if not values:
        return {"mean": None, "min": None, "max": None}
    return {"mean": round(sum(values) / len(values), 4), "min": min(values), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--duration-s", type=float, default=600.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--prompt-logprobs-frac", type=float, default=0.05)
    ap.add_argument("--rate-mult", type=float, default=1.0, help="scale every held-out workload's rate")
    ap.add_argument("--no-lstm", action="store_true", help="kvguard without its predictor tier")
    ap.add_argument("--priority-mix", default=None, help="e.g. 9:0.1,5:0.6,1:0.3 for requests the trace gives "
                    "no priority (issue 29)")
    args = ap.parse_args()
    held_out = [(w, r * args.rate_mult) for w, r in HELD_OUT]
    from kvguard.producers.admission import parse_priority_mix

    mix = parse_priority_mix(args.priority_mix) if args.priority_mix else None
    jobs = [(w, r, s, args.gpus, args.duration_s, args.prompt_logprobs_frac, not args.no_lstm, mix)
            for w, r in held_out for s in range(args.seeds)]
    t0 = time.perf_counter()
    runs = []
    with Progress(transient=True) as bar, ProcessPoolExecutor(max_workers=args.workers) as pool:
        task = bar.add_task(f"{len(jobs)} (workload, seed) x {len(ARMS)} arms", total=len(jobs))
        for run in pool.map(run_seed, jobs):
            runs.append(run)
            bar.advance(task)
    table = {}
    for w, r in held_out:
        mine = [run for run in runs if run["workload"] == w]
        table[w] = {"rate_scale": r, "seeds": len(mine),
                    "arms": {arm: {k: spread([m["arms"][arm] for m in mine], k) for k in FIELDS} for arm in ARMS}}
    doc = {"held_out": table, "operator_gpu_memory_utilization": OPERATOR_UTILIZATION,
           "guarded_gpu_memory_utilization": GUARDED_UTILIZATION, "rate_mult": args.rate_mult,
           "prompt_logprobs_frac": args.prompt_logprobs_frac, "gpus": args.gpus, "duration_s": args.duration_s,
           "lstm": not args.no_lstm, "wall_seconds": round(time.perf_counter() - t0, 1), "runs": runs}
    sys.stdout.write(json.dumps(doc) + "\n")


if __name__ == "__main__":
    main()
