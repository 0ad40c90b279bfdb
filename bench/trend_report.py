"""Trend prediction, measured: per target (OOM within 5 min; a preemption storm within 5 min) every
model and baseline on the held-out test runs of a TREND dataset, seed spreads of the trained models,
leave-one-workload-out, false alarms per GPU-hour on the calm held-out runs, and the
time-to-exhaustion estimate's error and interval coverage. Prints one JSON object.

    kvguard dataset --preset trend --out /tmp/trend/trend
    nice python bench/trend_report.py --data /tmp/trend/trend.npz [--ship streams/models]

``--ship DIR`` also writes the seed-0 trend trees of each target (``oom_trees``, ``storm_trees``): the
models the figures are of.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--bootstrap", type=int, default=200)
    ap.add_argument("--ship", default=None)
    ap.add_argument("--targets", default="oom,storm")
    ap.add_argument("--no-lowo", action="store_true")
    args = ap.parse_args()
    from kvguard.ml.dataset import TickDataset
    from kvguard.ml.trend_eval import (derived_matrix, evaluate_target, exhaustion_level, lowo, target_dataset,
                                       train_trend_model, tte_evaluation)
    from kvguard.streams.trend_model import save_trend_model

    started = time.monotonic()
    ds = TickDataset.load(args.data)
    out = {"data": args.data, "summary": ds.summary(), "targets": {}}
    for target in args.targets.split(","):
        tds = target_dataset(ds, target)
        X = derived_matrix(tds)
        figures, _ = evaluate_target(tds, X, bootstrap=args.bootstrap)
        block = {"summary": {k: tds.summary()[k] for k in ("train", "val", "test")}, "models": figures}
        if not args.no_lowo:
            block["leave_one_workload_out"] = lowo(tds, X)
        if args.ship:
            model = train_trend_model(tds if target == "oom" else ds, target=target, seed=0,
                                      X=X)
            model.metadata.training["source"] = {"data": args.data, "command": f"python bench/trend_report.py "
                                                 f"--data {args.data} --ship {args.ship}"}
            model.metadata.metrics["held_out"] = figures["trend_trees"]
            save_trend_model(model.trees, model.metadata, f"{args.ship}/{target}_trees")
            block["shipped"] = {"path": f"{args.ship}/{target}_trees", "threshold": model.threshold}
        out["targets"][target] = block
    cap = exhaustion_level(ds)
    out["time_to_exhaustion"] = {w: tte_evaluation(ds, cap, window_s=w) for w in (300.0, 900.0, 1800.0)}
    out["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
