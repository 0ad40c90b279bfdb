"""A contiguous free-run allocator over an arena of ``total_units`` units, with coalescing.

Free runs are kept three ways so that every hot operation is a dict lookup plus a bisect:
``_size_of[start]`` and ``_start_of_end[end]`` find a freed block's neighbours in O(1) for
coalescing, and ``_keys``, a sorted list of ``size * K + start`` integers (K = total_units + 1),
orders runs by (size, start) so best fit is one ``bisect`` away and the largest run is the last
key. A list insert/delete is a memmove of machine words, far cheaper than a tree at the run
counts a GPU pool sees. Invariant: no two free runs are adjacent (they are always merged).

Aligned requests (a page of c units at an offset that is a multiple of c) can skip runs that are
long enough but misaligned; the scan only visits runs shorter than ``size + align - 1``, since any
longer run always holds an aligned block.

``fit="first"`` (lowest offset that fits) also keeps a sorted list of run starts and scans it:
O(runs) per allocation, offered for comparison, not for the hot path.

``take_units``/``free_many`` do many single-unit placements or frees in one call (the pool's decode
pages); the pool inlines the same loops on its hottest paths, touching ``_keys``, ``_size_of`` and
``_start_of_end`` directly, so those three are the whole free-run state (best fit).

The allocator does not know what occupies the units: the pool keeps that.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from itertools import islice

FITS = ("best", "first")


class FreeRunAllocator:
    def __init__(self, total_units: int, fit: str = "best"):
        if total_units <= 0:
            raise ValueError(f"total_units: expected a positive integer, got {total_units!r}")
        if fit not in FITS:
            raise ValueError(f"fit: expected one of {FITS}, got {fit!r}")
        self.total_units = total_units
        self.fit = fit
        self._k = total_units + 1
        self._size_of: dict[int, int] = {}
        self._start_of_end: dict[int, int] = {}
        self._keys: list[int] = []
        self._starts: list[int] | None = [] if fit == "first" else None
        self.free_units = 0
        self.reset()

    # ---- queries -------------------------------------------------------------------------
    @property
    def largest(self) -> int:
        return self._keys[-1] // self._k if self._keys else 0

    @property
    def n_runs(self) -> int:
        return len(self._keys)

    def runs(self) -> tuple[list[int], list[int]]:
        """Free runs sorted by offset: (offsets, sizes)."""
        starts = sorted(self._size_of)
        return starts, [self._size_of[s] for s in starts]

    def run_at(self, start: int) -> int | None:
        return self._size_of.get(start)

    def run_ending_at(self, end: int) -> int | None:
        """Start of the free run that ends at ``end`` (exclusive), if any."""
        return self._start_of_end.get(end)

    def sizes_ascending(self):
        """(size, start) of every free run, smallest first."""
        k = self._k
        for key in self._keys:
            yield key // k, key % k

    def largest_runs(self, n: int) -> list[tuple[int, int]]:
        """(size, start) of the ``n`` longest free runs, longest first."""
        k = self._k
        return [divmod(key, k) for key in reversed(self._keys[-n:])] if n > 0 else []

    # ---- mutation ------------------------------------------------------------------------
    def reset(self) -> None:
        self._size_of.clear()
        self._start_of_end.clear()
        self._keys.clear()
        if self._starts is not None:
            self._starts.clear()
        self.free_units = 0
        self._add(0, self.total_units)

    def find(self, size: int, align: int = 1, avoid: tuple[int, int] | None = None) -> tuple[int, int] | None:
        """Where a block of ``size`` units aligned to ``align`` would go: (run start, block offset).

        ``avoid`` = (start, end) skips free runs touching that span (used by migrate). No mutation.
        """
        if size <= 0 or size > self.largest:
            return None
        if self._starts is not None:
            for start in self._starts:
                hit = self._place(start, self._size_of[start], size, align, avoid)
                if hit is not None:
                    return start, hit
            return None
        k = self._k
        keys = self._keys
        i = bisect_left(keys, size * k)
        if align == 1 and avoid is None:  # best fit: the first run long enough
            start = keys[i] % k
            return start, start
        if avoid is None:  # _place inlined (the aligned page case)
            for key in islice(keys, i, None):
                run_size, start = divmod(key, k)
                low = -(-start // align) * align
                end = start + run_size
                if low + size > end:
                    continue
                if low == start:
                    return start, low
                high = (end - size) // align * align
                return start, (high if high + size == end else low)
            return None
        for i in range(i, len(keys)):
            run_size, start = divmod(keys[i], k)
            hit = self._place(start, run_size, size, align, avoid)
            if hit is not None:
                return start, hit
        return None

    def alloc(self, size: int, align: int = 1) -> int | None:
        """Take a block; return its offset, or None (nothing changed) when no run fits."""
        found = self.find(size, align)
        if found is None:
            return None
        self.take(found[0], found[1], size)
        return found[1]

    def take(self, run_start: int, offset: int, size: int) -> None:
        """Remove [offset, offset+size) from the free run starting at ``run_start``."""
        run_size = self._size_of.get(run_start)
        if run_size is None or offset < run_start or offset + size > run_start + run_size:
            raise ValueError(f"take: [{offset}, {offset + size}) is not inside a free run at {run_start}")
        self._remove(run_start, run_size)
        if offset > run_start:
            self._add(run_start, offset - run_start)
        end, run_end = offset + size, run_start + run_size
        if run_end > end:
            self._add(end, run_end - end)

    def free(self, offset: int, size: int) -> None:
        """Return [offset, offset+size) and merge it with free neighbours."""
        if size <= 0 or offset < 0 or offset + size > self.total_units:
            raise ValueError(f"free: [{offset}, {offset + size}) is outside the arena of {self.total_units}")
        if offset in self._size_of or (offset + size) in self._start_of_end:
            raise ValueError(f"free: [{offset}, {offset + size}) overlaps a free run (double free)")
        start, end = offset, offset + size
        left = self._start_of_end.get(start)
        if left is not None:
            self._remove(left, start - left)
            start = left
        right_size = self._size_of.get(end)
        if right_size is not None:
            self._remove(end, right_size)
            end += right_size
        self._add(start, end - start)

    def take_units(self, n: int) -> list[int]:
        """Best-fit placement of ``n`` single-unit blocks, one after the other: the same offsets
        as ``n`` calls of ``alloc(1)`` (``fit="best"`` only). The caller checks ``free_units >= n``
        first; with single units that guarantees every placement succeeds.

        Best fit for one unit is the first key (smallest run, lowest start), and what is left of
        that run (one unit shorter) is again the smallest run, so it stays the first key: no bisect.
        """
        if self._starts is not None or n > self.free_units:
            raise ValueError(f"take_units: {n} units with fit={self.fit!r} and {self.free_units} free units")
        k = self._k
        keys = self._keys
        size_of = self._size_of
        start_of_end = self._start_of_end
        out = []
        append = out.append
        for _ in range(n):
            key = keys[0]
            size, start = divmod(key, k)
            del size_of[start]
            if size > 1:
                size_of[start + 1] = size - 1
                start_of_end[start + size] = start + 1
                keys[0] = key - k + 1
            else:
                del start_of_end[start + 1]
                del keys[0]
            append(start)
        self.free_units -= n
        return out

    def take_aligned(self, size: int, n: int) -> list[int] | None:
        """``n`` blocks of ``size`` units aligned to ``size`` (a power of two), placed one after the
        other: the same offsets as ``n`` calls of ``alloc(size, size)``, or None and nothing taken
        when one of them does not fit (``fit="best"`` only).

        Best fit scans the runs of at least ``size`` units in (size, start) order for the first
        holding an aligned block. A run that could not hold one still cannot later in the batch
        (the batch only takes), and every piece a placement leaves of ``size`` units or more starts
        or ends on an aligned boundary, so it can. So each placement only scans on from the run
        it last took, and compares with the smallest such piece: the misaligned runs are passed
        once per batch instead of once per block."""
        if self._starts is not None or size & (size - 1):
            raise ValueError(f"take_aligned: size {size} with fit={self.fit!r}")
        k = self._k
        keys = self._keys
        out: list[int] = []
        pieces: list[int] = []  # keys of pieces >= size left by this batch, ascending
        resume = size * k  # scan from here: the keys below it (but pieces) cannot hold a block
        for _ in range(n):
            hit = None
            for key in islice(keys, bisect_left(keys, resume), None):
                if pieces and pieces[0] < key:
                    break
                run_size, start = divmod(key, k)
                low = -(-start // size) * size
                if low + size <= start + run_size:
                    hit = key
                    break
            if hit is None or (pieces and pieces[0] < hit):
                if not pieces:
                    self.free_many([(offset, size) for offset in out])
                    return None
                hit = pieces.pop(0)
            else:
                resume = hit
            run_size, start = divmod(hit, k)
            end = start + run_size
            low = -(-start // size) * size
            if low == start:
                offset = low
            else:
                high = (end - size) // size * size
                offset = high if high + size == end else low
            self.take(start, offset, size)
            out.append(offset)
            for piece_start, piece_size in ((start, offset - start), (offset + size, end - offset - size)):
                if piece_size >= size:
                    insort(pieces, piece_size * k + piece_start)
        return out

    def free_many(self, blocks) -> None:
        """``free(offset, size)`` for every (offset, size) in ``blocks``: the free runs afterwards
        are a function of the free units, so the order does not matter. The blocks must be
        occupied (the pool frees only what it placed): no overlap check."""
        if self._starts is not None:
            for start, size in blocks:
                self.free(start, size)
            return
        k = self._k
        keys = self._keys
        size_of = self._size_of
        start_of_end = self._start_of_end
        freed = 0
        for start, size in blocks:
            end = start + size
            freed += size
            left = start_of_end.pop(start, None)
            if left is not None:
                del keys[bisect_left(keys, (start - left) * k + left)]
                start = left
            right = size_of.pop(end, None)
            if right is not None:
                del keys[bisect_left(keys, right * k + end)]
                end += right
            start_of_end[end] = start
            size_of[start] = end - start
            insort(keys, (end - start) * k + start)
        self.free_units += freed

    # ---- internals -----------------------------------------------------------------------
    @staticmethod
    def _place(start: int, run_size: int, size: int, align: int, avoid) -> int | None:
        """Offset for the block inside run (start, run_size), flush with an edge where alignment
        allows (fewer leftover fragments), or None."""
        end = start + run_size
        if avoid is not None and start <= avoid[1] and end >= avoid[0]:
            return None
        if align == 1:
            return start if run_size >= size else None
        low = -(-start // align) * align
        if low + size > end:
            return None
        if low == start:
            return low
        high = (end - size) // align * align
        return high if high + size == end else low

    def _add(self, start: int, size: int) -> None:
        self._size_of[start] = size
        self._start_of_end[start + size] = start
        insort(self._keys, size * self._k + start)
        if self._starts is not None:
            insort(self._starts, start)
        self.free_units += size

    def _remove(self, start: int, size: int) -> None:
        del self._size_of[start]
        del self._start_of_end[start + size]
        keys = self._keys
        del keys[bisect_left(keys, size * self._k + start)]
        if self._starts is not None:
            del self._starts[bisect_left(self._starts, start)]
        self.free_units -= size
