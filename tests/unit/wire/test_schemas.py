"""Wire contracts: round trips, permissive minor versions, DLQ reasons for everything else."""

import base64

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.contracts.events import COLUMNS, EVENT_DTYPE, EventBatch, Geometry, PoolState
from kvguard.wire.schemas import (
    Ack,
    Alert,
    Command,
    DecodeError,
    DlqRecord,
    EventBatchRecord,
    MetricTick,
    batch_headers,
    ce_type,
    decode,
    decode_batch,
    encode,
    encode_batch,
    make_headers,
)

GEOMETRY = Geometry(
    total_bytes=24 * 2**30, weights_bytes=16 * 2**30, context_bytes=2**30, gpu_memory_utilization=0.9,
    unit_tokens=4, kv_bytes_per_token=131072, dynamic_units=8192, page_classes=(1, 16),
)


def make_batch(n: int = 5, seq: int = 0, node: str = "host-a/gpu0", with_state: bool = False) -> EventBatch:
    events = np.zeros(n, dtype=EVENT_DTYPE)
    events["ts_ns"] = np.arange(n, dtype=np.int64) * 1_000 + 1_700_000_000_000_000_000
    events["kind"] = 5
    events["cls"] = 1
    events["req"] = np.arange(n) % 7
    events["offset"] = np.arange(n) * 16
    events["size"] = 16
    events["tokens"] = 64
    events["aux"] = -1
    state = None
    if with_state:
        state = PoolState(
            offset=np.array([0, 16]), size=np.array([16, 4]), state=np.array([0, 3]), cls=np.array([1, 0]),
            tokens=np.array([64, 0]), refs=[(1, 2), ()], tokens_stored=64,
        )
    return EventBatch(node=node, seq=seq, events=events, epoch=2, geometry=GEOMETRY, state=state,
                      extra={"engine": "shadow"})


def test_event_batch_round_trips_every_column_and_the_envelope():
    batch = make_batch(with_state=True)
    back = decode_batch(encode_batch(batch), batch_headers(batch))
    assert back.events.dtype == EVENT_DTYPE
    assert np.array_equal(back.events, batch.events)
    assert (back.node, back.seq, back.epoch) == (batch.node, batch.seq, batch.epoch)
    assert back.geometry == GEOMETRY
    assert back.state.refs == [(1, 2), ()]
    assert np.array_equal(back.state.offset, [0, 16])
    assert back.extra == {"engine": "shadow"}


def test_event_columns_are_json_arrays_one_per_column():
    data = orjson.loads(encode_batch(make_batch(3)))
    assert data["schema"] == "1.0"
    assert set(data["cols"]) == set(COLUMNS)
    assert data["cols"]["offset"] == [0, 16, 32]


def test_empty_batch_round_trips():
    batch = make_batch(0)
    assert len(decode_batch(encode_batch(batch)).events) == 0


event_rows = st.lists(
    st.tuples(st.integers(0, 2**62), st.integers(0, 255), st.integers(0, 255), st.integers(0, 255),
              st.integers(-(2**63), 2**63 - 1), st.integers(-(2**40), 2**40), st.integers(0, 2**40),
              st.integers(0, 2**40), st.integers(-(2**63), 2**63 - 1)),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(rows=event_rows)
def test_any_event_rows_round_trip_bit_for_bit(rows):
    events = np.array(rows, dtype=EVENT_DTYPE) if rows else np.zeros(0, dtype=EVENT_DTYPE)
    batch = EventBatch(node="n", seq=1, events=events)
    assert np.array_equal(decode_batch(encode_batch(batch), check=False).events, events)  # the codec alone


def test_newer_minor_version_with_unknown_fields_is_accepted():
    data = orjson.loads(encode_batch(make_batch()))
    data["schema"] = "1.9"
    data["a_future_field"] = {"x": 1}
    data["cols"]["a_future_column"] = [1, 2, 3, 4, 5]
    batch = decode_batch(orjson.dumps(data))
    assert len(batch.events) == 5


@pytest.mark.parametrize(
    "mutate, reason, words",
    [
        (lambda raw: b"\x00\xffnot json", "malformed", "not JSON"),
        (lambda raw: b"[1, 2]", "malformed", "JSON object"),
        (lambda raw: raw.replace(b'"schema":"1.0"', b'"schema":"2.0"'), "unknown_major", "2.0"),
        (lambda raw: raw.replace(b'"schema":"1.0",', b""), "invalid", "schema"),
        (lambda raw: raw.replace(b'"seq":0', b'"seq":-1'), "invalid", "seq"),
        (lambda raw: raw.replace(b'"size":[16,', b'"size":[16.5,'), "invalid", "cols.size"),
        (lambda raw: raw.replace(b'"kind":[5,', b'"kind":[300,'), "invalid", "cols.kind"),
        (lambda raw: raw.replace(b'"tokens":[64,', b'"tokens":[64,64,'), "invalid", "cols.tokens"),
        (lambda raw: raw.replace(b'"aux":', b'"not_aux":'), "invalid", "cols.aux is missing"),
    ],
)
def test_bad_event_records_raise_decode_error_with_reason(mutate, reason, words):
    raw = encode_batch(make_batch())
    bad = mutate(raw)
    assert bad != raw
    with pytest.raises(DecodeError) as info:
        decode_batch(bad)
    assert info.value.reason == reason
    assert words in str(info.value)


def test_type_header_of_another_kind_or_major_is_rejected():
    raw = encode_batch(make_batch())
    with pytest.raises(DecodeError) as info:
        decode("events", raw, [("ce_type", b"io.kvguard.events.v2")])
    assert info.value.reason == "unknown_major"
    with pytest.raises(DecodeError) as info:
        decode("events", raw, [("ce_type", b"io.kvguard.metrics.v1")])
    assert info.value.reason == "wrong_type"


def test_cloudevents_headers_are_complete():
    headers = dict(make_headers("alerts", "streams", record_id="abc"))
    assert headers["ce_specversion"] == b"1.0"
    assert headers["ce_type"] == b"io.kvguard.alerts.v1"
    assert headers["ce_source"] == b"streams"
    assert headers["ce_id"] == b"abc"
    assert headers["ce_time"].endswith(b"Z")
    assert headers["content-type"] == b"application/json"
    assert dict(batch_headers(make_batch(seq=9)))["ce_id"] == b"host-a/gpu0/2/9"
    assert ce_type("commands") == "io.kvguard.commands.v2"  # one payload per action: a major of its own


def test_metric_alert_command_ack_round_trip():
    tick = MetricTick(node="n", ts_ns=10, u_kv=0.9, f_ext=0.6, f_int=0.1, psi=0.97, p_oom=0.3,
                      utilization={"kv_live": 0.5}, candidates=[{"req": 3, "units": 16}])
    alert = Alert(node="n", ts_ns=10, name="KVCacheOOMRisk", tier="slope", severity="warning", value=0.9)
    command = Command(id="c1", node="n", action="evict", payload={"targets": [[3, 0]]}, issued_at_ns=10, ttl_ns=5)
    ack = Ack(command_id="c1", node="n", outcome="executed", executed_at_ns=12, errors=["x"])
    for kind, model in [("metrics", tick), ("alerts", alert), ("commands", command), ("acks", ack)]:
        assert decode(kind, encode(model)) == model


def test_command_wire_form_matches_the_policy_dict_so_signatures_survive():
    from kvguard.contracts.commands import Command as PolicyCommand
    from kvguard.contracts.commands import EvictPayload, Mode, Target, sign, verify

    signed = sign(PolicyCommand(id="c1", node="n", payload=EvictPayload((Target(3), Target(4, 16)), "block", "swap"),
                                reason="tick", mode=Mode.DEFAULT, variant="v", issued_at_ns=1, ttl_ns=2, epoch=7),
                  b"wire-secret")
    policy_dict = signed.to_dict()
    model = decode("commands", orjson.dumps(policy_dict), make_headers("commands", "n"))
    assert orjson.loads(encode(model)) == policy_dict
    assert verify(PolicyCommand.from_dict(model.model_dump()), b"wire-secret")


def test_absurd_payloads_and_flat_commands_are_dead_lettered_with_the_reason():
    good = {"schema": "2.0", "id": "c1", "node": "n", "action": "hold", "payload": {"max_prompt_tokens": 0, "steps": 0},
            "mode": "default", "issued_at_ns": 1, "ttl_ns": 2}
    decode("commands", orjson.dumps(good))
    for payload, field in (({"max_prompt_tokens": -1, "steps": -1}, "payload.max_prompt_tokens"),
                           ({"max_prompt_tokens": 0, "steps": 2**63 - 1}, "payload.steps"),
                           ({"units_needed": 5}, "payload.units_needed")):
        with pytest.raises(DecodeError) as info:
            decode("commands", orjson.dumps(good | {"payload": payload}))
        assert info.value.reason == "invalid" and field in info.value.detail
    with pytest.raises(DecodeError) as info:
        decode("commands", orjson.dumps({k: v for k, v in good.items() if k != "payload"}))
    assert info.value.reason == "invalid" and "payload" in info.value.detail
    flat = {k: v for k, v in good.items() if k != "payload"} | {"schema": "1.0", "units_needed": 0, "max_moves": 0}
    with pytest.raises(DecodeError) as info:
        decode("commands", orjson.dumps(flat))
    assert info.value.reason == "unknown_major" and "flat 1.x command" in info.value.detail
    with pytest.raises(DecodeError) as info:  # the old header says so too
        decode("commands", orjson.dumps(good), [("ce_type", b"io.kvguard.commands.v1")])
    assert info.value.reason == "unknown_major"
    unknown = good | {"action": "defragment", "payload": {"whatever": 1}}  # a newer minor's action passes the wire
    assert decode("commands", orjson.dumps(unknown)).action == "defragment"


def test_dlq_record_keeps_original_bytes_and_headers():
    dead = DlqRecord.of(reason="malformed", detail="x", topic="t", partition=1, offset=7, key=b"k",
                        value=b"\x00\x01", headers=[("ce_type", b"io.kvguard.events.v9")])
    back = decode("dlq", dead.to_bytes())
    assert back.value == b"\x00\x01" and back.key == b"k"
    assert base64.b64decode(back.headers[0][1]) == b"io.kvguard.events.v9"


def test_model_refuses_unknown_major_when_built_directly():
    with pytest.raises(ValueError):
        MetricTick(schema="3.0", node="n", ts_ns=1, u_kv=0, f_ext=0, f_int=0, psi=0)


def test_from_batch_builds_a_validated_record():
    record = EventBatchRecord.from_batch(make_batch(4))
    assert record.seq == 0 and len(record.to_batch()) == 4


def test_a_dlq_record_carries_a_value_whole_up_to_its_bound_and_a_larger_one_by_size_hash_and_prefix():
    import hashlib

    from kvguard.wire.schemas import DLQ_INLINE_VALUE_BYTES, DLQ_PREFIX_BYTES

    def dead(value, **kw):
        record = DlqRecord.of(reason="malformed", detail="d" * 10**6, topic="t", partition=0, offset=3,
                              key=kw.get("key", b"n"), value=value, headers=kw.get("headers", ()))
        return decode("dlq", record.to_bytes())

    small = bytes(range(256)) * (DLQ_INLINE_VALUE_BYTES // 256)
    kept = dead(small)
    assert kept.value == small and not kept.truncated and kept.value_bytes == len(small)
    assert kept.value_sha256 == hashlib.sha256(small).hexdigest() and len(kept.detail) == 2000
    for size in (DLQ_INLINE_VALUE_BYTES + 1, 800_000, 5_000_000, 20_000_000):
        value = (small * (size // len(small) + 1))[:size]
        cut = dead(value, key=b"k" * 5000, headers=[(f"h{i}", b"v" * 5000) for i in range(100)])
        assert cut.truncated and cut.value is None and cut.value_bytes == size
        assert cut.value_sha256 == hashlib.sha256(value).hexdigest()
        assert base64.b64decode(cut.value_prefix_b64) == value[:DLQ_PREFIX_BYTES]
        assert cut.key is None and cut.key_bytes == 5000  # a key too long to carry: its size only
        assert len(cut.headers) == 32 and cut.headers_dropped == 68
        assert len(cut.to_bytes()) < 512 * 1024, size  # half the default broker limit, whatever came in


def test_the_dlq_key_is_the_original_one_or_its_hash_when_that_is_too_long():
    from kvguard.wire.schemas import dlq_key

    assert dlq_key(None) is None and dlq_key(b"sim-0/gpu0") == b"sim-0/gpu0"
    long_key = b"k" * 5000
    assert dlq_key(long_key) == dlq_key(long_key) and len(dlq_key(long_key)) == 32


def test_an_empty_value_is_malformed_and_a_null_one_a_tombstone():
    with pytest.raises(DecodeError) as err:
        decode("metrics", b"")
    assert err.value.reason == "malformed" and "empty" in err.value.detail
    with pytest.raises(DecodeError) as err:
        decode_batch(None)
    assert err.value.reason == "tombstone"
