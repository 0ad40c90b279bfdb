"""The step governor against static configurations on held-out traffic with STEP classes mixed in (issue 22).

    nice python bench/bench_governor_arms.py [--seeds 3] [--gpus 2] [--duration-s 120] [--rate-mults 1,2.5]
                                             [--workloads azure-conv,...] [--workers 2]

Every arm serves the same requests (per workload, rate and seed) on the vLLM-faithful engine deployed the
way the STEP classes bite: the V1 model runner (``VLLM_USE_V2_MODEL_RUNNER=0``: prompt logprobs computed
a whole chunk at once), a padded-LSE attention build (``attention_lse=max_seq_len``: long-context buffers
sized by the context), 5 % of requests asking for prompt logprobs and 2 % of prompts made 16K tokens
long. Arms:

- ``vllm_default``: the profile's own knobs (vLLM 0.33's 0.92);
- ``tuned_static``: the static sweep's winner on the training workloads (kvguard/ops/tuned_static.json);
- ``oracle_static``: per workload and rate, the best (mean SLO attainment over seeds) of a small static sweep
  chosen with hindsight — utilization 0.90 / 0.92 / 0.95 / 0.97, and 0.95 with ``expandable_segments``;
- ``baseline``: the operator's 0.95 without kvguard;
- ``governor_0.95``, ``governor_0.97``, ``governor_max``: the node-side step governor (``kvguard simulate
  --governor``: no closed loop) at 0.95, 0.97 and the highest utilization vLLM accepts for the profile.

Prints one JSON object: per workload, rate and arm the mean and min-max over seeds of SLO attainment,
SLO goodput, OOMs (and ``ooms_by_cause`` summed), failed, rejected and preemptions.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HELD_OUT = {"azure-conv": 1.0, "azure-code": 1.0, "mooncake-sample": 0.05, "sharegpt-sample": 1.0, "sessions": 1.5}
SWEEP = {"static_0.90": (0.90, ""), "static_0.92": (0.92, ""), "static_0.95": (0.95, ""), "static_0.97": (0.97, ""),
         "static_0.95_expandable": (0.95, "expandable_segments:True")}
FIELDS = ("slo_attainment", "slo_goodput_tokens_per_s", "ooms", "failed", "rejected", "preemptions")
DEPLOY = {"model_runner": "v1", "attention_lse": "max_seq_len"}
TRAFFIC = {"prompt_logprobs_frac": 0.05, "long_context_frac": 0.02, "long_context_len": 16000}


def highest_accepted(lo: float = 0.9, hi: float = 0.999) -> float:
    """The highest gpu_memory_utilization (4 decimals) at which the profile's vLLM starts."""
    from kvguard.producers.sim.profiles import EngineKnobs, ProfileError, load_profile

    def starts(u: float) -> bool:
        try:
            load_profile(None, knobs=EngineKnobs(gpu_memory_utilization=u, **DEPLOY))
            return True
        except (ProfileError, ValueError):
            return False
    lo_i, hi_i = int(lo * 10_000), int(hi * 10_000)
    while hi_i - lo_i > 1:
        mid = (lo_i + hi_i) // 2
        lo_i, hi_i = (mid, hi_i) if starts(mid / 10_000) else (lo_i, mid)
    return lo_i / 10_000


def run_job(job: tuple) -> dict:
    import logging

    from kvguard.ops.static_sweep import tuned_knobs
    from kvguard.producers.sim.profiles import EngineKnobs
    from kvguard.runtime.simulation import run_simulation

    workload, rate, seed, gpus, duration_s, arm, util, conf, governor = job
    logging.disable(logging.WARNING)
    if arm == "vllm_default":
        knobs = EngineKnobs(**DEPLOY)
    elif arm == "tuned_static":
        t = tuned_knobs()
        knobs = EngineKnobs(gpu_memory_utilization=t.gpu_memory_utilization,
                            max_num_batched_tokens=t.max_num_batched_tokens, allocator_conf=t.allocator_conf or None,
                            watermark=t.watermark, **DEPLOY)
    else:
        knobs = EngineKnobs(gpu_memory_utilization=util, allocator_conf=conf or None, **DEPLOY)
    out = run_simulation(workload, gpus=gpus, duration_s=duration_s, rate_scale=rate, seed=seed, knobs=knobs,
                         logprobs_guard=governor, **TRAFFIC)
    row = {k: out.get(k) for k in FIELDS} | {"requests": out["requests"], "ooms_by_cause": out.get("ooms_by_cause", {})}
    if governor:
        g = out["governor"]
        row["governor"] = {k: g[k] for k in ("steps_governed", "cache_releases", "never_fits", "steps_no_fit")}
    return {"workload": workload, "rate": rate, "seed": seed, "arm": arm, "row": row}


def spread(values: list) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"mean": None, "min": None, "max": None}
    return {"mean": round(sum(values) / len(values), 4), "min": min(values), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--duration-s", type=float, default=120.0)
    ap.add_argument("--rate-mults", default="1,2.5")
    ap.add_argument("--workloads", default=",".join(HELD_OUT))
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    top = highest_accepted()
    arms = {"vllm_default": (None, "", False), "tuned_static": (None, "", False),
            **{name: (u, c, False) for name, (u, c) in SWEEP.items()},
            "governor_0.95": (0.95, "", True), "governor_0.97": (0.97, "", True), "governor_max": (top, "", True)}
    mults = [float(x) for x in args.rate_mults.split(",")]
    cases = [(w, HELD_OUT[w] * m) for w in args.workloads.split(",") for m in mults]
    jobs = [(w, r, s, args.gpus, args.duration_s, arm, u, c, g) for w, r in cases for s in range(args.seeds)
            for arm, (u, c, g) in arms.items()]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        runs = list(pool.map(run_job, jobs))
    table = {}
    for w, r in cases:
        mine = [x for x in runs if x["workload"] == w and x["rate"] == r]
        per_arm = {}
        for arm in arms:
            rows = [x["row"] for x in mine if x["arm"] == arm]
            causes = Counter()
            for row in rows:
                causes.update(row["ooms_by_cause"])
            per_arm[arm] = {k: spread([row[k] for row in rows]) for k in FIELDS} | {"ooms_by_cause": dict(causes)}
            if rows and "governor" in rows[0]:
                per_arm[arm]["governor"] = {k: sum(row["governor"][k] for row in rows) for k in rows[0]["governor"]}
        sweep = {name: per_arm[name]["slo_attainment"]["mean"] or 0.0 for name in SWEEP}
        best = max(sweep, key=sweep.get)
        per_arm["oracle_static"] = dict(per_arm[best], chosen=best)
        table[f"{w} x{r:g}"] = per_arm
    doc = {"bench": "governor_arms", "highest_accepted_gpu_memory_utilization": top, "deploy": DEPLOY,
           "traffic": TRAFFIC, "gpus": args.gpus, "duration_s": args.duration_s, "seeds": args.seeds,
           "wall_seconds": round(time.perf_counter() - t0, 1), "table": table}
    sys.stdout.write(json.dumps(doc) + "\n")


if __name__ == "__main__":
    main()
