"""A twin of PyTorch's CUDA caching allocator (``c10/cuda/CUDACachingAllocator.cpp``), in pure Python.

Written from the C++ source, not copied: the whole file at pytorch/pytorch commit
``001074d25084fdb87a799823e395a50f5ec044d3`` (2024, about PyTorch 2.4/2.5; the newest whole copy the
reference index holds), checked against the first 100 kB of a 2.9/2.10-era copy (the
``DeviceCachingAllocator`` with ``allowed_memory_maximum`` optional, ``use_on_oom_pools``,
``AcceleratorAllocatorConfig``; quoted in rbarfinezhadfeli0/pytorch
``docs/c10/cuda/CUDACachingAllocator.cpp_docs.md`` at ``4025f0a05244cf55b567ba1ece63c53c8f481054``) and
the matching ``c10/core/AllocatorConfig.cpp``. From those the twin takes ``max_non_split_rounding_size``,
``release_available_cached_blocks`` skipping expandable blocks, ``per_process_memory_fraction`` and the
fraction-gated garbage collector. The snapshot and ``memory_stats`` shapes follow the installed
torch 2.13.0 (``torch/cuda/memory.py``, ``torch/cuda/_memory_viz.py``) and ``_memory_snapshot_pickled``.
No newer C++ text was available, so rules changed after those commits are not in the twin. Checked
against reality by replaying four public ``_dump_snapshot`` traces (torch 2.6 to 2.11) through it
(tests/unit/producers/sim/torch_allocator/test_caching_allocator_replay.py): every alloc lands at the recorded address.

Files: ``torch_allocator.config`` (settings, size rules), ``torch_allocator.blocks`` (blocks, pools,
stats, errors), ``torch_allocator.device`` (the driver: capacity, external memory, addresses),
``torch_allocator.replay`` (replaying a real snapshot's trace, comparing).

The rules, as the real allocator applies them (names are the C++ ones):

* ``round_size``: at least 512 bytes, a multiple of 512, or a ``roundup_power2_divisions`` step.
* ``get_pool``: rounded sizes <= 1 MiB use the small pool, larger ones the large pool; blocks never
  move between pools or streams.
* ``get_free_block``: best fit over free blocks ordered by (stream, size, address); a request smaller
  than ``max_split_size`` may not take an oversize block, and an oversize request may take a block at
  most ``max_non_split_rounding_size`` (20 MiB) larger.
* ``get_allocation_size``: a new segment is 2 MiB (small pool), 20 MiB (requests under 10 MiB) or the
  request rounded up to 2 MiB.
* ``should_split``: the small pool (and every pool under expandable segments) splits when >= 512 bytes
  remain, the large pool when more than 1 MiB remains and the request is not oversize.
* ``free_block`` / ``try_merge_blocks``: a freed block merges with free neighbours of its segment.
* On a failed cudaMalloc: ``release_available_cached_blocks`` (oversize blocks, only when
  ``max_split_size`` is set) and retry, then ``release_cached_blocks`` (every unsplit free segment)
  and retry (counted in ``num_alloc_retries``), then ``OutOfMemoryError``.
* ``garbage_collect_cached_blocks`` before a cudaMalloc when a memory fraction and a threshold are set.
* Expandable segments: one reservation of address space per (pool, stream), mapped in 2 MiB (small)
  or 20 MiB (large) pages at the lowest free address; ``empty_cache`` unmaps whole free pages.

Simplifications (what the twin does not do):

* No CUDA graphs or private memory pools (``MemPool``, ``use_on_oom_pools``, checkpointing); every
  segment belongs to pool id (0, 0).
* No free-memory callbacks, no IPC, no peer access, no ``release_lock_on_cudamalloc`` (single thread).
* Cross-stream use: ``record_stream`` + ``free`` leave a block pending; its "CUDA event" completes when
  the caller says the stream caught up (``synchronize``), at the next ``malloc`` (process_events) or in
  ``empty_cache``/the OOM path (synchronize_and_free_events). GPU progress is the caller's to model.
* The driver never fragments physical memory: cudaMalloc succeeds iff the bytes are free
  (``torch_allocator.device.DeviceMemory``); addresses are never reused. Snapshots carry no stack
  frames (``frames`` is always empty) and the OOM message has no NVML per-process line.
* ``throw_on_cudamalloc_oom`` / ``num_oom_rejections`` and the ``large_segment_size`` setting of the
  newest releases are not modelled (no C++ text for them was available).
* ``malloc(0)`` raises ValueError (PyTorch hands out a null pointer without asking the allocator);
  ``empty_cache`` takes no pool id; stats have no ``reserved_bytes_by_private_pools``.

Invariants the tests check: the blocks of a segment tile it exactly; no two adjacent blocks of a
segment are both free (they would have merged); every stat equals the sum over the segments; allocated
<= reserved <= capacity. Hot paths are a bisect on a sorted list of (stream, size, address) keys and
dict lookups; nothing scans all blocks except ``snapshot``, ``empty_cache`` and the garbage collector.
"""

from __future__ import annotations

import copy
import pickle
from bisect import bisect_left
from collections import deque
from itertools import islice

from kvguard.producers.sim.torch_allocator.blocks import (
    NO_POOL,
    POOL_NAMES,
    STAT_ARRAYS,
    Block,
    BlockPool,
    OutOfMemoryError,
    Segment,
    UnknownAddress,
    allocatable,
    bump,
    bump_single,
    bump_together,
    expandable_size,
    new_stat,
    put_stat,
    trace_entry,
)
from kvguard.producers.sim.torch_allocator.config import (
    K_LARGE_BUFFER,
    K_MIN_BLOCK_SIZE,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
    SIZE_MAX,
    AllocatorConfig,
    format_size,
    get_allocation_size,
)
from kvguard.producers.sim.torch_allocator.device import DeviceMemory, Driver

__all__ = ["AllocatorConfig", "CachingAllocator", "DeviceMemory", "OutOfMemoryError", "UnknownAddress",
           "format_size", "get_allocation_size"]


class CachingAllocator:
    """One device's caching allocator (DeviceCachingAllocator) over a ``DeviceMemory``.

    Give either ``capacity_bytes`` (what cudaMalloc can ever get; ``total_bytes`` defaults to it) or a
    ``driver``. Memory held outside the allocator is taken with ``allocator.device_memory.reserve_external``.
    Time is never read: pass ``now_ns`` to malloc/free/empty_cache (or set ``now_ns``) to stamp the trace.
    """

    def __init__(self, capacity_bytes: int | None = None, *, total_bytes: int | None = None,
                 config: AllocatorConfig | None = None, device: int = 0, driver: Driver | None = None,
                 record_history: bool = True, trace_max_entries: int | None = None):
        if (capacity_bytes is None) == (driver is None):
            raise ValueError("give exactly one of capacity_bytes or driver")
        self.device_memory: Driver = driver if driver is not None else DeviceMemory(capacity_bytes,
                                                                                    total_bytes=total_bytes)
        self.config = config if config is not None else AllocatorConfig()
        self.device = device
        self.record_history = record_history
        self.now_ns = 0
        total = self.device_memory.mem_get_info()[1]
        fraction = self.config.per_process_memory_fraction
        self.allowed_memory_maximum: int | None = int(fraction * total) if fraction < 1.0 else None
        self._small = BlockPool(is_small=True)
        self._large = BlockPool(is_small=False)
        self._active: dict[int, Block] = {}  # allocated or pending a cross-stream free, by address
        self._segments: dict[int, Segment] = {}  # cudaMalloc'd segments by address
        self._expandable: list[Segment] = []
        self._events: dict[int, deque] = {}  # stream -> [block, done] "CUDA events" in record order
        self.total_allocated_memory = 0  # bytes obtained from the driver (cudaMalloc + mapped pages)
        self._stats = {name: new_stat() for name in STAT_ARRAYS}
        stats = self._stats
        self._on_alloc = tuple(stats[n] for n in ("allocation", "allocated_bytes", "active", "active_bytes",
                                                  "requested_bytes"))
        self._on_free = (stats["allocation"], stats["allocated_bytes"])
        self._on_free_block = (stats["active"], stats["active_bytes"], stats["requested_bytes"])
        self._oversize_allocations = new_stat()  # a single stat: only the first four entries are used
        self._oversize_segments = new_stat()
        self._counters = dict.fromkeys(("num_alloc_retries", "num_ooms", "num_sync_all_streams",
                                        "num_device_alloc", "num_device_free"), 0)
        self._trace: deque[tuple] = deque(maxlen=trace_max_entries)  # a ring buffer, like the real one
        self._trace_count = 0
        self._trace_taken = 0

    # ---- the client calls -------------------------------------------------------------------
    def malloc(self, size_bytes: int, stream: int = 0, *, now_ns: int | None = None) -> int:
        """Allocate ``size_bytes`` for ``stream``; returns the block's address or raises OutOfMemoryError."""
        if now_ns is not None:
            self.now_ns = now_ns
        if size_bytes <= 0:
            raise ValueError(f"malloc: size_bytes must be positive, got {size_bytes}")
        if self._events:
            self._process_events()
        size = self.config.round_size(size_bytes)
        pool = self._small if size <= K_SMALL_SIZE else self._large
        alloc_size = get_allocation_size(size)
        block = self._get_free_block(pool, size, stream)
        if block is None:
            if self._gc_armed():
                self._garbage_collect_cached_blocks()
            block = (self._alloc_block(pool, size, alloc_size, stream, False)
                     or (self._release_available_cached_blocks(pool, size, stream)
                         and self._alloc_block(pool, size, alloc_size, stream, False))
                     or (self._release_cached_blocks() and self._alloc_block(pool, size, alloc_size, stream, True)))
            if not block:
                self._raise_oom(size_bytes, size, alloc_size, stream)
        return self._alloc_found_block(block, size, size_bytes, self._should_split(block, size)).address

    def free(self, address: int, *, now_ns: int | None = None) -> None:
        """Return an allocation to the cache (pending if it was used on other streams)."""
        if now_ns is not None:
            self.now_ns = now_ns
        block = self._active.get(address)
        if block is None or not block.allocated:
            raise UnknownAddress(address, "free")
        block.allocated = False
        bump_together(self._on_free, block.pool.stat_index, (-1, -block.size))
        self._record("free_requested", block.address, block.requested_size, block.stream)
        if block.size >= self.config.max_split_size_bytes:
            bump_single(self._oversize_allocations, -1)
        if block.stream_uses:
            self._insert_events(block)
        else:
            self._free_block(block)

    def record_stream(self, address: int, stream: int) -> None:
        """The allocation is also used on ``stream``: a later free waits for that stream (recordStream)."""
        block = self._active.get(address)
        if block is None or not block.allocated:
            raise UnknownAddress(address, "record_stream")
        if stream != block.stream:
            if block.stream_uses is None:
                block.stream_uses = set()
            block.stream_uses.add(stream)

    def synchronize(self, stream: int | None = None) -> None:
        """GPU work queued so far on ``stream`` (all streams if None) has finished: its pending frees
        complete at the next malloc, as process_events finds their events done."""
        for s, events in self._events.items():
            if stream is None or s == stream:
                for event in events:
                    event[1] = True

    def empty_cache(self, *, now_ns: int | None = None) -> None:
        """Release every cached segment that holds no allocation (and unmap free expandable pages)."""
        if now_ns is not None:
            self.now_ns = now_ns
        self._release_cached_blocks()

    # ---- queries ------------------------------------------------------------------------------
    @property
    def allocated_bytes(self) -> int:
        return self._stats["allocated_bytes"][0]

    @property
    def reserved_bytes(self) -> int:
        return self._stats["reserved_bytes"][0]

    def segments(self) -> dict[int, tuple[int, bool, int]]:
        """Reserved segments: address -> (size, small pool?, stream)."""
        return {a: (seg.size, seg.pool.is_small, seg.stream) for a, seg in self._segments.items()}

    def active_blocks(self) -> dict[int, tuple[int, int, int]]:
        """Allocated (or pending-free) blocks: address -> (size, requested size, segment address)."""
        return {a: (b.size, b.requested_size, b.segment.address) for a, b in self._active.items()}

    def largest_free_cached_block(self) -> int:
        """Size of the largest free block in the cache (cacheInfo without the driver's free memory)."""
        best = 0
        for pool in (self._small, self._large):
            keys, i = pool.keys, len(pool.keys)
            while i:
                stream, size, _ = keys[i - 1]
                best = max(best, size)
                i = bisect_left(keys, (stream, -1, -1))  # jump to the largest block of the previous stream
        return best

    def memory_stats(self) -> dict[str, int]:
        """``torch.cuda.memory_stats()``: the same flat, sorted key names."""
        out: dict[str, int] = {}
        for name, stat in self._stats.items():
            for k, pool_name in enumerate(POOL_NAMES):
                put_stat(out, f"{name}.{pool_name}", stat[4 * k:4 * k + 4])
        put_stat(out, "oversize_allocations", self._oversize_allocations)
        put_stat(out, "oversize_segments", self._oversize_segments)
        out.update(self._counters)
        max_split = self.config.max_split_size_bytes
        out["max_split_size"] = max_split if max_split < 1 << 63 else max_split - (1 << 64)  # int64 cast
        return dict(sorted(out.items()))

    def reset_peak_stats(self) -> None:
        for stat in [*self._stats.values(), self._oversize_allocations, self._oversize_segments]:
            for j in (0, 4, 8):
                stat[j + 1] = stat[j]

    def clone(self) -> CachingAllocator:
        """An independent copy of this allocator and its driver, for what-if runs (the trace is shared
        up to now; entries are never mutated). Linked blocks are copied iteratively, not recursively."""
        twin = object.__new__(CachingAllocator)
        twin.__dict__.update(self.__dict__)
        twin.device_memory = copy.deepcopy(self.device_memory)
        pools = {id(self._small): BlockPool(True), id(self._large): BlockPool(False)}
        twin._small, twin._large = pools[id(self._small)], pools[id(self._large)]
        segments = {id(s): copy.copy(s) for s in [*self._segments.values(), *self._expandable]}
        for s in segments.values():
            s.pool = pools[id(s.pool)]
        blocks: dict[int, Block] = {}
        for old in self._every_block():
            new = copy.copy(old)
            new.pool, new.segment = pools[id(old.pool)], segments[id(old.segment)]
            if old.stream_uses:
                new.stream_uses = set(old.stream_uses)
            blocks[id(old)] = new
        for new in blocks.values():
            new.prev = blocks[id(new.prev)] if new.prev is not None else None
            new.next = blocks[id(new.next)] if new.next is not None else None
        for old_pool in (self._small, self._large):
            new_pool = pools[id(old_pool)]
            new_pool.keys, new_pool.unmapped_keys = list(old_pool.keys), list(old_pool.unmapped_keys)
            new_pool.get_free_blocks_call_count = old_pool.get_free_blocks_call_count
            new_pool.by_address = {a: blocks[id(b)] for a, b in old_pool.by_address.items()}
            new_pool.unmapped = {a: blocks[id(b)] for a, b in old_pool.unmapped.items()}
        twin._active = {a: blocks[id(b)] for a, b in self._active.items()}
        twin._segments = {a: segments[id(s)] for a, s in self._segments.items()}
        twin._expandable = [segments[id(s)] for s in self._expandable]
        twin._events = {s: deque([blocks[id(b)], done] for b, done in q) for s, q in self._events.items()}
        twin._stats = stats = {name: list(stat) for name, stat in self._stats.items()}
        twin._on_alloc = tuple(stats[n] for n in ("allocation", "allocated_bytes", "active", "active_bytes",
                                                  "requested_bytes"))
        twin._on_free = (stats["allocation"], stats["allocated_bytes"])
        twin._on_free_block = (stats["active"], stats["active_bytes"], stats["requested_bytes"])
        twin._oversize_allocations = list(self._oversize_allocations)
        twin._oversize_segments = list(self._oversize_segments)
        twin._counters = dict(self._counters)
        twin._trace = deque(self._trace, maxlen=self._trace.maxlen)
        return twin

    def take_trace(self) -> list[dict]:
        """Trace entries recorded since the last call (what the ring buffer still holds of them)."""
        fresh = min(self._trace_count - self._trace_taken, len(self._trace))
        self._trace_taken = self._trace_count
        entries = [trace_entry(e) for e in islice(reversed(self._trace), fresh)]
        entries.reverse()
        return entries

    def snapshot(self) -> dict:
        """``torch.cuda.memory._snapshot()``: segments sorted by address and this device's trace."""
        traces: list[list[dict]] = [[] for _ in range(self.device + 1)]
        traces[self.device] = [trace_entry(e) for e in self._trace]
        segments, total_active = [], 0
        for head in self._all_blocks():
            if head.prev is not None and head.prev.mapped:
                continue
            segment = self._segment_info(head)
            total_active += segment["active_size"]
            segments.append(segment)
        segments.sort(key=lambda s: s["address"])
        self._record("snapshot", 0, total_active, 0)
        return {"segments": segments, "device_traces": traces, "allocator_settings": self._settings(),
                "external_annotations": []}

    def dump_snapshot(self, path) -> None:
        """Write ``snapshot()`` as a pickle, like ``torch.cuda.memory._dump_snapshot``."""
        with open(path, "wb") as f:
            pickle.dump(self.snapshot(), f)

    # ---- malloc internals ---------------------------------------------------------------------
    def _gc_armed(self) -> bool:
        return self.allowed_memory_maximum is not None and self.config.garbage_collection_threshold > 0.0

    def _get_free_block(self, pool: BlockPool, size: int, stream: int) -> Block | None:
        if self._gc_armed():
            pool.get_free_blocks_call_count += 1
        keys = pool.keys
        i = bisect_left(keys, (stream, size, -1))
        if i == len(keys) or keys[i][0] != stream:
            return None
        block = pool.by_address[keys[i][2]]
        if block.segment.expandable:
            block = self._expandable_best_fit(pool, i, stream)
            if block is None:
                return None
        config = self.config
        max_split = config.max_split_size_bytes
        if size < max_split and block.size >= max_split:
            return None  # a request that may split may not take an oversize block
        if size >= max_split and block.size >= size + config.max_non_split_rounding_bytes:
            return None
        pool.erase(block)
        return block

    def _expandable_best_fit(self, pool: BlockPool, i: int, stream: int) -> Block | None:
        """Best fit when the first candidate lies in an expandable segment (get_free_block's loop)."""
        keys, by_address = pool.keys, pool.by_address
        block = by_address[keys[i][2]]
        if not self.config.expandable_segments:  # expandable segments switched off: skip their blocks
            while i < len(keys) and keys[i][0] == stream and by_address[keys[i][2]].segment.expandable:
                i += 1
            return by_address[keys[i][2]] if i < len(keys) and keys[i][0] == stream else None
        # a block followed by unmapped space counts as the size it can grow to
        j = i + 1
        while block.segment.expandable and j < len(keys) and keys[j][0] == stream:
            candidate = by_address[keys[j][2]]
            if expandable_size(candidate) >= expandable_size(block):
                break
            block, j = candidate, j + 1
        return block

    def _should_split(self, block: Block, size: int) -> bool:
        remaining = block.size - size
        if block.pool.is_small or self.config.expandable_segments:
            return remaining >= K_MIN_BLOCK_SIZE
        return size < self.config.max_split_size_bytes and remaining > K_SMALL_SIZE

    def _alloc_found_block(self, block: Block, size: int, orig_size: int, split: bool) -> Block:
        pool, stats = block.pool, self._stats
        pi = pool.stat_index
        expandable = block.segment.expandable
        already_split = block.prev is not None or block.next is not None
        if split:
            remaining = block
            block = Block(remaining.address, size, remaining.stream, pool, remaining.segment)
            block.prev = remaining.prev
            if block.prev is not None:
                block.prev.next = block
            block.next = remaining
            remaining.prev = block
            remaining.address += size
            remaining.size -= size
            pool.insert(remaining)
            if not expandable:
                if already_split:
                    bump(stats["inactive_split_bytes"], pi, -size)
                else:
                    bump(stats["inactive_split_bytes"], pi, remaining.size)
                    bump(stats["inactive_split"], pi, 1)
        elif already_split and not expandable:
            bump(stats["inactive_split_bytes"], pi, -block.size)
            bump(stats["inactive_split"], pi, -1)
        block.allocated = True
        block.requested_size = orig_size
        self._record("alloc", block.address, orig_size, block.stream)
        self._active[block.address] = block
        bump_together(self._on_alloc, pi, (1, block.size, 1, block.size, orig_size))
        if block.size >= self.config.max_split_size_bytes:
            bump_single(self._oversize_allocations, 1)
        return block

    def _alloc_block(self, pool: BlockPool, size: int, alloc_size: int, stream: int, is_retry: bool) -> Block | None:
        if is_retry:
            self._counters["num_alloc_retries"] += 1
        allowed = self.allowed_memory_maximum
        if allowed is not None and self.total_allocated_memory + alloc_size > allowed:
            return None
        if self.config.expandable_segments:
            return self._try_allocate_expandable_block(pool, size, stream)
        address = self.device_memory.cuda_malloc(alloc_size)
        if address is None:
            return None
        self.total_allocated_memory += alloc_size
        segment = Segment(address, alloc_size, stream, pool, expandable=False)
        self._segments[address] = segment
        bump(self._stats["segment"], pool.stat_index, 1)
        bump(self._stats["reserved_bytes"], pool.stat_index, alloc_size)
        if alloc_size >= self.config.max_split_size_bytes:
            bump_single(self._oversize_segments, 1)
        self._counters["num_device_alloc"] += 1
        self._record("segment_alloc", address, alloc_size, stream)
        return Block(address, alloc_size, stream, pool, segment)

    def _raise_oom(self, orig_size: int, size: int, alloc_size: int, stream: int) -> None:
        device_free, device_total = self.device_memory.mem_get_info()
        self._record("oom", device_free, size, stream)
        self._counters["num_ooms"] += 1
        raise OutOfMemoryError(requested_bytes=orig_size, rounded_bytes=size, tried_to_allocate_bytes=alloc_size,
                               device=self.device, stream=stream, device_total_bytes=device_total,
                               device_free_bytes=device_free, allocated_bytes=self.allocated_bytes,
                               reserved_bytes=self.reserved_bytes, allowed_bytes=self.allowed_memory_maximum)

    # ---- free internals -------------------------------------------------------------------------
    def _free_block(self, block: Block) -> None:
        pool, stats = block.pool, self._stats
        self._record("free_completed", block.address, block.requested_size, block.stream)
        del self._active[block.address]
        original_size, requested_size = block.size, block.requested_size
        net_blocks = net_bytes = 0
        for candidate in (block.prev, block.next):
            subsumed = self._try_merge_blocks(block, candidate, pool)
            if subsumed:
                net_blocks -= 1
                net_bytes -= subsumed
        pool.insert(block)
        if block.prev is not None or block.next is not None:
            net_blocks += 1
            net_bytes += block.size
        pi = pool.stat_index
        if not block.segment.expandable:  # PyTorch keeps expandable segments out of inactive_split
            if net_blocks:
                bump(stats["inactive_split"], pi, net_blocks)
            if net_bytes:
                bump(stats["inactive_split_bytes"], pi, net_bytes)
        bump_together(self._on_free_block, pi, (-1, -original_size, -requested_size))

    @staticmethod
    def _try_merge_blocks(dst: Block, src: Block | None, pool: BlockPool) -> int:
        if (src is None or src.allocated or src.event_count or src.stream_uses
                or dst.mapped != src.mapped):
            return 0
        if src.mapped:
            pool.erase(src)
        else:
            pool.erase_unmapped(src)
        if dst.prev is src:
            dst.address = src.address
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    def _insert_events(self, block: Block) -> None:
        for stream in block.stream_uses:
            self._events.setdefault(stream, deque()).append([block, False])
            block.event_count += 1
        block.stream_uses = None

    def _process_events(self) -> None:
        for stream in list(self._events):
            events = self._events[stream]
            while events and events[0][1]:
                block = events.popleft()[0]
                block.event_count -= 1
                if block.event_count == 0:
                    self._free_block(block)
            if not events:
                del self._events[stream]

    def _synchronize_and_free_events(self) -> None:
        self._counters["num_sync_all_streams"] += 1
        events, self._events = self._events, {}
        for queue in events.values():
            for block, _ in queue:
                block.event_count -= 1
                if block.event_count == 0:
                    self._free_block(block)

    def _complete_event(self, address: int) -> bool:
        """Complete every outstanding event of the pending block at ``address`` now (for replays that
        follow a recorded free_completed); returns False if no such pending block exists."""
        block = self._active.get(address)
        if block is None or block.allocated or not block.event_count:
            return False
        for stream in list(self._events):
            queue = self._events[stream]
            kept = deque(e for e in queue if e[0] is not block)
            if kept:
                self._events[stream] = kept
            else:
                del self._events[stream]
        block.event_count = 0
        self._free_block(block)
        return True

    # ---- releasing cached memory --------------------------------------------------------------
    def _release_block(self, block: Block) -> None:
        """cudaFree a whole, free, non-expandable segment."""
        self._counters["num_device_free"] += 1
        self._record("segment_free", block.address, block.size, block.stream)
        self.device_memory.cuda_free(block.address, block.size)
        self.total_allocated_memory -= block.size
        pi = block.pool.stat_index
        bump(self._stats["segment"], pi, -1)
        bump(self._stats["reserved_bytes"], pi, -block.size)
        if block.size >= self.config.max_split_size_bytes:
            bump_single(self._oversize_segments, -1)
        block.pool.erase(block)
        del self._segments[block.address]

    def _release_available_cached_blocks(self, pool: BlockPool, size: int, stream: int) -> bool:
        """Free oversize cached segments (largest first) until ``size`` could fit; only with max_split_size."""
        max_split = self.config.max_split_size_bytes
        if max_split == SIZE_MAX:
            return False
        keys, by_address = pool.keys, pool.by_address
        key_size = max(size, max_split)
        i = bisect_left(keys, (stream, key_size, -1))
        if i < len(keys) and keys[i][0] == stream and not by_address[keys[i][2]].segment.expandable:
            self._release_block(by_address[keys[i][2]])
            return True
        if i == 0:
            return False
        released = 0
        i -= 1
        while released < key_size and keys[i][1] >= max_split and keys[i][0] == stream:
            block = by_address[keys[i][2]]
            is_first = i == 0
            if not is_first:
                i -= 1
            if not block.segment.expandable:
                self._release_block(block)  # removes keys[i + 1]; the index i stays valid
                released += block.size
            if is_first:
                break
        return released >= key_size

    def _release_cached_blocks(self) -> bool:
        self._synchronize_and_free_events()
        self._release_blocks(self._large)
        self._release_blocks(self._small)
        return True

    def _release_blocks(self, pool: BlockPool) -> None:
        to_unmap = []
        for key in list(pool.keys):
            block = pool.by_address[key[2]]
            if block.segment.expandable:
                to_unmap.append(block)
            elif block.prev is None and block.next is None:
                self._release_block(block)
        for block in to_unmap:
            self._unmap_block(block)
            if block.prev is None and block.next is None:
                self._release_expandable_segment(block)

    def _garbage_collect_cached_blocks(self) -> None:
        """Release the free unsplit large segments not reused for the longest, down to the threshold."""
        threshold = int(self.config.garbage_collection_threshold * self.allowed_memory_maximum)
        if self.total_allocated_memory <= threshold:
            return
        target = self.total_allocated_memory - threshold
        large = self._large
        ages = [large.get_free_blocks_call_count - b.gc_count_base
                for b in large.by_address.values() if not b.is_split()]
        total_age, freeable = sum(ages), len(ages)
        reclaimed, freed_one = 0, True
        while reclaimed < target and freed_one and freeable:
            age_threshold = total_age / freeable
            freed_one = False
            for key in list(large.keys):
                block = large.by_address[key[2]]
                age = large.get_free_blocks_call_count - block.gc_count_base
                if not block.is_split() and age >= age_threshold:
                    freed_one = True
                    reclaimed += block.size
                    total_age -= age
                    freeable -= 1
                    self._release_block(block)

    # ---- expandable segments --------------------------------------------------------------------
    def _find_expandable_block(self, pool: BlockPool, size: int, stream: int) -> Block:
        """The lowest-addressed run of free + unmapped space of ``size`` bytes on ``stream``, or a new segment."""
        keys = pool.unmapped_keys
        i = bisect_left(keys, (stream, -1))
        while i < len(keys) and keys[i][0] == stream:
            candidate = pool.unmapped[keys[i][1]]
            if allocatable(candidate.prev):
                candidate = candidate.prev
            room, b = 0, candidate
            while room < size and allocatable(b):
                room += b.size
                b = b.next
            if room >= size:
                return candidate
            i += 1
        page = K_SMALL_BUFFER if pool.is_small else K_LARGE_BUFFER
        total = self.device_memory.mem_get_info()[1]
        reservation = -(-(total + total // 8) // page) * page
        address = self.device_memory.reserve_address_space(reservation)
        segment = Segment(address, reservation, stream, pool, expandable=True, page_size=page)
        self._expandable.append(segment)
        block = Block(address, reservation, stream, pool, segment)
        block.mapped = False
        pool.insert_unmapped(block)
        return block

    def _try_allocate_expandable_block(self, pool: BlockPool, size: int, stream: int) -> Block | None:
        candidate = self._find_expandable_block(pool, size, stream)
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:  # free -> unmapped -> ...: map the next piece, which merges
            following = candidate.next
            if not self._map_block(following, min(size - candidate.size, following.size)):
                return None
            candidate = following
        pool.erase(candidate)
        return candidate

    def _map_block(self, block: Block, size: int) -> bool:
        segment, pool = block.segment, block.pool
        mapped = -(-size // segment.page_size) * segment.page_size
        if not self.device_memory.map_pages(block.address, mapped):
            return False
        pool.erase_unmapped(block)
        block.mapped = True
        address = block.address
        if mapped < block.size:
            rest = Block(address + mapped, block.size - mapped, block.stream, pool, segment)
            rest.mapped = False
            rest.splice(block, block.next)
            pool.insert_unmapped(rest)
            block.size = mapped
        self._try_merge_blocks(block, block.prev, pool)
        self._try_merge_blocks(block, block.next, pool)
        pool.insert(block)
        self.total_allocated_memory += mapped
        bump(self._stats["reserved_bytes"], pool.stat_index, mapped)
        self._counters["num_device_alloc"] += 1
        self._record("segment_map", address, mapped, block.stream)
        return True

    def _unmap_block(self, block: Block) -> None:
        segment, pool = block.segment, block.pool
        page, base = segment.page_size, segment.address
        begin = base + -(-(block.address - base) // page) * page
        end = base + (block.address + block.size - base) // page * page
        if begin >= end:
            return
        pool.erase(block)
        if begin > block.address:
            before = Block(block.address, begin - block.address, block.stream, pool, segment)
            before.splice(block.prev, block)
            pool.insert(before)
        if block.address + block.size > end:
            after = Block(end, block.address + block.size - end, block.stream, pool, segment)
            after.splice(block, block.next)
            pool.insert(after)
        block.address, block.size, block.mapped = begin, end - begin, False
        self._try_merge_blocks(block, block.prev, pool)
        self._try_merge_blocks(block, block.next, pool)
        pool.insert_unmapped(block)
        self.device_memory.unmap_pages(begin, end - begin)
        self.total_allocated_memory -= end - begin
        bump(self._stats["reserved_bytes"], pool.stat_index, begin - end)
        self._counters["num_device_free"] += 1
        self._record("segment_unmap", begin, end - begin, block.stream)

    def _release_expandable_segment(self, block: Block) -> None:
        block.pool.erase_unmapped(block)
        self._expandable.remove(block.segment)
        self.device_memory.release_address_space(block.segment.address, block.segment.size)

    # ---- seeding (replays of traces that begin after segments existed) ---------------------------
    def _seed_segment(self, address: int, size: int, stream: int, is_small: bool,
                      allocations: list[tuple[int, int, int]]) -> None:
        """Install a cudaMalloc'd segment that existed before a trace began: ``allocations`` are the
        (address, size, requested_size) of its live blocks; the gaps between them become free blocks.
        No trace entry is recorded (it happened before the trace) and the driver is not asked."""
        pool = self._small if is_small else self._large
        pi, stats = pool.stat_index, self._stats
        segment = Segment(address, size, stream, pool, expandable=False)
        self._segments[address] = segment
        self.total_allocated_memory += size
        bump(stats["segment"], pi, 1)
        bump(stats["reserved_bytes"], pi, size)
        if size >= self.config.max_split_size_bytes:
            bump_single(self._oversize_segments, 1)
        pieces, cursor = [], address
        for start, length, requested in sorted(allocations):
            if start < cursor or start + length > address + size:
                raise ValueError(f"seed: allocation {start:#x}+{length} overlaps another or leaves the segment "
                                 f"{address:#x}+{size}")
            if start > cursor:
                pieces.append((cursor, start - cursor, None))
            pieces.append((start, length, requested))
            cursor = start + length
        if cursor < address + size:
            pieces.append((cursor, address + size - cursor, None))
        previous = None
        for start, length, requested in pieces:
            block = Block(start, length, stream, pool, segment)
            block.splice(previous, None)
            previous = block
            if requested is None:
                continue
            block.allocated, block.requested_size = True, requested
            self._active[start] = block
            for name, amount in (("allocation", 1), ("allocated_bytes", length), ("active", 1),
                                 ("active_bytes", length), ("requested_bytes", requested)):
                bump(stats[name], pi, amount)
            if length >= self.config.max_split_size_bytes:
                bump_single(self._oversize_allocations, 1)
        block = previous
        while block is not None:
            if not block.allocated:
                pool.insert(block)
                if len(pieces) > 1:
                    bump(stats["inactive_split"], pi, 1)
                    bump(stats["inactive_split_bytes"], pi, block.size)
            block = block.prev

    # ---- trace and snapshot ---------------------------------------------------------------------
    def _record(self, action: str, address: int, size: int, stream: int) -> None:
        """Append a trace entry as a tuple; it becomes a torch-shaped dict only when read (trace_entry)."""
        if self.record_history:
            self._trace.append((action, address, size, stream, self.now_ns // 1000))
            self._trace_count += 1

    def _all_blocks(self):
        """Every mapped block: the free ones of both pools and the allocated or pending ones."""
        yield from self._small.by_address.values()
        yield from self._large.by_address.values()
        yield from self._active.values()

    def _every_block(self):
        yield from self._all_blocks()
        yield from self._small.unmapped.values()
        yield from self._large.unmapped.values()

    def _segment_info(self, head: Block) -> dict:
        blocks, total = [], 0
        allocated = active = requested = 0
        block = head
        while block is not None and block.mapped:
            is_active = block.allocated or block.event_count > 0 or bool(block.stream_uses)
            state = "active_allocated" if block.allocated else "active_pending_free" if is_active else "inactive"
            blocks.append({"address": block.address, "size": block.size, "requested_size": block.requested_size,
                           "state": state, "frames": []})
            total += block.size
            if block.allocated:
                allocated += block.size
            if is_active:
                active += block.size
                requested += block.requested_size
            block = block.next
        return {"device": self.device, "address": head.address, "total_size": total, "allocated_size": allocated,
                "active_size": active, "requested_size": requested, "stream": head.stream,
                "segment_type": "small" if head.pool.is_small else "large", "segment_pool_id": NO_POOL,
                "is_expandable": head.segment.expandable, "frames": [], "blocks": blocks}

    def _settings(self) -> dict:
        """``allocator_settings`` with the keys torch 2.11 writes (the pinned-memory ones at their defaults)."""
        config = self.config
        return {"PYTORCH_CUDA_ALLOC_CONF": config.to_string(),
                "max_split_size": self.memory_stats()["max_split_size"],
                "garbage_collection_threshold": config.garbage_collection_threshold,
                "expandable_segments": config.expandable_segments,
                "pinned_num_register_threads": 1,
                "release_lock_on_cudamalloc": False,
                "pinned_use_cuda_host_register": False,
                "graph_capture_record_stream_reuse": False,
                "roundup_power2_divisions": {str(1 << k): d for k, d in enumerate(config.roundup_power2_divisions)}}


def __getattr__(name: str):
    """``replay_device_trace`` and ``compare_replay`` live in caching_allocator_replay (imported on use)."""
    if name in ("replay_device_trace", "compare_replay"):
        # the replay module imports this one: imported on use to avoid the cycle
        from kvguard.producers.sim.torch_allocator import replay as caching_allocator_replay
        return getattr(caching_allocator_replay, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
