"""Semantic checks of records that passed the schema, before any consumer state changes.

The schema (``kvguard.wire.schemas``) checks types and shapes. A record can pass it and still
hurt a consumer: an event kind no reader knows, a page run outside the node's region (the mirror
would index past D), a region of 10^11 units (the mirror allocates arrays of D), a batch of 10^8
events, a tick with ``u_kv = 1e308`` (the planner overflows), a record keyed as one node and
naming another (it lands in another node's partition and breaks per-node order). Each check
raises ``InvalidRecord`` with the field and what was expected; ``schemas.decode`` turns that into
``DecodeError("invalid", …)``, so the record goes to the DLQ and the consumer commits past it.

Checks that need the node's state (the region of a batch that carries no geometry, how far its
epoch may jump) are the stream core's (``kvguard.streams.core``), which calls ``check_events``
with the geometry it knows. Pure: numpy and the standard library.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvguard.contracts.events import EventKind, RegionState

_BOUND_2_62 = 1 << 62  # geometry integers and epochs beyond this are not a GPU's


class InvalidRecord(ValueError):
    """A record's contents cannot be right: ``detail`` names the field and what was expected."""

    def __init__(self, detail: str):
        self.detail = detail
        super().__init__(detail)


@dataclass(slots=True, frozen=True)
class WireLimits:
    """Caps on what one record may ask a consumer to hold (``streams.max_*`` settings, mapped by
    ``kvguard.runtime.mapping.wire_limits``)."""

    max_dynamic_units: int = 1 << 24  # D of one GPU; the mirror keeps ~17 bytes per unit
    max_batch_events: int = 1 << 20  # rows of one event batch
    max_state_refs: int = 1 << 22  # request references in one PoolState dump


DEFAULT_LIMITS = WireLimits()

# per kind: 0 unknown, 1 known, 2 a run of KV units inside D (the table in kvguard.contracts.events),
# 3 a run with a second one at ``aux`` (MIGRATE's target)
_KIND_CLASS = np.zeros(256, dtype=np.int8)
_KIND_CLASS[[int(k) for k in EventKind]] = 1
_KIND_CLASS[[int(k) for k in (EventKind.ALLOC, EventKind.SHARE, EventKind.FREE, EventKind.RECLAIM,
                              EventKind.EVICT, EventKind.SWAP_OUT, EventKind.SWAP_IN, EventKind.REMAP,
                              EventKind.EXPIRE, EventKind.WS_ALLOC, EventKind.WS_FREE)]] = 2
_KIND_CLASS[int(EventKind.MIGRATE)] = 3
_N_STATES = len(RegionState)


def check_events(cols: Mapping[str, np.ndarray], dynamic_units: int | None,
                 limits: WireLimits = DEFAULT_LIMITS) -> None:
    """Event rows (columns of ``EVENT_DTYPE`` or a structured array): known kinds, event times in
    0..2^62 ns (a boundary past int64 would wedge the node's tick clock), no negative size, and
    every KV run (``offset``, ``size`` > 0) inside ``[0, dynamic_units)``, or inside the region
    cap while the region is not known; MIGRATE's target (``aux``) as well. A handful of whole-array
    reductions on the way through (the stream core calls this per batch); rows are searched only
    to name the first bad one."""
    kind = cols["kind"]
    n = len(kind)
    if n > limits.max_batch_events:
        raise InvalidRecord(f"cols: {n} events in one batch, at most {limits.max_batch_events} "
                            "(streams.max_batch_events)")
    if n == 0:
        return
    klass = _KIND_CLASS[kind]
    if not klass.all():
        row = int(np.flatnonzero(klass == 0)[0])
        raise InvalidRecord(f"cols.kind[{row}]: unknown event kind {int(kind[row])} "
                            f"(known: {min(EventKind).value}..{max(EventKind).value})")
    ts = cols["ts_ns"]
    if ts.min() < 0 or ts.max() > _BOUND_2_62:
        row = int(np.flatnonzero((ts < 0) | (ts > _BOUND_2_62))[0])
        raise InvalidRecord(f"cols.ts_ns[{row}]: {int(ts[row])}, expected event time in 0..2^62 ns")
    size = cols["size"]
    if size.min() < 0:
        row = int(np.flatnonzero(size < 0)[0])
        raise InvalidRecord(f"cols.size[{row}]: {int(size[row])}, expected >= 0")
    top = klass.max()
    if top < 2:
        return
    region = limits.max_dynamic_units if dynamic_units is None else int(dynamic_units)
    runs = klass >= 2
    _check_runs("cols", runs, cols["offset"], size, region, dynamic_units is None)
    if top == 3:
        _check_runs("cols.aux (MIGRATE target)", klass == 3, cols["aux"], size, region, dynamic_units is None)


def _check_runs(what: str, rows: np.ndarray, offset: np.ndarray, size: np.ndarray, region: int,
                capped: bool) -> None:
    """Runs ``offset[rows]``, ``size[rows]`` inside [0, region); ``rows`` a mask or indices."""
    o, s = offset[rows], size[rows]
    # offset and size each within the region first: their sum then cannot overflow int64
    if o.min() >= 0 and s.min() > 0 and o.max() <= region and s.max() <= region and (o + s).max() <= region:
        return
    index = np.flatnonzero(rows) if rows.dtype == bool else np.asarray(rows)
    bad = (o < 0) | (s <= 0) | (o > region - s)
    i = int(np.flatnonzero(bad)[0])
    where = f"the region cap of {region} units (streams.max_dynamic_units)" if capped else f"D = {region} units"
    raise InvalidRecord(f"{what} row {int(index[i])}: run at offset {int(o[i])} of size {int(s[i])} "
                        f"is not inside {where} (expected offset >= 0, size > 0, offset + size <= D)")


def check_geometry(geometry: Any, limits: WireLimits = DEFAULT_LIMITS) -> None:
    """A node's device ledger: a region of 1..``max_dynamic_units`` units, device memory > 0,
    page classes of 1..D units, every integer within 2^62."""
    d = int(geometry.dynamic_units)
    if not 0 < d <= limits.max_dynamic_units:
        raise InvalidRecord(f"geometry.dynamic_units: {d}, expected 1..{limits.max_dynamic_units} "
                            "(streams.max_dynamic_units)")
    if not 0 < int(geometry.total_bytes) <= _BOUND_2_62:
        raise InvalidRecord(f"geometry.total_bytes: {int(geometry.total_bytes)}, expected 1..2^62")
    for name in ("weights_bytes", "context_bytes", "unit_tokens", "kv_bytes_per_token"):
        if int(getattr(geometry, name)) > _BOUND_2_62:
            raise InvalidRecord(f"geometry.{name}: {int(getattr(geometry, name))}, expected at most 2^62")
    classes = tuple(int(c) for c in geometry.page_classes)
    if len(classes) > 64 or any(not 0 < c <= d for c in classes):
        raise InvalidRecord(f"geometry.page_classes: {list(classes[:8])}{'…' if len(classes) > 8 else ''}, "
                            f"expected at most 64 sizes of 1..{d} units")


def check_state(state: Any, dynamic_units: int | None, limits: WireLimits = DEFAULT_LIMITS) -> None:
    """A ``PoolState`` dump: runs inside D, known run states, a bounded number of references."""
    region = limits.max_dynamic_units if dynamic_units is None else int(dynamic_units)
    offset = np.asarray(state.offset, dtype=np.int64)
    size = np.asarray(state.size, dtype=np.int64)
    run_state = np.asarray(state.state, dtype=np.int64)
    if offset.size > region:
        raise InvalidRecord(f"state: {offset.size} runs in a region of {region} units")
    if offset.size:
        _check_runs("state", np.ones(offset.size, dtype=bool), offset, size, region, dynamic_units is None)
        if int(run_state.min()) < 0 or int(run_state.max()) >= _N_STATES:
            raise InvalidRecord(f"state.state: values 0..{_N_STATES - 1} expected, got "
                                f"{int(run_state.min())}..{int(run_state.max())}")
    refs = sum(len(r) for r in state.refs)
    if refs > limits.max_state_refs:
        raise InvalidRecord(f"state.refs: {refs} references, at most {limits.max_state_refs}")


def check_batch_fields(*, epoch: int, seq: int, cols: Mapping[str, np.ndarray], geometry: Any, state: Any,
                       limits: WireLimits = DEFAULT_LIMITS, dynamic_units: int | None = None) -> None:
    """Everything about one event batch that needs no node state. ``dynamic_units``: the node's
    region when the caller knows it (the batch's own geometry wins)."""
    if int(epoch) > _BOUND_2_62 or int(seq) > _BOUND_2_62:
        raise InvalidRecord(f"epoch/seq: {int(epoch)}/{int(seq)}, expected at most 2^62")
    if geometry is not None:
        check_geometry(geometry, limits)
        dynamic_units = int(geometry.dynamic_units)
    check_events(cols, dynamic_units, limits)
    if state is not None:
        check_state(state, dynamic_units, limits)


def check_batch(batch: Any, limits: WireLimits = DEFAULT_LIMITS, dynamic_units: int | None = None) -> None:
    """``check_batch_fields`` of an ``EventBatch`` (its events are one structured array)."""
    check_batch_fields(epoch=batch.epoch, seq=batch.seq, cols=batch.events, geometry=batch.geometry,
                       state=batch.state, limits=limits, dynamic_units=dynamic_units)


# ---- metric ticks ---------------------------------------------------------------------------

# fields that are fractions by definition (docs/ARCHITECTURE.md, "Metrics")
_FRACTIONS = ("u_kv", "f_ext", "f_int", "p_oom")
_FLOAT_BOUND = 1e15  # no rate, share or duration of a GPU is larger; keeps the planner's arithmetic finite


def check_tick_values(values: Mapping[str, Any]) -> None:
    """A metric tick's numbers: every float finite and within ±1e15, every int within int64,
    fractions within [0, 1], the forecast and candidates likewise."""
    for name, value in values.items():
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, float):
            _check_float(name, value)
        elif isinstance(value, int):
            _check_int(name, value)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, float):
                    _check_float(f"{name}[{i}]", item)
                elif isinstance(item, Mapping):
                    for key, sub in item.items():
                        if isinstance(sub, int) and not isinstance(sub, bool):
                            _check_int(f"{name}[{i}].{key}", sub)
        elif isinstance(value, Mapping):
            for key, sub in value.items():
                if isinstance(sub, float):
                    _check_float(f"{name}.{key}", sub)
    for name in _FRACTIONS:
        value = values.get(name)
        if value is not None and not 0.0 <= float(value) <= 1.0:
            raise InvalidRecord(f"{name}: {value!r}, expected a fraction in [0, 1]")


def _check_float(name: str, value: float) -> None:
    if not math.isfinite(value) or abs(value) > _FLOAT_BOUND:
        raise InvalidRecord(f"{name}: {value!r}, expected a finite number within ±{_FLOAT_BOUND:g}")


def _check_int(name: str, value: int) -> None:
    if not -(1 << 63) <= value < (1 << 63):
        raise InvalidRecord(f"{name}: {value}, expected a 64-bit integer")


# ---- keys -------------------------------------------------------------------------------------


def check_key(key: bytes | str | None, node: str) -> None:
    """A record keyed by node must name that node (a record without a key is let through)."""
    if key is None:
        return
    text = key.decode("utf-8", "replace") if isinstance(key, (bytes, bytearray, memoryview)) else str(key)
    if text != node:
        raise InvalidRecord(f"key {text[:200]!r} does not match node {node[:200]!r} (records are keyed by node)")
