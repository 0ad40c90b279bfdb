"""The per-fleet risk forecast (kvguard.ml.fleet_risk) evaluated on its own, on held-out workloads.

    nice python bench/eval_fleet_risk.py [--engines vllm,seed] [--duration-s 1800] [--workers 2] [--bootstrap 500]

Label: a fleet tick is positive iff any GPU of the fleet has an OOM within the next 5 minutes;
ticks whose horizon passes the run's end are censored (``kvguard.ml.evaluation``, "the per-fleet
risk forecast"). Runs, per engine:

- ``vllm``: ``preset_vllm()`` (4-GPU fleets of the vLLM-faithful engine at gpu_memory_utilization
  0.95 with prompt-logprob traffic); its train and val runs calibrate the alarm threshold (FPR <= 5 %),
  its test runs and a load sweep of them (``VLLM_LOAD_SWEEP``: azure-conv x0.25-x2, mooncake-sample
  x0.02-x0.1) are the held-out workloads;
- ``seed``: the multi-GPU runs of ``preset_small()`` on the seed engine (train/val: azure-code 4-GPU
  fleets; test: azure-conv 4-GPU fleets) — where issue 13 measured fleet offered load. Mooncake has
  no multi-GPU run there.

Per held-out workload: AUC with its event-bootstrap interval, recall at FPR <= 5 %, and, at the
calibrated threshold, TPR/FPR, median lead time and false alarms per fleet-hour; the lead time also
at the threshold of FPR <= 5 % on the workload's own ticks (``lead_at_own_fpr_5pct``: optimistic, the
way issue 13 measured it). For the hazard and beside it: the hazard without its GPUs-down part
(``with_down=False``), the raw arrivals per up GPU in the window (issue 13's offered load, no
capacity) and the fleet's highest U_kv. Training workloads are scored too (``training_workloads``:
nothing is fitted to them but the threshold). Lead times count every OOM, so the second GPU of a
wave (seconds after the first) is usually a miss; ``isolated_lead_time_median_s`` counts the OOMs
with none in the fleet's 10 minutes before. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

import numpy as np

from kvguard.contracts.units import NS_PER_S
from kvguard.ml.dataset import RunSpec, preset_small, preset_vllm, simulate_run
from kvguard.ml.evaluation import DEFAULT_HORIZON_S, evaluate_fleet_risk, fleet_threshold, fleet_trace
from kvguard.ml.fleet_risk import WINDOW_S, fleet_series
from kvguard.producers.sim.profiles import load_profile
from kvguard.producers.sim.registry import KINDS, engine_kind

# Held-out fleets across load levels, quiet hours to overload (the preset's test runs have OOMs every few
# minutes, so a fleet there is at risk nearly all the time and the label has few negatives)
VLLM_LOAD_SWEEP = (("azure-conv", (0.25, 0.5, 1.0, 1.5, 2.0), 0.005), ("mooncake-sample", (0.02, 0.05, 0.1), 0.02))
SCORES = ("fleet_risk", "fleet_risk_without_down", "arrivals_per_up_gpu", "max_u_kv")


# the multi-GPU runs of these presets, each counted for the engine kind its profile runs on
FLEET_PRESETS = (preset_vllm, preset_small)


@functools.cache
def kind_of(profile: str) -> str:
    return engine_kind(load_profile(profile)).name


def engine_specs(engine: str, duration_s: float | None) -> list[RunSpec]:
    specs = [s for preset in FLEET_PRESETS for s in preset() if s.n_gpus > 1 and kind_of(s.profile) == engine]
    if KINDS[engine].capabilities.prompt_logprobs:
        # the load sweep varies the prompt-logprob share, which only an engine with a sampler serves
        template = next(s for s in specs if s.split == "test")
        sweep = [replace(template, workload=w, rate_scale=r, prompt_logprobs_frac=f, seed=0)
                 for w, rates, f in VLLM_LOAD_SWEEP for r in rates]
        specs = list({s.key(): s for s in specs + sweep}.values())
    if duration_s is not None:
        specs = [replace(s, duration_s=duration_s) for s in specs]
    return specs


def run_fleet(job: tuple[str, RunSpec]) -> dict:
    """One simulated fleet: its tick times, every score and its OOMs (small arrays, not the ticks)."""
    engine, spec = job
    record = simulate_run(spec, keep_ticks=True)
    risks = fleet_series(record.ticks)
    plain = fleet_series(record.ticks, with_down=False)
    window_ns = int(WINDOW_S * NS_PER_S)
    ticks = [t for seq in record.ticks.values() for t in seq]
    times = np.array([r.ts_ns for r in risks], np.int64)
    arrivals = np.zeros(len(times))
    max_u_kv = np.zeros(len(times))
    for t in ticks:
        lo, hi = np.searchsorted(times, t.ts_ns, "left"), np.searchsorted(times, t.ts_ns + window_ns, "left")
        arrivals[lo:hi] += t.arrivals  # in every window (t', t' - 60 s] that holds this tick
        at = np.searchsorted(times, t.ts_ns)
        max_u_kv[at] = max(max_u_kv[at], t.u_kv)
    up = np.array([max(r.gpus_up, 1) for r in risks], np.float64)
    return {"engine": engine, "key": spec.key(), "workload": spec.workload, "split": spec.split,
            "gpus": spec.n_gpus, "ts_ns": times, "end_ns": int(spec.duration_s * NS_PER_S),
            "oom_ts_ns": np.concatenate([s.oom_ts_ns for s in record.sequences]),
            "scores": {"fleet_risk": np.array([r.hazard for r in risks]),
                       "fleet_risk_without_down": np.array([r.hazard for r in plain]),
                       "arrivals_per_up_gpu": arrivals / up, "max_u_kv": max_u_kv},
            "seconds": round(record.seconds, 1)}


def traces(runs: list[dict], score: str, threshold: float | None = None) -> list:
    return [fleet_trace(r["key"], r["ts_ns"], r["scores"][score], r["oom_ts_ns"], r["end_ns"],
                        horizon_s=DEFAULT_HORIZON_S, threshold=threshold) for r in runs]


def brief(figures: dict) -> dict:
    keys = ("auc", "auc_ci", "recall_at_fpr_5pct", "at_threshold", "lead_time_median_s", "lead_time_recall",
            "false_alarms_per_fleet_hour", "lead_at_own_fpr_5pct")
    return {k: figures[k] for k in keys}


def engine_report(runs: list[dict], bootstrap: int) -> dict:
    calibration = [r for r in runs if r["split"] in ("train", "val")]
    held_out = [r for r in runs if r["split"] == "test"]
    thresholds = {s: fleet_threshold(traces(calibration, s)) for s in SCORES}
    out = {"calibration": {"workloads": sorted({r["workload"] for r in calibration}), "fleets": len(calibration),
                           "thresholds_at_fpr_5pct": {s: round(v, 6) for s, v in thresholds.items()}},
           "held_out": {}, "training_workloads": {}}
    for group, rows in (("held_out", held_out), ("training_workloads", calibration)):
        for workload in sorted({r["workload"] for r in rows}):
            mine = [r for r in rows if r["workload"] == workload]
            row = {"fleets": len(mine), "gpus_per_fleet": sorted({r["gpus"] for r in mine})}
            for s in SCORES:
                figures = evaluate_fleet_risk(traces(mine, s), threshold=thresholds[s], bootstrap_draws=bootstrap)
                own = evaluate_fleet_risk(traces(mine, s), bootstrap_draws=0)  # threshold at FPR 5 % of these ticks
                figures["lead_at_own_fpr_5pct"] = {"threshold": own["threshold"], "tpr": own["at_threshold"]["tpr"],
                                                   "lead_time_median_s": own["lead_time_median_s"],
                                                   "lead_time_recall": own["lead_time_recall"],
                                                   "isolated_lead_time_median_s": own["isolated_lead_time_median_s"]}
                if s == "fleet_risk":
                    row.update({k: figures[k] for k in ("ooms", "events", "ticks", "positive_ticks", "masked_ticks")})
                    row[s] = {**brief(figures), "isolated_lead_time_median_s": figures["isolated_lead_time_median_s"],
                              "bands": figures["bands"]}
                else:
                    row[s] = brief(figures)
            out[group][workload] = row
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", default=",".join(KINDS), help=f"comma-separated: {', '.join(KINDS)}")
    parser.add_argument("--duration-s", type=float, default=None,
                        help="simulated seconds per run (default: the preset's)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--bootstrap", type=int, default=500, help="event-bootstrap draws (0: no intervals)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    engines = [e for e in args.engines.split(",") if e]
    unknown = set(engines) - set(KINDS)
    if unknown:
        parser.error(f"--engines: unknown {sorted(unknown)}; expected {', '.join(KINDS)}")
    jobs = [(e, spec) for e in engines for spec in engine_specs(e, args.duration_s)]
    with ProcessPoolExecutor(max_workers=max(1, args.workers)) as pool:
        runs = list(pool.map(run_fleet, jobs))
    given = argv if argv is not None else sys.argv[1:]
    report = {"command": " ".join(["python", "bench/eval_fleet_risk.py", *given]),
              "label": "any OOM of the fleet in the next 300 s; censored ticks masked",
              "engines": {e: engine_report([r for r in runs if r["engine"] == e], args.bootstrap) for e in engines},
              "simulated_fleets": len(runs), "seconds": round(time.monotonic() - started, 1), "cpus": os.cpu_count()}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
