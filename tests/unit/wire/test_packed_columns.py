"""Packed event columns (``colsb``, schema 1.1): the same batch as the JSON columns, bit for bit,
and every bad packed column refused with its name."""

import base64

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.contracts.events import COLUMNS, EVENT_DTYPE, EventBatch
from kvguard.wire.fastcols import pack_column
from kvguard.wire.schemas import DecodeError, decode_batch, encode_batch
from tests.unit.wire.test_schemas import event_rows, make_batch


@settings(max_examples=80, deadline=None)
@given(rows=event_rows)
def test_packed_and_json_columns_decode_to_the_same_rows(rows):
    events = np.array(rows, dtype=EVENT_DTYPE) if rows else np.zeros(0, dtype=EVENT_DTYPE)
    batch = EventBatch(node="n", seq=1, events=events)
    packed = decode_batch(encode_batch(batch, packed=True), check=False).events
    assert packed.dtype == EVENT_DTYPE
    assert np.array_equal(packed, events)
    assert np.array_equal(packed, decode_batch(encode_batch(batch), check=False).events)


@given(values=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=30))
def test_a_column_takes_the_narrowest_width_that_holds_its_span(values):
    a = np.array(values, dtype=np.int64)
    dtype, base, data = pack_column(a)
    width = {"i1": 1, "i2": 2, "i4": 4, "i8": 8}[dtype]
    assert len(base64.b64decode(data)) == width * a.size
    span = int(a.max()) - int(a.min())
    if span < 2**31:  # a batch's event times: 4 bytes each, whatever their epoch
        assert width <= 4


def test_a_packed_batch_keeps_its_envelope_and_says_schema_1_1():
    batch = make_batch(6, with_state=True)
    value = encode_batch(batch, packed=True)
    data = orjson.loads(value)
    assert data["schema"] == "1.1" and "cols" not in data and set(data["colsb"]) == set(COLUMNS)
    assert data["colsb"]["ts_ns"][0] == "i4"  # 1.7e18 ns, spanning 5 µs
    back = decode_batch(value)
    assert np.array_equal(back.events, batch.events)
    assert (back.node, back.seq, back.epoch, back.geometry, back.extra) == \
        (batch.node, batch.seq, batch.epoch, batch.geometry, batch.extra)
    assert back.state.refs == [(1, 2), ()]


def _mutated(mutate) -> bytes:
    data = orjson.loads(encode_batch(make_batch(4), packed=True))
    mutate(data)
    return orjson.dumps(data)


@pytest.mark.parametrize("mutate, words", [
    (lambda d: d["colsb"]["req"].__setitem__(0, "f8"), "colsb.req: dtype 'f8'"),
    (lambda d: d["colsb"]["offset"].__setitem__(2, "not base64!"), "colsb.offset: data is not base64"),
    (lambda d: d["colsb"].__setitem__("size", ["i2", 0, base64.b64encode(b"\x01\x02\x03").decode()]),
     "colsb.size: 3 bytes"),
    (lambda d: d["colsb"].__setitem__("aux", ["i8", 5, ""]), "colsb.aux: an i8 column has base 0"),
    (lambda d: d["colsb"].__setitem__("ts_ns", ["i4", 2**63 - 2, base64.b64encode(b"\xff\xff\xff\x7f" * 4).decode()]),
     "past the int64 range"),
    (lambda d: d["colsb"].pop("tokens"), "colsb.tokens is missing"),
    (lambda d: d["colsb"].__setitem__("kind", ["u1", 0]), "colsb.kind: expected [dtype, base, base64 data]"),
    (lambda d: d.__setitem__("cols", {}), "a batch carries its columns one way"),
    (lambda d: d["colsb"].__setitem__("cls", ["i2", 0, base64.b64encode(np.array([1, 2, 3], "<i2").tobytes()).decode()]),
     "cols.cls has 3 rows"),
    (lambda d: d["colsb"].__setitem__("kind", ["i2", 0, base64.b64encode(np.array([300] * 4, "<i2").tobytes()).decode()]),
     "cols.kind must hold values 0..255"),
])
def test_bad_packed_columns_are_invalid_and_named(mutate, words):
    with pytest.raises(DecodeError) as err:
        decode_batch(_mutated(mutate))
    assert err.value.reason == "invalid"
    assert words in err.value.detail
