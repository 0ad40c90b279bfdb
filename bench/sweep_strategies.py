"""The strategy space, measured (issue 12): each of the 243 strategies of policy/strategy.py as the
closed loop's DEFAULT, on the training workloads only, ranked by SLO attainment.

    python bench/sweep_strategies.py [--profile P] [--gpus 2] [--duration-s 300] [--workers 2]
                                     [--limit N] [--plot strategies.png]

Every strategy keeps DEFAULT's numbers (thresholds, targets) and changes the five choices. The
runs use the demo's operator configuration on vLLM profiles (gpu_memory_utilization 0.95, 5 % of
requests with prompt logprobs) and the training runs of the static sweep
(kvguard/ops/static_sweep.py TRAINING_RUNS); held-out workloads never enter. Prints one JSON
object: the ranked table (mean SLO attainment, SLO goodput, OOMs, preemptions over the runs) and
where the presets rank; ``--plot`` draws the ranking.
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

from kvguard.ops.static_sweep import TRAINING_PROMPT_LOGPROBS_FRAC, TRAINING_RUNS
from kvguard.policy.strategy import DEFAULT, all_strategies

OPERATOR_UTILIZATION = 0.95


def run_strategy(job: tuple) -> dict:
    from kvguard.producers.sim.profiles import EngineKnobs, load_profile
    from kvguard.producers.sim.registry import engine_kind
    from kvguard.runtime.bootstrap import bootstrap
    from kvguard.runtime.embedded import demo_workload, run_embedded

    choices, profile, gpus, duration_s = job
    logging.disable(logging.WARNING)
    kind = engine_kind(load_profile(profile))
    graph = bootstrap(profile=profile, predictor=None, strategy_overrides={"default": choices},
                      knobs=EngineKnobs(gpu_memory_utilization=OPERATOR_UTILIZATION) if kind.takes_knobs else None,
                      node_config=kind.node_config(prompt_logprobs_frac=TRAINING_PROMPT_LOGPROBS_FRAC)
                      if kind.capabilities.prompt_logprobs else None)
    runs = []
    for workload, rate in TRAINING_RUNS:
        wl = demo_workload(graph.profile, workload=workload, rate_scale=rate, duration_s=duration_s, seed=0)
        s = asyncio.run(run_embedded(graph, wl, n_gpus=gpus, duration_s=duration_s, seed=0, guarded=True)).summary
        runs.append({k: s[k] for k in ("ooms", "preemptions", "slo_attainment", "slo_goodput_tokens_per_s")})
    n = len(runs)
    return {"variant": graph.engine_config.default.variant, "choices": choices,
            "slo_attainment": round(sum(r["slo_attainment"] or 0.0 for r in runs) / n, 6),
            "slo_goodput_tokens_per_s": round(sum(r["slo_goodput_tokens_per_s"] for r in runs) / n, 3),
            "ooms": sum(r["ooms"] for r in runs), "preemptions": sum(r["preemptions"] for r in runs)}


def plot(table: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 3.5))
    ax.bar(range(len(table)), [r["slo_attainment"] for r in table], color="#4c72b0", width=1.0)
    for i, r in enumerate(table):
        if r["variant"] == DEFAULT.variant:
            ax.axvline(i, color="#c44e52", lw=1)
            ax.annotate("DEFAULT", (i, r["slo_attainment"]), fontsize=8, color="#c44e52")
    ax.set_xlabel("strategy (ranked)")
    ax.set_ylabel("mean SLO attainment")
    ax.set_ylim(min(r["slo_attainment"] for r in table) * 0.98, 1.0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=None)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--duration-s", type=float, default=300.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--limit", type=int, default=None, help="only the first N strategies (a smoke run)")
    ap.add_argument("--plot", default=None, help="write the ranking as a PNG here")
    args = ap.parse_args()
    strategies = all_strategies()[: args.limit]
    jobs = [({k: str(v) for k, v in zip(("granularity", "selection", "timing", "handling", "trigger"), s.key)},
             args.profile, args.gpus, args.duration_s) for s in strategies]
    t0 = time.perf_counter()
    table = []
    with Progress(transient=True) as bar, ProcessPoolExecutor(max_workers=args.workers) as pool:
        task = bar.add_task(f"{len(jobs)} strategies x {len(TRAINING_RUNS)} training runs", total=len(jobs))
        for row in pool.map(run_strategy, jobs):
            table.append(row)
            bar.advance(task)
    table.sort(key=lambda r: (-r["slo_attainment"], -r["slo_goodput_tokens_per_s"], r["ooms"]))
    rank = {r["variant"]: i + 1 for i, r in enumerate(table)}
    if args.plot:
        plot(table, args.plot)
    sys.stdout.write(json.dumps({"strategies": len(table), "wall_seconds": round(time.perf_counter() - t0, 1),
                                 "default_rank": rank.get(DEFAULT.variant), "best": table[0],
                                 "training_runs": [list(r) for r in TRAINING_RUNS], "table": table}) + "\n")


if __name__ == "__main__":
    main()
