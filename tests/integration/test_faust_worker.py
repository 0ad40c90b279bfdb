"""The Faust worker against the real broker: outputs, DLQ, recovery after SIGKILL, two workers."""

import asyncio
import json
import uuid

import pytest

from tests.integration.streams_helpers import (
    OutputReader,
    WorkerProcess,
    expected_records,
    publish_batches,
    shadow_log,
    tick_map,
)


@pytest.fixture(scope="module")
def log_batches():
    return shadow_log(n_gpus=3, seconds=150)


def app_id() -> str:
    return f"kvg-{uuid.uuid4().hex[:8]}"


async def test_worker_recovers_node_state_from_the_changelog_after_sigkill(kafka_settings, log_batches, tmp_path):
    expected, _ = expected_records(log_batches)
    half = len(log_batches) // 2
    first_ticks = len(expected_records(log_batches[:half])[0])
    worker = WorkerProcess(kafka_settings, app_id(), tmp_path, checkpoint_every_ticks=2)
    try:
        async with OutputReader(kafka_settings, "reader") as out:
            await publish_batches(kafka_settings, log_batches[:half])
            worker.start()
            await out.until(lambda o: len(o.of("metrics")) >= first_ticks, what="first half's ticks")
            await asyncio.sleep(4)  # past Faust's commit interval: offsets and changelog are on the broker
            worker.kill()
            await publish_batches(kafka_settings, log_batches[half:])
            worker.start()
            await out.until(lambda o: len(tick_map(o.of("metrics"))[0]) >= len(expected), what="every tick")
            await out.settle()
        got, duplicates = tick_map(out.of("metrics"))
        assert set(got) == set(expected)  # no tick lost, none invented
        assert got == expected  # state came back: every tick equals the uninterrupted run's
        assert duplicates <= len(expected) // 2  # at-least-once redelivery only
        assert "restored from the changelog" in worker.log_text()
    finally:
        worker.stop()


async def test_worker_killed_while_consuming_loses_no_tick(kafka_settings, log_batches, tmp_path):
    expected, _ = expected_records(log_batches)
    worker = WorkerProcess(kafka_settings, app_id(), tmp_path, checkpoint_every_ticks=2)
    try:
        async with OutputReader(kafka_settings, "reader") as out:
            await publish_batches(kafka_settings, log_batches)
            worker.start()
            await out.until(lambda o: len(o.of("metrics")) >= len(expected) // 3, what="a third of the ticks")
            worker.kill()  # mid-stream: records in flight, outputs and changelog partly sent
            worker.start()
            await out.until(lambda o: len(tick_map(o.of("metrics"))[0]) >= len(expected), what="every tick")
            await out.settle()
        got, duplicates = tick_map(out.of("metrics"))
        assert got == expected
        assert duplicates <= len(expected)
    finally:
        worker.stop()


async def test_two_workers_split_partitions_and_produce_the_same_ticks_as_one(kafka_settings, log_batches, tmp_path):
    expected, expected_alerts = expected_records(log_batches)
    app = app_id()
    a = WorkerProcess(kafka_settings, app, tmp_path, name="a").start()
    b = WorkerProcess(kafka_settings, app, tmp_path, name="b").start()
    try:
        async with OutputReader(kafka_settings, "reader") as out:
            await asyncio.sleep(3)  # both join before the records arrive
            await publish_batches(kafka_settings, log_batches)
            await out.until(lambda o: len(tick_map(o.of("metrics"))[0]) >= len(expected), what="every tick")
            await out.settle()
        got, _ = tick_map(out.of("metrics"))
        assert got == expected
        alerts = {(d["node"], d["ts_ns"], d["rule"], d["state"]) for d in map(json.loads, (r.value for r in out.of("alerts")))}
        assert alerts == set(expected_alerts)
        pa, pb = a.assigned_partitions(), b.assigned_partitions()
        assert pa and pb and not set(pa) & set(pb)
        assert sorted(pa + pb) == list(range(kafka_settings.topics.events.partitions))
    finally:
        a.stop()
        b.stop()


async def test_bad_records_go_to_the_dlq_and_the_worker_lives_on(kafka_settings, log_batches, tmp_path):
    expected, _ = expected_records(log_batches[:20])
    worker = WorkerProcess(kafka_settings, app_id(), tmp_path)
    try:
        async with OutputReader(kafka_settings, "reader") as out:
            await publish_batches(kafka_settings, [], extra=[("sim-0/gpu0", b"\x00not json"),
                                                             ("sim-0/gpu1", b'{"schema": "9.0", "node": "x"}')])
            await publish_batches(kafka_settings, log_batches[:20])
            worker.start()
            await out.until(lambda o: len(o.of("dlq")) >= 2 and len(tick_map(o.of("metrics"))[0]) >= len(expected),
                            what="dlq records and ticks")
        reasons = sorted(json.loads(r.value)["reason"] for r in out.of("dlq"))
        assert reasons == ["malformed", "unknown_major"]
        assert tick_map(out.of("metrics"))[0] == expected
    finally:
        worker.stop()


async def test_a_seq_gap_is_read_back_once_then_marks_the_node_unsynced(kafka_settings, log_batches, tmp_path):
    lost = next(i for i, b in enumerate(log_batches) if b.node == "sim-0/gpu0" and b.seq == 8)
    gapped = log_batches[:lost] + log_batches[lost + 1:]
    expected, _ = expected_records(gapped)
    assert any(not d["synced"] for d in expected.values())  # the embedded core sees the gap too
    worker = WorkerProcess(kafka_settings, app_id(), tmp_path)
    try:
        async with OutputReader(kafka_settings, "reader") as out:
            await publish_batches(kafka_settings, gapped)
            worker.start()
            await out.until(lambda o: len(tick_map(o.of("metrics"))[0]) >= len(expected), what="every tick")
            await out.settle()
        assert tick_map(out.of("metrics"))[0] == expected
        log_text = worker.log_text()
        assert log_text.count("node sim-0/gpu0: seq gap before seq 9; read 0 missing batches back") == 1
        assert "seq gap 7 -> 9" in log_text
    finally:
        worker.stop()
