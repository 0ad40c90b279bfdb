"""The closed loop as concurrent services over a real bus (``kvguard demo --bus kafka://…``).

The node (engine, producer, actuators), the stream service and the policy service run as asyncio
tasks in one process, each with its own consumer group, exactly as they would in separate
processes; only the baseline (the bare engine, which needs no bus) stays embedded.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import Counter
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient

from kvguard.bus.kafka import client_kwargs, create_topics
from kvguard.contracts.tick import Tick
from kvguard.contracts.units import NS_PER_S
from kvguard.runtime.bootstrap import make_bus
from kvguard.runtime.embedded import RunResult, series_point
from kvguard.runtime.node import run_node
from kvguard.streams.embedded import StreamsService

log = logging.getLogger("policy.delivery")  # the demo shows this logger's warnings

async def run_over_bus(graph: Any, workload: Any, *, bus: str, n_gpus: int, duration_s: float, seed: int,
                       speed: float, run_id: str | None = None, keep_topics: bool = False) -> RunResult:
    """The closed loop as concurrent services over a real bus: the node (engine, producer,
    actuators), the stream service and the policy service, each with its own consumer group.
    The budget and SLO ledgers are the graph's (the caller opens and closes them).

    The run gets its own topics (prefix ``kvguard-demo-<run>.``, created first: Tansu does not
    auto-create) so that records of an earlier run are never read as this one's; they are
    deleted at the end unless ``keep_topics``. Node ids are ``demo-<run>/gpu<i>``.
    """


    run_id = run_id or secrets.token_hex(4)
    settings = graph.settings.model_copy(update={
        "topics": graph.settings.topics.model_copy(update={"prefix": f"kvguard-demo-{run_id}."})})
    graph.settings = settings
    carrier = make_bus(settings, bus)
    kafka = getattr(carrier, "kafka", None)
    if kafka is not None:
        await create_topics(kafka, settings.topics.all())
    try:
        await carrier.start()
        result = RunResult("guarded", {})
        streams = StreamsService(carrier, settings, graph.predictor, config=graph.stream_config(),
                                 group=f"kvguard-demo-{run_id}-streams")
        slo = graph.slo_recorder(confirm_with_acks=True)
        service = graph.policy_service(bus=carrier, slo=slo)
        handle = service.handle_tick
        last_ts = {"ns": 0}

        def observe(tick: Tick):
            result.series.setdefault(tick.node, []).append(series_point(tick))
            if tick.ooms:
                result.oom_times.setdefault(tick.node, []).append(tick.ts_ns / NS_PER_S)
            last_ts["ns"] = max(last_ts["ns"], tick.ts_ns)
            return handle(tick)

        service.handle_tick = observe
        stop = asyncio.Event()
        acks: list = []
        tasks = [asyncio.create_task(streams.run()),
                 asyncio.create_task(service.run(group=f"kvguard-demo-{run_id}-policy", stop=stop, poll_s=0.02))]
        wall0 = time.perf_counter()
        try:
            summary = await run_node(graph, carrier, workload, n_gpus=n_gpus, duration_s=duration_s, speed=speed,
                                     seed=seed, host=f"demo-{run_id}", acks_out=acks,
                                     on_ack=slo.observe_ack if slo else None,
                                     on_batches=slo.observe_batches if slo else None)
        finally:
            stop.set()
            streams.stop()
            await asyncio.gather(*tasks, return_exceptions=True)
            await carrier.stop()
        if slo is not None:
            slo.finish(last_ts["ns"])
    finally:
        if kafka is not None and not keep_topics:
            await delete_run_topics(kafka, list(settings.topics.all()))
    result.wall_seconds = round(time.perf_counter() - wall0, 3)
    for ack in acks:
        result.actions.setdefault(ack.node, Counter())[f"{ack.action}:{ack.outcome.value}"] += 1
    total = Counter()
    for c in result.actions.values():
        total.update(c)
    summary["kvguard"] = {"policy": service.engine.counters.as_dict(), "actuators": summary.pop("actuators", {}),
                          "budget_unavailable_ticks": service.budget_errors,
                          "acks": dict(sorted(total.items())),
                          "mode_changes": [c.to_dict() for c in service.mode_changes],
                          "predictor": graph.predictor_note, "bus": bus, "topic_prefix": settings.topics.prefix,
                          "topics_deleted": kafka is not None and not keep_topics,
                          "slo": slo.counters.as_dict() if slo else None}
    result.summary = summary
    return result


async def delete_run_topics(kafka: Any, names: list[str]) -> bool:
    """Delete the run's topics; a failure is logged (with the names to delete by hand), not raised."""
    admin = AIOKafkaAdminClient(**client_kwargs(kafka))
    try:
        await admin.start()
        await admin.delete_topics(names)
        return True
    except Exception as err:  # noqa: BLE001 - cleanup must not hide the run's result
        log.warning(
            "demo: could not delete the run's topics %s (%s: %s); delete them by hand", ", ".join(names),
            type(err).__name__, err)
        return False
    finally:
        await admin.close()
