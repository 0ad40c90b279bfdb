"""The tuned_static baseline (issue 12): sweep vLLM's start-up knobs on the training workloads only.

    python bench/sweep_static.py [--workers N] [--write]

Prints the ranked table as JSON (best first); ``--write`` stores the winner and the table in
kvguard/ops/tuned_static.json, which `kvguard demo`'s tuned_static arm reads.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from rich.progress import Progress

from kvguard.ops import static_sweep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    ap.add_argument("--write", action="store_true", help="store the winner in kvguard/ops/tuned_static.json")
    args = ap.parse_args()
    jobs = len(static_sweep.grid()) * len(static_sweep.TRAINING_RUNS)
    t0 = time.perf_counter()
    with Progress(transient=True) as bar:
        task = bar.add_task(f"{jobs} training runs", total=jobs)
        table = static_sweep.sweep(workers=args.workers, progress=lambda: bar.advance(task))
    wall = round(time.perf_counter() - t0, 1)
    if args.write:
        static_sweep.write_tuned(table, "python bench/sweep_static.py --write")
    summary = [{k: r[k] for k in ("knobs", "slo_attainment", "slo_goodput_tokens_per_s", "ooms", "preemptions")}
               for r in table]
    sys.stdout.write(json.dumps({"configs": len(table), "runs": jobs, "wall_seconds": wall, "best": table[0]["knobs"],
                                 "table": summary}) + "\n")


if __name__ == "__main__":
    main()
