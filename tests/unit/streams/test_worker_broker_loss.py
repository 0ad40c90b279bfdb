"""The Faust worker's logic when the broker loses its data under it (issue 28): the events log
starts over at offset 0 while the worker holds its nodes' offsets of the old log. No broker: the
worker with its small working fakes; the same on a real broker is
tests/integration/test_broker_restart.py."""

from __future__ import annotations

import struct

from tests.unit.runtime.test_hostile_services import events_of, faust_worker, node_a, wire


async def feed(worker, batches, first_offset: int) -> None:
    for offset, batch in enumerate(batches, first_offset):
        (event,) = events_of([wire(batch)])
        event.message.offset = offset
        await worker.handle([event])


async def test_a_log_that_starts_over_is_seen_and_the_offsets_and_checkpoints_are_rebuilt(caplog):
    clean = node_a()
    half = len(clean) // 2
    reference = faust_worker()
    await feed(reference, clean, 0)
    worker = faust_worker()
    await feed(worker, clean[:half], 100)  # the old log: the node's batches at offsets 100..
    assert worker.last_offset["a"] == 100 + half - 1
    await feed(worker, clean[half:], 0)  # the broker lost its data: the same node's next batches from offset 0
    assert worker.counters.log_rebuilds == 1 and "events partition 0 started over" in caplog.text
    assert worker.metrics_topic.sent == reference.metrics_topic.sent  # nothing was lost: every tick as before
    assert worker.last_offset["a"] == len(clean) - half - 1  # offsets of the new log
    (offset,) = struct.unpack_from("<q", worker.table.data[b"C|a"])
    assert offset < 100 and worker.counters.gap_fills == 0  # rewritten with a new-log offset; nothing read back


async def test_a_redelivered_batch_at_its_old_offset_is_a_duplicate_not_a_lost_log():
    clean = node_a()
    worker = faust_worker()
    await feed(worker, clean[:6], 0)
    await feed(worker, clean[3:6], 3)  # at-least-once: the same batches again at their own offsets
    assert worker.counters.log_rebuilds == 0 and worker.counters.duplicates == 3
