"""One event log, three shells (Faust on Kafka, the embedded service on the in-process bus, the
log replay): identical tick and alert records, apart from transport metadata."""

import json
import uuid

from kvguard.bus.inproc import InprocBus
from kvguard.config.settings import Settings
from kvguard.runtime.mapping import stream_config
from kvguard.streams.embedded import StreamsService, run_event_log
from kvguard.streams.outputs import encode_alert, encode_tick
from kvguard.wire.eventlog import write_event_log
from kvguard.wire.schemas import batch_headers, encode_batch
from tests.integration.streams_helpers import OutputReader, WorkerProcess, publish_batches, shadow_log, tick_map


def alert_set(values) -> list:
    return sorted(json.dumps(json.loads(v), sort_keys=True) for v in values)


async def test_embedded_service_log_replay_and_faust_give_identical_records(kafka_settings, tmp_path):
    batches = shadow_log(n_gpus=2, seconds=120, seed=9)

    # 1. the log replay (kvguard metrics)
    path = tmp_path / "log.jsonl.gz"
    write_event_log(path, batches, {"test": "embedded-vs-faust"})
    replay_ticks, replay_alerts = [], []
    for ticks, alerts in run_event_log(path):
        replay_ticks += [encode_tick(t) for t in ticks]
        replay_alerts += [encode_alert(a) for a in alerts]

    # 2. the embedded service on the in-process bus
    settings = Settings()
    bus = InprocBus.from_settings(settings)
    for b in batches:
        await bus.publish(settings.topics.name("events"), b.node, encode_batch(b), batch_headers(b))
    service = StreamsService(bus, settings, config=stream_config(settings))
    await service.run(idle_timeout_s=0.5)
    sub = bus.subscribe([settings.topics.name("metrics"), settings.topics.name("alerts")], "check")
    records = await sub.getmany(100_000, 0.1)
    inproc_ticks = [r.value for r in records if r.topic.endswith("metrics")]
    inproc_alerts = [r.value for r in records if r.topic.endswith("alerts")]
    inproc_ids = sorted(dict(r.headers)["ce_id"] for r in records)

    # 3. the Faust worker on the real broker
    worker = WorkerProcess(kafka_settings, f"kvg-{uuid.uuid4().hex[:8]}", tmp_path)
    try:
        async with OutputReader(kafka_settings, "reader") as out:
            await publish_batches(kafka_settings, batches)
            worker.start()
            await out.until(lambda o: len(tick_map(o.of("metrics"))[0]) >= len(replay_ticks), what="every tick")
            await out.settle()
    finally:
        worker.stop()
    faust_ticks, duplicates = tick_map(out.of("metrics"))

    by_key = lambda values: {(d["node"], d["ts_ns"]): d for d in map(json.loads, values)}
    assert len(replay_ticks) >= 20 and service.counters.batches == len(batches)
    assert by_key(replay_ticks) == by_key(inproc_ticks) == faust_ticks
    assert sorted(replay_ticks) == sorted(inproc_ticks)  # byte-identical values
    assert duplicates == 0
    assert alert_set(replay_alerts) == alert_set(inproc_alerts) == alert_set(r.value for r in out.of("alerts"))
    # the same records under the same CloudEvents ids (consumers deduplicate by id)
    faust_ids = sorted(dict(r.headers)["ce_id"] for r in out.of("metrics") + out.of("alerts"))
    assert inproc_ids == faust_ids
    assert replay_alerts, "the log should raise alerts"
