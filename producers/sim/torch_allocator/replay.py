"""Replay a real ``torch.cuda.memory._snapshot()`` trace through the caching-allocator twin, and compare.

``replay_device_trace(snapshot)`` rebuilds the segments that existed before the trace began, then
feeds the trace's client actions (alloc, free_requested, free_completed of cross-stream frees) to a
``CachingAllocator`` in order. The twin makes every placement, split, merge and release decision itself;
only the *driver's* answers come from the recording: a ``TraceDriver`` lets a cudaMalloc (or page map)
succeed exactly when the real one did, at the real address, so a capacity that was never recorded is
not guessed. Between two client actions the real allocator's segment actions form a *window*:

* window holds a segment_alloc/segment_map: the next malloc needs memory; a cudaMalloc succeeds only
  once the twin has released (cudaFree'd) whatever the real allocator released before it, so a
  release-and-retry, a garbage collection and an empty_cache before a malloc all replay as they ran;
* window ends in an oom: a failed malloc of the recorded (rounded) size, which the twin must fail too;
* window holds only segment_free/segment_unmap: an ``empty_cache()`` call.

Each disagreement (the twin asks for memory the real one did not, frees another segment, fails where
the real one succeeded) is appended to ``driver.notes``; ``compare_replay`` reports the notes, the
segment_alloc sequences and the final block layouts side by side.

Seeding (traces that start after the allocator was in use, e.g. a wrapped ring buffer): a segment
first seen being freed, or present at the end without a segment_alloc, existed before. Its live blocks
at the start are the final snapshot's active blocks never allocated in the trace (exact) plus the
addresses freed before any alloc, sized ``round_size(requested)`` and corrected for a remainder the
block may have absorbed (``_seeded_length``); the gaps are free. Expandable segments and CUDA-graph
private pools that existed before the trace cannot be seeded: ``ReplayUnsupported``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvguard.producers.sim.torch_allocator.caching_allocator import CachingAllocator, OutOfMemoryError
from kvguard.producers.sim.torch_allocator.config import K_SMALL_BUFFER, K_SMALL_SIZE, SIZE_MAX, AllocatorConfig
from kvguard.producers.sim.torch_allocator.device import DEFAULT_BASE_ADDRESS

SEGMENT_ACTIONS = frozenset({"segment_alloc", "segment_free", "segment_map", "segment_unmap"})
_GROW = frozenset({"segment_alloc", "segment_map"})
_SHRINK = frozenset({"segment_free", "segment_unmap"})
_DEFAULT_TOTAL = 80 << 30
_PENDING_STREAM = -1  # a stream no real trace uses: holds a free until the trace records its completion


class ReplayUnsupported(ValueError):
    """The snapshot holds state the twin cannot rebuild; the message says which and why."""


class TraceDriver:
    """A CUDA driver that answers from a recorded window of real segment actions (see module docstring)."""

    def __init__(self, total_bytes: int = _DEFAULT_TOTAL):
        self.total_bytes = total_bytes
        self.window: list[dict] = []
        self.notes: list[str] = []
        self.position = 0  # index of the client trace entry being replayed, for notes
        self._high = DEFAULT_BASE_ADDRESS  # end of the highest range handed out: off-trace ranges go above
        self._reserved: list[tuple[int, int]] = []  # expandable address-space reservations
        self._live: dict[int, int] = {}  # cudaMalloc'd segments the twin holds: address -> size

    def open(self, window: list[dict], position: int) -> None:
        self.close()
        self.window, self.position = list(window), position

    def close(self) -> None:
        for entry in self.window:
            if entry["action"] != "oom":
                self.note(f"real {entry['action']}({entry['addr']:#x}, {entry['size']}) not reproduced by the twin")
        self.window = []

    def note(self, text: str) -> None:
        self.notes.append(f"entry {self.position}: {text}")

    def _grow(self, action: str, size: int) -> dict | None | bool:
        """The real entry that lets this request succeed, None if the real one failed here, True if the
        real allocator did not ask at all (the twin diverged; it is allowed, and noted)."""
        if self.window and self.window[0]["action"] == action:
            entry = self.window.pop(0)
            if entry["size"] != size:
                self.note(f"twin {action} of {size} bytes where the real one got {entry['size']}")
            return entry
        if self.window:
            return None
        self.note(f"twin {action} of {size} bytes that the real allocator did not need")
        return True

    def cuda_malloc(self, size: int) -> int | None:
        entry = self._grow("segment_alloc", size)
        if entry is None:
            return None
        address = entry["addr"] if isinstance(entry, dict) else None
        if address is not None and self._overlaps(address, size):
            self.note(f"real segment_alloc at {address:#x} overlaps memory the twin still holds")
            address = None
        address = self._fresh(size) if address is None else address
        self.claim(address, size)
        return address

    def claim(self, address: int, size: int) -> None:
        """Record a cudaMalloc'd range the twin holds (also for segments seeded before the trace)."""
        self._live[address] = size
        self._high = max(self._high, address + size)

    def cuda_free(self, address: int, size: int) -> None:
        self._live.pop(address, None)
        self._shrink("segment_free", address, size)

    def map_pages(self, address: int, size: int) -> bool:
        entry = self._grow("segment_map", size)
        if isinstance(entry, dict) and entry["addr"] != address:
            self.note(f"twin segment_map at {address:#x} where the real one mapped {entry['addr']:#x}")
        return entry is not None

    def unmap_pages(self, address: int, size: int) -> None:
        self._shrink("segment_unmap", address, size)

    def reserve_address_space(self, size: int) -> int:
        """A new expandable segment maps its first page at its base: take the next real map address.
        A reservation the trace never maps (its first map failed) goes above everything handed out, as
        a bump allocator would place it, so segments keep their real address order."""
        address = next((e["addr"] for e in self.window if e["action"] == "segment_map"), None)
        if address is None or self._overlaps(address, size):
            address = self._fresh(size)
        self._reserved.append((address, size))
        self._high = max(self._high, address + size)
        return address

    def release_address_space(self, address: int, size: int) -> None:
        if (address, size) in self._reserved:
            self._reserved.remove((address, size))

    def mem_get_info(self) -> tuple[int, int]:
        free = next((e["device_free"] for e in self.window if e["action"] == "oom"), 0)
        return free, self.total_bytes

    def _shrink(self, action: str, address: int, size: int) -> None:
        for i, entry in enumerate(self.window):
            if entry["action"] == action and entry["addr"] == address:
                del self.window[i]
                if entry["size"] != size:
                    self.note(f"twin {action}({address:#x}) of {size} bytes, real one {entry['size']}")
                return
        self.note(f"twin {action}({address:#x}, {size}) that the real allocator did not do")

    def _overlaps(self, address: int, size: int) -> bool:
        ranges = [*self._live.items(), *self._reserved]
        return any(a < address + size and address < a + s for a, s in ranges)

    def _fresh(self, size: int) -> int:
        align = 2 << 20
        address = -(-self._high // align) * align
        self._high = address + size
        return address


def replay_device_trace(snapshot: dict, *, device: int | None = None, config: AllocatorConfig | None = None,
                        total_bytes: int = _DEFAULT_TOTAL) -> CachingAllocator:
    """Rebuild the allocator a real snapshot came from by replaying its trace through a twin.

    ``device`` defaults to the only device with trace entries; ``config`` to the snapshot's
    ``allocator_settings`` (or defaults, with expandable segments inferred from segment_map entries);
    ``total_bytes`` is the device total used to size expandable segments' address space.
    The returned twin's ``device_memory`` is the ``TraceDriver``; its ``notes`` list every divergence.
    """
    device = _pick_device(snapshot) if device is None else device
    trace = [e for e in snapshot["device_traces"][device] if tuple(e.get("pool_id", (0, 0))) == (0, 0)]
    config = config if config is not None else config_from_snapshot(snapshot, trace)
    twin = CachingAllocator(driver=TraceDriver(total_bytes), config=config, device=device)
    _seed(twin, snapshot, device, trace)
    return _Replayer(twin, trace).run()


class _Replayer:
    """Walks a real trace; between two client calls it gathers the *window* of real segment actions,
    ooms and cross-stream completions, and replays the client call against it.

    Some windows read more than one way: a completion before the first segment action is
    process_events (before the search) or synchronize_and_free_events (after a failed cudaMalloc), and
    releases before a segment_alloc are a release-and-retry or an ``empty_cache()`` just before the
    malloc. Such a window is replayed on clones of the twin under each reading, in that order, and the
    first reading the trace fully confirms (same address, every real segment action reproduced, nothing
    else) is kept; if none is, the first reading stands and its notes report the divergence.
    """

    def __init__(self, twin: CachingAllocator, trace: list[dict]):
        self.twin = twin
        self.trace = trace
        self.to_twin: dict[int, int] = {}  # real address -> twin address of live (or pending) allocations

    def run(self) -> CachingAllocator:
        window: list[dict] = []
        for i, entry in enumerate(self.trace):
            action = entry["action"]
            if action in SEGMENT_ACTIONS or action == "free_completed":
                window.append(entry)
            elif action in ("alloc", "oom"):
                if action == "oom":
                    window.append(entry)
                self._malloc(window, entry, i)
                window = []
            elif action == "free_requested":
                self._releases(self.twin, window, i)
                window = []
                self._free(i)
        self._releases(self.twin, window, len(self.trace))
        self.twin.device_memory.close()
        return self.twin

    def _malloc(self, window: list[dict], entry: dict, position: int) -> None:
        grows = [k for k, e in enumerate(window) if e["action"] in _GROW or e["action"] == "oom"]
        if not grows:  # served from the cache, after whatever empty_cache ran before
            self._releases(self.twin, window, position)
            self._attempt(self.twin, [], entry, position, completions=[], later=[])
            return
        first = next(k for k, e in enumerate(window) if e["action"] != "free_completed")
        leading = [e for e in window[:first] if e["action"] == "free_completed"]
        later = [e for e in window[first:] if e["action"] == "free_completed"]
        actions = [e for e in window if e["action"] != "free_completed"]
        readings = [("process_events", leading, later)]
        if leading:
            readings.append(("synchronize_and_free_events", [], leading + later))
        before_grow = window[:grows[0]]
        if any(e["action"] in _SHRINK for e in before_grow):
            readings.append(("empty_cache", None, None))
        if len(readings) == 1:
            self._attempt(self.twin, actions, entry, position, completions=leading, later=later)
            return
        for name, completions, rest in readings:
            trial = self.twin.clone()
            to_twin = dict(self.to_twin)
            notes = len(trial.device_memory.notes)
            if name == "empty_cache":
                self._releases(trial, before_grow, position)
                tail = window[grows[0]:]
                ok = self._attempt(trial, [e for e in tail if e["action"] != "free_completed"], entry, position,
                                   completions=[], later=[e for e in tail if e["action"] == "free_completed"])
            else:
                ok = self._attempt(trial, actions, entry, position, completions=completions, later=rest)
            trial.device_memory.open([], position)  # notes whatever this reading left unreproduced
            if ok and len(trial.device_memory.notes) == notes:
                self.twin = trial
                return
            self.to_twin = to_twin
        self._attempt(self.twin, actions, entry, position, completions=leading, later=later)

    def _attempt(self, twin, actions, entry, position, *, completions, later) -> bool:
        """Replay one real malloc (or failed malloc) on ``twin``; True if it ended as the real one did."""
        driver = twin.device_memory
        self._complete(twin, completions)
        driver.open(actions, position)
        expect_oom = entry["action"] == "oom"
        try:
            address = twin.malloc(entry["size"], entry["stream"], now_ns=entry.get("time_us", 0) * 1000)
        except OutOfMemoryError:
            self._complete(twin, later)
            if not expect_oom:
                driver.note(f"twin OOM on alloc of {entry['size']} bytes that the real allocator served")
            return expect_oom
        self._complete(twin, later)
        if expect_oom:
            driver.note(f"real OOM on {entry['size']} bytes, the twin served it at {address:#x} (freed again)")
            twin.free(address)
            return False
        if address != entry["addr"]:
            driver.note(f"alloc of {entry['size']} bytes placed at {address:#x}, real {entry['addr']:#x}")
        self.to_twin[entry["addr"]] = address
        return address == entry["addr"]

    def _releases(self, twin, window: list[dict], position: int) -> None:
        """Before a free (or at the end): completions, then releases that can only be an ``empty_cache()``."""
        self._complete(twin, [e for e in window if e["action"] == "free_completed"])
        actions = [e for e in window if e["action"] in SEGMENT_ACTIONS]
        twin.device_memory.open(actions, position)
        if actions:
            twin.empty_cache()
            twin.device_memory.open([], position)

    def _free(self, i: int) -> None:
        """A free is replayed as pending (an event on a stream no one syncs): its free_completed entry,
        right after it or later, completes it - before or during the next malloc, as readings decide."""
        entry, twin = self.trace[i], self.twin
        address = self.to_twin.get(entry["addr"], entry["addr"])
        try:
            twin.record_stream(address, _PENDING_STREAM)
            twin.free(address, now_ns=entry.get("time_us", 0) * 1000)
        except KeyError:
            twin.device_memory.note(f"free of {entry['addr']:#x}, which the twin does not hold")

    def _complete(self, twin, entries: list[dict]) -> None:
        """Complete the twin's pending frees that these free_completed entries record."""
        for entry in entries:
            twin._complete_event(self.to_twin.get(entry["addr"], entry["addr"]))


def config_from_snapshot(snapshot: dict, trace: list[dict] = ()) -> AllocatorConfig:
    """The allocator settings a snapshot records (``allocator_settings``), else inferred from the trace."""
    settings = snapshot.get("allocator_settings") or {}
    setting_string = settings.get("PYTORCH_CUDA_ALLOC_CONF")
    if isinstance(setting_string, str) and setting_string:
        return AllocatorConfig.from_string(setting_string)
    values = {}
    max_split = settings.get("max_split_size")
    if isinstance(max_split, int) and 0 < max_split < SIZE_MAX:
        values["max_split_size_bytes"] = max_split
    if settings.get("garbage_collection_threshold"):
        values["garbage_collection_threshold"] = float(settings["garbage_collection_threshold"])
    divisions = settings.get("roundup_power2_divisions")
    if isinstance(divisions, dict):  # torch writes {"1": d, "2": d, ..., "32768": d}, keyed by MiB
        divisions = [divisions[k] for k in sorted(divisions, key=int)]
    if isinstance(divisions, (list, tuple)) and len(divisions) == 16:
        values["roundup_power2_divisions"] = tuple(int(d) for d in divisions)
    expandable = settings.get("expandable_segments")
    if expandable is None:
        expandable = (any(e["action"] == "segment_map" for e in trace)
                      or any(s.get("is_expandable") for s in snapshot.get("segments", ())))
    values["expandable_segments"] = bool(expandable)
    return AllocatorConfig(**values)


def _pick_device(snapshot: dict) -> int:
    with_trace = [i for i, t in enumerate(snapshot.get("device_traces", ())) if t]
    if len(with_trace) == 1:
        return with_trace[0]
    devices = sorted({s["device"] for s in snapshot.get("segments", ())})
    if not with_trace and len(devices) <= 1:
        return devices[0] if devices else 0
    raise ReplayUnsupported(f"snapshot has traces for devices {with_trace} and segments on {devices}: "
                            f"pass device=")


def _seed(twin: CachingAllocator, snapshot: dict, device: int, trace: list[dict]) -> None:
    """Install the segments that existed before the trace began (see the module docstring)."""
    final = [s for s in snapshot.get("segments", ()) if s["device"] == device]
    private = [s for s in final if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)]
    if private:
        twin.device_memory.notes.append(f"{len(private)} private-pool (CUDA graph / MemPool) segments are not "
                                        f"modelled and left out")
    final = [s for s in final if tuple(s.get("segment_pool_id", (0, 0))) == (0, 0)]
    born: set[int] = set()  # segments cudaMalloc'd in the trace
    mapped: list[tuple[int, int]] = []  # expandable ranges mapped in the trace
    pre: dict[int, dict] = {}
    allocated_in_trace, freed_first = set(), {}
    alloc_positions: list[tuple[int, int]] = []  # (trace index, address) of every alloc
    in_mapped = lambda address: any(a <= address < b for a, b in mapped)
    for position, entry in enumerate(trace):
        action, address = entry["action"], entry.get("addr")
        if action == "segment_alloc":
            born.add(address)
        elif action == "segment_map":
            mapped.append((address, address + entry["size"]))
        elif action == "segment_unmap" and not in_mapped(address):
            raise ReplayUnsupported(f"the trace unmaps {address:#x}, in an expandable segment mapped before it "
                                    f"began; expandable segments cannot be seeded")
        elif action == "segment_free" and address not in born and address not in pre:
            pre[address] = {"address": address, "total_size": entry["size"], "stream": entry["stream"],
                            "segment_type": "small" if entry["size"] == K_SMALL_BUFFER else "large", "blocks": []}
        elif action == "alloc":
            allocated_in_trace.add(address)
            alloc_positions.append((position, address))
        elif action == "free_requested" and address not in allocated_in_trace and address not in freed_first:
            freed_first[address] = (entry["size"], position)
    for segment in final:
        if segment.get("is_expandable"):
            if not in_mapped(segment["address"]):
                raise ReplayUnsupported(f"segment {segment['address']:#x} is expandable and existed before the "
                                        f"trace began; expandable segments cannot be seeded")
        elif segment["address"] not in born and segment["address"] not in pre:
            pre[segment["address"]] = segment
    for segment in pre.values():
        _seed_one(twin, segment, final, allocated_in_trace, freed_first, alloc_positions)
    _seed_pending(twin, [s for s in final if s["address"] in pre], allocated_in_trace, freed_first)


def _seed_one(twin, segment, final, allocated_in_trace, freed_first, alloc_positions) -> None:
    start, size = segment["address"], segment["total_size"]
    end = start + size
    is_small = segment["segment_type"] == "small"
    live = {}
    for final_segment in final:  # live all along: active at the end, never allocated in the trace
        if final_segment["address"] == start:
            address = start
            for block in final_segment["blocks"]:
                if block["state"] != "inactive" and address not in allocated_in_trace:
                    live[address] = (block["size"], block["requested_size"])
                address += block["size"]
    freed_at = {}
    for address, (requested, position) in freed_first.items():
        if start <= address < end and address not in live:  # the final snapshot's size is exact
            live[address] = (twin.config.round_size(requested), requested)
            freed_at[address] = position
    allocations = []
    starts = sorted(live)
    for k, address in enumerate(starts):
        length, requested = live[address]
        limit = starts[k + 1] if k + 1 < len(starts) else end
        if not is_small and address in freed_at:
            length = _seeded_length(address, length, limit, freed_at[address], alloc_positions,
                                    twin.config.max_split_size_bytes)
        allocations.append((address, min(length, limit - address), requested))
    twin._seed_segment(start, size, segment["stream"], is_small, allocations)
    twin.device_memory.claim(start, size)


def _seed_pending(twin, segments, allocated_in_trace, freed_first) -> None:
    """Blocks pending a cross-stream free before the trace began stay pending (unrecorded)."""
    twin.record_history = False
    for segment in segments:
        address = segment["address"]
        for block in segment["blocks"]:
            if (block["state"] == "active_pending_free" and address not in allocated_in_trace
                    and address not in freed_first):
                twin.record_stream(address, _PENDING_STREAM)
                twin.free(address)
            address += block["size"]
    twin.record_history = True


def _seeded_length(address, length, limit, freed_position, alloc_positions, max_split) -> int:
    """A large-pool block live before the trace may have absorbed a remainder of <= 1 MiB: it covers a
    gap of <= 1 MiB outright (no free block is that small there) and the whole gap when oversize (never
    split); before a larger gap, the first trace alloc placed within 1 MiB after the estimate, before the
    block is freed, lands at the start of the free space behind it, which is where the block ends."""
    gap = limit - (address + length)
    if 0 < gap <= K_SMALL_SIZE or length >= max_split:
        return limit - address
    if gap > 0:
        for position, placed in alloc_positions:
            if position > freed_position:
                break
            if address + length <= placed <= address + length + K_SMALL_SIZE:
                return placed - address
    return length


# ---- comparison ---------------------------------------------------------------------------------

@dataclass(slots=True, frozen=True)
class SegmentLayout:
    address: int
    total_size: int
    stream: int
    segment_type: str
    blocks: tuple[tuple[int, int, str], ...]  # (offset within the segment, size, state)

    def shape(self) -> tuple:
        """Everything but the address: what must match between real and twin."""
        return self.total_size, self.stream, self.segment_type, self.blocks


@dataclass(slots=True, frozen=True)
class ReplayComparison:
    real_segment_allocs: tuple[tuple[str, int], ...]  # (segment_alloc | segment_map, size) in trace order
    twin_segment_allocs: tuple[tuple[str, int], ...]
    real_layout: tuple[SegmentLayout, ...]
    twin_layout: tuple[SegmentLayout, ...]
    notes: tuple[str, ...]

    @property
    def matches(self) -> bool:
        return (self.real_segment_allocs == self.twin_segment_allocs
                and [s.shape() for s in self.real_layout] == [s.shape() for s in self.twin_layout])

    def first_difference(self) -> str | None:
        real, twin = self.real_segment_allocs, self.twin_segment_allocs
        for k, (a, b) in enumerate(zip(real, twin)):
            if a != b:
                return f"segment allocation #{k}: real {a}, twin {b}"
        if len(real) != len(twin):
            return f"segment allocations: real made {len(real)}, twin {len(twin)}"
        for a, b in zip(self.real_layout, self.twin_layout):
            if a.shape() != b.shape():
                return f"segment at {a.address:#x}: real {a.shape()}, twin at {b.address:#x} {b.shape()}"
        if len(self.real_layout) != len(self.twin_layout):
            return f"segments at the end: real {len(self.real_layout)}, twin {len(self.twin_layout)}"
        return None

    def summary(self, max_notes: int = 5) -> str:
        """A few lines for a person: match or the first difference, the counts, the first notes."""
        blocks = sum(len(s.blocks) for s in self.real_layout)
        head = (f"{'match' if self.matches else 'MISMATCH'}: {len(self.real_layout)} segments, {blocks} blocks, "
                f"{len(self.real_segment_allocs)} real / {len(self.twin_segment_allocs)} twin segment allocations, "
                f"{len(self.notes)} notes")
        lines = [head]
        if not self.matches:
            lines.append(f"first difference: {self.first_difference()}")
        lines += [f"note: {n}" for n in self.notes[:max_notes]]
        return "\n".join(lines)


def layout(segments: list[dict]) -> tuple[SegmentLayout, ...]:
    out = []
    for s in sorted(segments, key=lambda s: s["address"]):
        if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0):
            continue
        offset, blocks = 0, []
        for b in s["blocks"]:
            blocks.append((offset, b["size"], b["state"]))
            offset += b["size"]
        out.append(SegmentLayout(s["address"], s["total_size"], s["stream"], s["segment_type"], tuple(blocks)))
    return tuple(out)


def compare_replay(snapshot: dict, twin: CachingAllocator, *, device: int | None = None) -> ReplayComparison:
    """Real vs twin: segment_alloc/segment_map sizes in order, and the final per-segment block layouts."""
    device = twin.device if device is None else device
    real_trace = [e for e in snapshot["device_traces"][device] if tuple(e.get("pool_id", (0, 0))) == (0, 0)]
    twin_snapshot = twin.snapshot()
    twin_trace = twin_snapshot["device_traces"][twin.device]
    grows = lambda trace: tuple((e["action"], e["size"]) for e in trace if e["action"] in _GROW)
    notes = tuple(getattr(twin.device_memory, "notes", ()))
    return ReplayComparison(grows(real_trace), grows(twin_trace),
                            layout([s for s in snapshot["segments"] if s["device"] == device]),
                            layout(twin_snapshot["segments"]), notes)
