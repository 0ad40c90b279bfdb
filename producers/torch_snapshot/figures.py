"""The allocator figures ``kvguard rca --snapshot`` reads from a PyTorch snapshot of the crashing process.

``torch.cuda.memory._dump_snapshot()`` (the OOM observer's dump, ``torch.cuda.memory._record_memory_history``)
holds the segments and blocks at dump time and, with history on, the trace whose ``oom`` entry records
the request's ``size`` and the ``device_free`` bytes (``c10/cuda/CUDACachingAllocator.cpp``,
``TraceEntry::OOM``). From those: reserved, allocated, reserved-but-unallocated, the largest cached free
block, the bytes ``empty_cache()`` could release and the free bytes pinned by an allocated block.
Loaded with the restricted unpickler of ``snapshot.load_snapshot`` (plain data only).
"""

from __future__ import annotations

from pathlib import Path

from kvguard.producers.torch_snapshot.snapshot import SnapshotError, fragmentation_report, load_snapshot

__all__ = ["SnapshotError", "snapshot_figures"]


def snapshot_figures(path: str | Path) -> dict:
    """JSON-ready figures of the snapshot at ``path``; ``SnapshotError`` when it is none."""
    try:
        snap = load_snapshot(path)
    except OSError as err:
        raise SnapshotError(str(err)) from None
    report = fragmentation_report(snap)
    totals = report["totals"]
    out = {"path": str(path), "reserved_bytes": int(totals["reserved_bytes"]),
           "allocated_bytes": int(totals["allocated_bytes"]),
           "reserved_unallocated_bytes": int(totals["unallocated_bytes"]),
           "largest_free_block_bytes": int(totals["largest_free_bytes"]),
           "releasable_bytes": int(totals["releasable_bytes"]), "pinned_free_bytes": int(totals["pinned_free_bytes"]),
           "segments": int(totals["num_segments"]), "expandable_segments": bool(report["expandable_segments"]),
           "requested_bytes": None, "device_free_bytes": None}
    for trace in snap.get("device_traces") or []:
        for entry in trace:
            if isinstance(entry, dict) and entry.get("action") == "oom":
                out["requested_bytes"] = int(entry.get("size", 0))
                if isinstance(entry.get("device_free"), int):
                    out["device_free_bytes"] = int(entry["device_free"])
    return out
