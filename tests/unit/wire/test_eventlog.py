import gzip
import json

import numpy as np
import pytest

from kvguard.contracts.events import EVENT_DTYPE, EventBatch, EventKind, Geometry, PoolState
from kvguard.wire.eventlog import EventLogError, EventLogWriter, read_event_log, write_event_log

GEOMETRY = Geometry(total_bytes=1 << 30, weights_bytes=1 << 28, context_bytes=1 << 20, gpu_memory_utilization=0.9,
                    unit_tokens=4, kv_bytes_per_token=1024, dynamic_units=1000, page_classes=(1, 16))


def _batch(seq, n=3, state=False):
    ev = np.zeros(n, dtype=EVENT_DTYPE)
    ev["ts_ns"] = np.arange(n) + seq * 100
    ev["kind"] = int(EventKind.ALLOC)
    ev["req"] = 7
    ev["offset"] = np.arange(n) * 16
    ev["size"] = 16
    st = PoolState(offset=np.array([0, 16]), size=np.array([16, 16]), state=np.array([0, 1]),
                   cls=np.array([1, 1]), tokens=np.array([64, 64]), refs=[(7,), ()], tokens_stored=64) if state else None
    return EventBatch(node="sim-0/gpu0", seq=seq, events=ev, epoch=3, geometry=GEOMETRY if seq == 0 else None, state=st)


def test_round_trip_keeps_every_column_geometry_and_state(tmp_path):
    path = tmp_path / "log.jsonl.gz"
    batches = [_batch(0), _batch(1, state=True), _batch(2, n=0)]
    assert write_event_log(path, batches, {"who": "test"}) == 6
    meta, it = read_event_log(path)
    back = list(it)
    assert meta == {"who": "test"}
    assert [(b.node, b.seq, b.epoch) for b in back] == [("sim-0/gpu0", i, 3) for i in range(3)]
    for a, b in zip(batches, back):
        assert a.events.tobytes() == b.events.tobytes()
    assert back[0].geometry == GEOMETRY and back[1].geometry is None
    assert back[1].state.refs == [(7,), ()] and back[1].state.tokens_stored == 64
    assert np.array_equal(back[1].state.offset, [0, 16])


def test_same_batches_give_byte_identical_files(tmp_path):
    for name in ("a.gz", "b.gz"):
        with EventLogWriter(tmp_path / name, {"x": 1}) as w:
            w.write(_batch(0))
            w.write(_batch(1, state=True))
    assert (tmp_path / "a.gz").read_bytes() == (tmp_path / "b.gz").read_bytes()


def _write_lines(path, lines):
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))


def test_bad_header_and_bad_batch_lines_name_the_line(tmp_path):
    p = tmp_path / "bad.gz"
    _write_lines(p, ['{"type":"batch"}'])
    with pytest.raises(EventLogError) as info:
        read_event_log(p)
    assert info.value.line_no == 1 and "header" in info.value.expected

    header = json.dumps({"type": "header", "schema": "1.0", "created_by": "t", "meta": {}})
    _write_lines(p, [header, '{"type":"batch","node":"n","epoch":0,"seq":0,"cols":{"ts_ns":[1]}}'])
    with pytest.raises(EventLogError) as info:
        list(read_event_log(p)[1])
    assert info.value.line_no == 2 and str(p) in str(info.value)

    _write_lines(p, [header, "not json"])
    with pytest.raises(EventLogError, match=":2:"):
        list(read_event_log(p)[1])

    _write_lines(p, [json.dumps({"type": "header", "schema": "9.0", "meta": {}})])
    with pytest.raises(EventLogError, match="schema"):
        read_event_log(p)


def test_plain_text_file_is_rejected_as_not_gzip(tmp_path):
    p = tmp_path / "plain.jsonl"
    p.write_text('{"type":"header"}\n')
    with pytest.raises(EventLogError, match="gzip"):
        read_event_log(p)
