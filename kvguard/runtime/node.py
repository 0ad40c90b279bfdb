"""The node loop: simulated GPUs (shadow engine), their producer and actuators, over a bus.

The shadow engine runs a workload on simulated time paced by the wall clock (``speed``
simulated seconds per wall second). Its events go to ``kvguard.events`` through the node
publisher; the actuators consume the node's commands, execute them on the engine between its
steps (``Engine.now_ns`` is the node's clock for TTLs) and ack. Executed actions are pool events
like any other and reach ``kvguard.events`` with the next batch.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvguard.actuators.actuator import run_actuators
from kvguard.contracts.units import NS_PER_S
from kvguard.producers.publisher import NodePublisher
from kvguard.runtime.embedded import with_node_guard


async def run_node(graph: Any, bus: Any, workload: Any, *, n_gpus: int, duration_s: float, speed: float,
                   seed: int = 0, host: str = "sim-0", actuate: bool = True, journal_dir: str | Path | None = None,
                   step_wall_s: float = 0.05, on_progress: Any = None, acks_out: list | None = None,
                   on_ack: Any = None, on_batches: Any = None, epoch: int | None = None,
                   governor: bool = True) -> dict:
    """Run the node until ``duration_s`` of simulated time; returns the summary dict.
    ``on_ack(ack)`` sees each ack, ``on_batches(batches)`` each list of event batches published
    (the demo reads the FINISH rows of evicted requests from them). ``epoch``: the producer run
    the batches carry (None: the seed, so logs stay deterministic; a restartable node passes a
    newer one on every start). ``governor``: with ``actuate``, the node-side step governor too
    (False: the policy's commands alone)."""

    settings = graph.settings
    fleet = (with_node_guard(graph, governor) if actuate else graph).fleet(n_gpus, seed=seed, host=host)
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
    actuators = graph.actuators(fleet.engines, journal_dir=journal_dir, epoch=fleet.epoch) if actuate else {}
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
    end_ns = int(duration_s * NS_PER_S)
    wall0 = time.perf_counter()
    try:
        while clock["sim_ns"] < end_ns:
            elapsed = time.perf_counter() - wall0
            clock["sim_ns"] = min(end_ns, int(elapsed * speed * NS_PER_S))
            fleet.advance(clock["sim_ns"])
            publisher.drain()
            await publisher.send_pending()
            if on_progress is not None:
                on_progress(clock["sim_ns"] / NS_PER_S, duration_s)
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
        lag_s = np.array([(a.executed_at_ns - a.issued_at_ns) / NS_PER_S for a in acks], dtype=np.float64)
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
