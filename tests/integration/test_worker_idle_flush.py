"""The Faust worker on the real broker publishes the last, partial tick of nodes that stopped
sending, once they have been silent for ``streams.idle_flush_s`` of wall time (issue 16)."""

import json
import uuid

from kvguard.config.settings import Settings
from kvguard.streams.core import StreamConfig, StreamCore
from kvguard.streams.outputs import encode_tick
from tests.integration.streams_helpers import OutputReader, WorkerProcess, publish_batches, shadow_log, tick_map


async def test_nodes_that_stop_sending_get_their_last_partial_tick_published(kafka_settings, tmp_path):
    batches = shadow_log(n_gpus=2, seconds=60, seed=7)
    core = StreamCore(StreamConfig())
    full = {(t.node, t.ts_ns): json.loads(encode_tick(t)) for t in core.process_many(batches)[0]}
    partial = {(t.node, t.ts_ns): json.loads(encode_tick(t)) for t in core.finish()[0]}
    assert len(partial) == 2 and all(d["partial"] for d in partial.values())  # each node has a pending interval
    data = kafka_settings.model_dump()
    data["streams"]["idle_flush_s"] = 1.0
    settings = Settings.from_dict(data)

    worker = WorkerProcess(settings, f"kvg-{uuid.uuid4().hex[:8]}", tmp_path)
    try:
        async with OutputReader(settings, "reader") as out:
            await publish_batches(settings, batches)  # then the nodes fall silent
            worker.start()
            await out.until(lambda o: len(tick_map(o.of("metrics"))[0]) >= len(full) + len(partial),
                            what="every tick and each node's partial last one")
            await out.settle()
    finally:
        worker.stop()
    got, _ = tick_map(out.of("metrics"))
    assert got == {**full, **partial}  # nothing flushed early (the worker was not idle, only catching up)
    assert "idle flush: partial ticks of" in worker.log_text()
