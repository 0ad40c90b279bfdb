"""PyTorch's CUDA caching allocator as kvguard rows: any PyTorch engine's, or the shadow engine's twin.

``StepRecorder`` compares an allocator's segments and active blocks with what it last reported
and returns the rows that take a mirror (``kvguard.streams.allocator_layer``) from the old state to
the new one, in an order the mirror can apply: blocks freed, segments released, segments reserved,
blocks allocated. An engine step allocates and frees its activations, workspaces and sampler
buffers before it ends; only what outlives the step changes the allocator's state at the step
boundary (segments reserved or released, blocks that stay allocated, retries: cached blocks released
so a malloc could succeed), so the event volume is independent of how many tensors a step
allocates. Its input is anything shaped like ``AllocatorState``: the twin
(``kvguard.producers.sim.torch_allocator``) or ``SnapshotView`` over a real ``_snapshot()``.

``CudaMemoryObserver`` reads the allocator of the engine process; three sources, all PyTorch's own:

- ``torch.cuda.memory_stats(device)`` at most every ``stats_every_ms`` (at a step end, on the engine
  thread): reserved/allocated/active bytes, ``num_alloc_retries`` and ``num_ooms`` ride on the next
  batch as ``extra["cuda_memory"]``;
- ``torch.cuda.memory._snapshot()`` at most every ``segments_every_s``: its segments and blocks
  become SEG_ALLOC/SEG_FREE/BLK_ALLOC/BLK_FREE rows (and ALLOC_RETRY per new retry) through
  ``StepRecorder`` over a view of the snapshot, so the mirror's allocator
  layer (``kvguard.streams.allocator_layer``) equals the allocator at each sample. The allocator
  state between samples is not seen (a snapshot costs milliseconds; the GPU check measures it);
- ``torch._C._cuda_attach_out_of_memory_observer``: PyTorch calls it with ``(device, requested bytes,
  device allocated, device free)`` when a ``cudaMalloc`` fails after the cache was released; the
  plugin writes an OOM row (``cls=OomLayer.ALLOCATOR``, ``aux`` = reserved but unallocated bytes,
  ``flags`` = ``OomCause``) and flushes at once, before the engine dies of it.

The sources need CUDA initialised in this process: vLLM's ``UniProcExecutor`` (one GPU; the worker
runs in the engine process). On a CPU machine, or with the workers in other processes
(tensor parallel), the observer is inactive and ``reason`` says why; the KV rows are unaffected.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from kvguard.contracts.events import EventKind, OomCause, OomLayer, Pool, empty_events
from kvguard.contracts.units import NS_PER_S

log = logging.getLogger(__name__)

_STATS_KEYS = ("reserved_bytes.all.current", "allocated_bytes.all.current", "active_bytes.all.current",
               "inactive_split_bytes.all.current", "num_alloc_retries", "num_ooms", "num_device_alloc",
               "num_device_free")


class AllocatorState(Protocol):
    """What ``StepRecorder`` reads of an allocator: ``{address: (size, is_small, stream)}`` of its
    segments, ``{address: (size, requested, segment address)}`` of its active blocks, and PyTorch's
    ``memory_stats()`` keys (``num_alloc_retries`` at least)."""

    def segments(self) -> dict[int, tuple[int, bool, int]]: ...

    def active_blocks(self) -> dict[int, tuple[int, int, int]]: ...

    def memory_stats(self) -> dict[str, int]: ...


class StepRecorder:
    def __init__(self, twin: AllocatorState) -> None:
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


class SnapshotView:
    """A ``torch.cuda.memory._snapshot()`` of one device, shaped like the twin ``StepRecorder`` reads
    (``segments``, ``active_blocks``, ``memory_stats``)."""

    def __init__(self, device: int = 0) -> None:
        self.device = device
        self._segments: dict[int, tuple[int, bool, int]] = {}
        self._blocks: dict[int, tuple[int, int, int]] = {}
        self._stats: dict[str, int] = {"num_alloc_retries": 0}

    def update(self, snapshot: dict, stats: dict | None = None) -> None:
        segments, blocks = {}, {}
        for seg in snapshot.get("segments", ()):
            if seg.get("device", 0) != self.device:
                continue
            address = int(seg["address"])
            segments[address] = (int(seg["total_size"]), seg.get("segment_type") == "small", int(seg.get("stream", 0)))
            cursor = address
            for block in seg.get("blocks", ()):
                size = int(block["size"])
                if block.get("state") != "inactive":
                    blocks[cursor] = (size, int(block.get("requested_size", size)), address)
                cursor += size
        self._segments, self._blocks = segments, blocks
        if stats is not None:
            self._stats = {"num_alloc_retries": int(stats.get("num_alloc_retries", 0))}

    def segments(self) -> dict[int, tuple[int, bool, int]]:
        return self._segments

    def active_blocks(self) -> dict[int, tuple[int, int, int]]:
        return self._blocks

    def memory_stats(self) -> dict[str, int]:
        return self._stats


class CudaMemoryObserver:
    def __init__(self, translator: Any, torch_module: Any = None, *, stats_every_ms: float = 100.0,
                 segments_every_s: float = 5.0, clock_ns: Callable[[], int] = time.monotonic_ns) -> None:
        self.translator = translator
        self.torch = torch_module
        self.stats_every_ns = int(stats_every_ms * 1e6)
        self.segments_every_ns = int(segments_every_s * NS_PER_S)
        self.clock_ns = clock_ns
        self.active, self.reason = self._check(torch_module)
        self.device = int(torch_module.cuda.current_device()) if self.active else -1
        self.view = SnapshotView(max(self.device, 0))
        self.recorder = StepRecorder(self.view)  # type: ignore[arg-type] - duck-typed like the twin
        self.last_stats: dict[str, int] = {}
        self._next_stats_ns = 0
        self._next_segments_ns = 0
        self.samples = self.snapshots = self.ooms = 0
        self.oom_observer_installed = False

    @staticmethod
    def _check(torch: Any) -> tuple[bool, str]:
        if torch is None:
            return False, "inactive: torch is not importable"
        if not torch.cuda.is_available():
            return False, "inactive: torch.cuda.is_available() is False (no GPU): KV rows only"
        if not torch.cuda.is_initialized():
            return False, ("inactive: CUDA is not initialised in the engine process (the workers run in other "
                           "processes): KV rows only")
        return True, "active"

    def install_oom_observer(self) -> bool:
        if not self.active:
            return False
        attach = getattr(self.torch._C, "_cuda_attach_out_of_memory_observer", None)
        if attach is None:
            self.reason = "active without the OOM observer: this torch has no _cuda_attach_out_of_memory_observer"
            return False
        attach(self._on_oom)
        self.oom_observer_installed = True
        return True

    def _on_oom(self, device: int, requested: int, device_allocated: int, device_free: int) -> None:
        """PyTorch's OOM observer: an OOM row, flushed now (the engine may not survive this error)."""
        self.ooms += 1
        reserved = allocated = None
        try:
            stats = self.torch.cuda.memory_stats(device)
            reserved = int(stats.get("reserved_bytes.all.current", 0))
            allocated = int(stats.get("allocated_bytes.all.current", 0))
            unallocated = reserved - allocated
        except Exception:  # noqa: BLE001 - inside an OOM, report what is known
            unallocated = 0
        cause = OomCause.FRAGMENTATION if unallocated >= requested else OomCause.PEAK
        if reserved is not None:  # PyTorch's OOM message's figures, for kvguard rca (an OOM_STEP DEVICE row)
            self.translator.on_oom_device(device_free, reserved, allocated, requested)
        self.translator.on_oom(requested, unallocated, int(cause), int(OomLayer.ALLOCATOR))
        self.translator.extra["cuda_oom"] = {"device": int(device), "requested_bytes": int(requested),
                                             "device_allocated_bytes": int(device_allocated),
                                             "device_free_bytes": int(device_free)}
        self.translator.flush()

    def sample(self) -> None:
        """At a step end: memory_stats when due, the segment rows when due."""
        if not self.active:
            return
        now = self.clock_ns()
        if now < self._next_stats_ns:
            return
        self._next_stats_ns = now + self.stats_every_ns
        torch = self.torch
        stats = torch.cuda.memory_stats(self.device)
        self.last_stats = {k: int(stats.get(k, 0)) for k in _STATS_KEYS}
        self.translator.extra["cuda_memory"] = dict(self.last_stats)
        self.samples += 1
        if now >= self._next_segments_ns:
            self._next_segments_ns = now + self.segments_every_ns
            self.view.update(torch.cuda.memory._snapshot(), stats)
            self.translator.add_rows(self.recorder.rows(self.translator.now()))
            self.snapshots += 1

    def status(self) -> dict:
        return {"active": self.active, "reason": self.reason, "device": self.device, "samples": self.samples,
                "segment_snapshots": self.snapshots, "ooms": self.ooms,
                "oom_observer": self.oom_observer_installed, "last": self.last_stats}
