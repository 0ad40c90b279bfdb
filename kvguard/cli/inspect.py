"""`kvguard inspect`: read PyTorch allocator snapshots — a fragmentation report, and a replay of the
recorded trace through kvguard's caching-allocator twin.

Both read `torch.cuda.memory._dump_snapshot()` pickles (`.pickle` or `.pickle.gz`) with a
restricted unpickler: a file that tries to run code is refused, not executed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from kvguard.cli.app import app

inspect_app = typer.Typer(help="Read PyTorch CUDA allocator snapshots (torch.cuda.memory._dump_snapshot).",
                          no_args_is_help=True)
app.add_typer(inspect_app, name="inspect")


def _load(path: Path) -> dict:
    from kvguard.producers.torch_snapshot.snapshot import (  # loaded on use, like every command
        SnapshotError,
        load_snapshot,
    )

    try:
        return load_snapshot(path)
    except (OSError, SnapshotError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None


@inspect_app.command("snapshot")
def snapshot(
    path: Path = typer.Argument(..., help="A _dump_snapshot pickle (.pickle or .pickle.gz)."),
    pinned_free_frac: float = typer.Option(0.5, "--pinned-free-frac", min=0.0, max=1.0,
                                           help="A segment at least this free but holding an allocated block is "
                                                "reported as pinned."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Fragmentation report of a snapshot, per pool and segment.

    Reserved, allocated, largest free block, F_ext, rounding waste, and the blocks that pin
    mostly-free segments (what empty_cache() cannot return).
    """
    from kvguard.producers.torch_snapshot.snapshot import fragmentation_report, render_report

    report = fragmentation_report(_load(path), pinned_free_frac=pinned_free_frac)
    if json_out:
        sys.stdout.write(json.dumps(report, default=str) + "\n")
    else:
        typer.echo(render_report(report))


@inspect_app.command("replay")
def replay(
    path: Path = typer.Argument(..., help="A _dump_snapshot pickle with a device trace."),
    out: Path = typer.Option(None, "--out", help="Write the twin's own snapshot here (same format; "
                                                  "python -m torch.cuda._memory_viz reads it)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Replay a snapshot's trace through the caching-allocator twin and compare.

    Compared: the sizes and order of segment allocations, and every segment's final block
    layout. Exit status 1 when the twin diverges from the real allocator.
    """
    from kvguard.producers.sim.torch_allocator.replay import ReplayUnsupported, compare_replay, replay_device_trace

    snap = _load(path)
    try:
        twin = replay_device_trace(snap)
    except ReplayUnsupported as err:
        typer.echo(f"error: cannot replay {path}: {err}", err=True)
        raise typer.Exit(2) from None
    result = compare_replay(snap, twin)
    if out is not None:
        twin.dump_snapshot(out)
    if json_out:
        sys.stdout.write(json.dumps({
            "matches": result.matches, "first_difference": result.first_difference(),
            "segments": len(result.real_layout), "blocks": sum(len(s.blocks) for s in result.real_layout),
            "segment_allocs": {"real": len(result.real_segment_allocs), "twin": len(result.twin_segment_allocs)},
            "notes": list(result.notes), "twin_snapshot": None if out is None else str(out),
        }) + "\n")
    else:
        typer.echo(result.summary())
        if out is not None:
            typer.echo(f"twin snapshot: {out}")
    if not result.matches:
        raise typer.Exit(1)
