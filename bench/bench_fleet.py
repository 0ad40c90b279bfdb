"""Fleet-scale load and soak: 1,000 GPUs' event batches through the stream core and the policy engine.

The shadow engine records ``--record-gpus`` GPUs for ``--record-s`` simulated seconds
(``producers.sim.fleet``: a batch per GPU per second of event time, a snapshot a minute); each of the
``--gpus`` simulated GPUs replays one of those streams under its own name, all of them in
event-time order (as one partition delivers them), as fast as the stages go. A GPU replays the
recording over and over, each time as a producer restart (a new epoch: the core and the policy
start that node's state over), so a soak runs as long as asked on a fixed recording. GPU ``i``
joins the fleet ``i / gpus`` of a pass late, so its restarts are spread over time as in a fleet,
not all in one chunk.

Per chunk of ``--chunk`` batches (``streams.chunk_max_records``, as the Faust agent takes them):

  wire    JSON bytes -> EventBatch (``kvguard.wire.schemas.decode_batch``, the worker's decode);
  core    ``StreamCore.process_many`` (ticks, alerts);
  policy  ``PolicyEngine.decide`` per tick (the budget ledger left out).

A chunk's decision latency is the three together: from its bytes to its ticks' decisions, in
process (the bus and the agent's wait to fill a chunk are not in it; ``bench_decision_latency.py``
measures those end to end). Throughput counts the stages' wall time, not the replay's own.

Phases: (1) soak: one worker for ``--soak-s`` wall seconds, RSS sampled every ``--rss-every-s``,
growth measured from the end of ``--warmup-passes`` passes to the end of the soak, and per GPU
above the RSS before any node's state (a mirror holds its occupied runs and references, not
D-sized arrays: ``mirror_bytes_per_gpu``); (2) scale-out: the second pass (the
first builds every node's state) with one worker process, then with ``--workers`` processes,
each owning the nodes of its partitions (``crc32(node) % workers``, as Kafka keys records by
node); ``ratio_wall`` is fleet events/s with N workers over events/s with one (it cannot exceed
the free cores: ``cpu_count`` and ``load_avg_1m`` in the output), ``ratio_cpu`` the same by CPU
time: the workers' events per CPU-second summed, over one worker's (what N free cores would give).

CPU time per stage (``stage_events_per_cpu_s``) gives ``fleet_path_over_core``: the in-process
core's CPU-seconds over the whole path's (decode + core + policy), in the same run.

"No lost tick": every node's every full pass must give as many ticks as its first (same events,
same times), and no batch may be rejected, dropped or missing (``core_counters``, ``seq_gaps``).

Each node's state lives ``--record-s`` of event time per epoch: a long soak wants a long
recording (``--soak-s 1800 --record-s 120``: a pass of ~2 minutes of event time).

Usage: .venv/bin/python bench/bench_fleet.py [--gpus 1000] [--soak-s 50] [--workers 2]
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import multiprocessing as mp
import os
import sys
import time
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvguard.config.settings import Settings
from kvguard.contracts.units import NS_PER_S
from kvguard.policy.engine import PolicyEngine
from kvguard.producers.sim.fleet import Fleet
from kvguard.producers.sim.profiles import load_profile
from kvguard.producers.sim.workloads import load_workload
from kvguard.runtime.bootstrap import engine_config_from
from kvguard.runtime.mapping import stream_config
from kvguard.streams.core import StreamCore
from kvguard.wire.schemas import decode_batch, encode_batch

# the recording: per second of event time, the recorded GPUs' batches as wire bytes (None: no
# batch); a module global so that forked workers share it instead of receiving a copy
RECORDING: list[list[bytes | None]] = []
PACKED = False  # --columns packed: the batches as the publisher writes them with packed_columns


def record(gpus: int, seconds: float, scenario: str, rate_scale: float, profile_name: str | None,
           seed: int) -> tuple[list[list[bytes | None]], int]:
    profile = load_profile(profile_name)
    fleet = Fleet(gpus, profile, seed=seed)
    fleet.submit_workload(load_workload(scenario, rate_scale=rate_scale, window=seconds, seed=seed))
    index = {node: i for i, node in enumerate(fleet.nodes)}
    out, events = [], 0
    for now in range(NS_PER_S, int(seconds * NS_PER_S) + 1, NS_PER_S):
        fleet.advance(now)
        row: list[bytes | None] = [None] * gpus
        for batch in fleet.take_batches(now):
            row[index[batch.node]] = encode_batch(batch, packed=PACKED)
            events += len(batch)
        out.append(row)
    return out, events


def policy_engine(profile_name: str | None) -> PolicyEngine:
    config = engine_config_from(Settings.load(env={}), load_profile(profile_name), {})
    return PolicyEngine(config, secret=b"bench-fleet-secret-of-32-bytes!!")


def node_name(i: int) -> str:
    return f"fleet-{i // 8:03d}/gpu{i % 8}"


def fleet_nodes(gpus: int, index: int = 0, workers: int = 1) -> list[tuple[int, str]]:
    """The nodes (number, name) of one worker's partitions."""
    return [(i, node_name(i)) for i in range(gpus) if zlib.crc32(node_name(i).encode()) % workers == index]


def fleet_stream(nodes: list[tuple[int, str]], gpus: int, record_gpus: int):
    """(global pass, node, its epoch, wire bytes) in event-time order, without end. GPU ``i``
    starts ``i * rows // gpus`` rows late and then replays the recording back to back."""
    rows = len(RECORDING)
    start = {name: i * rows // gpus for i, name in nodes}
    r = 0
    while True:
        for i, name in nodes:
            local = r - start[name]
            if local < 0:
                continue
            value = RECORDING[local % rows][i % record_gpus]
            if value is not None:
                yield r // rows, name, local // rows, value
        r += 1


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Worker:
    """One stream worker: decode, core, policy per chunk; stage timings and counts."""

    def __init__(self, nodes: list[tuple[int, str]], args: argparse.Namespace):
        settings = Settings.load(env={})
        self.core = StreamCore(stream_config(settings))
        self.engine = policy_engine(args.profile)
        self.chunk = args.chunk
        self.stream = fleet_stream(nodes, args.gpus, args.record_gpus)
        self.pass_no = 0
        self.events = self.batches = self.ticks = self.commands = self.stale = 0
        self.cpu_s = 0.0
        self.stage_cpu_s = {"wire": 0.0, "core": 0.0, "policy": 0.0}
        # per node: [its current epoch, that epoch's ticks, ticks of its first full epoch, all equal]
        self.passes: dict[str, list] = {}
        self.stage_s: dict[str, list[float]] = {"wire": [], "core": [], "policy": [], "decision": []}

    def step(self) -> int:
        """One chunk through the stages; returns the global pass it ended in."""
        raw = [next(self.stream) for _ in range(self.chunk)]
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        batches = [dataclasses.replace(decode_batch(value), node=name, epoch=epoch) for _, name, epoch, value in raw]
        t1, cpu1 = time.perf_counter(), time.process_time()
        ticks, _alerts = self.core.process_many(batches)
        t2, cpu2 = time.perf_counter(), time.process_time()
        for tick in ticks:
            decision = self.engine.decide(tick)
            self.commands += len(decision.commands)
            self.stale += bool(decision.stale)
        t3, cpu3 = time.perf_counter(), time.process_time()
        self.cpu_s += cpu3 - cpu0
        self.stage_cpu_s["wire"] += cpu1 - cpu0
        self.stage_cpu_s["core"] += cpu2 - cpu1
        self.stage_cpu_s["policy"] += cpu3 - cpu2
        for name, seconds in (("wire", t1 - t0), ("core", t2 - t1), ("policy", t3 - t2), ("decision", t3 - t0)):
            self.stage_s[name].append(seconds)
        self.batches += len(batches)
        self.events += sum(len(b) for b in batches)
        self.ticks += len(ticks)
        for t in ticks:  # a node's ticks come in order, and a chunk may hold two of its epochs
            self._epoch_starts(t.node, t.epoch)
            self.passes[t.node][1] += 1
        for _, name, epoch, _ in raw:  # a pass that gave no tick ends too
            self._epoch_starts(name, epoch)
        self.pass_no = raw[-1][0]
        return self.pass_no

    @property
    def busy_s(self) -> float:
        return float(sum(self.stage_s["decision"]))

    def _epoch_starts(self, node: str, epoch: int) -> None:
        """A node's tick or batch of ``epoch``: a newer one ends the node's pass, whose ticks must
        equal its first full pass's (bounded bookkeeping: a soak must not grow the bench itself)."""
        state = self.passes.get(node)
        if state is None:
            self.passes[node] = [epoch, 0, None, True]
        elif epoch > state[0]:
            if state[2] is None:
                state[2] = state[1]
            state[3] = state[3] and state[1] == state[2]
            state[0], state[1] = epoch, 0

    def full_passes(self) -> dict:
        """Ticks of every node's finished passes: equal per node when no tick was lost."""
        full = [s for s in self.passes.values() if s[2] is not None]
        return {"nodes_with_a_full_pass": len(full), "ticks_per_full_pass": sorted({s[2] for s in full})[:8],
                "ticks_equal_every_pass": all(s[3] for s in full)}

    def figures(self) -> dict:
        busy = self.busy_s
        latency = {name: {f"p{q}_ms": round(float(np.percentile(v, q)) * 1e3, 1) for q in (50, 99)}
                   | {"max_ms": round(max(v) * 1e3, 1)} for name, v in self.stage_s.items() if v}
        return {"events": self.events, "batches": self.batches, "ticks": self.ticks, "commands": self.commands,
                "stale_decisions": self.stale, "chunks": len(self.stage_s["decision"]),
                "events_per_s": round(self.events / busy) if busy else None,
                "events_per_cpu_s": round(self.events / self.cpu_s) if self.cpu_s else None,
                "cpu_s_per_million_events": round(self.cpu_s / self.events * 1e6, 3) if self.events else None,
                "stage_events_per_cpu_s": {k: round(self.events / v) if v else None for k, v in self.stage_cpu_s.items()},
                # the fleet path (decode + core + policy) over the in-process core alone, both by CPU time
                "fleet_path_over_core": round(self.stage_cpu_s["core"] / self.cpu_s, 3) if self.cpu_s else None,
                "ticks_per_s": round(self.ticks / busy, 1) if busy else None,
                "stage_share": {name: round(sum(self.stage_s[name]) / busy, 3) for name in ("wire", "core", "policy")}
                if busy else None,
                "latency_per_chunk": latency, "core_counters": self.core.counters.as_dict(),
                "seq_gaps": sum(st.gaps for st in self.core.nodes.values()),
                "policy_counters": {k: getattr(self.engine.counters, k) for k in ("restarts", "stale_ticks",
                                                                                   "epoch_jumps_rejected")
                                    if hasattr(self.engine.counters, k)}}


def soak(args) -> dict:
    gc.collect()
    baseline = rss_mb()  # the interpreter, the imports and the recording, before any node's state
    worker = Worker(fleet_nodes(args.gpus), args)
    start = time.monotonic()
    samples = [(0.0, round(rss_mb(), 1))]
    pass_ends = []  # (t, rss) as each global pass ends
    next_sample = args.rss_every_s
    while (elapsed := time.monotonic() - start) < args.soak_s:
        if worker.step() > len(pass_ends):
            pass_ends.append((round(elapsed, 1), round(rss_mb(), 1)))
        if elapsed >= next_sample:
            samples.append((round(elapsed, 1), round(rss_mb(), 1)))
            next_sample += args.rss_every_s
    end = (round(time.monotonic() - start, 1), round(rss_mb(), 1))
    samples.append(end)
    warm = pass_ends[args.warmup_passes - 1] if len(pass_ends) >= args.warmup_passes else None
    out = worker.figures()
    out.update(worker.full_passes())
    out.update({
        "wall_s": end[0], "passes_completed": len(pass_ends), "rss_at_pass_end_mb": [r for _, r in pass_ends],
        "rss_mb": samples, "warmup_passes": args.warmup_passes, "warmup_s": warm[0] if warm else None,
        "rss_after_warmup_mb": warm[1] if warm else None, "rss_end_mb": end[1],
        "rss_growth_after_warmup_pct": round((end[1] - warm[1]) / warm[1] * 100, 2) if warm else None,
        "rss_per_gpu_mb": round(end[1] / args.gpus, 3),
        "rss_baseline_mb": round(baseline, 1),
        "rss_per_gpu_above_baseline_mb": round((end[1] - baseline) / args.gpus, 3),
        "mirror_bytes_per_gpu": round(sum(st.mirror.nbytes for st in worker.core.nodes.values() if st.mirror is not None)
                                      / max(1, len(worker.core.nodes))),
    })
    return out


def _scale_worker(index: int, n: int, args, barrier, results) -> None:
    nodes = fleet_nodes(args.gpus, index, n)
    worker = Worker(nodes, args)
    barrier.wait()
    while worker.step() < 1:  # the first pass: every node joins, its state is built
        pass
    events, t0, cpu0 = worker.events, time.monotonic(), worker.cpu_s
    while worker.step() < 2:  # the second, measured: a fleet in its steady state
        pass
    results.put({"worker": index, "nodes": len(nodes), "events": worker.events - events, "start": t0,
                 "end": time.monotonic(), "cpu_s": worker.cpu_s - cpu0})


def scale_out(n: int, args) -> dict:
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_scale_worker, args=(i, n, args, barrier, results)) for i in range(n)]
    for p in procs:
        p.start()
    parts = [results.get() for _ in procs]
    for p in procs:
        p.join()
    wall = max(r["end"] for r in parts) - min(r["start"] for r in parts)
    events = sum(r["events"] for r in parts)
    # capacity by CPU time: each worker's events per CPU-second, summed (what N free cores would do)
    capacity = sum(r["events"] / r["cpu_s"] for r in parts if r["cpu_s"] > 0)
    return {"workers": n, "events": events, "wall_s": round(wall, 2), "events_per_s": round(events / wall),
            "cpu_s": round(sum(r["cpu_s"] for r in parts), 2), "events_per_cpu_s_summed": round(capacity),
            "nodes_per_worker": sorted(r["nodes"] for r in parts)}


def main(argv=None) -> int:
    global RECORDING, PACKED
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=1000)
    ap.add_argument("--record-gpus", type=int, default=16, help="GPUs the shadow engine records")
    ap.add_argument("--record-s", type=float, default=15.0, help="simulated seconds recorded (one pass)")
    ap.add_argument("--scenario", default="mixed")
    ap.add_argument("--rate-scale", type=float, default=4.0)
    ap.add_argument("--profile", default="llama3-70b-tp8-80gb", help="profile of the recorded GPUs")
    ap.add_argument("--chunk", type=int, default=1000, help="batches per chunk (streams.chunk_max_records)")
    ap.add_argument("--soak-s", type=float, default=50.0, help="wall seconds of the one-worker soak")
    ap.add_argument("--warmup-passes", type=int, default=3)
    ap.add_argument("--rss-every-s", type=float, default=10.0)
    ap.add_argument("--workers", type=int, default=2, help="processes of the scale-out phase (< 2: skip it)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--columns", choices=("packed", "json"), default="packed",
                    help="wire form of the batches (packed: NodePublisher(packed_columns=True))")
    args = ap.parse_args(argv)
    for name in ("gpus", "record_gpus", "chunk", "warmup_passes"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: expected >= 1")
    if not args.record_s >= 1:
        ap.error("--record-s: expected >= 1")
    PACKED = args.columns == "packed"
    logging.disable(logging.WARNING)  # every pass restarts every node, each logged; the counters say it

    t0 = time.perf_counter()
    RECORDING, recorded_events = record(args.record_gpus, args.record_s, args.scenario, args.rate_scale,
                                        args.profile, args.seed)
    record_s = time.perf_counter() - t0
    out = {
        "bench": "fleet", "gpus": args.gpus, "record_gpus": args.record_gpus, "record_s": args.record_s,
        "profile": args.profile, "columns": args.columns, "scenario": args.scenario, "rate_scale": args.rate_scale, "chunk": args.chunk,
        "recorded_events": recorded_events, "recording_wall_s": round(record_s, 2), "cpu_count": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "fleet_events_per_event_s": round(recorded_events / args.record_s * args.gpus / args.record_gpus),
        "soak_s": args.soak_s, "soak": soak(args),
        "targets": {"rss_growth_after_warmup_pct": 5, "scale_out_ratio": 1.7, "decision_p99_ms": 500},
    }
    out["soak"]["x_real_time"] = round(out["soak"]["events_per_s"] / out["fleet_events_per_event_s"], 2)
    gc.collect()
    if args.workers >= 2:
        single = scale_out(1, args)
        many = scale_out(args.workers, args)
        out["scale_out"] = {"one": single, "many": many,
                            "ratio_wall": round(many["events_per_s"] / single["events_per_s"], 2),
                            "ratio_cpu": round(many["events_per_cpu_s_summed"] / single["events_per_cpu_s_summed"], 2),
                            "load_avg_1m": round(os.getloadavg()[0], 2)}
    json.dump(out, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
