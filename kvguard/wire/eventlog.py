"""The event log file: gzip JSON lines, one header then one line per ``EventBatch``.

Line 1: ``{"type":"header","schema":"1.0","created_by":…,"meta":{…}}``; then per batch
``{"type":"batch","node":…,"epoch":…,"seq":…,"geometry":{…}|null,"state":{…}|null,"cols":{col:[…]}}``.
Columns are the names of ``EVENT_DTYPE``. Writing is deterministic (sorted keys, no gzip mtime), so the
same batches give byte-identical files. Reading checks each batch's contents as the bus does
(``kvguard.wire.validate``: known event kinds, page runs inside the node's region as its last
geometry in the log gives it, caps) and its node id (``kvguard.contracts.node_id``): a bad line
raises ``EventLogError`` naming its line, never a traceback further down.

Lines are bounded: a reader takes at most ``MAX_LINE_CHARS`` (64 MiB) of one line, and the header
at most ``MAX_HEADER_CHARS`` (1 MiB), so a hostile file (a line of 400 MB of whitespace) costs a
bounded amount of memory before it is refused; the writer refuses to write a longer line, so
every log kvguard writes, kvguard reads. A batch line is far below the bound: a node's bus
records are at most ``kafka.max_message_bytes`` (1 MiB), a busy simulated GPU's batch a few
hundred KB. Pure: standard library + numpy.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvguard.contracts.events import COLUMNS, EVENT_DTYPE, SCHEMA_VERSION, EventBatch, Geometry, PoolState
from kvguard.contracts.node_id import node_id_problem
from kvguard.wire.validate import DEFAULT_LIMITS, InvalidRecord, WireLimits, check_batch

CREATED_BY = "kvguard"
MAX_LINE_CHARS = 64 * 1024 * 1024
MAX_HEADER_CHARS = 1024 * 1024


class EventLogError(ValueError):
    """An event log line could not be read: names the file, the 1-based line and what was expected."""

    def __init__(self, path: str, line_no: int, expected: str):
        self.path, self.line_no, self.expected = str(path), line_no, expected
        super().__init__(f"{path}:{line_no}: expected {expected}")


@dataclass(slots=True, frozen=True)
class SkippedBatch:
    """A batch line a replay left out (``read_event_log(on_invalid=…)``), as the stream worker
    dead-letters an invalid record: its line, the node, epoch and seq when the line names them,
    and why."""

    path: str
    line_no: int
    node: str | None
    epoch: int | None
    seq: int | None
    reason: str

    def to_dict(self) -> dict:
        return {"line": self.line_no, "node": self.node, "epoch": self.epoch, "seq": self.seq, "reason": self.reason}

    def describe(self) -> str:
        where = f"node {self.node!r} epoch {self.epoch} seq {self.seq}" if self.node is not None else "the line"
        at = f"{self.path}:{self.line_no}" if self.line_no else self.path
        return f"{at}: {self.reason} ({where} skipped)"


def _names(d: object) -> tuple[str | None, int | None, int | None]:
    """The node, epoch and seq a batch line names, where it names them as such."""
    if not isinstance(d, dict):
        return None, None, None
    node = d.get("node") if isinstance(d.get("node"), str) else None
    epoch = d.get("epoch") if isinstance(d.get("epoch"), int) else None
    seq = d.get("seq") if isinstance(d.get("seq"), int) else None
    return node, epoch, seq


def _dumps(obj: dict) -> bytes:
    return (json.dumps(obj, sort_keys=True, separators=(",", ":")) + "\n").encode()


def batch_to_dict(batch: EventBatch) -> dict:
    return {
        "type": "batch",
        "node": batch.node,
        "epoch": int(batch.epoch),
        "seq": int(batch.seq),
        "geometry": batch.geometry.to_dict() if batch.geometry is not None else None,
        "state": batch.state.to_dict() if batch.state is not None else None,
        "cols": {c: batch.events[c].tolist() for c in COLUMNS},
    }


def batch_from_dict(d: dict, path: str = "<memory>", line_no: int = 0) -> EventBatch:
    problem = node_id_problem(d.get("node"))
    if problem is not None:
        raise EventLogError(path, line_no, f"a batch of a node id (its node id {problem})")
    try:
        cols = d["cols"]
        n = len(cols["ts_ns"])
        events = np.zeros(n, dtype=EVENT_DTYPE)
        for c in COLUMNS:
            values = cols[c]
            if len(values) != n:
                raise EventLogError(path, line_no, f"column {c!r} of length {n}, got {len(values)}")
            events[c] = values
        return EventBatch(
            node=str(d["node"]), seq=int(d["seq"]), events=events, epoch=int(d["epoch"]),
            geometry=Geometry.from_dict(d["geometry"]) if d.get("geometry") else None,
            state=PoolState.from_dict(d["state"]) if d.get("state") else None,
        )
    except EventLogError:
        raise
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise EventLogError(path, line_no, f"a batch with node, epoch, seq and columns {list(COLUMNS)} ({e!r})") from None


class EventLogWriter:
    """Context manager: ``with EventLogWriter(path, meta) as w: w.write(batch)``."""

    def __init__(self, path: str | Path, meta: dict | None = None):
        self.path = Path(path)
        self.meta = dict(meta or {})
        self.batches = 0
        self.events = 0
        self._raw = None
        self._gz = None

    def __enter__(self) -> "EventLogWriter":
        self._raw = open(self.path, "wb")
        self._gz = gzip.GzipFile(filename="", mode="wb", fileobj=self._raw, mtime=0, compresslevel=6)
        self._gz.write(_dumps({"type": "header", "schema": SCHEMA_VERSION, "created_by": CREATED_BY, "meta": self.meta}))
        return self

    def write(self, batch: EventBatch) -> None:
        if self._gz is None:
            raise RuntimeError("EventLogWriter.write outside its `with` block")
        line = _dumps(batch_to_dict(batch))
        if len(line) > MAX_LINE_CHARS:  # the reader would refuse it
            raise ValueError(f"batch seq {batch.seq} of node {batch.node!r} is a line of {len(line)} characters, "
                             f"over the event log's {MAX_LINE_CHARS}: write it as smaller batches")
        self._gz.write(line)
        self.batches += 1
        self.events += len(batch.events)

    def __exit__(self, *exc) -> None:
        if self._gz is not None:
            self._gz.close()
            self._raw.close()
            self._gz = self._raw = None


def write_event_log(path: str | Path, batches: Iterable[EventBatch], meta: dict | None = None) -> int:
    """Write all ``batches``; returns the number of events written."""
    with EventLogWriter(path, meta) as w:
        for b in batches:
            w.write(b)
    return w.events


def read_event_log(path: str | Path, *, limits: WireLimits = DEFAULT_LIMITS,
                   on_invalid: Callable[[SkippedBatch], None] | None = None) -> tuple[dict, Iterator[EventBatch]]:
    """``(meta, batches)``; the header is read now, batches lazily. Bad lines raise ``EventLogError``;
    with ``on_invalid``, a line that is no valid batch (not JSON, not a batch, impossible contents) is
    handed to it as a ``SkippedBatch`` and the reading goes on, as the stream worker dead-letters a bad
    record and goes on (a bad header, unreadable gzip data or an overlong line still raise: what
    follows cannot be trusted to be lines)."""
    path = str(path)
    try:
        fh = gzip.open(path, "rt", encoding="utf-8")
        first = fh.readline(MAX_HEADER_CHARS + 1)
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise EventLogError(path, 1, f"a gzip file of JSON lines ({e})") from None
    if len(first) > MAX_HEADER_CHARS:
        fh.close()
        raise EventLogError(path, 1, f"a header line of at most {MAX_HEADER_CHARS} characters")
    try:
        header = json.loads(first)
    except json.JSONDecodeError:
        fh.close()
        raise EventLogError(path, 1, 'a header line {"type":"header","schema":…}') from None
    if not isinstance(header, dict) or header.get("type") != "header":
        fh.close()
        raise EventLogError(path, 1, 'a header line {"type":"header","schema":…}')
    if str(header.get("schema", "")).split(".")[0] != SCHEMA_VERSION.split(".")[0]:
        fh.close()
        raise EventLogError(path, 1, f"schema {SCHEMA_VERSION}, got {header.get('schema')!r}")

    def batches() -> Iterator[EventBatch]:
        region: dict[str, int] = {}  # node -> D of its latest geometry in the log
        with fh:
            line_no = 1
            while True:
                try:
                    line = fh.readline(MAX_LINE_CHARS + 1)
                except (OSError, EOFError, UnicodeDecodeError) as e:
                    raise EventLogError(path, line_no + 1, f"more gzip data of UTF-8 JSON lines ({e})") from None
                if not line:
                    return
                line_no += 1
                if len(line) > MAX_LINE_CHARS:
                    raise EventLogError(path, line_no, f"a line of at most {MAX_LINE_CHARS} characters")
                if not line.strip():
                    continue
                d = None
                try:
                    try:
                        d = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise EventLogError(path, line_no, f"a JSON batch line ({e.msg})") from None
                    if not isinstance(d, dict) or d.get("type") != "batch":
                        raise EventLogError(path, line_no, 'a line with "type":"batch"')
                    batch = batch_from_dict(d, path, line_no)
                    try:
                        check_batch(batch, limits, region.get(batch.node))
                    except InvalidRecord as e:
                        raise EventLogError(path, line_no,
                                            f"a valid batch of node {batch.node!r} ({e.detail})") from None
                except EventLogError as e:
                    if on_invalid is None:
                        raise
                    on_invalid(SkippedBatch(path, line_no, *_names(d), reason=f"expected {e.expected}"))
                    continue
                if batch.geometry is not None:
                    region[batch.node] = int(batch.geometry.dynamic_units)
                yield batch

    return dict(header.get("meta") or {}), batches()
