"""The Faust worker on the real broker, running the shipped predictor (as deployed) over a
vLLM-faithful log with allocator OOMs, GPUs down after them, a producer restart and a seq gap
(issue 27): it keeps going and publishes every tick, each equal to the embedded core's."""

from __future__ import annotations

import json
import uuid

from kvguard.runtime.bootstrap import bootstrap
from kvguard.streams.loader import SHIPPED_DIR
from kvguard.streams.outputs import encode_tick
from tests.integration.streams_helpers import OutputReader, WorkerProcess, publish_batches
from tests.unit.streams.vllm_oom_log import ooms, vllm_oom_log


def keyed(values) -> dict:
    """{(node, epoch, ts_ns): record}: a restarted node's clock starts over, so ts_ns alone repeats."""
    out = {}
    for d in map(json.loads, values):
        key = (d["node"], d["epoch"], d["ts_ns"])
        assert out.get(key, d) == d, f"two different ticks for {key}"
        out[key] = d
    return out


async def test_the_worker_with_the_shipped_predictor_publishes_every_tick_of_a_vllm_log_with_ooms(
        kafka_settings, tmp_path):
    settings = kafka_settings.model_copy(update={"predictor": kafka_settings.predictor.model_copy(
        update={"model_path": str(SHIPPED_DIR)})})
    batches = vllm_oom_log()
    core = bootstrap(settings).stream_core()  # the embedded core with the shipped predictor
    assert core.predictor is not None
    expected_ticks = [t for b in batches for t in core.process(b)[0]]
    expected = keyed(encode_tick(t) for t in expected_ticks)
    assert ooms(batches) >= 4 and sum(t.ooms for t in expected_ticks) >= 2 and {k[1] for k in expected} == {0, 1}
    worker = WorkerProcess(settings, f"kvg-{uuid.uuid4().hex[:8]}", tmp_path, predictor=True)
    try:
        async with OutputReader(settings, "reader") as out:
            await publish_batches(settings, batches)
            worker.start()
            await out.until(lambda o: len(keyed(r.value for r in o.of("metrics"))) >= len(expected),
                            what="every tick")
            await out.settle()
        assert worker.proc.poll() is None, worker.log_text()[-3000:]  # still running
    finally:
        worker.stop()
    got = keyed(r.value for r in out.of("metrics"))
    assert got == expected
    assert all(d["p_oom"] is not None for d in got.values())
    assert not out.of("dlq") and "processing_error" not in worker.log_text()
