"""The drain-and-restart guard on a held-out leak run, against the same run without it (the crash it
replaces). Prints one JSON object: both runs' OOMs, failed/rejected requests, SLO attainment, and the
guard's counters and actions.

    nice python bench/trend_drain_restart.py --workload azure-conv --rate-scale 0.6 --gpus 2 \
        --leak 6GiB/h --duration 3600 --seed 7
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="azure-conv")
    ap.add_argument("--rate-scale", type=float, default=0.6)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--leak", default="6GiB/h")
    ap.add_argument("--duration", type=float, default=3600.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--model", default=None, help="trend model (default: the shipped one)")
    ap.add_argument("--capacity", type=float, default=None, help="the guard's capacity (reserved share outside KV "
                    "at which growth OOMs happen: kvguard.ml.trend_eval.exhaustion_level of the train runs); "
                    "default: drain as soon as P(OOM) is confirmed")
    ap.add_argument("--drain-tte-s", type=float, default=180.0)
    args = ap.parse_args()
    from kvguard.ml.dataset import RunSpec
    from kvguard.ml.trend import VLLM_PROFILE
    from kvguard.ml.trend_act import compare
    from kvguard.streams.loader import load_predictor
    from kvguard.streams.metrics import FEATURE_NAMES

    predictor = load_predictor(args.model, expected_features=list(FEATURE_NAMES))
    spec = RunSpec(args.workload, args.rate_scale, VLLM_PROFILE, seed=args.seed, duration_s=args.duration,
                   n_gpus=args.gpus, split="test", leak=args.leak)
    from kvguard.policy.drain_guard import DrainRestartConfig

    config = DrainRestartConfig(p_threshold=float(predictor.threshold), capacity=args.capacity,
                                drain_tte_s=args.drain_tte_s)
    print(json.dumps(compare(spec, predictor, config=config)))


if __name__ == "__main__":
    main()
