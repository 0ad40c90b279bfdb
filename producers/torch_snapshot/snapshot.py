"""PyTorch CUDA memory snapshots: a safe reader, a fragmentation report, and the trace as events.

``torch.cuda.memory._dump_snapshot(path)`` pickles a dict with ``segments`` (every cudaMalloc'd
segment of the caching allocator at dump time, each cut into contiguous ``blocks`` whose state is
``active_allocated``, ``active_pending_free`` or ``inactive``) and ``device_traces`` (per device,
the allocator events recorded since ``_record_memory_history()``, oldest first, possibly only the
last ``max_entries``). Such files come from other people's machines, and a pickle can run code,
so the reader builds plain data only and refuses every global.

The report is the one pytorch/pytorch#29554 asks for: per pool and per segment, what is reserved,
allocated and free, the largest free block, F_ext and the rounding waste, and the segments that
are mostly free yet cannot be released because a live block sits in them ("pinned").

Pools follow CUDACachingAllocator: a request of at most 1 MiB (``kSmallSize``) is served from the
small pool, whose segments are 2 MiB (``kSmallBuffer``); anything larger goes to the large pool,
whose segments are never smaller than 10 MiB. Byte counts follow ``torch.cuda.memory_allocated``:
a block counts as allocated with its rounded ``size`` while its state is ``active_allocated``.

Pure: standard library only; no torch, no kvguard.
"""

from __future__ import annotations

import gzip
import io
import os
import pickle
import zlib
from bisect import bisect_right, insort
from typing import NamedTuple

from kvguard.contracts import pressure

SMALL_ALLOC_MAX_BYTES = 1 << 20  # kSmallSize: the largest request the small pool serves
SMALL_SEGMENT_BYTES = 2 << 20  # kSmallBuffer: every small-pool segment is this size
PINNED_FREE_FRAC = 0.5  # a segment at least this free, but holding a live block, is "pinned"

ALLOCATED = "active_allocated"
PENDING_FREE = "active_pending_free"  # freed by the program, waiting for its streams' events
FREE = "inactive"
POOLS = ("small", "large")

_GZIP_MAGIC = b"\x1f\x8b"
_UNPICKLE_ERRORS = (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError,
                    KeyError, AttributeError, OverflowError, RecursionError)
_SEGMENT_FIELDS = {"address": int, "total_size": int, "stream": int, "segment_type": str,
                   "blocks": list}
_BLOCK_FIELDS = {"size": int, "state": str}
_BLOCK_OPTIONAL_FIELDS = {"requested_size": int}
_ENTRY_FIELDS = {"action": str}
_ENTRY_OPTIONAL_FIELDS = {"size": int, "stream": int, "time_us": int}
_ADDRESSED_ENTRY_FIELDS = {"addr": int, "size": int}  # all actions but oom and snapshot
# sizes and addresses are unsigned in the allocator (size_t, uintptr): a negative one is no snapshot
_NON_NEGATIVE = frozenset({"address", "total_size", "size", "addr", "requested_size"})
_UNADDRESSED_ACTIONS = ("oom", "snapshot")  # oom records "device_free" where others have "addr"
# C++ frames that only say "the allocator was called": skipped when naming who allocated
_MACHINERY_PREFIXES = ("torch::unwind", "torch::CapturedTraceback", "torch::cuda::", "c10::",
                       "at::", "void at::", "void c10::", "std::")


class SnapshotError(ValueError):
    """The file is not a PyTorch memory snapshot this reader can use; ``reason`` says why."""

    def __init__(self, path, reason: str):
        self.path = os.fspath(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


class _PlainUnpickler(pickle.Unpickler):
    """Builds only what pickle's own opcodes build (dicts, lists, tuples, str, numbers, None).

    A pickle runs code only through a global it names (``os.system`` handed to REDUCE, a class
    handed to BUILD), so refusing every global closes that door. PyTorch's snapshot writer emits
    no globals at all, not even in ``frames``. Opcodes can still build bytes or sets, which run
    nothing; the fields this module reads are type-checked by ``_shape_problem`` instead of
    walking every frame (a full walk costs 20x the unpickling).
    """

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refused global {module}.{name}: a snapshot is plain data")


def load_snapshot(path) -> dict:
    """Read a ``.pickle`` or ``.pickle.gz`` snapshot (gzip is recognised by its magic bytes).

    Raises ``SnapshotError`` when the file is not a snapshot (not a pickle, truncated, names a
    global, or lacks ``segments``/``device_traces``); an unreadable path raises ``OSError``.
    """
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == _GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as err:
            raise SnapshotError(path, f"broken gzip stream ({err})") from err
    try:
        data = _PlainUnpickler(io.BytesIO(raw)).load()
    except _UNPICKLE_ERRORS as err:
        raise SnapshotError(path, f"not a readable pickle ({type(err).__name__}: {err})") from err
    problem = _shape_problem(data)
    if problem:
        raise SnapshotError(path, problem)
    return data


def _shape_problem(data) -> str | None:
    if not isinstance(data, dict):
        return (f"holds a {type(data).__name__}, not a dict; write snapshots with "
                f"torch.cuda.memory._dump_snapshot()")
    segments, traces = data.get("segments"), data.get("device_traces")
    if not isinstance(segments, list) or not isinstance(traces, list):
        return "no 'segments' and 'device_traces' lists: not a torch.cuda.memory snapshot"
    for i, seg in enumerate(segments):
        problem = _field_problem(seg, _SEGMENT_FIELDS)
        if problem:
            return f"segment {i}: {problem}"
        for block in seg["blocks"]:
            problem = (_field_problem(block, _BLOCK_FIELDS)
                       or _field_problem(block, _BLOCK_OPTIONAL_FIELDS, required=False))
            if problem:
                return f"a block of segment {i}: {problem}"
    for device, trace in enumerate(traces):
        if not isinstance(trace, list):
            return f"device_traces[{device}] is a {type(trace).__name__}, not a list"
        for entry in trace:
            problem = (_field_problem(entry, _ENTRY_FIELDS)
                       or _field_problem(entry, _ENTRY_OPTIONAL_FIELDS, required=False)
                       or (entry["action"] not in _UNADDRESSED_ACTIONS
                           and _field_problem(entry, _ADDRESSED_ENTRY_FIELDS)))
            if problem:
                return f"a trace entry of device {device}: {problem}"
    return None


def _field_problem(obj, fields: dict, required: bool = True) -> str | None:
    if not isinstance(obj, dict):
        return f"a {type(obj).__name__}, not a dict"
    for key, kind in fields.items():
        if key not in obj:
            if required:
                return f"no {key!r}"
        elif not isinstance(obj[key], kind) or isinstance(obj[key], bool):
            return f"{key!r} is a {type(obj[key]).__name__}, not {kind.__name__}"
        elif key in _NON_NEGATIVE and obj[key] < 0:
            return f"{key!r} is {obj[key]}, expected >= 0 (a size or an address)"
    return None


# --- fragmentation report ---------------------------------------------------------------------


def pool_of_request(size: int) -> str:
    """The pool CUDACachingAllocator serves a request of ``size`` bytes from.

    The allocator tests the rounded size, but rounding (to 512 B, or to a power-of-two division)
    never carries a request of at most 1 MiB past 1 MiB, so the raw size gives the same answer.
    """
    return "small" if size <= SMALL_ALLOC_MAX_BYTES else "large"


def pool_of_segment(size: int) -> str:
    """The pool a segment of ``size`` bytes belongs to when the snapshot does not say."""
    return "small" if size <= SMALL_SEGMENT_BYTES else "large"


def fragmentation_report(snapshot: dict, pinned_free_frac: float = PINNED_FREE_FRAC) -> dict:
    """Per-segment, per-pool and overall fragmentation of a loaded snapshot (JSON-ready).

    Keys: ``totals`` and ``pools`` (``small``/``large``) with the same sums; ``segments`` (one
    row per segment, by address); ``pinned`` (segments at least ``pinned_free_frac`` free that
    ``empty_cache()`` cannot release because an allocated block sits in them, with those
    blocks, named by their frames, or by their ``alloc`` entry's frames in the trace when the
    dump kept none); ``pinned_free_frac``, ``num_trace_entries``, ``expandable_segments``.
    Free means ``inactive``: a pending-free block is not yet reusable, so it is neither free nor
    allocated and is counted apart. ``private_pool_reserved_bytes`` sums the segments of private
    pools (``segment_pool_id`` other than (0, 0): a CUDA graph capture or a torch.cuda.MemPool,
    such as vLLM's sleep-mode weights and KV cache), which ordinary requests cannot use.
    """
    rows, pinned = [], []
    alloc_frames = _last_alloc_frames(snapshot)
    for seg in sorted(snapshot["segments"], key=lambda s: s["address"]):
        row, holders = _segment_row(seg, pinned_free_frac, alloc_frames)
        rows.append(row)
        if row["pinned"]:
            pinned.append({key: row[key] for key in ("address", "pool", "stream", "reserved_bytes",
                                                      "free_bytes", "free_frac")}
                          | {"blocks": holders})
    pinned.sort(key=lambda p: -p["free_bytes"])
    settings = snapshot.get("allocator_settings") or {}
    return {
        "totals": _sum_rows(rows),
        "pools": {pool: _sum_rows([r for r in rows if r["pool"] == pool]) for pool in POOLS},
        "segments": rows,
        "pinned": pinned,
        "pinned_free_frac": pinned_free_frac,
        "num_trace_entries": sum(len(trace) for trace in snapshot["device_traces"]),
        "expandable_segments": bool(settings.get("expandable_segments", False)),
    }


def _last_alloc_frames(snapshot: dict) -> dict[tuple[int, int], list]:
    """(device, addr) -> frames of the last ``alloc`` there: a live block's own allocation."""
    return {(device, entry.get("addr")): entry["frames"]
            for device, trace in enumerate(snapshot["device_traces"]) for entry in trace
            if entry["action"] == "alloc" and entry.get("frames")}


def _segment_row(seg: dict, pinned_free_frac: float,
                 alloc_frames: dict[tuple[int, int], list]) -> tuple[dict, list[dict]]:
    sizes = {ALLOCATED: 0, PENDING_FREE: 0, FREE: 0}
    requested = largest_free = num_allocated = 0
    holders = []
    address, device = seg["address"], seg.get("device", 0)
    for block in seg["blocks"]:  # contiguous: each block starts where the previous ended
        size, state = block["size"], block["state"]
        sizes[state] = sizes.get(state, 0) + size
        if state == FREE:
            largest_free = max(largest_free, size)
        elif state == ALLOCATED:
            num_allocated += 1
            requested += block.get("requested_size", size)
            holders.append({"address": address, "size": size,
                            "requested_size": block.get("requested_size", size),
                            "frame": top_frame(block.get("frames")
                                               or alloc_frames.get((device, address)) or [])})
        address += size
    reserved = seg["total_size"]
    free_frac = sizes[FREE] / reserved if reserved else 0.0
    pinned = num_allocated > 0 and free_frac >= pinned_free_frac
    pool_id = seg.get("segment_pool_id")
    row = {
        "address": seg["address"], "pool": seg["segment_type"], "stream": seg["stream"],
        "device": seg.get("device", 0), "pool_id": list(pool_id) if pool_id else None,
        "expandable": bool(seg.get("is_expandable", False)),
        "reserved_bytes": reserved, "allocated_bytes": sizes[ALLOCATED],
        "requested_bytes": requested, "rounding_waste_bytes": sizes[ALLOCATED] - requested,
        "pending_free_bytes": sizes[PENDING_FREE], "free_bytes": sizes[FREE],
        "largest_free_bytes": largest_free, "f_ext": pressure.f_ext(sizes[FREE], largest_free),
        "free_frac": free_frac, "num_blocks": len(seg["blocks"]),
        "num_allocated_blocks": num_allocated,
        "releasable": sizes[ALLOCATED] == 0 and sizes[PENDING_FREE] == 0,
        "pinned": pinned,
    }
    return row, holders if pinned else []


def _sum_rows(rows: list[dict]) -> dict:
    def total(key: str) -> int:
        return sum(r[key] for r in rows)

    largest = max((r["largest_free_bytes"] for r in rows), default=0)
    private = [r for r in rows if r["pool_id"] and any(r["pool_id"])]
    return {
        "num_segments": len(rows),
        "reserved_bytes": total("reserved_bytes"),
        "allocated_bytes": total("allocated_bytes"),
        "requested_bytes": total("requested_bytes"),
        "rounding_waste_bytes": total("rounding_waste_bytes"),
        "pending_free_bytes": total("pending_free_bytes"),
        "free_bytes": total("free_bytes"),
        "unallocated_bytes": total("reserved_bytes") - total("allocated_bytes"),
        "largest_free_bytes": largest,
        "f_ext": pressure.f_ext(total("free_bytes"), largest),
        "num_allocated_blocks": total("num_allocated_blocks"),
        "releasable_bytes": sum(r["reserved_bytes"] for r in rows if r["releasable"]),
        "num_pinned_segments": sum(1 for r in rows if r["pinned"]),
        "pinned_free_bytes": sum(r["free_bytes"] for r in rows if r["pinned"]),
        "private_pool_reserved_bytes": sum(r["reserved_bytes"] for r in private),
    }


def top_frame(frames: list[dict]) -> str | None:
    """The frame that best names who allocated: the first Python frame outside torch itself.

    Frames run innermost first; with ``stacks="all"`` the C++ allocator frames come first, and
    the innermost Python frames are usually torch's own (``torch/nn/modules/...``). A stack
    without Python frames (the backward pass runs on autograd's thread) is named by its first
    C++ frame outside the allocator and ATen's dispatch; None when nothing is left.
    """
    python = [f for f in frames if str(f.get("filename", "")).endswith(".py")]
    outside = [f for f in python if not _in_torch_package(str(f["filename"]))]
    for candidates in (outside, python):
        if candidates:
            frame = candidates[0]
            name = os.path.basename(str(frame["filename"]).replace("\\", "/"))
            return f"{frame.get('name', '?')} ({name}:{frame.get('line', 0)})"
    for frame in frames:  # C++ only (autograd's thread): the first frame past the allocator
        name = str(frame.get("name", ""))
        if name and not name.startswith(_MACHINERY_PREFIXES):
            return name.split("(")[0] + " [C++]"
    return None


def _in_torch_package(filename: str) -> bool:
    path = filename.replace("\\", "/")
    return "/torch/" in path and ("site-packages/" in path or "dist-packages/" in path)


# --- text rendering ---------------------------------------------------------------------------

_WIDTH = 80
_TOP_SEGMENTS = 10
_HOLDERS_SHOWN = 3


def format_bytes(num_bytes: int) -> str:
    """Binary units, at most 10 characters: ``512 B``, ``20.0 MiB``, ``1023.9 GiB``."""
    if abs(num_bytes) < 1024:
        return f"{num_bytes} B"
    value = num_bytes / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def render_report(report: dict) -> str:
    """The report as plain text, no line wider than 80 columns."""
    lines = [*_render_summary(report), "", *_render_pinned(report), "",
             *_render_segments(report)]
    return "\n".join(_clip(line) for line in lines) + "\n"


def _clip(line: str) -> str:
    return line if len(line) <= _WIDTH else line[:_WIDTH - 3] + "..."


def _render_summary(report: dict) -> list[str]:
    t = report["totals"]
    b = format_bytes
    lines = [(f"PyTorch memory snapshot: {t['num_segments']} segments, "
              f"{report['num_trace_entries']} trace entries"),
             f"expandable segments: {'on' if report['expandable_segments'] else 'off'}",
             "",
             (f"{'pool':<6} {'segs':>5} {'reserved':>10} {'allocated':>10} {'unalloc.':>10} "
              f"{'free':>10} {'largest free':>12} {'F_ext':>6}")]
    for name, s in list(report["pools"].items()) + [("total", t)]:
        lines.append(f"{name:<6} {s['num_segments']:>5} {b(s['reserved_bytes']):>10} "
                     f"{b(s['allocated_bytes']):>10} {b(s['unallocated_bytes']):>10} "
                     f"{b(s['free_bytes']):>10} {b(s['largest_free_bytes']):>12} "
                     f"{s['f_ext']:>6.3f}")
    lines += [
        "",
        (f"rounding waste (size - requested): {b(t['rounding_waste_bytes'])} over "
         f"{t['num_allocated_blocks']} allocated blocks"),
        f"pending free (awaiting stream events): {b(t['pending_free_bytes'])}",
        f"releasable by empty_cache() (nothing allocated): {b(t['releasable_bytes'])}",
    ]
    if t["private_pool_reserved_bytes"]:
        lines.append(f"reserved by private pools (CUDA graphs, MemPools): "
                     f"{b(t['private_pool_reserved_bytes'])}")
    return lines


def _render_pinned(report: dict) -> list[str]:
    t, pinned = report["totals"], report["pinned"]
    frac = f"{report['pinned_free_frac']:.0%}"
    lines = [(f"pinned segments (>= {frac} free, held by allocated blocks): "
              f"{t['num_pinned_segments']}, {format_bytes(t['pinned_free_bytes'])} free")]
    if not pinned:
        return lines
    lines.append(f"  {'segment':<16} {'pool':<5} {'reserved':>10} {'free':>10} {'free%':>6} "
                 f"{'held by':>8}")
    for seg in pinned[:_TOP_SEGMENTS]:
        lines.append(f"  {seg['address']:#016x} {seg['pool']:<5} "
                     f"{format_bytes(seg['reserved_bytes']):>10} "
                     f"{format_bytes(seg['free_bytes']):>10} {seg['free_frac']:>6.0%} "
                     f"{len(seg['blocks']):>3} blk")
        for block in seg["blocks"][:_HOLDERS_SHOWN]:
            lines.append(f"    +{block['address'] - seg['address']:#x} "
                         f"{format_bytes(block['size'])} {block['frame'] or '(no frames)'}")
        if len(seg["blocks"]) > _HOLDERS_SHOWN:
            lines.append(f"    ... {len(seg['blocks']) - _HOLDERS_SHOWN} more blocks")
    if len(pinned) > _TOP_SEGMENTS:
        lines.append(f"  ... {len(pinned) - _TOP_SEGMENTS} more pinned segments (see --json)")
    return lines


def _render_segments(report: dict) -> list[str]:
    held = [r for r in report["segments"] if not r["releasable"]]
    rows = sorted(held, key=lambda r: -r["free_bytes"])[:_TOP_SEGMENTS]
    lines = [(f"most free space in segments empty_cache() cannot release (top {len(rows)} of "
              f"{len(held)}):"),
             (f"  {'segment':<16} {'pool':<5} {'strm':>4} {'reserved':>10} {'allocated':>10} "
              f"{'largest free':>12} {'F_ext':>6}")]
    for r in rows:
        lines.append(f"  {r['address']:#016x} {r['pool']:<5} {r['stream']:>4} "
                     f"{format_bytes(r['reserved_bytes']):>10} "
                     f"{format_bytes(r['allocated_bytes']):>10} "
                     f"{format_bytes(r['largest_free_bytes']):>12} {r['f_ext']:>6.3f}")
    return lines


# --- the trace as allocator events --------------------------------------------------------------


class AllocatorEvent(NamedTuple):
    """One trace entry, sizes as PyTorch records them: for alloc/free_* ``size`` is the request
    before rounding (the block's ``requested_size``; the block itself may be larger, as the
    allocator rounds and keeps unsplit remainders of up to 1 MiB), for segment_* the segment's
    size. ``segment_addr`` is the live segment holding ``addr``, when known."""

    ts_us: int | None
    action: str
    addr: int
    size: int
    stream: int
    pool: str
    segment_addr: int | None
    device: int


class InitialSegment(NamedTuple):
    """A segment that existed before the trace began. ``pool_id`` is None when the segment is
    known only from its ``segment_free`` in the trace."""

    address: int
    size: int
    stream: int
    pool: str
    device: int
    pool_id: tuple | None


class InitialBlock(NamedTuple):
    """A block allocated before the trace began (live at dump time, or freed during the trace).
    ``size`` is the request, as in ``AllocatorEvent``; ``block_size`` the block's own size when
    the dump still holds it, None when only its free in the trace tells of it."""

    addr: int
    size: int
    block_size: int | None
    stream: int
    pool: str
    segment_addr: int | None
    device: int


class AllocatorTrace(NamedTuple):
    """The allocator's state when recording began, and what happened after, per device in turn."""

    initial_segments: list[InitialSegment]
    initial_blocks: list[InitialBlock]
    events: list[AllocatorEvent]


class _SegmentIndex:
    """Live segments of one device by start address, so the segment holding an address is one
    bisect away. Segment counts are in the hundreds, so a sorted list beats a tree."""

    def __init__(self):
        self.starts: list[int] = []
        self.end_of: dict[int, int] = {}
        self.pool_of: dict[int, str] = {}

    def add(self, address: int, size: int, pool: str) -> None:
        if address not in self.end_of:
            insort(self.starts, address)
        self.end_of[address], self.pool_of[address] = address + size, pool

    def remove(self, address: int) -> None:
        if self.end_of.pop(address, None) is not None:
            self.starts.pop(bisect_right(self.starts, address) - 1)
            del self.pool_of[address]

    def find(self, addr: int) -> int | None:
        i = bisect_right(self.starts, addr) - 1
        if i >= 0 and addr < self.end_of[self.starts[i]]:
            return self.starts[i]
        return None


def trace_to_allocator_events(snapshot: dict) -> AllocatorTrace:
    """The device traces as ``AllocatorEvent`` s in recorded order (device 0's, then device 1's,
    ...), with the segments and live blocks that existed when recording began.

    The start state is the dump-time state with the trace undone: a segment (block) counts as
    pre-existing when it is freed in the trace before any allocation of it there, or when it
    is still present at dump time and was never allocated in the trace. Replaying ``events``
    on the start state gives back the dump's segments and non-free blocks.
    Expandable segments' ``segment_map``/``segment_unmap`` pass through unchanged.
    """
    segments, blocks, events = [], [], []
    for device, trace in enumerate(snapshot["device_traces"]):
        final = [s for s in snapshot["segments"] if s.get("device", 0) == device]
        initial = _initial_segments(trace, final, device)
        index = _SegmentIndex()
        for seg in initial:
            index.add(seg.address, seg.size, seg.pool)
        final_pool = {(s["address"], s["total_size"]): s["segment_type"] for s in final}
        start_blocks = _initial_blocks(trace, final, index, device)
        events.extend(_events(trace, index, final_pool, device))
        segments.extend(initial)
        blocks.extend(start_blocks)
    return AllocatorTrace(segments, blocks, events)


def _initial_segments(trace: list[dict], final: list[dict], device: int) -> list[InitialSegment]:
    born, freed_first = set(), []
    for entry in trace:
        if entry["action"] == "segment_alloc":
            born.add(entry["addr"])
        elif entry["action"] == "segment_free":
            if entry["addr"] in born:
                born.discard(entry["addr"])
            else:
                freed_first.append(InitialSegment(entry["addr"], entry["size"],
                                                  entry.get("stream", 0),
                                                  pool_of_segment(entry["size"]), device, None))
    survivors = [InitialSegment(s["address"], s["total_size"], s["stream"], s["segment_type"],
                                device, s.get("segment_pool_id"))
                 for s in final if s["address"] not in born]
    return sorted(freed_first + survivors, key=lambda s: s.address)


def _initial_blocks(trace: list[dict], final: list[dict], index: _SegmentIndex,
                    device: int) -> list[InitialBlock]:
    born, freed_first = set(), []
    for entry in trace:
        if entry["action"] == "alloc":
            born.add(entry["addr"])
        elif entry["action"] == "free_completed":
            if entry["addr"] in born:
                born.discard(entry["addr"])
            else:
                freed_first.append((entry["addr"], entry["size"], None, entry.get("stream", 0)))
    live = [(addr, block.get("requested_size", block["size"]), block["size"], seg["stream"])
            for seg in final for addr, block in _addressed_blocks(seg)
            if block["state"] != FREE and addr not in born]
    out = []
    for addr, size, block_size, stream in sorted(freed_first + live, key=lambda b: b[0]):
        seg_addr = index.find(addr)
        pool = index.pool_of[seg_addr] if seg_addr is not None else pool_of_request(size)
        out.append(InitialBlock(addr, size, block_size, stream, pool, seg_addr, device))
    return out


def _addressed_blocks(seg: dict):
    address = seg["address"]
    for block in seg["blocks"]:
        yield address, block
        address += block["size"]


def _events(trace: list[dict], index: _SegmentIndex, final_pool: dict,
            device: int) -> list[AllocatorEvent]:
    out = []
    for entry in trace:
        action, size = entry["action"], entry.get("size", 0)
        addr = entry.get("addr", entry.get("device_free", 0))
        if action == "segment_alloc":
            index.add(addr, size, final_pool.get((addr, size), pool_of_segment(size)))
        seg_addr = index.find(addr) if action not in _UNADDRESSED_ACTIONS else None
        if seg_addr is not None:
            pool = index.pool_of[seg_addr]
        elif action.startswith("segment"):
            pool = pool_of_segment(size)
        else:
            pool = pool_of_request(size)
        out.append(AllocatorEvent(entry.get("time_us"), action, addr, size,
                                  entry.get("stream", 0), pool, seg_addr, device))
        if action == "segment_free":
            index.remove(addr)
    return out
