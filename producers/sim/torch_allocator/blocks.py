"""The data model of the caching-allocator twin: blocks, segments, pools, stats and errors.

A ``Block`` is a piece of a segment; the blocks of a segment form a doubly linked list in address
order (``prev``/``next``), so a free finds its neighbours in O(1) and merging is pointer surgery.
A ``BlockPool`` (small or large, as in PyTorch) orders its free blocks by (stream, size, address)
for best fit; see ``caching_allocator.py`` for the rules that use them.
"""

from __future__ import annotations

from bisect import bisect_left, insort

from kvguard.producers.sim.torch_allocator.config import format_size

STAT_ARRAYS = ("allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
               "active_bytes", "inactive_split_bytes", "requested_bytes")
POOL_NAMES = ("all", "small_pool", "large_pool")  # StatType: AGGREGATE, SMALL_POOL, LARGE_POOL
_SMALL, _LARGE = 1, 2
NO_POOL = (0, 0)


class OutOfMemoryError(MemoryError):
    """The allocator could not get memory even after releasing its cache; carries PyTorch's OOM fields.

    ``cause`` is "fragmentation" when the memory reserved but unallocated is at least the rounded
    request (it exists, only not in one piece or in the wrong pool/stream), else "peak".
    """

    def __init__(self, *, requested_bytes: int, rounded_bytes: int, tried_to_allocate_bytes: int, device: int,
                 stream: int, device_total_bytes: int, device_free_bytes: int, allocated_bytes: int,
                 reserved_bytes: int, allowed_bytes: int | None):
        self.requested_bytes = requested_bytes
        self.rounded_bytes = rounded_bytes
        self.tried_to_allocate_bytes = tried_to_allocate_bytes
        self.device = device
        self.stream = stream
        self.device_total_bytes = device_total_bytes
        self.device_free_bytes = device_free_bytes
        self.allocated_bytes = allocated_bytes
        self.reserved_bytes = reserved_bytes
        self.reserved_unallocated_bytes = reserved_bytes - allocated_bytes
        self.allowed_bytes = allowed_bytes
        self.cause = "fragmentation" if self.reserved_unallocated_bytes >= rounded_bytes else "peak"
        allowed = f"{format_size(allowed_bytes)} allowed; " if allowed_bytes is not None else ""
        super().__init__(
            f"CUDA out of memory. Tried to allocate {format_size(tried_to_allocate_bytes)}. GPU {device} has a "
            f"total capacity of {format_size(device_total_bytes)} of which {format_size(device_free_bytes)} is "
            f"free. {allowed}Of the allocated memory {format_size(allocated_bytes)} is allocated by PyTorch, and "
            f"{format_size(self.reserved_unallocated_bytes)} is reserved by PyTorch but unallocated. If reserved "
            f"but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to "
            f"avoid fragmentation.  See documentation for Memory Management  "
            f"(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")


class UnknownAddress(KeyError):
    """free/record_stream got an address that is not a live allocation of this allocator."""

    def __init__(self, address: int, action: str):
        self.address = address
        super().__init__(f"{action}({address:#x}): not a live allocation of this allocator (never returned by "
                         f"malloc, or already freed); pass the int that malloc returned")


def new_stat() -> list[int]:
    """[current, peak, allocated, freed] for all, small_pool, large_pool: one flat list, so that an
    update is one call touching two slices of it (this is the hottest code in the twin)."""
    return [0] * 12


def bump_together(stats: tuple[list[int], ...], pool_index: int, amounts: tuple[int, ...]) -> None:
    """``bump`` for several stats that move together (an alloc or a free moves five), in one call: the
    call overhead, not the arithmetic, is what a malloc spends most of its time on."""
    j = pool_index * 4
    for stat, amount in zip(stats, amounts):
        if amount >= 0:
            current = stat[0] + amount
            stat[0] = current
            stat[2] += amount
            if current > stat[1]:  # noqa: PLR1730 - a branch is cheaper than max() here
                stat[1] = current
            current = stat[j] + amount
            stat[j] = current
            stat[j + 2] += amount
            if current > stat[j + 1]:  # noqa: PLR1730
                stat[j + 1] = current
        else:
            stat[0] += amount
            stat[3] -= amount
            stat[j] += amount
            stat[j + 3] -= amount


def bump_single(stat: list[int], amount: int) -> None:
    """A stat without pool breakdown (oversize_allocations, oversize_segments): entries 0..3 only."""
    if amount >= 0:
        stat[0] += amount
        stat[2] += amount
        stat[1] = max(stat[1], stat[0])
    else:
        stat[0] += amount
        stat[3] -= amount


def bump(stat: list[int], pool_index: int, amount: int) -> None:
    j = pool_index * 4
    if amount >= 0:
        current = stat[0] + amount
        stat[0] = current
        stat[2] += amount
        if current > stat[1]:  # noqa: PLR1730 - a branch is cheaper than max() here
            stat[1] = current
        current = stat[j] + amount
        stat[j] = current
        stat[j + 2] += amount
        if current > stat[j + 1]:  # noqa: PLR1730
            stat[j + 1] = current
    else:
        stat[0] += amount
        stat[3] -= amount
        stat[j] += amount
        stat[j + 3] -= amount


class Segment:
    """A cudaMalloc'd range (``expandable`` False) or an expandable segment's address-space reservation."""

    __slots__ = ("address", "expandable", "page_size", "pool", "size", "stream")

    def __init__(self, address: int, size: int, stream: int, pool: BlockPool, expandable: bool, page_size: int = 0):
        self.address = address
        self.size = size
        self.stream = stream
        self.pool = pool
        self.expandable = expandable
        self.page_size = page_size


class Block:
    """A piece of a segment: allocated, pending a cross-stream free, free (cached), or unmapped."""

    __slots__ = (
        "address",
        "allocated",
        "event_count",
        "gc_count_base",
        "mapped",
        "next",
        "pool",
        "prev",
        "requested_size",
        "segment",
        "size",
        "stream",
        "stream_uses",
    )

    def __init__(self, address: int, size: int, stream: int, pool: BlockPool, segment: Segment):
        self.address = address
        self.size = size
        self.requested_size = 0
        self.stream = stream
        self.pool = pool
        self.segment = segment
        self.allocated = False
        self.mapped = True
        self.prev: Block | None = None
        self.next: Block | None = None
        self.event_count = 0
        self.stream_uses: set[int] | None = None
        self.gc_count_base = 0

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def splice(self, before: Block | None, after: Block | None) -> None:
        if before is not None:
            before.next = self
        self.prev = before
        if after is not None:
            after.prev = self
        self.next = after


class BlockPool:
    """Free mapped blocks as a sorted list of (stream, size, address) keys plus address -> Block; the
    unmapped blocks of expandable segments as sorted (stream, address) keys. A list insert or delete is a
    memmove of pointers, cheaper than a tree at the block counts a GPU sees."""

    __slots__ = (
        "by_address",
        "get_free_blocks_call_count",
        "is_small",
        "keys",
        "stat_index",
        "unmapped",
        "unmapped_keys",
    )

    def __init__(self, is_small: bool):
        self.is_small = is_small
        self.stat_index = _SMALL if is_small else _LARGE
        self.keys: list[tuple[int, int, int]] = []
        self.by_address: dict[int, Block] = {}
        self.unmapped_keys: list[tuple[int, int]] = []
        self.unmapped: dict[int, Block] = {}
        self.get_free_blocks_call_count = 0

    def insert(self, block: Block) -> None:
        block.gc_count_base = self.get_free_blocks_call_count
        insort(self.keys, (block.stream, block.size, block.address))
        self.by_address[block.address] = block

    def erase(self, block: Block) -> None:
        keys = self.keys
        del keys[bisect_left(keys, (block.stream, block.size, block.address))]
        del self.by_address[block.address]

    def insert_unmapped(self, block: Block) -> None:
        insort(self.unmapped_keys, (block.stream, block.address))
        self.unmapped[block.address] = block

    def erase_unmapped(self, block: Block) -> None:
        del self.unmapped_keys[bisect_left(self.unmapped_keys, (block.stream, block.address))]
        del self.unmapped[block.address]


def put_stat(out: dict, prefix: str, stat: list[int]) -> None:
    out[f"{prefix}.current"], out[f"{prefix}.peak"], out[f"{prefix}.allocated"], out[f"{prefix}.freed"] = stat[:4]


def trace_entry(record: tuple) -> dict:
    """A trace record as the dict torch.cuda.memory._snapshot() holds (an oom carries device_free, no addr)."""
    action, address, size, stream, time_us = record
    entry = {"action": action, "addr": address, "size": size, "stream": stream, "time_us": time_us,
             "compile_context": "N/A", "user_metadata": "", "frames": []}
    if action == "oom":
        entry["device_free"] = entry.pop("addr")
    return entry


def allocatable(block: Block | None) -> bool:
    return block is not None and not block.allocated and not block.event_count and not block.stream_uses


def expandable_size(block: Block) -> int:
    following = block.next
    return block.size + (following.size if following is not None and not following.mapped else 0)
