"""Wire contracts: what goes on the topics (pydantic v2 at the boundary, plain dataclasses inside).

Every record is a JSON object with ``"schema": "<major>.<minor>"``. Readers accept any minor
version of the major they know and ignore fields they do not know (``extra="ignore"``), so a
newer producer can add fields without breaking older consumers. An unknown major version,
bytes that are not a JSON object, and records that fail validation raise ``DecodeError`` with a
``reason`` (``tombstone`` / ``malformed`` / ``unknown_major`` / ``wrong_type`` / ``invalid``);
consumers send them to the DLQ (``kvguard.bus.dlq``) and keep going. A record with a null value
(a Kafka tombstone) is ``tombstone``, an empty one ``malformed``: no kvguard topic carries either.

Node ids are bounded where they enter (``NodeId``, the rule in ``kvguard.contracts.node_id``): at
most 48 characters of letters, digits and ``-_./:``; a record naming any other node is ``invalid``.
A DLQ record is bounded whatever it carries (``DlqRecord.of``: a large value travels as its size,
SHA-256 and a prefix), so the DLQ takes every bad record under the default 1 MiB broker limit.

Event batches are columnar: ``"cols": {"ts_ns": [...], "kind": [...], ...}``, one JSON array per
``EVENT_DTYPE`` column (the event-log line format minus ``"type"``). The envelope is validated by
pydantic; the columns by numpy (integer dtype, one dimension, equal lengths, u8 ranges), so
decoding costs a few array conversions per batch, not a model per event.

Kafka headers (CloudEvents binary mode): ``ce_specversion``, ``ce_type``
(``io.kvguard.<kind>.v<major>``), ``ce_source`` (node or component), ``ce_id``, ``ce_time``
(RFC 3339), ``content-type``. ``make_headers`` builds them.
"""

from __future__ import annotations

import base64
import hashlib
import uuid
from dataclasses import MISSING
from dataclasses import fields as dataclass_fields
from datetime import datetime, timezone
from typing import Annotated, Any, ClassVar, get_type_hints

import numpy as np
import orjson
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from kvguard.contracts.commands import COMMAND_MAJOR, COMMAND_SCHEMA, PAYLOADS, CommandError
from kvguard.contracts.events import COLUMNS, EVENT_DTYPE, EventBatch, Geometry, PoolState
from kvguard.contracts.node_id import node_id_problem
from kvguard.contracts.tick import Tick, tick_group
from kvguard.contracts.tick import Candidate as TickCandidate
from kvguard.contracts.units import DEFAULT_PRIORITY
from kvguard.wire.fastcols import PACKED_SCHEMA_VERSION, PackedColumnError, pack_columns, unpack_columns
from kvguard.wire.validate import DEFAULT_LIMITS, InvalidRecord, WireLimits, check_batch_fields, check_tick_values

SCHEMA_VERSION = "1.0"
SUPPORTED_MAJOR = 1
CE_SPECVERSION = "1.0"
CONTENT_TYPE = "application/json"
KINDS: tuple[str, ...] = ("events", "metrics", "alerts", "commands", "acks", "dlq")
# a kind whose records changed incompatibly has its own major (commands: one payload per action)
MAJORS: dict[str, int] = {kind: SUPPORTED_MAJOR for kind in KINDS} | {"commands": COMMAND_MAJOR}
# what a reader says of a record of an older major it no longer reads
_OLD_MAJORS = {("commands", 1): " (a flat 1.x command, whose units_needed/max_moves meant different things per "
                                "action; re-issue it as a 2.x command with one payload per action, docs/CONTRACTS.md)"}
_U8_COLUMNS = frozenset(name for name in COLUMNS if EVENT_DTYPE[name] == np.uint8)
_INT64_MAX = np.iinfo(np.int64).max


def ce_type(kind: str, major: int | None = None) -> str:
    """``ce_type`` header of a record kind: ``io.kvguard.events.v1`` (its own major by default)."""
    if kind not in KINDS:
        raise KeyError(f"unknown record kind {kind!r}; expected one of {', '.join(KINDS)}")
    return f"io.kvguard.{kind}.v{MAJORS[kind] if major is None else major}"


class DecodeError(ValueError):
    """A record cannot be decoded. ``reason`` is a DLQ reason code; ``detail`` says why."""

    REASONS = ("tombstone", "malformed", "unknown_major", "wrong_type", "invalid")

    def __init__(self, reason: str, detail: str):
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}")


def schema_major(version: Any) -> int:
    """Major number of a ``"M.m"`` schema string; ``DecodeError(invalid)`` when it is not one."""
    if not isinstance(version, str):
        raise DecodeError("invalid", f"schema: expected a 'major.minor' string, got {version!r}")
    major, _, minor = version.partition(".")
    if not major.isdigit() or (minor and not minor.split(".")[0].isdigit()):
        raise DecodeError("invalid", f"schema: expected a 'major.minor' string, got {version!r}")
    return int(major)


def _node_id(value: str) -> str:
    problem = node_id_problem(value)
    if problem is not None:
        raise ValueError(f"node id {problem}")
    return value


# every record's ``node`` (kvguard.contracts.node_id): checked on the length before anything else
NodeId = Annotated[str, AfterValidator(_node_id)]

# a value the exporter writes as a label of a series (alert name, tier, severity, an action, a mode, an
# outcome, a strategy variant): bounded like a node id, so a hostile record cannot grow /metrics by the
# length of its strings; kvguard's own values ("KVCacheOOMRisk", "request/cost/async/recompute/hard") fit
LABEL_VALUE_MAX_CHARS = 64
LabelValue = Annotated[str, Field(max_length=LABEL_VALUE_MAX_CHARS, pattern=r"^[A-Za-z0-9_.:/-]*$")]


class WireModel(BaseModel):
    """Base of every record: a schema version, unknown fields ignored."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True, frozen=False)

    schema_version: str = Field(SCHEMA_VERSION, alias="schema")
    major: ClassVar[int] = SUPPORTED_MAJOR

    @field_validator("schema_version")
    @classmethod
    def _known_major(cls, value: str) -> str:
        major = schema_major(value)
        if major != cls.major:
            raise ValueError(f"unknown major version {major} (this reader knows {cls.major}.x)")
        return value

    def to_bytes(self) -> bytes:
        return orjson.dumps(self.model_dump(mode="json", by_alias=True))


# ---- event batches -------------------------------------------------------------------------


class GeometryModel(BaseModel):
    model_config = ConfigDict(extra="ignore")

    total_bytes: int = Field(ge=0)
    weights_bytes: int = Field(ge=0)
    context_bytes: int = Field(ge=0)
    gpu_memory_utilization: float = Field(gt=0, le=1)
    unit_tokens: int = Field(gt=0)
    kv_bytes_per_token: int = Field(gt=0)
    dynamic_units: int = Field(ge=0)
    page_classes: tuple[int, ...] = Field(min_length=1)
    reserved_frac: float = Field(0.05, ge=0, lt=1)

    def to_geometry(self) -> Geometry:
        return Geometry(**self.model_dump())


class PoolStateModel(BaseModel):
    model_config = ConfigDict(extra="ignore")

    offset: list[int]
    size: list[int]
    state: list[int]
    cls: list[int]
    tokens: list[int]
    refs: list[list[int]]
    tokens_stored: int = 0

    @field_validator("refs")
    @classmethod
    def _same_length(cls, refs: list[list[int]], info) -> list[list[int]]:
        n = len(info.data.get("offset", ()))
        for name in ("size", "state", "cls", "tokens"):
            if name in info.data and len(info.data[name]) != n:
                raise ValueError(f"state.{name} has {len(info.data[name])} rows, state.offset has {n}")
        if len(refs) != n:
            raise ValueError(f"state.refs has {len(refs)} rows, state.offset has {n}")
        return refs

    def to_state(self) -> PoolState:
        return PoolState.from_dict(self.model_dump())


def _column_arrays(value: Any) -> dict[str, np.ndarray]:
    """Validate the event columns with numpy; returns ``{column: int64/uint8 array}``."""
    if not isinstance(value, dict):
        raise ValueError(f"cols must be an object of column arrays, got {type(value).__name__}")
    out: dict[str, np.ndarray] = {}
    length = None
    for name in COLUMNS:
        if name not in value:
            raise ValueError(f"cols.{name} is missing")
        raw = value[name]
        if isinstance(raw, np.ndarray):
            arr = raw
        elif isinstance(raw, list):
            arr = np.array(raw) if raw else np.zeros(0, dtype=np.int64)
        else:
            raise ValueError(f"cols.{name} must be an array, got {type(raw).__name__}")
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise ValueError(f"cols.{name} must be a flat array of integers (got dtype {arr.dtype}, {arr.ndim} dims)")
        if len(arr) and arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and int(arr.max()) > _INT64_MAX:
            raise ValueError(f"cols.{name} has a value above the int64 range")
        if name in _U8_COLUMNS and len(arr) and (int(arr.min()) < 0 or int(arr.max()) > 255):
            raise ValueError(f"cols.{name} must hold values 0..255")
        if length is None:
            length = len(arr)
        elif len(arr) != length:
            raise ValueError(f"cols.{name} has {len(arr)} rows, cols.{COLUMNS[0]} has {length}")
        out[name] = arr
    return out


EventColumns = Annotated[Any, PlainValidator(_column_arrays)]


class EventBatchRecord(WireModel):
    """One node's event batch on ``kvguard.events`` (see ``kvguard.contracts.events.EventBatch``)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True, arbitrary_types_allowed=True)

    node: NodeId
    epoch: int = Field(0, ge=0)
    seq: int = Field(ge=0)
    geometry: GeometryModel | None = None
    state: PoolStateModel | None = None
    cols: EventColumns
    extra: dict[str, Any] = Field(default_factory=dict)

    def to_bytes(self) -> bytes:
        return encode(self)

    def to_batch(self) -> EventBatch:
        n = len(self.cols[COLUMNS[0]])
        events = np.empty(n, dtype=EVENT_DTYPE)
        for name in COLUMNS:
            events[name] = self.cols[name]
        return EventBatch(
            node=self.node,
            seq=self.seq,
            events=events,
            epoch=self.epoch,
            geometry=self.geometry.to_geometry() if self.geometry else None,
            state=self.state.to_state() if self.state else None,
            extra=dict(self.extra),
        )

    @classmethod
    def from_batch(cls, batch: EventBatch) -> "EventBatchRecord":
        return cls.model_validate(batch_to_wire_dict(batch))


def batch_to_wire_dict(batch: EventBatch) -> dict[str, Any]:
    events = batch.events
    if events.dtype != EVENT_DTYPE:
        raise TypeError(f"batch.events must have EVENT_DTYPE, got {events.dtype}")
    record: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "node": batch.node,
        "epoch": int(batch.epoch),
        "seq": int(batch.seq),
        "geometry": batch.geometry.to_dict() if batch.geometry is not None else None,
        "state": batch.state.to_dict() if batch.state is not None else None,
        "cols": {name: np.ascontiguousarray(events[name]) for name in COLUMNS},
    }
    if batch.extra:
        record["extra"] = batch.extra
    return record


def encode_batch(batch: EventBatch, *, packed: bool = False) -> bytes:
    """EventBatch -> JSON bytes, without a per-event Python loop: columns as JSON arrays, or with
    ``packed`` as packed columns (``colsb``, schema 1.1: ``kvguard.wire.fastcols``, which readers of
    1.0 refuse)."""
    record = batch_to_wire_dict(batch)
    if packed:
        record["schema"] = PACKED_SCHEMA_VERSION
        record["colsb"] = pack_columns(batch.events)
        del record["cols"]
    return orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY)


def decode_batch(value: bytes | bytearray | memoryview | None, headers: Any = None, *,
                 limits: WireLimits | None = None, check: bool = True) -> EventBatch:
    """JSON bytes -> validated EventBatch; ``DecodeError`` with a DLQ reason otherwise."""
    return decode("events", value, headers, limits=limits, check=check).to_batch()


# ---- metrics, alerts, commands, acks -------------------------------------------------------


class Candidate(BaseModel):
    """A victim candidate carried on a metric tick (policy picks among them)."""

    model_config = ConfigDict(extra="ignore")

    req: int
    priority: int = DEFAULT_PRIORITY
    units: int = 0
    pages: int = 0
    tokens: int = 0
    shared_units: int = 0
    prompt_tokens: int = 0
    last_ts_ns: int = 0
    generated_tokens: int | None = Field(None, ge=0)  # None: not known to the sender


class _MetricTickDeclared(WireModel):
    """The fields of ``MetricTick`` whose wire contract differs from the core's ``Tick``: a bounded
    node id, required levels, bounds, the wire's own ``utilization`` and candidate types. Every other
    field is derived from the ``Tick`` dataclass (``_derived_tick_fields``)."""

    node: NodeId
    ts_ns: int
    # the producer run (``EventBatch.epoch``): ts_ns orders a node's ticks only within one epoch; a
    # newer epoch is a restarted node whose clock may start over (0: records from before the field)
    epoch: int = Field(0, ge=0)
    u_kv: float
    f_ext: float
    f_int: float
    psi: float
    # utilization split as fractions of device memory: weights, workspace, kv_live, kv_cached,
    # reserved, free (keys may grow in later minor versions); wire only (the Tick has util_* fields)
    utilization: dict[str, float] = Field(default_factory=dict)
    synced: bool = True  # a record from before the field was synced
    candidates: list[Candidate] = Field(default_factory=list)
    logprob_requests_pending: int = Field(0, ge=0)
    logprob_prompt_tokens_pending: int = Field(0, ge=0)
    late_events: int = Field(0, ge=0)
    governed: int = Field(0, ge=0)
    never_fits: int = Field(0, ge=0)
    endpoint_admit: int | None = Field(None, ge=0, le=1)
    endpoint_saturation: float | None = Field(None, ge=0.0, le=1.0)
    endpoint_queue_delay_s: float | None = Field(None, ge=0.0)

    def to_tick(self) -> Tick:
        """The core's tick from this validated record: fields the record does not carry take the
        wire defaults, fields the core does not know are dropped."""
        values = {f.name: getattr(self, f.name) for f in dataclass_fields(Tick) if f.name in type(self).model_fields}
        values["candidates"] = [TickCandidate(**c.model_dump()) for c in self.candidates]
        return Tick(**values)


# what a record from before a field was added carries for it (the Tick field has no default)
_ZERO: dict[Any, Any] = {int: 0, float: 0.0, bool: False, str: ""}


def _derived_tick_fields(declared: type[WireModel], tick: type = Tick) -> dict[str, Any]:
    """Every ``tick`` field ``declared`` does not declare, with the dataclass's type, its default (or
    the type's zero: a record from before the field) and its group (``TICK_GROUPS``) in the JSON schema."""
    hints = get_type_hints(tick)
    out: dict[str, Any] = {}
    for f in dataclass_fields(tick):
        if f.name in declared.model_fields:
            continue
        kind = hints[f.name]
        extra = {"group": tick_group(f.name)}
        if f.default is not MISSING:
            out[f.name] = (kind, Field(f.default, json_schema_extra=extra))
        elif f.default_factory is not MISSING:
            out[f.name] = (kind, Field(default_factory=f.default_factory, json_schema_extra=extra))
        elif kind in _ZERO:
            out[f.name] = (kind, Field(_ZERO[kind], json_schema_extra=extra))
        else:
            raise TypeError(f"Tick.{f.name}: no wire default for {kind!r}; declare it in _MetricTickDeclared")
    return out


# One tick of one node's pressure metrics on ``kvguard.metrics`` (docs/ARCHITECTURE.md, "Metrics"):
# derived from ``kvguard.contracts.tick.Tick``, so a field added there travels on the bus without
# another list to keep (tests/unit/wire/test_tick_parity.py checks both ways).
MetricTick = create_model(
    "MetricTick",
    __base__=_MetricTickDeclared,
    __module__=__name__,
    __doc__="One tick of one node's pressure metrics on ``kvguard.metrics`` (docs/ARCHITECTURE.md, \"Metrics\"); "
            "the fields of ``kvguard.contracts.tick.Tick`` (derived), some with wire bounds.",
    **_derived_tick_fields(_MetricTickDeclared),
)


class Alert(WireModel):
    """A firing or resolved alert on ``kvguard.alerts`` (shaped for an Alertmanager webhook)."""

    node: NodeId
    ts_ns: int
    name: LabelValue = Field(min_length=1)  # alertname, e.g. KVCacheOOMRisk
    tier: LabelValue  # threshold | slope | fragmentation | lstm | budget (more may come)
    rule: LabelValue = ""  # the stream's rule name (same as ``name`` for stream alerts)
    state: LabelValue = ""  # the stream's own firing/resolved field, mirrored by ``status``
    severity: LabelValue  # warning | critical
    status: LabelValue = "firing"  # firing | resolved
    fingerprint: str = ""
    started_at_ns: int = 0
    ends_at_ns: int | None = None
    tier_level: int | None = None  # 1 threshold, 2 slope, 3 lstm
    value: float | None = None
    threshold: float | None = None
    p_oom: float | None = None
    summary: str = ""
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class Command(WireModel):
    """A signed policy command on ``kvguard.commands`` (schema 2.x); fields as
    ``kvguard.contracts.commands.Command.to_dict``.

    ``payload`` is the action's own object; for an action this reader knows it is checked by that
    action's payload type (its fields and bounds, ``kvguard.contracts.commands``), so an absurd value
    is dead-lettered here with the field named. Other enumerations are plain strings (the actuator
    checks them), and an action this reader does not know passes, so a newer minor version may add
    actions without older readers dead-lettering them.
    """

    schema_version: str = Field(COMMAND_SCHEMA, alias="schema")
    major: ClassVar[int] = COMMAND_MAJOR
    id: str = Field(min_length=1)
    node: NodeId
    action: LabelValue
    payload: dict[str, Any]
    reason: str = ""
    mode: LabelValue = "default"
    variant: LabelValue = ""
    issued_at_ns: int
    ttl_ns: int = Field(ge=0)
    epoch: int = Field(0, ge=0)  # the producer epoch of the tick it was decided on (signed)
    signature: str = ""

    @model_validator(mode="after")
    def _payload_in_bounds(self) -> Command:
        if self.action in PAYLOADS:
            try:
                PAYLOADS[self.action].from_dict(self.payload)
            except CommandError as err:
                raise ValueError(str(err)) from None
        return self


class Ack(WireModel):
    """An actuator's acknowledgement on ``kvguard.acks``; fields as ``kvguard.contracts.commands.Ack.to_dict``."""

    command_id: str = Field(min_length=1)
    node: NodeId
    outcome: LabelValue
    executed_at_ns: int
    units_freed: int = 0
    units_moved: int = 0
    latency_ns: int = 0
    issued_at_ns: int = 0
    action: LabelValue = ""
    variant: LabelValue = ""
    mode: LabelValue = ""
    targets_done: int = 0
    targets_noop: int = 0
    errors: list[str] = Field(default_factory=list)


# A DLQ record stays under ~400 KiB whatever it dead-letters: the value whole up to 256 KiB (342 KiB
# of base64), else its size, SHA-256 and first 4 KiB; the key, header values and the detail cut to
# a few KiB. It fits the default broker limit (Kafka's message.max.bytes, aiokafka's
# max_request_size: 1 MiB) with room to spare, so a bad record of any size reaches the DLQ.
DLQ_INLINE_VALUE_BYTES = 256 * 1024
DLQ_PREFIX_BYTES = 4096
DLQ_KEY_BYTES = 1024
DLQ_HEADERS = 32
DLQ_HEADER_NAME_CHARS = 256
DLQ_HEADER_VALUE_BYTES = 1024
DLQ_DETAIL_CHARS = 2000
DLQ_SCHEMA_VERSION = "1.1"  # 1.1: value_b64 optional; value_bytes, value_sha256, value_prefix_b64, tombstone


class DlqRecord(WireModel):
    """A record that could not be decoded, with the reason and what it held, bounded (``of``).

    ``value_b64`` is the original value (base64) when it has at most ``DLQ_INLINE_VALUE_BYTES``;
    a larger one is ``value_bytes`` long, hashes to ``value_sha256`` and begins with
    ``value_prefix_b64`` (its first ``DLQ_PREFIX_BYTES``). A null value (a tombstone) has
    ``tombstone`` set and neither. The key likewise: whole up to ``DLQ_KEY_BYTES`` (``key_bytes``
    is its size either way)."""

    schema_version: str = Field(DLQ_SCHEMA_VERSION, alias="schema")
    reason: str
    detail: str = ""
    topic: str
    partition: int
    offset: int
    key_b64: str | None = None
    key_bytes: int = 0
    value_b64: str | None = None
    value_bytes: int = 0
    value_sha256: str = ""
    value_prefix_b64: str = ""
    tombstone: bool = False
    headers: list[tuple[str, str]] = Field(default_factory=list)  # (name, base64 value), each cut to a bound
    headers_dropped: int = 0  # headers past DLQ_HEADERS, left out
    group: str = ""
    component: str = ""
    dead_lettered_at_ns: int = 0

    @property
    def value(self) -> bytes | None:
        """The original value, or None: a tombstone, or a value too large to carry (``truncated``)."""
        return None if self.value_b64 is None else base64.b64decode(self.value_b64)

    @property
    def truncated(self) -> bool:
        """The value was too large to carry whole: only its size, hash and prefix are here."""
        return self.value_b64 is None and not self.tombstone

    @property
    def key(self) -> bytes | None:
        return None if self.key_b64 is None else base64.b64decode(self.key_b64)

    @classmethod
    def of(cls, *, reason: str, detail: str, topic: str, partition: int, offset: int, key: bytes | None,
           value: bytes | None, headers: Any = (), group: str = "", component: str = "",
           dead_lettered_at_ns: int = 0) -> "DlqRecord":
        """The DLQ record of one consumed record, within the bounds above whatever its size."""
        raw = None if value is None else bytes(value)
        inline = raw is not None and len(raw) <= DLQ_INLINE_VALUE_BYTES
        pairs = list(headers or ())
        return cls(
            reason=reason[:DLQ_HEADER_NAME_CHARS],
            detail=detail[:DLQ_DETAIL_CHARS],
            topic=topic,
            partition=partition,
            offset=offset,
            key_b64=None if key is None or len(key) > DLQ_KEY_BYTES else base64.b64encode(bytes(key)).decode(),
            key_bytes=0 if key is None else len(key),
            value_b64=base64.b64encode(raw).decode() if inline else None,
            value_bytes=0 if raw is None else len(raw),
            value_sha256="" if raw is None else hashlib.sha256(raw).hexdigest(),
            value_prefix_b64="" if raw is None or inline else base64.b64encode(raw[:DLQ_PREFIX_BYTES]).decode(),
            tombstone=raw is None,
            headers=[(str(name)[:DLQ_HEADER_NAME_CHARS], base64.b64encode(_raw(val)[:DLQ_HEADER_VALUE_BYTES]).decode())
                     for name, val in pairs[:DLQ_HEADERS]],
            headers_dropped=max(0, len(pairs) - DLQ_HEADERS),
            group=group,
            component=component,
            dead_lettered_at_ns=dead_lettered_at_ns,
        )


def _raw(value: Any) -> bytes:
    if value is None:
        return b""
    return value.encode("utf-8", "replace") if isinstance(value, str) else bytes(value)


def dlq_key(key: bytes | None) -> bytes | None:
    """The key a DLQ record is published with: the original one (so one node's bad records share
    a partition), or its SHA-256 when it is longer than ``DLQ_KEY_BYTES``."""
    if key is None or len(key) <= DLQ_KEY_BYTES:
        return key
    return hashlib.sha256(bytes(key)).digest()


MODELS: dict[str, type[WireModel]] = {
    "events": EventBatchRecord,
    "metrics": MetricTick,
    "alerts": Alert,
    "commands": Command,
    "acks": Ack,
    "dlq": DlqRecord,
}


# ---- generic codec -------------------------------------------------------------------------


def encode(model: WireModel) -> bytes:
    if isinstance(model, EventBatchRecord):
        data = model.model_dump(mode="python", by_alias=True)
        data["cols"] = {name: np.ascontiguousarray(model.cols[name]) for name in COLUMNS}
        return orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY)
    return model.to_bytes()


def decode(kind: str, value: bytes | bytearray | memoryview | None, headers: Any = None, *,
           limits: WireLimits | None = None, check: bool = True) -> WireModel:
    """Bytes of a ``kind`` record -> its model. ``headers`` (Kafka header pairs) are checked when given.

    Raises ``DecodeError`` with reason ``tombstone`` (a null value), ``malformed`` (empty, or not
    a JSON object), ``wrong_type`` (the ``ce_type`` header names another kind), ``unknown_major``
    (header or payload) or ``invalid``
    (the schema, or the contents: ``kvguard.wire.validate``, with ``limits`` as its caps;
    ``check=False`` skips the contents, for the codec alone).
    """
    model_cls = MODELS.get(kind)
    if model_cls is None:
        raise KeyError(f"unknown record kind {kind!r}; expected one of {', '.join(KINDS)}")
    if value is None:
        raise DecodeError("tombstone", "a null value (a tombstone): no kvguard topic carries one")
    if len(value) == 0:
        raise DecodeError("malformed", "an empty value: expected a JSON object")
    if headers:
        _check_type_header(kind, headers)
    try:
        data = orjson.loads(value)
    except (orjson.JSONDecodeError, TypeError) as exc:
        raise DecodeError("malformed", f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise DecodeError("malformed", f"expected a JSON object, got {type(data).__name__}")
    if "schema" not in data:
        raise DecodeError("invalid", "schema: missing (every record carries 'schema': 'major.minor')")
    major = schema_major(data["schema"])
    if major != MAJORS[kind]:
        raise DecodeError("unknown_major", f"schema {data.get('schema')!r}: this reader knows {MAJORS[kind]}.x"
                                           + _OLD_MAJORS.get((kind, major), ""))
    if kind == "events" and "colsb" in data:  # packed columns (kvguard.wire.fastcols)
        if "cols" in data:
            raise DecodeError("invalid", "cols and colsb: a batch carries its columns one way")
        try:
            data["cols"] = unpack_columns(data.pop("colsb"))
        except PackedColumnError as exc:
            raise DecodeError("invalid", str(exc)) from None
    try:
        model = model_cls.model_validate(data)
    except ValidationError as exc:
        raise DecodeError("invalid", _first_error(exc)) from None
    if check:
        try:
            _check_contents(model, limits or DEFAULT_LIMITS)
        except InvalidRecord as exc:
            raise DecodeError("invalid", exc.detail) from None
    return model


def _check_contents(model: WireModel, limits: WireLimits) -> None:
    """What the schema lets through but a consumer must not meet (``kvguard.wire.validate``)."""
    if isinstance(model, EventBatchRecord):
        check_batch_fields(epoch=model.epoch, seq=model.seq, cols=model.cols, geometry=model.geometry,
                           state=model.state, limits=limits)
    elif isinstance(model, MetricTick):
        check_tick_values({name: getattr(model, name) for name in type(model).model_fields}
                          | {"candidates": [c.model_dump() for c in model.candidates]})


def _check_type_header(kind: str, headers: Any) -> None:
    for name, raw in headers:
        if name != "ce_type":
            continue
        text = raw.decode("utf-8", "replace") if isinstance(raw, (bytes, bytearray)) else str(raw)
        prefix, _, version = text.rpartition(".v")
        if not prefix.startswith("io.kvguard."):
            raise DecodeError("wrong_type", f"ce_type {text!r} is not a kvguard record type")
        if prefix != f"io.kvguard.{kind}":
            raise DecodeError("wrong_type", f"ce_type {text!r} on a {kind} topic (expected {ce_type(kind)})")
        if not version.isdigit():
            raise DecodeError("invalid", f"ce_type {text!r} has no version suffix .v<major>")
        if int(version) != MAJORS[kind]:
            raise DecodeError("unknown_major", f"ce_type {text!r}: this reader knows v{MAJORS[kind]}"
                                               + _OLD_MAJORS.get((kind, int(version)), ""))
        return


def _first_error(exc: ValidationError) -> str:
    errors = exc.errors(include_url=False)
    err = errors[0]
    loc = ".".join(str(p) for p in err["loc"]) or "<record>"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{loc}: {err['msg']}{more}"


def make_headers(kind: str, source: str, *, record_id: str | None = None,
                 time: datetime | None = None) -> list[tuple[str, bytes]]:
    """CloudEvents binary-mode headers for one record. ``record_id`` defaults to a random uuid;
    pass a deterministic one (``node/epoch/seq``) where consumers deduplicate."""
    when = time or datetime.now(timezone.utc)
    return [
        ("ce_specversion", CE_SPECVERSION.encode()),
        ("ce_type", ce_type(kind).encode()),
        ("ce_source", source.encode()),
        ("ce_id", (record_id or uuid.uuid4().hex).encode()),
        ("ce_time", when.isoformat(timespec="milliseconds").replace("+00:00", "Z").encode()),
        ("content-type", CONTENT_TYPE.encode()),
    ]


def batch_headers(batch: EventBatch, *, time: datetime | None = None) -> list[tuple[str, bytes]]:
    """Headers of an event batch; its ``ce_id`` is ``node/epoch/seq`` (unique per batch)."""
    return make_headers("events", batch.node, record_id=f"{batch.node}/{batch.epoch}/{batch.seq}", time=time)
