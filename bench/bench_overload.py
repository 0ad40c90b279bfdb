"""Overload without collapse (issue 29): kvguard's admission against vLLM's knobs and a router baseline.

    nice python bench/bench_overload.py [--seeds 3] [--gpus 2] [--duration-s 60] [--rates 1.5,2,3]
        [--workloads azure-conv,azure-code,sharegpt-sample,mooncake-sample] [--priority-mix 9:0.1,5:0.6,1:0.3]
        [--goodput 'ttft:2000 tpot:100'] [--workers 1]

Per held-out workload, rate and seed the same requests (priorities drawn from the mix; a trace's own
priority wins) run on the vLLM-faithful engine, every request counted, against one SLO:

- ``vllm_default``: vLLM 0.33's defaults (fcfs, unbounded queue), least-loaded router;
- ``vllm_queue_cap``: ``--max-num-queued-reqs`` at its best value for the workload and rate in
  hindsight (best mean SLO attainment over the seeds, of ``QUEUE_CAPS``; vLLM answers 503);
- ``best_static``: the best of ``STATIC_GRID`` (vLLM start-up knobs) for the workload and rate in hindsight;
- ``llmd_router``: vLLM's defaults behind a router doing what llm-d-router's utilization detector does
  (KV usage 0.8, queue depth 5: saturated endpoints filtered, sheddable requests — priority < 5, llm-d's
  < 0 — shed with a 429 when the pool is saturated; ``producers.sim.routing``);
- ``kvguard``: ``--scheduling-policy priority`` + kvguard's admission gate on each node + the router
  reading kvguard's endpoint series.

Plus ``quarter_rate_vip``: priority >= 8 attainment of the same requests replayed at a quarter of the
trace's rate on vLLM's defaults (the reference of the issue's "priority >= 8" criterion).

Prints one JSON object: per workload and rate, per arm, the mean and (min, max) over seeds of SLO
attainment, per-priority attainment, SLO goodput, goodput, refused, rejected, preemptions, OOMs and
TTFT/TPOT percentiles (served requests; ``ttft_p99_all_s`` over all requests, misses last).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor

BASE_RATE = {"mooncake-sample": 0.05}  # the Mooncake sample is a fast trace: its 1x is this rate (bench_arms)
QUEUE_CAPS = (16, 32, 64)
STATIC_GRID = {
    "util0.95": {"gpu_memory_utilization": 0.95},
    "priority": {"scheduling_policy": "priority"},
    "seqs64": {"max_num_seqs": 64},
    "util0.95+priority+mnbt4096": {"gpu_memory_utilization": 0.95, "scheduling_policy": "priority",
                                   "max_num_batched_tokens": 4096},
}
FIELDS = ("slo_attainment", "slo_goodput_tokens_per_s", "goodput_tokens_per_s", "refused", "rejected",
          "preemptions", "ooms", "failed", "unfinished", "ttft_p50_s", "ttft_p99_s", "ttft_p99_all_s", "tpot_p50_s",
          "tpot_p99_s")


def _one(workload, rate, seed, gpus, duration_s, mix, slo, knobs=None, admission=False, router="least_loaded"):
    from kvguard.producers.sim.profiles import EngineKnobs
    from kvguard.runtime.simulation import run_simulation

    out = run_simulation(workload, gpus=gpus, duration_s=duration_s, rate_scale=rate, seed=seed,
                         knobs=EngineKnobs(**knobs) if knobs else None, priority_mix=mix, slo=slo,
                         admission=admission, router=router)
    row = {k: out.get(k) for k in FIELDS}
    row["slo_attainment_by_priority"] = out["slo_attainment_by_priority"]
    row["requests"] = out["requests"]
    return row


def run_job(job: tuple) -> dict:
    workload, rate, seed, gpus, duration_s, mix, slo = job
    base = BASE_RATE.get(workload, 1.0)
    r = rate * base
    arms = {"vllm_default": _one(workload, r, seed, gpus, duration_s, mix, slo),
            "llmd_router": _one(workload, r, seed, gpus, duration_s, mix, slo, router="llmd_utilization"),
            "kvguard": _one(workload, r, seed, gpus, duration_s, mix, slo, {"scheduling_policy": "priority"},
                            admission=True, router="kvguard")}
    for cap in QUEUE_CAPS:
        arms[f"queue_cap_{cap}"] = _one(workload, r, seed, gpus, duration_s, mix, slo, {"max_num_queued_reqs": cap})
    for name, knobs in STATIC_GRID.items():
        arms[f"static_{name}"] = _one(workload, r, seed, gpus, duration_s, mix, slo, knobs)
    # the same requests at a quarter of the trace's rate: the window stretches so that they all arrive
    quarter = _one(workload, 0.25 * base, seed, gpus, duration_s * rate / 0.25, mix, slo)
    vip = _vip(quarter)
    return {"workload": workload, "rate": rate, "seed": seed, "arms": arms, "quarter_rate_vip": vip}


def _vip(row: dict) -> float | None:
    by = row["slo_attainment_by_priority"] or {}
    return by.get("9")


def spread(values: list) -> dict:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"mean": None}
    return {"mean": round(sum(vals) / len(vals), 4), "min": round(min(vals), 4), "max": round(max(vals), 4)}


def _arm_stats(rows: list[dict]) -> dict:
    out = {k: spread([r[k] for r in rows]) for k in FIELDS}
    prios = sorted({p for r in rows for p in (r["slo_attainment_by_priority"] or {})}, key=int)
    out["slo_attainment_by_priority"] = {p: spread([(r["slo_attainment_by_priority"] or {}).get(p) for r in rows])
                                         for p in prios}
    return out


def summarize(results: list[dict]) -> dict:
    groups: dict[tuple, list[dict]] = {}
    for res in results:
        groups.setdefault((res["workload"], res["rate"]), []).append(res)
    report = {}
    for (wl, rate), runs in sorted(groups.items()):
        def best(prefix):
            names = [a for a in runs[0]["arms"] if a.startswith(prefix)]
            return max(names, key=lambda a: (sum(r["arms"][a]["slo_attainment"] for r in runs),
                                             sum(r["arms"][a]["slo_goodput_tokens_per_s"] for r in runs)))
        picks = {"vllm_default": "vllm_default", "vllm_queue_cap": best("queue_cap_"),
                 "best_static": best("static_"), "llmd_router": "llmd_router", "kvguard": "kvguard"}
        arms = {arm: {"config": name, **_arm_stats([r["arms"][name] for r in runs])} for arm, name in picks.items()}
        vip_ref = spread([r["quarter_rate_vip"] for r in runs])
        k = arms["kvguard"]
        others = max(a["slo_attainment"]["mean"] for n, a in arms.items() if n != "kvguard")
        d = arms["vllm_default"]["slo_attainment"]["mean"]
        k_vip = k["slo_attainment_by_priority"].get("9", {}).get("mean")
        checks = {"kvguard_at_least_best_other": k["slo_attainment"]["mean"] >= others,
                  "kvguard_twice_default_where_default_below_half": (
                      None if d >= 0.5 else k["slo_attainment"]["mean"] >= min(1.0, 2 * d)),
                  "vip_vs_quarter_rate": (round(k_vip / vip_ref["mean"], 4) if k_vip is not None and vip_ref["mean"]
                                          else None),
                  "goodput_not_below_best_static": (k["slo_goodput_tokens_per_s"]["mean"]
                                                    >= arms["best_static"]["slo_goodput_tokens_per_s"]["mean"]),
                  "no_oom": k["ooms"]["max"] == 0}
        report[f"{wl}@{rate:g}x"] = {"seeds": len(runs), "arms": arms, "quarter_rate_vip_attainment": vip_ref,
                                     "checks": checks}
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--duration-s", type=float, default=60.0)
    ap.add_argument("--rates", default="1.5,2,3")
    ap.add_argument("--workloads", default="azure-conv,azure-code,sharegpt-sample,mooncake-sample")
    ap.add_argument("--priority-mix", default="9:0.1,5:0.6,1:0.3")
    ap.add_argument("--goodput", default="ttft:2000 tpot:100")
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args()
    from kvguard.producers.admission import parse_priority_mix
    from kvguard.producers.sim.run import parse_goodput

    mix, slo = parse_priority_mix(args.priority_mix), parse_goodput(args.goodput)
    jobs = [(wl, float(rate), seed, args.gpus, args.duration_s, mix, slo)
            for wl in args.workloads.split(",") for rate in args.rates.split(",") for seed in range(args.seeds)]
    t0 = time.time()
    results = []
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        for res in pool.map(run_job, jobs):
            results.append(res)
            print(f"done {res['workload']}@{res['rate']:g}x seed {res['seed']} ({time.time() - t0:.0f} s)",
                  file=sys.stderr)
    print(json.dumps({"bench": "overload", "slo": slo.name, "priority_mix": args.priority_mix, "gpus": args.gpus,
                      "duration_s": args.duration_s, "seeds": args.seeds, "profile": "llama3-8b-24gb-vllm",
                      "wall_s": round(time.time() - t0, 1), "results": summarize(results)}, indent=1))


if __name__ == "__main__":
    main()
