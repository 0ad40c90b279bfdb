"""The fleet through a real broker: producer → Kafka → the Faust worker (as deployed) → metrics → policy → commands.

Uses ``$KAFKA_BOOTSTRAP`` when set, else a private Tansu broker (``kvguard/testing/rigs``). The shadow
engine records ``--record-gpus`` GPUs for ``--record-s`` simulated seconds (a batch per GPU every
``--flush-s``, as ``NodePublisher`` flushes; packed columns unless ``--columns json``); ``--gpus``
simulated GPUs replay it under their own names in real time: the batch of event time ``t`` is
published at wall time ``t``, its event times rewritten to the wall clock (ns since the epoch), and
each pass of the recording is a producer restart (a new epoch), as in ``bench_fleet.py``.

Stages, each as deployed:

  producer  this process (aiokafka through ``KafkaBus``), keyed by node;
  worker    ``kvguard worker`` processes (``--workers``, one consumer group), nice'd like the rest;
  policy    the policy service (``Graph.policy_service``) in this process, over the metrics topic, with
            ``headroom_refresh_s = 0``, ``headroom_from_u_kv = 0`` and ``use_headroom`` (off by default
            on uniform-block vLLM profiles) so that every tick re-sends the node's admission hold
            (a sample per node and tick, on the ordinary decide → sign → publish path);
  commands  a consumer of the commands topic in this process, where a node agent would receive them.

Figures (one JSON object):

- ``decision_latency``: per command, wall time at which the commands consumer received it minus
  the event time of the tick it answers (``issued_at_ns``: the boundary); ``from_closing_batch``:
  minus the wall time at which the batch that closed that tick (the node's first batch past the
  boundary) was published, i.e. without the node's own publish interval. Not "executed": a replayed
  stream has no engine to act on (``bench_decision_latency.py`` executes them on live shadow engines).
- ``consumer_lag``: records of the events topic not yet committed by the worker group, sampled every
  second (p50/p99/max), and the same in seconds of traffic.
- ``worker``: CPU-seconds of the worker processes (``/proc``), events per worker CPU-second, RSS at
  start and end and its growth, RSS per GPU above the idle worker's.

Usage: .venv/bin/python bench/bench_fleet_kafka.py [--gpus 100] [--soak-s 120] [--workers 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvguard.contracts.units import NS_PER_S  # noqa: E402
from kvguard.wire.fastcols import pack_column, unpack_column  # noqa: E402


def record(args) -> tuple[list[list[bytes | None]], int]:
    """Per flush step, the recorded GPUs' batches as wire bytes (None: no batch)."""
    from kvguard.producers.sim.fleet import Fleet
    from kvguard.producers.sim.profiles import load_profile
    from kvguard.producers.sim.workloads import load_workload
    from kvguard.wire.schemas import encode_batch

    fleet = Fleet(args.record_gpus, load_profile(args.profile), seed=args.seed)
    fleet.submit_workload(load_workload(args.scenario, rate_scale=args.rate_scale, window=args.record_s,
                                        seed=args.seed))
    index = {node: i for i, node in enumerate(fleet.nodes)}
    step = int(args.flush_s * NS_PER_S)
    out, events = [], 0
    for now in range(step, int(args.record_s * NS_PER_S) + 1, step):
        fleet.advance(now)
        row: list[bytes | None] = [None] * args.record_gpus
        for batch in fleet.take_batches(now):
            row[index[batch.node]] = encode_batch(batch, packed=args.columns == "packed")
            events += len(batch)
        out.append(row)
    return out, events


def node_name(i: int) -> str:
    return f"fleet-{i // 8:03d}/gpu{i % 8}"


def rewrite(value: bytes, node: str, epoch: int, shift_ns: int) -> tuple[bytes, int, int]:
    """A recorded batch as node ``node``'s, epoch ``epoch``, its event times moved by ``shift_ns``."""
    data = orjson.loads(value)
    data["node"], data["epoch"] = node, epoch
    if "colsb" in data:
        ts = unpack_column("ts_ns", data["colsb"]["ts_ns"]) + shift_ns
        data["colsb"]["ts_ns"] = pack_column(ts)
        n = int(ts.size)
    else:
        data["cols"]["ts_ns"] = [t + shift_ns for t in data["cols"]["ts_ns"]]
        n = len(data["cols"]["ts_ns"])
    return orjson.dumps(data), n, int(data["seq"])


def proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def spawn_worker(config: Path, app_id: str, work: Path, i: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(["nice", "-n", "10", sys.executable, "-c", "from kvguard.cli import main; main()",
                             "worker", "--config", str(config), "--app-id", app_id,
                             "--datadir", str(work / f"faust{i}")],
                            stdout=open(work / f"worker{i}.log", "wb"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, cwd=ROOT, env=env, start_new_session=True)


def terminate(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def pct(values, qs=(50, 99)) -> dict:
    if not len(values):
        return {}
    a = np.asarray(values, dtype=np.float64)
    return {f"p{q}": round(float(np.percentile(a, q)), 1) for q in qs} | {"max": round(float(a.max()), 1)}


async def run(args, bootstrap: str, work: Path, recording: list, recorded_events: int) -> dict:
    from dataclasses import replace

    from aiokafka import AIOKafkaConsumer, TopicPartition

    from kvguard.bus.kafka import create_topics
    from kvguard.config.settings import TOPIC_KINDS, Settings
    from kvguard.runtime.bootstrap import bootstrap as build
    from kvguard.runtime.bootstrap import make_bus
    from kvguard.wire.schemas import decode, make_headers

    prefix = f"fleet{uuid.uuid4().hex[:6]}."
    app_id = f"{prefix}streams"
    settings = Settings(
        kafka={"bootstrap": bootstrap, "session_timeout_ms": 6000, "heartbeat_interval_ms": 1000, "linger_ms": 5},
        topics={"prefix": prefix, **{k: {"partitions": args.partitions} for k in TOPIC_KINDS}},
        streams={"tick_s": args.tick_s},
        policy={"hmac_secret": "bench-secret-" + uuid.uuid4().hex, "command_ttl_s": 60.0})
    await create_topics(settings, settings.topics.all())
    config = work / "settings.json"
    config.write_text(settings.model_dump_json())
    workers = [spawn_worker(config, app_id, work, i) for i in range(args.workers)]
    graph = build(settings, predictor=None, require_secret=True, profile=args.profile)
    graph.engine_config = replace(graph.engine_config, headroom_refresh_s=0.0, headroom_from_u_kv=0.0,
                                  use_headroom=True)
    bus = make_bus(settings, f"kafka://{bootstrap}")
    await bus.start()
    policy = graph.policy_service(bus=bus)
    stop = asyncio.Event()
    decided = {"ticks": 0, "commands": 0}

    def on_output(out) -> None:
        decided["ticks"] += 1
        decided["commands"] += len(out.decision.commands)

    policy_task = asyncio.create_task(policy.run(group=f"{prefix}policy", stop=stop, poll_s=0.01, on_output=on_output))
    commands = bus.subscribe([settings.topics.name("commands")], f"{prefix}node-agent")
    received: list[tuple[int, str, int]] = []  # (receive wall ns, node, issued_at_ns)

    async def receive() -> None:
        while not stop.is_set():
            for r in await commands.getmany(max_records=4096, timeout_s=0.05):
                now = time.time_ns()
                try:
                    cmd = decode("commands", r.value)
                except Exception:  # noqa: BLE001 - a bench counts what it cannot read
                    continue
                received.append((now, cmd.node, int(cmd.issued_at_ns)))

    recv_task = asyncio.create_task(receive())
    events_topic = settings.topics.name("events")
    lag_consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=app_id, enable_auto_commit=False)
    await lag_consumer.start()
    tps = [TopicPartition(events_topic, p) for p in range(args.partitions)]
    await asyncio.sleep(args.join_s)  # the worker group joins and takes its partitions
    pids = [w.pid for w in workers]
    for w in workers:
        if w.poll() is not None:
            raise SystemExit(f"worker exited early, see {work}")
    rss0 = [proc_rss_mb(p) for p in pids]
    cpu0 = [proc_cpu_s(p) for p in pids]
    rows = len(recording)
    step_ns = int(args.flush_s * NS_PER_S)
    t0_ns = (time.time_ns() // NS_PER_S + 1) * NS_PER_S  # event time 0 of the replay
    published_at: dict[tuple[str, int], int] = {}  # (node, step index) -> wall ns of its publish
    start_row = {node_name(i): i * rows // args.gpus for i in range(args.gpus)}
    lag_samples, rss_samples, sent_events, sent_records = [], [], 0, 0
    next_lag = time.monotonic()
    r = 0
    soak_end = time.monotonic() + args.soak_s
    while time.monotonic() < soak_end:
        due_ns = t0_ns + (r + 1) * step_ns  # the batch of (r, r+1] steps goes out at its end
        delay = (due_ns - time.time_ns()) / NS_PER_S
        if delay > 0:
            await asyncio.sleep(delay)
        sent_ns = time.time_ns()
        for i in range(args.gpus):
            node = node_name(i)
            local = r - start_row[node]
            if local < 0:
                continue
            value = recording[local % rows][i % args.record_gpus]
            if value is None:
                continue
            epoch = local // rows
            # the recording's event time 0 is the pass's first step
            shift = t0_ns + (r - local % rows) * step_ns
            out, n, seq = rewrite(value, node, epoch, shift)
            await bus.publish(events_topic, node, out, make_headers("events", node, record_id=f"{node}/{epoch}/{seq}"))
            published_at[(node, r)] = sent_ns
            sent_events += n
            sent_records += 1
        r += 1
        if time.monotonic() >= next_lag:
            next_lag += 1.0
            ends = await lag_consumer.end_offsets(tps)
            committed = [await lag_consumer.committed(tp) for tp in tps]
            lag_samples.append(sum(max(0, ends[tp] - (c or 0)) for tp, c in zip(tps, committed)))
            rss_samples.append(round(sum(proc_rss_mb(p) for p in pids), 1))
    await bus.flush()
    soak_wall = args.soak_s
    # drain: let the workers finish what was sent (bounded), then read the CPU they used
    drain_deadline = time.monotonic() + args.drain_s
    final_lag = None
    while time.monotonic() < drain_deadline:
        ends = await lag_consumer.end_offsets(tps)
        committed = [await lag_consumer.committed(tp) for tp in tps]
        final_lag = sum(max(0, ends[tp] - (c or 0)) for tp, c in zip(tps, committed))
        if final_lag == 0:
            break
        await asyncio.sleep(1.0)
    await asyncio.sleep(2 * args.tick_s)  # the last ticks' commands
    cpu1 = [proc_cpu_s(p) for p in pids]
    rss1 = [proc_rss_mb(p) for p in pids]
    stop.set()
    await policy_task
    await recv_task
    await lag_consumer.stop()
    await bus.stop()
    for w in workers:
        terminate(w)

    # latency: from the tick's boundary, and from the publish of the batch that closed it
    lat_boundary, lat_closing = [], []
    for recv_ns, node, issued in received:
        lat_boundary.append((recv_ns - issued) / 1e6)
        step = (issued - t0_ns) // step_ns  # the batch of (step, step+1] holds the first events past it
        sent = published_at.get((node, step))
        if sent is not None:
            lat_closing.append((recv_ns - sent) / 1e6)
    warm = len(lat_boundary) // 10  # the first ticks wait for the group to settle
    cpu = sum(b - a for a, b in zip(cpu0, cpu1))
    events_per_s = sent_events / soak_wall
    return {
        "bench": "fleet_kafka", "broker": "KAFKA_BOOTSTRAP" if os.environ.get("KAFKA_BOOTSTRAP") else "tansu",
        "gpus": args.gpus, "workers": args.workers, "partitions": args.partitions, "profile": args.profile,
        "scenario": args.scenario, "rate_scale": args.rate_scale, "record_gpus": args.record_gpus,
        "columns": args.columns, "flush_s": args.flush_s, "tick_s": args.tick_s, "soak_s": args.soak_s,
        "events_per_gpu_s": round(recorded_events / args.record_s / args.record_gpus, 1),
        "records_sent": sent_records, "events_sent": sent_events, "offered_events_per_s": round(events_per_s),
        "bytes_per_event": round(sum(len(v) for row in recording for v in row if v) / max(recorded_events, 1), 1),
        "decision_latency_ms": {"commands": len(received), "from_boundary": pct(lat_boundary[warm:], (50, 90, 99)),
                                "from_closing_batch": pct(lat_closing[warm:], (50, 90, 99)), "target_p99": 500},
        "policy": decided | {"errors": policy.errors, "rejected": policy.rejected},
        "consumer_lag_records": pct(lag_samples) | {"samples": len(lag_samples), "final": final_lag},
        "consumer_lag_s": {k: round(v / (sent_records / soak_wall), 2) for k, v in pct(lag_samples).items()}
        if sent_records else None,
        "worker": {"cpu_s": round(cpu, 2), "cpu_s_per_million_events": round(cpu / max(sent_events, 1) * 1e6, 3),
                   "events_per_worker_cpu_s": round(sent_events / cpu) if cpu else None,
                   "busy_fraction_of_one_core": round(cpu / soak_wall / args.workers, 3),
                   "rss_start_mb": [round(x, 1) for x in rss0], "rss_end_mb": [round(x, 1) for x in rss1],
                   "rss_samples_mb": rss_samples[:: max(1, len(rss_samples) // 20)],
                   "rss_per_gpu_above_idle_mb": round((sum(rss1) - sum(rss0)) / args.gpus, 3)},
        "load_avg_1m": round(os.getloadavg()[0], 2), "cpu_count": os.cpu_count(),
        "note": "the machine is shared: CPU-seconds, not wall time, carry the throughput figures",
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=100)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--record-gpus", type=int, default=4)
    ap.add_argument("--record-s", type=float, default=60.0)
    ap.add_argument("--profile", default="llama3-70b-tp8-80gb-vllm")
    ap.add_argument("--scenario", default="azure-conv")
    ap.add_argument("--rate-scale", type=float, default=8.0, help="of the recorded GPUs together (8: ~90 running each)")
    ap.add_argument("--columns", choices=("packed", "json"), default="packed")
    ap.add_argument("--flush-s", type=float, default=0.1, help="node.flush_interval_s (its default)")
    ap.add_argument("--tick-s", type=float, default=10.0, help="streams.tick_s (its default)")
    ap.add_argument("--soak-s", type=float, default=120.0)
    ap.add_argument("--join-s", type=float, default=15.0, help="wait for the worker group to join")
    ap.add_argument("--drain-s", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    recording, recorded_events = record(args)
    work = Path(tempfile.mkdtemp(prefix="kvguard-fleet-kafka-"))
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP")
    broker = None
    if not bootstrap:
        from kvguard.testing.rigs import TansuBroker

        broker = TansuBroker().start()
        bootstrap = broker.bootstrap
    try:
        out = asyncio.run(run(args, bootstrap, work, recording, recorded_events))
    finally:
        if broker is not None:
            broker.stop()
    out["workdir"] = str(work)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
