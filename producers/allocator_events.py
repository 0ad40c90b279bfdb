"""The caching-allocator twin's changes over one engine step, as SEG_*/BLK_* event rows.

An engine step allocates and frees its activations, workspaces and sampler buffers before it
ends; only what outlives the step changes the allocator's state at the step boundary: segments
reserved or released (cudaMalloc / release), blocks that stay allocated (persistent buffers,
caches), and retries (cached blocks released so a malloc could succeed). ``StepRecorder``
compares the twin's segments and active blocks with what it last reported and returns the rows
that take a mirror (``kvguard.streams.allocator_layer``) from the old state to the new one, in an
order the mirror can apply: blocks freed, segments released, segments reserved, blocks allocated.
So the event volume is independent of how many tensors a step allocates.
"""

from __future__ import annotations

import numpy as np

from kvguard.contracts.events import EventKind, Pool, empty_events
from kvguard.producers.caching_allocator import CachingAllocator


class StepRecorder:
    def __init__(self, twin: CachingAllocator) -> None:
        self.twin = twin
        self._segments: dict[int, tuple[int, bool, int]] = {}
        self._blocks: dict[int, tuple[int, int, int]] = {}
        self._retries = 0

    def rows(self, ts_ns: int) -> np.ndarray:
        """Rows since the last call (all of the twin's state on the first call)."""
        segments, blocks = self.twin.segments(), self.twin.active_blocks()
        retries = self.twin.memory_stats()["num_alloc_retries"]
        resized = {a for a, (size, _, _) in segments.items() if a in self._segments and self._segments[a][0] != size}
        gone_segments = [a for a in self._segments if a not in segments or a in resized]
        new_segments = [a for a in segments if a not in self._segments or a in resized]
        moved = set(gone_segments)
        gone_blocks = [a for a, b in self._blocks.items() if blocks.get(a) != b or b[2] in moved]
        new_blocks = [a for a, b in blocks.items() if self._blocks.get(a) != b or b[2] in moved]
        out = empty_events(len(gone_blocks) + len(gone_segments) + len(new_segments) + len(new_blocks)
                           + (retries - self._retries))
        i = 0
        for a in gone_blocks:
            size, _, seg = self._blocks[a]
            out[i] = (ts_ns, EventKind.BLK_FREE, self._pool(self._segments[seg][1]), 0, -1, a, size, 0, seg)
            i += 1
        for a in gone_segments:
            size, small, _ = self._segments[a]
            out[i] = (ts_ns, EventKind.SEG_FREE, self._pool(small), 0, -1, a, size, 0, 0)
            i += 1
        for a in new_segments:
            size, small, stream = segments[a]
            out[i] = (ts_ns, EventKind.SEG_ALLOC, self._pool(small), stream & 0xFF, -1, a, size, 0, 0)
            i += 1
        for a in new_blocks:
            size, requested, seg = blocks[a]
            out[i] = (ts_ns, EventKind.BLK_ALLOC, self._pool(segments[seg][1]), 0, -1, a, size, requested, seg)
            i += 1
        for _ in range(retries - self._retries):
            out[i] = (ts_ns, EventKind.ALLOC_RETRY, 0, 0, -1, -1, 0, 0, 0)
            i += 1
        self._segments, self._blocks, self._retries = segments, blocks, retries
        return out

    @staticmethod
    def _pool(small: bool) -> int:
        return int(Pool.SMALL if small else Pool.LARGE)
