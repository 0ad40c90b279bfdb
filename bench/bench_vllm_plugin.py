"""The vLLM plugin's cost per engine step, on CPU, against vLLM 0.33's own scheduler step.

Two copies of vLLM's real v1 ``Scheduler`` (the conformance rig: CPU, weightless config, fake model
step) run the same workload step for step, one bare, one with the plugin attached (hooks,
translator, one batch per step into a deque, as ``KafkaSink.publish`` does on the engine thread).
Runs alternate and the fastest of ``--repeat`` is kept for each (after ``gc.freeze()``, as vLLM's
``EngineCore`` freezes its start-up heap); the plugin's cost per step is the
difference of the two totals over the steps. Reported beside it, and not on the engine thread or
not per step: the publisher thread's encoding of one batch (``encode_batch``), and the periodic
SNAPSHOT (``block_truth``, O(blocks)) amortised over its period of ``--step-ms`` steps.

The target is ≤ 1 % of a real GPU step; ``ratio_to_gpu_step`` divides the CPU-measured µs per step
by ``--step-ms`` (25 ms: a decode step of a mid-size model). vLLM's scheduler step on this CPU is
reported too (``vllm_step_us``). Prints one JSON object.
Usage: .venv/bin/python bench/bench_vllm_plugin.py [--workload azure-conv] [--repeat 5]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from kvguard.producers.sim.vllm.conformance import VllmSide, conformance_requests
from kvguard.producers.sim.vllm.scheduler import SchedulerConfig
from kvguard.producers.sim.workloads import load_workload
from kvguard.producers.vllm.plugin import PluginConfig, VllmPlugin
from kvguard.wire.schemas import encode_batch

CASES = {
    "azure-conv": {"rate_scale": 4, "window": 10, "num_gpu_blocks": 600, "watermark": 0.05,
                   "long_prefill_token_threshold": 256},
    "mooncake-sample": {"rate_scale": 10, "window": 3, "num_gpu_blocks": 3000, "scheduler_reserve_full_isl": False},
}


class DequeSink:
    """What the engine thread does with a batch under Kafka: append it to a deque."""

    def __init__(self) -> None:
        self.queue: deque = deque()
        self.kept: list = []

    def publish(self, batch) -> None:
        self.queue.append(batch)
        if len(self.queue) > 4096:
            self.kept.append(self.queue.popleft()) if len(self.kept) < 64 else self.queue.popleft()


def config_for(case: dict) -> SchedulerConfig:
    blocks = case["num_gpu_blocks"]
    extra = {k: v for k, v in case.items() if k not in ("rate_scale", "window", "num_gpu_blocks")}
    return SchedulerConfig(num_gpu_blocks=blocks, max_model_len=min(32768, (blocks - 1) * 16), block_size=16,
                           max_num_seqs=64, max_num_batched_tokens=2048, **extra)


def run(requests, config: SchedulerConfig, plugin: bool, max_steps: int) -> dict:
    side = VllmSide(config)
    sink = DequeSink()
    attached = None
    if plugin:
        attached = VllmPlugin(side.scheduler, config=PluginConfig(node_id="bench/gpu0", snapshot_every_s=1e9),
                              sink=sink).attach()
    gc.collect()
    gc.freeze()  # as vLLM's EngineCore does once it is built (freeze_gc_heap): start-up objects leave the GC
    pending = deque(requests)
    clock = steps = 0
    stepping_s = 0.0
    while steps < max_steps:
        if pending and not side.unfinished():
            clock = max(clock, pending[0].arrival_step)
        while pending and pending[0].arrival_step <= clock:
            side.add(pending.popleft())
        if not pending and not side.unfinished():
            break
        t0 = time.perf_counter()
        side.step()
        stepping_s += time.perf_counter() - t0
        steps += 1
        clock += 1
    out = {"steps": steps, "stepping_s": stepping_s, "side": side, "plugin": attached, "sink": sink}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="azure-conv", choices=sorted(CASES))
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--max-steps", type=int, default=20_000)
    parser.add_argument("--step-ms", type=float, default=25.0, help="the GPU step the ratio is taken against")
    parser.add_argument("--snapshot-every-s", type=float, default=60.0)
    args = parser.parse_args()
    case = CASES[args.workload]
    config = config_for(case)
    requests = conformance_requests(load_workload(args.workload, rate_scale=case["rate_scale"],
                                                  window=case["window"]).requests,
                                    block_size=16, step_duration_s=args.step_ms / 1000)
    run(requests, config, True, 50)  # warm-up: vLLM's first scheduler build and imports
    bare_s, plugin_s = [], []
    last = None
    for _ in range(args.repeat):
        bare = run(requests, config, False, args.max_steps)
        with_plugin = run(requests, config, True, args.max_steps)
        if bare["steps"] != with_plugin["steps"]:
            raise SystemExit(f"the plugin changed vLLM's schedule: {bare['steps']} vs {with_plugin['steps']} steps")
        bare_s.append(bare["stepping_s"])
        plugin_s.append(with_plugin["stepping_s"])
        last = with_plugin
    steps = last["steps"]
    vllm_us = min(bare_s) / steps * 1e6
    plugin_us = max(0.0, (min(plugin_s) - min(bare_s)) / steps * 1e6)
    translator = last["plugin"].translator
    batches = list(last["sink"].queue)[-200:]
    t0 = time.perf_counter()
    for b in batches:
        encode_batch(b)
    encode_us = (time.perf_counter() - t0) / max(1, len(batches)) * 1e6
    attachment = last["plugin"].attachment
    t0 = time.perf_counter()
    for _ in range(5):
        attachment.block_truth()
    truth_ms = (time.perf_counter() - t0) / 5 * 1e3
    steps_per_snapshot = args.snapshot_every_s * 1000 / args.step_ms
    snapshot_us_per_step = truth_ms * 1000 / steps_per_snapshot
    total_us = plugin_us + snapshot_us_per_step
    print(json.dumps({
        "bench": "vllm_plugin", "workload": args.workload, "num_gpu_blocks": config.num_gpu_blocks,
        "steps": steps, "repeat": args.repeat, "rows_per_step": round(translator.rows_total / steps, 2),
        "vllm_step_us": round(vllm_us, 2), "plugin_us_per_step": round(plugin_us, 2),
        "plugin_frac_of_cpu_vllm_step": round(plugin_us / vllm_us, 4),
        "snapshot_block_truth_ms": round(truth_ms, 3), "snapshot_us_per_step_amortised": round(snapshot_us_per_step, 3),
        "engine_thread_us_per_step": round(total_us, 2),
        "gpu_step_ms": args.step_ms, "ratio_to_gpu_step": round(total_us / (args.step_ms * 1000), 5),
        "target_ratio": 0.01, "meets_target": total_us / (args.step_ms * 1000) <= 0.01,
        "publisher_thread_encode_us_per_batch": round(encode_us, 2),
        "bare_s": [round(x, 4) for x in bare_s], "plugin_s": [round(x, 4) for x in plugin_s],
        "rows_total": int(translator.rows_total), "p50_rows_per_batch": float(np.median([len(b) for b in batches]))
        if batches else 0.0,
    }))


if __name__ == "__main__":
    main()
