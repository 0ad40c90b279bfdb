"""Tier-3 inference time per tick for a fleet of GPUs on CPU (docs/ARCHITECTURE.md "Targets": 1,000 GPUs x
30-minute windows <= 20 ms per tick). Prints one JSON object.

The shipped model is gradient-boosted trees over one tick (``streams.tick_model``): its one path,
``predict`` on [n, 1, F], is timed. For the LSTM (``--model streams/models/oom_lstm``) two paths
are timed with the same model:
- ``window``: ``LSTMPredictor.predict`` on [n, 180, F] windows (the ``Predictor`` protocol's
  path, used by the stream core for predictors without ``step``): 180 LSTM steps per node per tick.
- ``stateful``: ``LSTMPredictor.step`` keeps each node's (h, c) and advances one step per tick;
  what ``StreamCore`` calls for the LSTM (``prime`` once per node, then ``step``).
It also reports how far the two paths' P(OOM) drift apart on a simulated hour of real features.

    .venv/bin/python bench/bench_predictor.py [--nodes 1000] [--threads 1] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1000.0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default=None, help="model artifact; default: the shipped one (else random weights)")
    args = parser.parse_args()

    import torch

    from kvguard.streams.loader import load_predictor
    from kvguard.streams.lstm import LSTMPredictor, ModelError, ModelMetadata, Normalisation, OOMNet
    from kvguard.streams.metrics import FEATURE_NAMES
    from kvguard.streams.predictor import window_from_history

    try:
        predictor = load_predictor(args.model, expected_features=list(FEATURE_NAMES), threads=args.threads)
        source = args.model or "shipped"
    except ModelError:
        torch.manual_seed(0)
        meta = ModelMetadata(feature_names=list(FEATURE_NAMES),
                             normalisation=Normalisation.fit(np.zeros((2, len(FEATURE_NAMES)))))
        predictor = LSTMPredictor(OOMNet(len(FEATURE_NAMES)), meta, threads=args.threads)
        source = "random weights (no shipped model found)"
    n, window, f = args.nodes, predictor.window_ticks, len(FEATURE_NAMES)
    rng = np.random.default_rng(0)
    if not hasattr(predictor, "step"):  # a per-tick model: one tick per node, no state
        ticks = np.abs(rng.normal(size=(n, 1, f))).astype(np.float32) * 0.3
        predictor.predict(ticks[:8])  # warm up
        tick_ms = timed(lambda: predictor.predict(ticks), args.repeats * 4)
        print(json.dumps({"bench": "predictor", "model": source, "kind": type(predictor).__name__, "nodes": n,
                          "features": f, "ms_per_tick": {"median": round(statistics.median(tick_ms), 2),
                                                         "min": round(min(tick_ms), 2)},
                          "target_ms": 20.0, "meets_target": statistics.median(tick_ms) <= 20.0}))
        return
    history = np.abs(rng.normal(size=(n, window + 20, f))).astype(np.float32) * 0.3
    windows = history[:, -window:]
    nodes = [f"bench/gpu{i}" for i in range(n)]

    predictor.predict(windows[:8])  # warm up
    window_ms = timed(lambda: predictor.predict(windows), args.repeats)

    for t in range(window):  # bring every node's state to a full window of history
        predictor.step(nodes, history[:, t])
    step_ms = timed(lambda: predictor.step(nodes, history[:, window]), args.repeats * 4)

    # agreement on realistic inputs: a simulated hour (shadow engine + stream core), 12 nodes
    # starting at different offsets, stateful vs exact padded windows over 240 ticks
    from kvguard.ml.dataset import RunSpec, simulate_run

    run = simulate_run(RunSpec("azure-code", 0.34, duration_s=3600, split="test")).sequences[0].features
    k, ticks = 12, 240
    seq = np.stack([run[i * 10: i * 10 + ticks] for i in range(k)])
    agree = LSTMPredictor(predictor.net, predictor.metadata, threads=None)
    diffs = []
    for t in range(ticks):
        p_step, _ = agree.step(nodes[:k], seq[:, t])
        wins = np.stack([window_from_history(seq[i, :t + 1], window) for i in range(k)])
        p_win, _ = predictor.predict(wins)
        diffs.append(np.abs(p_step - p_win).max())

    print(json.dumps({
        "bench": "predictor",
        "model": source,
        "nodes": n,
        "window_ticks": window,
        "features": f,
        "torch_threads": torch.get_num_threads(),
        "window_ms_per_tick": {"median": round(statistics.median(window_ms), 2), "min": round(min(window_ms), 2)},
        "stateful_ms_per_tick": {"median": round(statistics.median(step_ms), 3), "min": round(min(step_ms), 3)},
        "target_ms": 20.0,
        "window_meets_target": statistics.median(window_ms) <= 20.0,
        "stateful_meets_target": statistics.median(step_ms) <= 20.0,
        "stateful_vs_window_max_abs_diff_p": round(float(max(diffs)), 5),
    }))


if __name__ == "__main__":
    main()
