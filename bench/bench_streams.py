"""In-process stream core throughput: allocator events per CPU-second (per core).

Generates a realistic shadow-engine log (``producers.sim.fleet``: N GPUs, a scenario at a rate that
keeps them busy, producer-like flushes every ``--flush-s`` of event time), then runs the log through
``AllocatorMirror`` alone, ``StreamCore.process`` per batch, and ``StreamCore.process_many`` over
chunks of batches (how the Faust agent and the embedded runner feed it). Figures are per CPU
second of this process (``time.process_time``), the best of ``--repeat`` runs, so other load on the
machine does not halve them. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvguard.contracts.units import NS_PER_S


def make_log(gpus: int, seconds: float, scenario: str, rate_scale: float, flush_s: float, seed: int):
    from kvguard.producers.sim.fleet import Fleet
    from kvguard.producers.sim.profiles import load_profile
    from kvguard.producers.sim.workloads import load_workload

    profile = load_profile()
    workload = load_workload(scenario, rate_scale=rate_scale, window=seconds, seed=seed)
    fleet = Fleet(gpus, profile, seed=seed)
    fleet.submit_workload(workload)
    batches = []
    step = int(flush_s * NS_PER_S)
    for now in range(step, int(seconds * NS_PER_S) + 1, step):
        fleet.advance(now)
        batches.extend(fleet.take_batches(now))
    return batches, fleet.summary()


def best_cpu_seconds(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=900.0)
    ap.add_argument("--scenario", default="mixed")
    ap.add_argument("--rate-scale", type=float, default=4.0)
    ap.add_argument("--flush-s", type=float, default=1.0)
    ap.add_argument("--chunk", type=int, default=64, help="batches per process_many call")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)

    from kvguard.streams.core import StreamConfig, StreamCore
    from kvguard.streams.mirror import AllocatorMirror

    t0 = time.perf_counter()
    batches, summary = make_log(args.gpus, args.seconds, args.scenario, args.rate_scale, args.flush_s, args.seed)
    gen_s = time.perf_counter() - t0
    n_events = sum(len(b) for b in batches)

    def mirrors_only():
        mirrors = {}
        for b in batches:
            m = mirrors.get(b.node)
            if m is None:
                m = mirrors[b.node] = AllocatorMirror(b.geometry)
            m.apply(b.events, b.state)

    ticks = []

    def per_batch():
        core = StreamCore(StreamConfig())
        ticks.clear()
        for b in batches:
            ticks.extend(core.process(b)[0])

    def chunked():
        core = StreamCore(StreamConfig())
        for i in range(0, len(batches), args.chunk):
            core.process_many(batches[i:i + args.chunk])

    mirror_s = best_cpu_seconds(mirrors_only, args.repeat)
    batch_s = best_cpu_seconds(per_batch, args.repeat)
    chunk_s = best_cpu_seconds(chunked, args.repeat)
    out = {
        "bench": "streams_core",
        "gpus": args.gpus, "sim_seconds": args.seconds, "scenario": args.scenario, "rate_scale": args.rate_scale,
        "events": n_events, "batches": len(batches), "events_per_batch": round(n_events / max(len(batches), 1), 1),
        "ticks": len(ticks), "events_per_tick": round(n_events / max(len(ticks), 1), 1),
        "ooms": summary.ooms, "preemptions": summary.preemptions,
        "mirror_events_per_cpu_s": round(n_events / mirror_s),
        "core_events_per_cpu_s": round(n_events / batch_s),
        "core_chunked_events_per_cpu_s": round(n_events / chunk_s),
        "chunk_batches": args.chunk,
        "target_events_per_s": 1_000_000,
        "log_generation_s": round(gen_s, 2),
    }
    json.dump(out, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
