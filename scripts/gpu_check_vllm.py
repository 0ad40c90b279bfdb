"""GPU check of the vLLM plugin (not run in CI): a small real model on CUDA, the plugin attached, a burst of
long prompts; vLLM's and PyTorch's own figures against what kvguard sees and what its twins predict.

    python scripts/gpu_check_vllm.py --model /models/Qwen2.5-0.5B-Instruct [--prompts 48 --prompt-tokens 3000]

Compared, per engine step and at the end:
- KV: kvguard's mirror (fed only by the plugin's rows) against vLLM's used blocks at every step; kvguard's
  scheduler twin (``producers.sim.vllm.scheduler``, driven by the same token ids, all arriving at step 0, on the
  engine's real ``num_gpu_blocks``) against vLLM's schedule (steps, preemptions, identical step fraction);
- memory: each step's transient peak (``max_memory_allocated`` after ``reset_peak_memory_stats`` at the start
  of the step, minus what was allocated then) against the step-memory twin's ``step_plan(...).peak_bytes``
  for the same token and sequence counts (``producers.vllm.step_memory``, eager mode); the mirror's allocator
  layer (the plugin's segment rows) against ``memory_stats`` and a ``_snapshot`` at the end;
- the step governor (``producers.vllm.plugin_governor``, on by default): its calibration's measured peak per step
  against the plan's prediction (``governor.prediction_error`` histogram, the learned factor per step class,
  the steps whose peak exceeded the prediction, with their shape).
The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one GPU, ``enforce_eager``, synchronous
scheduling) so the check can read the scheduler and CUDA directly. Writes the snapshot pickle next to
``--out`` and prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a local model directory (no hub access)")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--out", default="gpu_check_vllm")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    import numpy as np
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvguard.contracts.events import EventKind
    from kvguard.producers.sim.vllm.conformance import ConformanceRequest, KvguardSide
    from kvguard.producers.sim.vllm.scheduler import SchedulerConfig
    from kvguard.producers.vllm import plugin as vllm_plugin
    from kvguard.producers.vllm.step_memory import ModelShape, RunnerConfig, step_plan
    from kvguard.producers.vllm.translator import ListSink
    from kvguard.streams.mirror import AllocatorMirror

    sink = ListSink()
    vllm_plugin.install_scheduler_hook(sink=sink, config=vllm_plugin.PluginConfig(
        node_id="gpu-check/gpu0", snapshot_every_s=5.0, cuda_stats_every_ms=0.0, cuda_segments_every_s=0.5))
    llm = LLM(model=args.model, gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=True,
              enable_prefix_caching=True, async_scheduling=False, seed=0)
    plugin = vllm_plugin.attached_plugins()[-1]
    sched = plugin.scheduler
    mirror = AllocatorMirror(plugin.geometry)
    steps: list[dict] = []
    mark = {}
    inner_schedule, inner_update = sched.schedule, sched.update_from_output

    def schedule(*a, **k):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        mark["allocated"] = torch.cuda.memory_allocated()
        mark["t0"] = time.perf_counter()
        return inner_schedule(*a, **k)

    def update_from_output(out, *a, **k):
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - mark["allocated"]
        result = inner_update(out, *a, **k)
        for batch in sink.batches:
            mirror.apply(batch.events, batch.state)
        sink.batches.clear()
        pool = sched.kv_cache_manager.block_pool
        steps.append({"scheduled": dict(out.num_scheduled_tokens), "tokens": out.total_num_scheduled_tokens,
                      "seqs": len(out.num_scheduled_tokens), "peak_bytes": int(peak),
                      "used_blocks": pool.num_gpu_blocks - 1 - pool.get_num_free_blocks(),
                      "mirror_live": mirror.metrics().live_units, "wall_ms": (time.perf_counter() - mark["t0"]) * 1e3})
        return result

    sched.schedule, sched.update_from_output = schedule, update_from_output
    rng = np.random.default_rng(0)
    vocab = int(llm.llm_engine.model_config.get_vocab_size())
    prompts = [rng.integers(100, vocab - 100, size=args.prompt_tokens).tolist() for _ in range(args.prompts)]
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                 SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0), use_tqdm=False)
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "snapshot.pickle", "wb") as fh:
        pickle.dump(snapshot, fh)
    plugin.memory.sample()  # one last allocator sample after the burst
    plugin.memory._next_segments_ns = 0
    plugin.memory._next_stats_ns = 0
    plugin.memory.sample()
    plugin.translator.flush()
    for batch in sink.batches:
        mirror.apply(batch.events, batch.state)

    # the KV twin on the same requests and the engine's real block count
    sc = sched.scheduler_config
    config = SchedulerConfig(num_gpu_blocks=sched.kv_cache_manager.block_pool.num_gpu_blocks,
                             max_model_len=sched.max_model_len, block_size=sched.block_size,
                             max_num_seqs=sc.max_num_seqs, max_num_batched_tokens=sc.max_num_batched_tokens,
                             long_prefill_token_threshold=sc.long_prefill_token_threshold,
                             scheduler_reserve_full_isl=sc.scheduler_reserve_full_isl, watermark=sc.watermark)
    twin = KvguardSide(config, "tokens")
    real_ids = [s["scheduled"] for s in steps]
    order = list(dict.fromkeys(rid for s in real_ids for rid in s))  # vLLM's request ids, in admission order
    for i, (rid, p) in enumerate(zip(order, prompts)):
        twin.add(ConformanceRequest(rid, 0, 0, 0, args.max_tokens, i, p, ()))
    twin_steps, twin_preempted = [], 0
    while twin.unfinished() and len(twin_steps) < 10 * len(steps) + 100:
        view = twin.step()
        twin_steps.append(dict(view.scheduled))
        twin_preempted += len(view.preempted)
    same = sum(1 for a, b in zip(real_ids, twin_steps) if a == b)

    # the step-memory twin on the same batches
    hf = json.loads((Path(args.model) / "config.json").read_text())
    shape = ModelShape.from_hf_config(hf)
    runner = RunnerConfig(max_num_batched_tokens=sc.max_num_batched_tokens, max_num_seqs=sc.max_num_seqs,
                          cudagraph_mode="NONE")
    busy = [s for s in steps if s["tokens"]]
    real_peak = np.array([s["peak_bytes"] for s in busy], dtype=np.float64)
    twin_peak = np.array([step_plan(shape, runner, s["tokens"], s["seqs"]).peak_bytes for s in busy], dtype=np.float64)
    rel = np.abs(twin_peak - real_peak) / np.maximum(real_peak, 1.0)
    layer = mirror.allocator.metrics()
    segments = [s for s in snapshot["segments"] if s.get("device", 0) == torch.cuda.current_device()]
    print(json.dumps({
        "gpu": torch.cuda.get_device_name(), "vllm": vllm.__version__, "torch": torch.__version__, "model": args.model,
        "num_gpu_blocks": config.num_gpu_blocks, "steps": len(steps), "requests": len(prompts),
        "kv": {"mirror_equals_vllm_every_step": all(s["mirror_live"] == s["used_blocks"] for s in steps),
               "max_used_frac": max(s["used_blocks"] for s in steps) / (config.num_gpu_blocks - 1),
               "preemptions": int(mirror.kind_counts[int(EventKind.PREEMPT)]), "snapshot_drift": mirror.drift_count},
        "kv_twin": {"steps": len(twin_steps), "identical_steps_frac": same / max(1, len(steps)),
                    "preemptions": twin_preempted},
        "step_peak": {"real_p50_bytes": float(np.median(real_peak)), "real_max_bytes": float(real_peak.max()),
                      "twin_p50_bytes": float(np.median(twin_peak)), "twin_max_bytes": float(twin_peak.max()),
                      "rel_err_p50": float(np.median(rel)), "rel_err_p95": float(np.percentile(rel, 95))},
        "allocator": {"reserved_bytes": int(stats["reserved_bytes.all.current"]),
                      "allocated_bytes": int(stats["allocated_bytes.all.current"]),
                      "peak_reserved_bytes": int(stats["reserved_bytes.all.peak"]),
                      "num_alloc_retries": int(stats["num_alloc_retries"]), "num_ooms": int(stats["num_ooms"]),
                      "mirror_reserved_bytes": layer.reserved_bytes, "mirror_allocated_bytes": layer.allocated_bytes,
                      "snapshot_reserved_bytes": sum(s["total_size"] for s in segments),
                      "mirror_equals_snapshot": layer.reserved_bytes == sum(s["total_size"] for s in segments)},
        "step_wall_ms_p50": float(np.median([s["wall_ms"] for s in busy])), "cuda_observer": plugin.memory.status(),
        # the step governor's own measurement (on by default): each step's allocator peak against its plan's
        # prediction, the per-class correction it learned, the error histogram, steps above the prediction
        "governor": plugin.status()["governor"],
        "governor_exceeded": [{"tokens": sh.num_tokens, "seqs": sh.num_seqs, "predicted": p, "measured": m}
                              for sh, p, m in list(plugin.actions.governor.calibration.exceeded)[:10]]
        if plugin.actions.governor is not None else [],
        "snapshot_file": str(out_dir / "snapshot.pickle"),
    }, default=str))


if __name__ == "__main__":
    main()
