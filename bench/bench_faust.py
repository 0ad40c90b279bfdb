"""End-to-end stream throughput through Kafka + Faust for one worker, and its ratio to a raw
aiokafka consumer reading the same records.

Uses ``$KAFKA_BOOTSTRAP`` when set, else a private Tansu broker (``kvguard/testing/rigs``). Publishes a
shadow-engine log (``--gpus`` GPUs, ``--seconds`` of event time, a batch per node every
``--flush-s``) to a fresh events topic first, then:

1. raw: an ``AIOKafkaConsumer`` reads every record (no decoding), timed from its first record to
   its last;
2. faust no-op: a Faust agent that only counts the records (Faust's own ceiling here);
3. faust: the kvguard Faust app (``streams.app.build_app``) started in this process consumes the
   same records, decodes, runs the core, publishes ticks/alerts and writes its changelog table,
   timed from the first record it handles to the last.

Prints one JSON object: events/s of each and the ratio. The broker shares the machine's CPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from pathlib import Path

from kvguard.contracts.units import NS_PER_S

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

def make_batches(gpus: int, seconds: int, flush_s: float, rate_scale: float, seed: int):
    from kvguard.producers.sim.fleet import Fleet
    from kvguard.producers.sim.profiles import load_profile
    from kvguard.producers.sim.workloads import load_workload

    fleet = Fleet(gpus, load_profile(), seed=seed)
    fleet.submit_workload(load_workload("mixed", rate_scale=rate_scale, window=seconds, seed=seed))
    batches = []
    step = int(flush_s * NS_PER_S)
    for now in range(step, seconds * NS_PER_S + 1, step):
        fleet.advance(now)
        batches.extend(fleet.take_batches(now))
    return batches


async def publish(settings, batches) -> None:
    from kvguard.bus.kafka import KafkaBus
    from kvguard.wire.schemas import batch_headers, encode_batch

    bus = KafkaBus(settings)
    await bus.start()
    try:
        topic = settings.topics.name("events")
        for b in batches:
            await bus.publish(topic, b.node, encode_batch(b), batch_headers(b))
        await bus.flush()
    finally:
        await bus.stop()


async def raw_consume(settings, n_records: int) -> tuple[float, int]:
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(settings.topics.name("events"), bootstrap_servers=settings.kafka.bootstrap,
                                group_id=None, auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    try:
        seen = 0
        first = None
        deadline = time.monotonic() + 300
        while seen < n_records and time.monotonic() < deadline:
            got = await consumer.getmany(timeout_ms=500, max_records=10_000)
            for records in got.values():
                if records and first is None:
                    first = time.perf_counter()
                seen += len(records)
        return time.perf_counter() - (first or time.perf_counter()), seen
    finally:
        await consumer.stop()


async def faust_consume(settings, n_records: int, app_id: str) -> tuple[float, float, dict]:
    from kvguard.runtime.mapping import stream_config
    from kvguard.streams.app import build_app, ensure_topics

    await ensure_topics(settings, app_id)
    app, worker = build_app(settings, config=stream_config(settings), app_id=app_id)
    await app.start()
    try:
        first = None
        cpu0 = None
        deadline = time.monotonic() + 600
        while worker.counters.records < n_records and time.monotonic() < deadline:
            if first is None and worker.counters.records > 0:
                first, cpu0 = time.perf_counter(), time.process_time()
            await asyncio.sleep(0.01)
        wall = time.perf_counter() - (first or time.perf_counter())
        cpu = time.process_time() - (cpu0 or time.process_time())
        await worker.wait_outputs()
        return wall, cpu, worker.counters.as_dict()
    finally:
        await app.stop()


async def faust_noop_consume(settings, n_records: int, app_id: str) -> float:
    """Faust's own ceiling here: an agent that only counts the records."""
    import tempfile

    import faust

    app = faust.App(app_id, broker=f"kafka://{settings.kafka.bootstrap}", store="memory://",
                    datadir=tempfile.mkdtemp(prefix="bench-noop-"), topic_allow_declare=False,
                    consumer_auto_offset_reset="earliest", web_enabled=False,
                    broker_session_timeout=settings.kafka.session_timeout_ms / 1000,
                    broker_heartbeat_interval=settings.kafka.heartbeat_interval_ms / 1000)
    topic = app.topic(settings.topics.name("events"), key_type=bytes, value_type=bytes,
                      key_serializer="raw", value_serializer="raw")
    seen = {"n": 0, "first": None}

    @app.agent(topic)
    async def count(stream):
        async for chunk in stream.take_events(1000, within=0.05):
            if seen["first"] is None:
                seen["first"] = time.perf_counter()
            seen["n"] += len(chunk)

    await app.start()
    try:
        deadline = time.monotonic() + 300
        while seen["n"] < n_records and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return time.perf_counter() - (seen["first"] or time.perf_counter())
    finally:
        await app.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--seconds", type=int, default=600)
    ap.add_argument("--flush-s", type=float, default=1.0)
    ap.add_argument("--rate-scale", type=float, default=4.0)
    ap.add_argument("--partitions", type=int, default=6)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)

    import logging

    logging.basicConfig(level=logging.ERROR)
    from kvguard.config.settings import TOPIC_KINDS, Settings

    broker = None
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP")
    if not bootstrap:
        from kvguard.testing.rigs import TansuBroker

        broker = TansuBroker().start()
        bootstrap = broker.bootstrap
    try:
        prefix = f"bench{uuid.uuid4().hex[:6]}."
        settings = Settings(kafka={"bootstrap": bootstrap, "client_id": "kvguard-bench",
                                   "session_timeout_ms": 6000, "heartbeat_interval_ms": 1000},
                            topics={"prefix": prefix, **{k: {"partitions": args.partitions} for k in TOPIC_KINDS}})
        batches = make_batches(args.gpus, args.seconds, args.flush_s, args.rate_scale, args.seed)
        n_events = sum(len(b) for b in batches)
        from kvguard.streams.app import ensure_topics

        app_id = f"kvguard-bench-{uuid.uuid4().hex[:6]}"
        asyncio.run(ensure_topics(settings, app_id))
        t0 = time.perf_counter()
        asyncio.run(publish(settings, batches))
        publish_s = time.perf_counter() - t0
        raw_s, raw_seen = asyncio.run(raw_consume(settings, len(batches)))
        noop_app = f"kvguard-bench-noop-{uuid.uuid4().hex[:6]}"
        from kvguard.bus.kafka import create_topics
        from kvguard.config.settings import TopicSpec

        asyncio.run(create_topics(settings, {f"{noop_app}-__assignor-__leader": TopicSpec(name="x", partitions=1)}))
        noop_s = asyncio.run(faust_noop_consume(settings, len(batches), noop_app))
        faust_s, faust_cpu_s, counters = asyncio.run(faust_consume(settings, len(batches), app_id))
        raw_eps = n_events / raw_s if raw_s > 0 else None
        faust_eps = n_events / faust_s if faust_s > 0 else None
        out = {
            "bench": "streams_faust",
            "bootstrap": "tansu (private)" if broker else bootstrap,
            "gpus": args.gpus, "sim_seconds": args.seconds, "partitions": args.partitions,
            "records": len(batches), "events": n_events,
            "events_per_record": round(n_events / max(len(batches), 1), 1),
            "publish_events_per_s": round(n_events / publish_s),
            "raw_aiokafka_events_per_s": round(raw_eps) if raw_eps else None,
            "raw_records_seen": raw_seen,
            "faust_noop_agent_events_per_s": round(n_events / noop_s) if noop_s > 0 else None,
            "faust_events_per_s": round(faust_eps) if faust_eps else None,
            "faust_events_per_cpu_s": round(n_events / faust_cpu_s) if faust_cpu_s > 0 else None,
            "faust_to_raw_ratio": round(faust_eps / raw_eps, 3) if raw_eps and faust_eps else None,
            "target_events_per_s": 200_000,
            "worker": counters,
        }
        json.dump(out, sys.stdout)
        print()
    finally:
        if broker is not None:
            broker.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
