"""A real ``torch.cuda.memory._dump_snapshot()`` as kvguard allocator rows (``kvguard ingest torch-snapshot``).

``producers.torch_snapshot.snapshot.trace_to_allocator_events`` gives the segments and blocks that existed
when recording began and the trace after it; this module writes them as SEG_ALLOC/SEG_FREE/
BLK_ALLOC/BLK_FREE/OOM rows of one node (one device), so the stream core's allocator layer
(``kvguard.streams.allocator_layer``) replays the allocator and ``kvguard metrics`` / ``kvguard rca``
read the log like any other.

Choices, stated:

- Steps: every trace entry is a step boundary. The rows follow the trace one for one (an ``alloc``
  is a BLK_ALLOC even if it is freed two entries later), so the layer equals the recorded allocator
  after every entry, not only at engine steps; batches are cut every ``rows_per_batch`` rows, which
  changes nothing for the mirror (it applies rows in order).
- Time: an entry's ``time_us`` (PyTorch's clock, µs) as event time; an entry without one is 1 µs
  after the previous. The start state is stamped 1 µs before the first entry.
- Allocated bytes follow ``torch.cuda.memory_allocated`` and the snapshot's ``active_allocated``
  blocks: a block stops counting at ``free_requested`` (a free waiting for its streams is
  ``active_pending_free``, not allocated). A block still live at the dump has the size the dump
  gives it; one freed earlier has its request rounded to 512 bytes (the caching allocator's
  ``kMinBlockSize``; a large block can hold an unsplit remainder on top, which only shows while it is live).
- ``oom`` entries become OOM rows (``cls=OomLayer.ALLOCATOR``, size = requested bytes, aux = reserved
  but unallocated bytes then, flags = FRAGMENTATION when those would have covered the request).
- Expandable segments (``segment_map``/``segment_unmap``) are counted and skipped: the allocator
  layer has no resizable segments. So are blocks whose segment the trace never shows.
- The KV layer is empty: the geometry has one placeholder unit, so U_kv, F_ext and F_int are 0 and
  only the ``alloc_*`` figures of each tick carry information.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from kvguard.contracts.events import (
    EVENT_DTYPE,
    EventBatch,
    EventKind,
    Geometry,
    OomCause,
    OomLayer,
    Pool,
)
from kvguard.producers.torch_snapshot.snapshot import ALLOCATED, PENDING_FREE, trace_to_allocator_events

_MIN_BLOCK = 512


@dataclass(slots=True)
class SnapshotLogSummary:
    device: int
    entries: int = 0
    rows: int = 0
    batches: int = 0
    ooms: int = 0
    skipped: dict = field(default_factory=dict)
    snapshot_reserved_bytes: int = 0
    snapshot_allocated_bytes: int = 0
    rows_reserved_bytes: int = 0
    rows_allocated_bytes: int = 0
    first_ts_ns: int = 0
    last_ts_ns: int = 0

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


def snapshot_totals(snapshot: dict, device: int) -> tuple[int, int]:
    """Reserved and allocated bytes of one device at dump time (``memory_reserved``/``memory_allocated``)."""
    reserved = allocated = 0
    for seg in snapshot["segments"]:
        if seg.get("device", 0) != device:
            continue
        reserved += int(seg["total_size"])
        allocated += sum(int(b["size"]) for b in seg["blocks"] if b["state"] == ALLOCATED)
    return reserved, allocated


def busiest_device(snapshot: dict) -> int:
    """The device with the most trace entries (then the most segments); 0 for an empty snapshot."""
    traces = snapshot["device_traces"]
    devices = {s.get("device", 0) for s in snapshot["segments"]} | set(range(len(traces)))
    return max(sorted(devices), key=lambda d: (len(traces[d]) if d < len(traces) else 0,
                                               sum(1 for s in snapshot["segments"] if s.get("device", 0) == d)),
               default=0)


def placeholder_geometry(total_bytes: int) -> Geometry:
    return Geometry(total_bytes=max(1, int(total_bytes)), weights_bytes=0, context_bytes=0, gpu_memory_utilization=1.0,
                    unit_tokens=1, kv_bytes_per_token=1, dynamic_units=1, page_classes=(1,))


class _Rows:
    """The allocator's state as the rows have set it, and the rows."""

    def __init__(self) -> None:
        self.rows: list[tuple] = []
        self.segments: dict[int, tuple[int, int]] = {}  # address -> (size, pool)
        self.blocks: dict[int, tuple[int, int]] = {}  # address -> (size, segment)
        self.by_segment: dict[int, set[int]] = {}
        self.allocated = 0

    def seg_alloc(self, ts: int, addr: int, size: int, pool: int, stream: int) -> None:
        if addr in self.segments:
            self.seg_free(ts, addr)
        self.segments[addr] = (size, pool)
        self.by_segment[addr] = set()
        self.rows.append((ts, int(EventKind.SEG_ALLOC), pool, stream & 0xFF, -1, addr, size, 0, 0))

    def seg_free(self, ts: int, addr: int) -> None:
        if addr not in self.segments:
            return
        for block in sorted(self.by_segment.get(addr, ())):
            self.blk_free(ts, block)
        size, pool = self.segments.pop(addr)
        self.by_segment.pop(addr, None)
        self.rows.append((ts, int(EventKind.SEG_FREE), pool, 0, -1, addr, size, 0, 0))

    def segment_of(self, addr: int) -> int | None:
        for seg, (size, _) in self.segments.items():
            if seg <= addr < seg + size:
                return seg
        return None

    def blk_alloc(self, ts: int, addr: int, size: int, requested: int, seg: int) -> None:
        if addr in self.blocks:
            self.blk_free(ts, addr)
        seg_size, pool = self.segments[seg]
        size = min(size, seg + seg_size - addr)
        self.blocks[addr] = (size, seg)
        self.by_segment[seg].add(addr)
        self.allocated += size
        self.rows.append((ts, int(EventKind.BLK_ALLOC), pool, 0, -1, addr, size, requested, seg))

    def blk_free(self, ts: int, addr: int) -> None:
        block = self.blocks.pop(addr, None)
        if block is None:
            return
        size, seg = block
        self.by_segment[seg].discard(addr)
        self.allocated -= size
        self.rows.append((ts, int(EventKind.BLK_FREE), self.segments[seg][1], 0, -1, addr, size, 0, seg))

    @property
    def reserved(self) -> int:
        return sum(size for size, _ in self.segments.values())


def _pool(name: str) -> int:
    return int(Pool.SMALL if name == "small" else Pool.LARGE)


def snapshot_to_batches(snapshot: dict, node: str, *, device: int | None = None, epoch: int = 0,
                        rows_per_batch: int = 4096) -> tuple[list[EventBatch], SnapshotLogSummary]:
    """The snapshot's device ``device`` (default: ``busiest_device``) as event batches of ``node``."""
    device = busiest_device(snapshot) if device is None else device
    trace = trace_to_allocator_events(snapshot)
    final = [s for s in snapshot["segments"] if s.get("device", 0) == device]
    final_blocks: dict[int, tuple[int, str]] = {}
    for seg in final:
        addr = int(seg["address"])
        for block in seg["blocks"]:
            final_blocks[addr] = (int(block["size"]), block["state"])
            addr += int(block["size"])
    events = [e for e in trace.events if e.device == device]
    last_alloc = {e.addr: i for i, e in enumerate(events) if e.action == "alloc"}
    freed_in_trace = {e.addr for e in events if e.action in ("free_requested", "free_completed")}
    summary = SnapshotLogSummary(device=device, entries=len(events))
    summary.snapshot_reserved_bytes, summary.snapshot_allocated_bytes = snapshot_totals(snapshot, device)
    skipped: dict[str, int] = {}
    state = _Rows()

    first_us = next((e.ts_us for e in events if e.ts_us is not None), None)
    ts = (first_us * 1000 - 1000) if first_us is not None else 0
    for seg in trace.initial_segments:
        if seg.device == device:
            state.seg_alloc(ts, seg.address, seg.size, _pool(seg.pool), seg.stream)
    for block in trace.initial_blocks:
        if block.device != device:
            continue
        seg = block.segment_addr if block.segment_addr in state.segments else state.segment_of(block.addr)
        pending = final_blocks.get(block.addr, (0, ""))[1] == PENDING_FREE and block.addr not in freed_in_trace
        if seg is None or pending:
            skipped["initial_block_outside_segments" if seg is None else "initial_block_pending_free"] = skipped.get(
                "initial_block_outside_segments" if seg is None else "initial_block_pending_free", 0) + 1
            continue
        size = block.block_size if block.block_size is not None else _rounded(block.size)
        state.blk_alloc(ts, block.addr, size, block.size, seg)

    for i, e in enumerate(events):
        ts = e.ts_us * 1000 if e.ts_us is not None else ts + 1000
        action = e.action
        if action == "segment_alloc":
            state.seg_alloc(ts, e.addr, e.size, _pool(e.pool), e.stream)
        elif action == "segment_free":
            state.seg_free(ts, e.addr)
        elif action == "alloc":
            seg = e.segment_addr if e.segment_addr in state.segments else state.segment_of(e.addr)
            if seg is None:
                skipped["alloc_outside_segments"] = skipped.get("alloc_outside_segments", 0) + 1
                continue
            live = final_blocks.get(e.addr)
            exact = live is not None and live[1] != "inactive" and last_alloc.get(e.addr) == i
            state.blk_alloc(ts, e.addr, live[0] if exact else _rounded(e.size), e.size, seg)
        elif action in ("free_requested", "free_completed"):
            state.blk_free(ts, e.addr)
        elif action == "oom":
            unallocated = state.reserved - state.allocated
            cause = OomCause.FRAGMENTATION if unallocated >= e.size else OomCause.PEAK
            state.rows.append((ts, int(EventKind.OOM), int(OomLayer.ALLOCATOR), int(cause), -1, 0, e.size, 0,
                               unallocated))
            summary.ooms += 1
        elif action in ("segment_map", "segment_unmap"):
            skipped[action] = skipped.get(action, 0) + 1

    rows = np.array(state.rows, dtype=EVENT_DTYPE) if state.rows else np.zeros(0, dtype=EVENT_DTYPE)
    rows["ts_ns"] = np.maximum.accumulate(rows["ts_ns"]) if len(rows) else rows["ts_ns"]
    peak = max(summary.snapshot_reserved_bytes, _peak_reserved(rows))
    geometry = placeholder_geometry(peak)
    batches = [EventBatch(node=node, seq=k, events=chunk, epoch=epoch, geometry=geometry if k == 0 else None)
               for k, chunk in enumerate(_chunks(rows, rows_per_batch))]
    if not batches:  # an empty allocator: one empty batch still announces the node and its geometry
        batches = [EventBatch(node=node, seq=0, events=rows, epoch=epoch, geometry=geometry)]
    summary.rows, summary.batches, summary.skipped = len(rows), len(batches), skipped
    summary.rows_reserved_bytes, summary.rows_allocated_bytes = state.reserved, state.allocated
    summary.first_ts_ns = int(rows["ts_ns"][0]) if len(rows) else 0
    summary.last_ts_ns = int(rows["ts_ns"][-1]) if len(rows) else 0
    return batches, summary


def _rounded(size: int) -> int:
    return -(-max(int(size), 1) // _MIN_BLOCK) * _MIN_BLOCK


def _chunks(rows: np.ndarray, n: int) -> Iterator[np.ndarray]:
    for start in range(0, len(rows), n):
        yield rows[start:start + n]


def _peak_reserved(rows: np.ndarray) -> int:
    if not len(rows):
        return 0
    sign = np.where(rows["kind"] == int(EventKind.SEG_ALLOC), 1, np.where(rows["kind"] == int(EventKind.SEG_FREE), -1, 0))
    return int(np.cumsum(sign * rows["size"]).max(initial=0))
