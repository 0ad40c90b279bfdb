"""Capture a fleet's events topic into an event log, for `kvguard metrics`, `rca` and `dataset`.

The recorder reads ``kvguard.events`` from the beginning with a private, throwaway consumer
group (it never commits, so it takes nothing from the fleet's own consumers), keeps the batches
whose broker timestamp falls in ``[since, until)`` and whose node is wanted, and writes them in
the order they were read: per node that is the producer's order, since a node's batches share a
partition. Records that do not decode are counted and skipped (they are in the DLQ already, or
will be, when the stream worker meets them); a record with a null value (a tombstone) is counted
apart, in ``tombstones``. It stops once it has been idle for ``idle_timeout_s``
(caught up with the topic) or past ``until``.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvguard.wire.eventlog import EventLogWriter
from kvguard.wire.schemas import DecodeError, decode_batch


@dataclass(slots=True)
class RecordSummary:
    path: str
    batches: int = 0
    events: int = 0
    skipped_time: int = 0
    skipped_node: int = 0
    undecodable: int = 0
    tombstones: int = 0
    nodes: list[str] = field(default_factory=list)
    first_ts_ms: int | None = None
    last_ts_ms: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


async def record_events(bus: Any, settings: Any, path: str | Path, *, since_ms: int | None = None,
                        until_ms: int | None = None, nodes: set[str] | None = None, idle_timeout_s: float = 3.0,
                        max_wall_s: float | None = None, on_progress: Callable[[RecordSummary], None] | None = None
                        ) -> RecordSummary:
    topic = settings.topics.name("events")
    group = f"kvguard-record-{secrets.token_hex(4)}"
    summary = RecordSummary(str(path))
    seen: set[str] = set()
    meta = {"recorded_from": topic, "since_ms": since_ms, "until_ms": until_ms,
            "nodes": sorted(nodes) if nodes else None}
    sub = bus.subscribe([topic], group)
    started = time.monotonic()
    idle_since = time.monotonic()
    try:
        with EventLogWriter(path, meta) as log:
            while True:
                records = await sub.getmany(1000, 0.5)
                now = time.monotonic()
                if not records:
                    if now - idle_since >= idle_timeout_s:
                        break
                else:
                    idle_since = now
                for record in records:
                    if until_ms is not None and record.timestamp_ms >= until_ms:
                        summary.skipped_time += 1
                        continue
                    if since_ms is not None and record.timestamp_ms < since_ms:
                        summary.skipped_time += 1
                        continue
                    try:
                        batch = decode_batch(record.value, record.headers)
                    except DecodeError as err:
                        if err.reason == "tombstone":
                            summary.tombstones += 1
                        else:
                            summary.undecodable += 1
                        continue
                    if nodes and batch.node not in nodes:
                        summary.skipped_node += 1
                        continue
                    log.write(batch)
                    seen.add(batch.node)
                    summary.batches += 1
                    summary.events += len(batch)
                    summary.first_ts_ms = record.timestamp_ms if summary.first_ts_ms is None else summary.first_ts_ms
                    summary.last_ts_ms = record.timestamp_ms
                if on_progress is not None and records:
                    on_progress(summary)
                if max_wall_s is not None and now - started >= max_wall_s:
                    break
    finally:
        await sub.close()
    summary.nodes = sorted(seen)
    return summary
