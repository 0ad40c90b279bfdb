"""The strongest static alternative: sweep vLLM's start-up knobs on the training workloads only.

Issue 12's second arm. Every configuration of ``GRID`` (gpu_memory_utilization ×
max_num_batched_tokens × PYTORCH_CUDA_ALLOC_CONF × watermark) runs the bare vLLM-faithful engine
(no kvguard) over each training run of ``TRAINING_RUNS``; configurations are ranked by mean SLO
attainment over those runs (every request counted: failed and rejected ones are misses), then by
SLO goodput. The winner is written to ``tuned_static.json`` next to this module with the whole
ranked table and the command that produced it; ``kvguard demo``'s ``tuned_static`` arm reads it.
Held-out workloads (``HELD_OUT_WORKLOADS``) never enter the sweep.

The traffic condition is part of the training runs: the operator's share of requests asking for
prompt logprobs (``TRAINING_PROMPT_LOGPROBS_FRAC``, eval traffic: vllm#5907), the condition under
which vLLM's profiled peak undercounts memory.
"""

from __future__ import annotations

import itertools
import json
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvguard.contracts.units import NS_PER_S
from kvguard.producers.sim.fleet import Fleet
from kvguard.producers.sim.profiles import EngineKnobs, load_profile
from kvguard.producers.sim.vllm.engine import VllmEngineConfig
from kvguard.producers.sim.workloads import load_workload

GRID = {
    "gpu_memory_utilization": (0.9, 0.92, 0.95),  # at 0.85 vLLM refuses to start (max_model_len 32768)
    "max_num_batched_tokens": (1024, 2048, 4096),
    "allocator_conf": ("", "expandable_segments:True"),
    "watermark": (0.0, 0.02),
}
# (workload, rate scale): scenarios only; every bundled trace and the long-session scenario are held out
TRAINING_RUNS = (("mixed", 2.25), ("rag", 2.0), ("drill", 1.0))
HELD_OUT_WORKLOADS = ("azure-conv", "azure-code", "mooncake-sample", "sharegpt-sample", "sessions")
TRAINING_PROMPT_LOGPROBS_FRAC = 0.05
TRAINING_GPUS = 4
TRAINING_DURATION_S = 600.0
TRAINING_SEED = 0
TUNED_PATH = Path(__file__).with_name("tuned_static.json")


@dataclass(slots=True, frozen=True)
class SweepRun:
    knobs: EngineKnobs
    workload: str
    rate_scale: float
    profile: str | None = None


def grid() -> list[EngineKnobs]:
    keys = list(GRID)
    return [EngineKnobs(**dict(zip(keys, values))) for values in itertools.product(*(GRID[k] for k in keys))]


def run_one(run: SweepRun) -> dict:
    """One training run of one configuration (the bare engine, no kvguard): the fields the ranking reads."""
    profile = load_profile(run.profile, knobs=run.knobs)
    workload = load_workload(run.workload, rate_scale=run.rate_scale, window=TRAINING_DURATION_S, seed=TRAINING_SEED)
    fleet = Fleet(TRAINING_GPUS, profile, seed=TRAINING_SEED,
                  config=VllmEngineConfig(prompt_logprobs_frac=TRAINING_PROMPT_LOGPROBS_FRAC))
    fleet.submit_workload(workload)
    for _ in fleet.steps(int(TRAINING_DURATION_S * NS_PER_S), step_ns=10 * NS_PER_S):
        pass  # the bare engine: its batches go nowhere
    out = fleet.summary().to_dict()
    return {"workload": run.workload, "rate_scale": run.rate_scale, "kv_blocks": profile.memory.num_gpu_blocks,
            **{k: out[k] for k in ("requests", "ooms", "preemptions", "failed", "rejected", "slo_attainment",
                                   "slo_goodput_tokens_per_s", "ttft_p99_s")}}


def rank(results: dict[EngineKnobs, list[dict]]) -> list[dict]:
    """Configurations best first: mean SLO attainment, then mean SLO goodput, then fewer OOMs."""
    rows = []
    for knobs, runs in results.items():
        n = len(runs)
        rows.append({"knobs": knobs.to_dict(),
                     "slo_attainment": round(sum(r["slo_attainment"] or 0.0 for r in runs) / n, 6),
                     "slo_goodput_tokens_per_s": round(sum(r["slo_goodput_tokens_per_s"] for r in runs) / n, 3),
                     "ooms": sum(r["ooms"] for r in runs), "preemptions": sum(r["preemptions"] for r in runs),
                     "runs": runs})
    rows.sort(key=lambda r: (-r["slo_attainment"], -r["slo_goodput_tokens_per_s"], r["ooms"]))
    return rows


def sweep(*, profile: str | None = None, workers: int | None = None, progress=None,
          knob_grid: list[EngineKnobs] | None = None, runs=TRAINING_RUNS) -> list[dict]:
    """Run the grid (in ``workers`` processes) and return the ranked table."""
    knob_grid = knob_grid if knob_grid is not None else grid()
    jobs = [SweepRun(k, w, r, profile) for k in knob_grid for w, r in runs]
    for w, _ in runs:
        if w in HELD_OUT_WORKLOADS:
            raise ValueError(f"{w!r} is a held-out workload: it must not tune the static baseline")
    results: dict[EngineKnobs, list[dict]] = {k: [] for k in knob_grid}
    workers = workers or max(1, (os.cpu_count() or 1))
    with ProcessPoolExecutor(max_workers=workers) as pool:
        for job, out in zip(jobs, pool.map(run_one, jobs)):
            results[job.knobs].append(out)
            if progress is not None:
                progress()
    return rank(results)


def write_tuned(table: list[dict], command: str, path: Path = TUNED_PATH) -> dict:
    best = table[0]
    doc = {"knobs": best["knobs"], "objective": "mean SLO attainment over the training runs, then SLO goodput",
           "training_runs": [list(r) for r in TRAINING_RUNS], "held_out_workloads": list(HELD_OUT_WORKLOADS),
           "prompt_logprobs_frac": TRAINING_PROMPT_LOGPROBS_FRAC, "gpus": TRAINING_GPUS,
           "duration_s": TRAINING_DURATION_S, "seed": TRAINING_SEED, "grid": {k: list(v) for k, v in GRID.items()},
           "command": command, "table": table}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def tuned_knobs(path: Path = TUNED_PATH) -> EngineKnobs:
    """The shipped winner of the sweep (``tuned_static`` arm)."""
    doc = json.loads(path.read_text())
    return EngineKnobs(**doc["knobs"])
