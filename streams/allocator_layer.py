"""The caching-allocator layer of a node's mirror, rebuilt from SEG_*/BLK_* rows.

PyTorch's caching allocator (twinned by ``kvguard.producers.sim.torch_allocator.caching_allocator``) reserves
*segments* from the device and carves *blocks* out of them. The node emits a segment row at every
cudaMalloc and release, and a block row only for blocks that outlive the engine step that made
them (``kvguard.contracts.events``): a step's transient activations are freed before it ends, so
at every step boundary the rows describe the allocator exactly.

From segments and the long-lived blocks in them the layer derives PyTorch's own figures:
reserved and allocated bytes, the free blocks (the gaps between allocated blocks of a segment —
the allocator coalesces neighbouring free blocks, so each gap is one free block), the largest
cached free block, ``inactive_split_bytes`` (free blocks inside segments that still hold an
allocated block: cached memory that ``empty_cache()`` cannot return) and the allocator's F_ext
(1 − largest free block / cached free bytes). Pure: numpy and the standard library.

Segments are few (tens to hundreds) and change rarely. The figures are kept incrementally: the
reserved bytes as a running sum, and per segment its free-block summary (largest free block, free
bytes, whether it holds a block), recomputed only for the segments a row changed since the last
``metrics()`` (the dirty set), so a tick costs the segments that changed plus one pass over the
per-segment summaries, never a walk of every block.

Expandable segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) grow and shrink by
mapping and unmapping pages of one reserved address range: their SEG_ALLOC / SEG_FREE rows carry
``aux = SEG_MAPPED`` and name the pages mapped or unmapped. The layer keeps, as PyTorch's snapshot
does, one segment per contiguous mapped run: a map next to a run of the same expandable range
merges with it, an unmap inside a run splits it. A block belongs to the segment its address lies
in (its row's ``aux`` names the run it was carved from, which a later map may have merged).
"""

from __future__ import annotations

from bisect import bisect_right, insort
from dataclasses import dataclass

import numpy as np

from kvguard.contracts import pressure
from kvguard.contracts.events import SEG_MAPPED, EventKind

_SEG_ALLOC, _SEG_FREE = int(EventKind.SEG_ALLOC), int(EventKind.SEG_FREE)
_BLK_ALLOC, _BLK_FREE = int(EventKind.BLK_ALLOC), int(EventKind.BLK_FREE)
_RETRY = int(EventKind.ALLOC_RETRY)


class AllocatorLayerError(ValueError):
    """Rows that contradict the layer's state (a block outside any segment, a double free)."""


@dataclass(slots=True, frozen=True)
class AllocatorMetrics:
    """PyTorch's names where it has them (``memory_stats()``: ``reserved_bytes.all.current`` …)."""

    reserved_bytes: int
    allocated_bytes: int
    inactive_split_bytes: int
    largest_free_block_bytes: int
    f_ext: float
    segments: int
    alloc_retries: int  # cumulative: cached blocks released and a malloc retried


class AllocatorLayer:
    """Segments (address → size) and the long-lived blocks in each (sorted start addresses)."""

    def __init__(self) -> None:
        self.segment_size: dict[int, int] = {}
        self.blocks_of: dict[int, list[int]] = {}  # segment address -> sorted block addresses
        self.block_size: dict[int, int] = {}  # block address -> size
        self.block_segment: dict[int, int] = {}
        self.starts: list[int] = []  # sorted segment addresses (to find a block's segment)
        self.expandable: set[int] = set()  # segments that are mapped runs of expandable ranges
        self.allocated_bytes = 0
        self.alloc_retries = 0
        self.reserved_bytes = 0
        self._summary: dict[int, tuple[int, int]] = {}  # segment -> (largest free block, split bytes)
        self._dirty: set[int] = set()

    def reset(self) -> None:
        """The engine process died: its allocator is gone with it."""
        retries = self.alloc_retries
        self.__init__()
        self.alloc_retries = retries

    def apply(self, rows: np.ndarray) -> None:
        for kind, offset, size, aux in zip(rows["kind"].tolist(), rows["offset"].tolist(), rows["size"].tolist(),
                                           rows["aux"].tolist()):
            if kind == _SEG_ALLOC:
                if aux == SEG_MAPPED:
                    self._map(offset, size)
                else:
                    self._segment_alloc(offset, size)
            elif kind == _SEG_FREE:
                if aux == SEG_MAPPED:
                    self._unmap(offset, size)
                else:
                    self._segment_free(offset)
            elif kind == _BLK_ALLOC:
                self._block_alloc(offset, size, aux)
            elif kind == _BLK_FREE:
                self._block_free(offset)
            elif kind == _RETRY:
                self.alloc_retries += 1

    def _segment_alloc(self, address: int, size: int) -> None:
        if size <= 0 or address in self.segment_size:
            raise AllocatorLayerError(f"SEG_ALLOC at {address:#x} of {size} bytes: a segment exists there or the "
                                      "size is not positive")
        self.segment_size[address] = size
        self.blocks_of[address] = []
        insort(self.starts, address)
        self.reserved_bytes += size
        self._dirty.add(address)

    def _segment_free(self, address: int) -> None:
        if self.blocks_of.get(address):
            raise AllocatorLayerError(f"SEG_FREE at {address:#x}: the segment still holds allocated blocks")
        size = self.segment_size.pop(address, None)
        if size is None:
            raise AllocatorLayerError(f"SEG_FREE at {address:#x}: no such segment")
        self.reserved_bytes -= size
        self._forget(address)
        del self.blocks_of[address]
        self.starts.remove(address)
        self.expandable.discard(address)

    def _containing(self, address: int) -> int | None:
        """The segment whose range holds ``address``, or None."""
        i = bisect_right(self.starts, address) - 1
        if i >= 0 and address < self.starts[i] + self.segment_size[self.starts[i]]:
            return self.starts[i]
        return None

    def _map(self, address: int, size: int) -> None:
        """Pages ``[address, address + size)`` of an expandable range mapped: a run, merged with the
        expandable runs that end where it starts and start where it ends."""
        if size <= 0 or self._containing(address) is not None or self._containing(address + size - 1) is not None:
            raise AllocatorLayerError(f"SEG_ALLOC (mapped) at {address:#x} of {size} bytes overlaps a segment")
        self._segment_alloc(address, size)
        self.expandable.add(address)
        right = address + size
        if right in self.expandable:
            self._merge(address, right)
        i = self.starts.index(address)
        if i > 0:
            left = self.starts[i - 1]
            if left in self.expandable and left + self.segment_size[left] == address:
                self._merge(left, address)

    def _merge(self, left: int, right: int) -> None:
        for block in self.blocks_of.pop(right):
            self.block_segment[block] = left
            insort(self.blocks_of[left], block)
        self.segment_size[left] += self.segment_size.pop(right)
        self._forget(right)
        self._dirty.add(left)
        self.starts.remove(right)
        self.expandable.discard(right)

    def _unmap(self, address: int, size: int) -> None:
        """Pages ``[address, address + size)`` unmapped: cut out of the run that holds them."""
        run = self._containing(address)
        if run is None or run not in self.expandable or address + size > run + self.segment_size[run] or size <= 0:
            raise AllocatorLayerError(f"SEG_FREE (unmapped) at {address:#x} of {size} bytes is not inside one "
                                      "mapped run of an expandable segment")
        end, run_end = address + size, run + self.segment_size[run]
        blocks = self.blocks_of[run]
        if any(b < end and b + self.block_size[b] > address for b in blocks):
            raise AllocatorLayerError(f"SEG_FREE (unmapped) at {address:#x}: allocated blocks lie in those pages")
        self.blocks_of[run] = []
        self.reserved_bytes -= self.segment_size.pop(run)
        self._forget(run)
        del self.blocks_of[run]
        self.starts.remove(run)
        self.expandable.discard(run)
        for start, stop in ((run, address), (end, run_end)):
            if stop > start:
                self._segment_alloc(start, stop - start)
                self.expandable.add(start)
        for b in blocks:
            home = run if b < address else end
            self.block_segment[b] = home
            insort(self.blocks_of[home], b)

    def _block_alloc(self, address: int, size: int, segment: int) -> None:
        seg_size = self.segment_size.get(segment)
        if (seg_size is None or not segment <= address < address + size <= segment + seg_size) and \
                self.expandable:  # a run the block was carved from may have merged into a longer one
            home = self._containing(address)
            if home is not None and home in self.expandable:
                segment, seg_size = home, self.segment_size[home]
        if seg_size is None or not segment <= address < address + size <= segment + seg_size:
            raise AllocatorLayerError(f"BLK_ALLOC at {address:#x} ({size} bytes) is outside segment {segment:#x}")
        if address in self.block_size:
            raise AllocatorLayerError(f"BLK_ALLOC at {address:#x}: a block is allocated there already")
        insort(self.blocks_of[segment], address)
        self.block_size[address] = size
        self.block_segment[address] = segment
        self.allocated_bytes += size
        self._dirty.add(segment)

    def _block_free(self, address: int) -> None:
        size = self.block_size.pop(address, None)
        if size is None:
            raise AllocatorLayerError(f"BLK_FREE at {address:#x}: no block is allocated there")
        segment = self.block_segment.pop(address)
        self.blocks_of[segment].remove(address)
        self.allocated_bytes -= size
        self._dirty.add(segment)

    def _forget(self, segment: int) -> None:
        self._summary.pop(segment, None)
        self._dirty.discard(segment)
    def free_blocks(self, segment: int) -> list[int]:
        """Sizes of the free blocks of one segment (the gaps between its allocated blocks)."""
        start, end = segment, segment + self.segment_size[segment]
        gaps, cursor = [], start
        for address in self.blocks_of[segment]:
            if address > cursor:
                gaps.append(address - cursor)
            cursor = address + self.block_size[address]
        if end > cursor:
            gaps.append(end - cursor)
        return gaps

    def metrics(self) -> AllocatorMetrics:
        for segment in self._dirty:
            gaps = self.free_blocks(segment)
            self._summary[segment] = (max(gaps) if gaps else 0, sum(gaps) if gaps and self.blocks_of[segment] else 0)
        self._dirty.clear()
        reserved = self.reserved_bytes
        largest = max((s[0] for s in self._summary.values()), default=0)
        split = sum(s[1] for s in self._summary.values())
        free = reserved - self.allocated_bytes
        return AllocatorMetrics(reserved_bytes=reserved, allocated_bytes=self.allocated_bytes,
                                inactive_split_bytes=split, largest_free_block_bytes=largest,
                                f_ext=float(pressure.f_ext(free, largest)), segments=len(self.segment_size),
                                alloc_retries=self.alloc_retries)

    # -- checkpoint state (the stream's NodeState) --------------------------------------------------

    def to_dict(self) -> dict:
        return {"segments": [[a, s] for a, s in sorted(self.segment_size.items())],
                "expandable": sorted(self.expandable),
                "blocks": [[a, self.block_size[a], self.block_segment[a]] for a in sorted(self.block_size)],
                "retries": self.alloc_retries}

    @classmethod
    def from_dict(cls, d: dict | None) -> "AllocatorLayer":
        layer = cls()
        for address, size in (d or {}).get("segments", ()):
            layer._segment_alloc(int(address), int(size))
        layer.expandable = {int(a) for a in (d or {}).get("expandable", ())}
        for address, size, segment in (d or {}).get("blocks", ()):
            layer._block_alloc(int(address), int(size), int(segment))
        layer.alloc_retries = int((d or {}).get("retries", 0))
        return layer
