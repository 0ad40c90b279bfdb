"""Packed event columns (``"colsb"``, schema 1.1): each column one base64 string of little-endian
integers of the narrowest width that holds it, decoded by one ``b64decode`` and one ``frombuffer``.

A JSON column (``"cols"``) costs a Python int per event and column in the JSON parser and a walk of
those objects in ``np.array``; a packed column costs two C calls whatever its length. A packed
column is ``[dtype, base, data]``: the values are ``base + frombuffer(b64decode(data), dtype)`` with
``dtype`` one of ``u1 i1 i2 i4 i8`` (little-endian) and ``base`` an integer (0 for ``i8``); the
encoder picks the narrowest width for ``value - min`` (``ts_ns`` spans of a batch fit ``i4``), so
the record is about as long as its JSON form.

Compatibility: a reader of 1.0 does not know ``colsb`` and refuses such a batch (``cols`` missing),
so the workers are upgraded before the producers that write it (``NodePublisher(packed_columns=True)``);
every reader of 1.1 takes both forms. Bad packed columns are ``DecodeError("invalid")`` with the
column named: an unknown dtype, data that is not base64 or not a whole number of values, a base
with ``i8``, or values past the int64 range.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import numpy as np

from kvguard.contracts.events import COLUMNS, EVENT_DTYPE

PACKED_SCHEMA_VERSION = "1.1"
_DTYPES = {"u1": np.dtype("u1"), "i1": np.dtype("<i1"), "i2": np.dtype("<i2"), "i4": np.dtype("<i4"),
           "i8": np.dtype("<i8")}
_SIGNED = [("i1", np.iinfo(np.int8)), ("i2", np.iinfo(np.int16)), ("i4", np.iinfo(np.int32))]
_I64 = np.iinfo(np.int64)


class PackedColumnError(ValueError):
    """A packed column that cannot be read; the message names it."""


def pack_column(a: np.ndarray) -> list:
    """``[dtype, base, base64]`` of one column (the narrowest width of ``a`` or of ``a - min``)."""
    if a.dtype == np.uint8:
        return ["u1", 0, base64.b64encode(a.tobytes()).decode()]
    a = a.astype(np.int64, copy=False)
    if a.size == 0:
        return ["i1", 0, ""]
    lo, hi = int(a.min()), int(a.max())
    for name, info in _SIGNED:
        if info.min <= lo and hi <= info.max:
            return [name, 0, base64.b64encode(a.astype(_DTYPES[name]).tobytes()).decode()]
    i32 = np.iinfo(np.int32)
    if hi - lo <= int(i32.max) - int(i32.min):
        # any base in [hi - INT32_MAX, lo - INT32_MIN] puts every value - base in the i4 range
        base = lo - int(i32.min) if lo - int(i32.min) <= _I64.max else hi - int(i32.max)
        return ["i4", base, base64.b64encode((a - base).astype("<i4").tobytes()).decode()]
    return ["i8", 0, base64.b64encode(a.astype("<i8").tobytes()).decode()]


def pack_columns(events: np.ndarray) -> dict[str, list]:
    return {name: pack_column(np.ascontiguousarray(events[name])) for name in COLUMNS}


def unpack_column(name: str, value: Any) -> np.ndarray:
    """One packed column as an int64 array (uint8 for the u1 columns of ``EVENT_DTYPE``)."""
    if not (isinstance(value, list) and len(value) == 3 and isinstance(value[0], str)
            and isinstance(value[1], int) and not isinstance(value[1], bool) and isinstance(value[2], str)):
        raise PackedColumnError(f"colsb.{name}: expected [dtype, base, base64 data]")
    dtype_name, base, data = value
    dtype = _DTYPES.get(dtype_name)
    if dtype is None:
        raise PackedColumnError(f"colsb.{name}: dtype {dtype_name[:8]!r}, expected one of {', '.join(_DTYPES)}")
    if dtype_name == "i8" and base != 0:
        raise PackedColumnError(f"colsb.{name}: an i8 column has base 0")
    if not _I64.min <= base <= _I64.max:
        raise PackedColumnError(f"colsb.{name}: base outside the int64 range")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise PackedColumnError(f"colsb.{name}: data is not base64") from None
    if len(raw) % dtype.itemsize:
        raise PackedColumnError(f"colsb.{name}: {len(raw)} bytes is not a whole number of {dtype_name} values")
    arr = np.frombuffer(raw, dtype=dtype)
    if EVENT_DTYPE[name] == np.uint8 and dtype_name == "u1" and base == 0:
        return arr
    out = arr.astype(np.int64)
    if base and out.size:
        lo, hi = int(out.min()), int(out.max())
        if base + lo < _I64.min or base + hi > _I64.max:
            raise PackedColumnError(f"colsb.{name}: base {base} puts values past the int64 range")
        out += base
    return out


def unpack_columns(value: Any) -> dict[str, np.ndarray]:
    if not isinstance(value, dict):
        raise PackedColumnError(f"colsb must be an object of packed columns, got {type(value).__name__}")
    out = {}
    for name in COLUMNS:
        if name not in value:
            raise PackedColumnError(f"colsb.{name} is missing")
        out[name] = unpack_column(name, value[name])
    return out
