"""`kvguard node`: one or more simulated GPUs — shadow engine, producer and actuator — over a bus.

The shadow engine runs a workload on simulated time paced by the wall clock (``--speed``
simulated seconds per wall second). Its events go to ``kvguard.events`` through the node
publisher; the actuator consumes the node's commands from ``kvguard.commands``, executes them on
the engine between its steps (``Engine.now_ns`` is the node's clock for TTLs) and acks on
``kvguard.acks``. Executed actions are pool events like any other and reach ``kvguard.events``
with the next batch. ``--no-actuator`` runs the bare engine (a baseline).

Each ``kvguard node`` process is one producer run: its batches carry a fresh, increasing
``epoch`` (the wall clock in ns at its start), since its simulated clock starts at 0 again. The
stream, the policy and the exporter take a newer epoch as the node restarted and start its state
over; with the seed as epoch a restarted node's batches would be dropped as redeliveries.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import typer

from kvguard.cli.app import app


async def run_node(graph: Any, bus: Any, workload: Any, *, n_gpus: int, duration_s: float, speed: float,
                   seed: int = 0, host: str = "sim-0", actuate: bool = True, journal_dir: str | Path | None = None,
                   step_wall_s: float = 0.05, on_progress: Any = None, acks_out: list | None = None,
                   on_ack: Any = None, on_batches: Any = None, epoch: int | None = None) -> dict:
    """Run the node until ``duration_s`` of simulated time; returns the summary dict.
    ``on_ack(ack)`` sees each ack, ``on_batches(batches)`` each list of event batches published
    (the demo reads the FINISH rows of evicted requests from them). ``epoch``: the producer run
    the batches carry (None: the seed, so logs stay deterministic; a restartable node passes a
    newer one on every start)."""
    from kvguard.actuators.actuator import run_actuators
    from kvguard.producers.engine import NS
    from kvguard.producers.publisher import NodePublisher

    settings = graph.settings
    fleet = graph.fleet(n_gpus, seed=seed, host=host)
    if epoch is not None:
        if epoch < 0:
            raise ValueError(f"epoch: expected >= 0, got {epoch}")
        fleet.epoch = epoch
    fleet.submit_workload(workload)
    engines = {e.node: e for e in fleet.engines}
    clock = {"sim_ns": 0}
    def take_batches():
        batches = fleet.take_batches(clock["sim_ns"])
        if on_batches is not None and batches:
            on_batches(batches)
        return batches

    publisher = NodePublisher.from_settings(bus, settings, take_batches)
    stop = asyncio.Event()
    actuators = graph.actuators(fleet.engines, journal_dir=journal_dir) if actuate else {}
    acks: list = acks_out if acks_out is not None else []

    def record_ack(ack) -> None:
        acks.append(ack)
        if on_ack is not None:
            on_ack(ack)

    tasks = []
    if actuators:
        tasks.append(asyncio.create_task(run_actuators(
            bus, settings, actuators, node_time_ns=lambda node: engines[node].now_ns,
            group=f"kvguard-actuators-{host}", stop=stop, on_ack=record_ack, poll_s=0.02)))
    end_ns = int(duration_s * NS)
    wall0 = time.perf_counter()
    try:
        while clock["sim_ns"] < end_ns:
            elapsed = time.perf_counter() - wall0
            clock["sim_ns"] = min(end_ns, int(elapsed * speed * NS))
            fleet.advance(clock["sim_ns"])
            publisher.drain()
            await publisher.send_pending()
            if on_progress is not None:
                on_progress(clock["sim_ns"] / NS, duration_s)
            for task in tasks:
                if task.done():
                    task.result()  # an actuator crash must not go unnoticed
            await asyncio.sleep(step_wall_s)
        await publisher.flush(timeout_s=30)
        await asyncio.sleep(0.5)  # commands for the last ticks
    finally:
        stop.set()
        for task in tasks:
            await asyncio.gather(task, return_exceptions=True)
    wall = time.perf_counter() - wall0
    out = fleet.summary().to_dict()
    out.update({"gpus": n_gpus, "host": host, "epoch": fleet.epoch, "speed": speed, "wall_seconds": round(wall, 3),
                "nodes": fleet.nodes, "publisher": publisher.counters.as_dict()})
    if acks:
        import numpy as np

        lag_s = np.array([(a.executed_at_ns - a.issued_at_ns) / NS for a in acks], dtype=np.float64)
        # tick time -> executed on the node, in simulated seconds, and in wall seconds at this speed
        out["decision_lag_sim_s"] = {"p50": round(float(np.percentile(lag_s, 50)), 3),
                                     "p99": round(float(np.percentile(lag_s, 99)), 3)}
        out["decision_lag_wall_s"] = {k: round(v / speed, 3) for k, v in out["decision_lag_sim_s"].items()}
    if actuators:
        totals: dict[str, int] = {}
        for a in actuators.values():
            for k, v in a.counters.as_dict().items():
                totals[k] = totals.get(k, 0) + v
        out["actuators"] = totals
    return out


@app.command()
def node(
    workload: str = typer.Option("mixed", "--workload", help="Scenario or trace (see kvguard simulate)."),
    gpus: int = typer.Option(1, "--gpus", min=1, help="Simulated GPUs in this process."),
    duration: str = typer.Option("15m", "--duration", help="Simulated duration."),
    rate_scale: float = typer.Option(1.0, "--rate-scale"),
    speed: float = typer.Option(10.0, "--speed", min=0.01, help="Simulated seconds per wall second."),
    seed: int = typer.Option(0, "--seed"),
    host: str = typer.Option("sim-0", "--host", help="Node ids are <host>/gpu<i>."),
    profile: str = typer.Option(None, "--profile"),
    bus: str = typer.Option(None, "--bus", help="kafka://HOST:PORT (default: kafka.bootstrap from settings)."),
    journal_dir: Path = typer.Option(None, "--journal-dir", help="Where actuators keep their applied-id journals."),
    no_actuator: bool = typer.Option(False, "--no-actuator", help="Run the bare engine (baseline)."),
    config: Path = typer.Option(None, "--config", help="Settings file (TOML/JSON)."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as one JSON object."),
) -> None:
    """Run simulated GPUs (shadow engine + producer + actuator) against the bus."""
    from kvguard.runtime.bootstrap import BootstrapError, bootstrap, make_bus
    from kvguard.cli.demo import demo_workload
    from kvguard.cli.simulate import parse_duration
    from kvguard.wire.settings import ConfigError, Settings

    try:
        settings = Settings.load(config)
        graph = bootstrap(settings, profile=profile, predictor=None, require_secret=not no_actuator)
        carrier = make_bus(settings, bus or f"kafka://{settings.kafka.bootstrap}")
    except (ConfigError, BootstrapError, ValueError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    duration_s = parse_duration(duration)
    wl = demo_workload(graph.profile, workload=workload, rate_scale=rate_scale, duration_s=duration_s, seed=seed)
    typer.echo(f"kvguard node {host}: {gpus} GPU(s), {len(wl.requests)} requests over {duration_s:g} s at "
               f"{speed:g}x, actuator {'off' if no_actuator else 'on'}", err=True)

    # this process is a new producer run: its simulated clock starts at 0, so its batches must carry
    # an epoch newer than any earlier run of the same host (the edge may read the clock)
    epoch = time.time_ns()

    async def main() -> dict:
        await carrier.start()
        try:
            return await run_node(graph, carrier, wl, n_gpus=gpus, duration_s=duration_s, speed=speed, seed=seed,
                                  host=host, actuate=not no_actuator, journal_dir=journal_dir, epoch=epoch)
        finally:
            await carrier.stop()

    summary = asyncio.run(main())
    if json_out:
        sys.stdout.write(json.dumps(summary, default=str) + "\n")
    else:
        typer.echo(json.dumps({k: summary[k] for k in ("requests", "completed", "failed", "ooms", "preemptions",
                                                        "goodput_tokens_per_s")}), err=True)
