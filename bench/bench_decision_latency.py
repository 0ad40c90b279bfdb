"""Decision latency over loopback Kafka: event time → command executed on the node.

Uses ``$KAFKA_BOOTSTRAP`` when set, else a private Tansu broker (``kvguard/testing/rigs``). Runs the real
pipeline in real time (``--speed 1``: event time is wall time):

  node (shadow engine, publisher, actuators)
    → kvguard.events → stream worker → kvguard.metrics → policy service
    → kvguard.commands → the node's actuator executes → ack.

The node and the policy service run in this process (each with its own consumer over the
broker; the policy needs a bench-only setting, see below), the stream stage in another.

The stream stage is the Faust worker (``kvguard worker``, a process) with ``--streams faust``,
or the in-process stream service over the same broker with ``--streams service``.

A command is issued for the tick with boundary ``b`` (event time): the tick is emitted when the
node's first event at or after ``b`` reaches the stream, so the latency counts the node's publish
interval too. Latency of one command = wall time at which the actuator finished executing it −
``b`` mapped to wall time (the node's clock starts at wall time ``t0``: event time ``b`` happened
at ``t0 + b / speed``). To get many samples the policy re-sends each busy node's admission hold
every tick (``headroom_refresh_s = 0``) on a 1-second tick; the path is the same as for any command.

Prints one JSON object: p50/p90/p99/max in ms, the sample count, the target (p99 ≤ 500 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from kvguard.contracts.units import NS_PER_S

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--seconds", type=float, default=60.0, help="wall seconds of traffic (speed 1)")
    p.add_argument("--tick-s", type=float, default=1.0)
    p.add_argument("--streams", choices=("faust", "service"), default="faust")
    p.add_argument("--rate-scale", type=float, default=2.0)
    return p.parse_args()


def spawn(args: list[str], log: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "from kvguard.cli import main; main()", *args],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            cwd=ROOT, env=env, start_new_session=True)


def terminate(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


async def run(opts, bootstrap: str, work: Path) -> dict:
    import numpy as np

    from kvguard.bus.kafka import create_topics
    from kvguard.config.settings import Settings
    from kvguard.runtime.bootstrap import bootstrap as build
    from kvguard.runtime.bootstrap import make_bus
    from kvguard.runtime.embedded import demo_workload
    from kvguard.runtime.node import run_node

    prefix = f"lat{uuid.uuid4().hex[:8]}."
    settings = Settings(
        kafka={"bootstrap": bootstrap, "session_timeout_ms": 1000, "heartbeat_interval_ms": 250,
               "consumer_options": {"fetch_max_wait_ms": 10}, "linger_ms": 0},
        topics={"prefix": prefix}, streams={"tick_s": opts.tick_s},
        policy={"hmac_secret": "bench-secret-" + uuid.uuid4().hex, "command_ttl_s": 30.0})
    await create_topics(settings, settings.topics.all())
    config = work / "settings.json"
    config.write_text(settings.model_dump_json())
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = []
    if opts.streams == "faust":
        procs.append(spawn(["worker", "--config", str(config), "--app-id", f"{prefix}streams",
                            "--datadir", str(work / "faust")], work / "worker.log", env))
    graph = build(settings, predictor=None, require_secret=True)
    # every busy tick re-sends the hold: one command per node per tick, on the ordinary path
    from dataclasses import replace

    graph.engine_config = replace(graph.engine_config, headroom_refresh_s=0.0, headroom_from_u_kv=0.0)
    bus = make_bus(settings, f"kafka://{bootstrap}")
    await bus.start()
    policy = graph.policy_service(bus=bus)
    policy_stop = asyncio.Event()
    policy_task = asyncio.create_task(policy.run(group=f"{prefix}policy", stop=policy_stop, poll_s=0.01))
    stream_task = None
    if opts.streams == "service":
        from kvguard.runtime.mapping import stream_config
        from kvguard.streams.embedded import StreamsService

        service = StreamsService(bus, settings, config=stream_config(settings), group=f"{prefix}streams")
        stream_task = asyncio.create_task(service.run())
    await asyncio.sleep(6.0)  # consumer groups join (Tansu answers JoinGroup after ~session/2)
    wl = demo_workload(graph.profile, workload="mixed", rate_scale=opts.rate_scale, duration_s=opts.seconds, seed=0)
    samples: list[float] = []
    state = {"t0": None}

    def on_ack(ack) -> None:
        if ack.outcome.value in ("executed", "noop") and state["t0"] is not None:
            samples.append(time.perf_counter() - (state["t0"] + ack.issued_at_ns / NS_PER_S))

    def progress(done_s: float, total_s: float) -> None:
        if state["t0"] is None:
            state["t0"] = time.perf_counter() - done_s  # event time 0 happened at t0 (speed 1)

    try:
        summary = await run_node(graph, bus, wl, n_gpus=opts.gpus, duration_s=opts.seconds, speed=1.0,
                                 on_progress=progress, on_ack=on_ack, step_wall_s=0.02)
    finally:
        policy_stop.set()
        await policy_task
        if stream_task is not None:
            service.stop()
            await stream_task
        await bus.stop()
        for proc in procs:
            terminate(proc)
    # the first ticks wait for group joins and the worker's start: measure the steady state
    warm = [s for s in samples]
    lat_ms = np.array(warm[len(warm) // 10:], dtype=np.float64) * 1000
    out = {"bench": "decision_latency", "streams": opts.streams, "broker": "tansu" if not os.environ.get(
        "KAFKA_BOOTSTRAP") else "KAFKA_BOOTSTRAP", "gpus": opts.gpus, "tick_s": opts.tick_s,
        "wall_seconds": opts.seconds, "samples": int(lat_ms.size), "samples_total": len(samples),
        "target_p99_ms": 500, "actuators": summary.get("actuators")}
    if lat_ms.size:
        out.update({f"p{q}_ms": round(float(np.percentile(lat_ms, q)), 1) for q in (50, 90, 99)})
        out["max_ms"] = round(float(lat_ms.max()), 1)
        out["meets_target"] = bool(out["p99_ms"] <= 500)
    return out


def main() -> None:
    opts = parse()
    work = Path(tempfile.mkdtemp(prefix="kvguard-latency-"))
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP")
    broker = None
    if not bootstrap:
        from kvguard.testing.rigs import TansuBroker

        broker = TansuBroker().start()
        bootstrap = broker.bootstrap
    try:
        result = asyncio.run(run(opts, bootstrap, work))
    finally:
        if broker is not None:
            broker.stop()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
