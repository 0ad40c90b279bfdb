"""`kvguard ingest`: other sources' records as kvguard input (vLLM and SGLang KV events, PyTorch memory snapshots)."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import typer

from kvguard.cli.app import app

ingest_app = typer.Typer(name="ingest", no_args_is_help=True, add_completion=False,
                         help="Turn other tools' records into kvguard input: vLLM's and SGLang's KV-event streams, "
                              "PyTorch memory snapshots.")
app.add_typer(ingest_app, name="ingest")


@ingest_app.command("vllm-kv-events")
def vllm_kv_events(
    endpoint: str = typer.Option(..., "--endpoint", help="vLLM's KV-event PUB socket, e.g. tcp://host:5557 "
                                                         "(vLLM's --kv-events-config endpoint)."),
    replay: str = typer.Option(None, "--replay", help="vLLM's replay ROUTER socket, e.g. tcp://host:5558 "
                                                      "(replay_endpoint): sequence gaps are filled from it."),
    topic: str = typer.Option("", "--topic", help="Topic prefix to subscribe to (vLLM's kv-events topic)."),
    interval: str = typer.Option("5s", "--interval", help="How often to print the figures."),
    duration: str = typer.Option(None, "--duration", help="Stop after this long (default: run until Ctrl-C)."),
    from_seq: int = typer.Option(None, "--from-seq", help="Treat this sequence number as the start: earlier "
                                                          "gaps are filled from --replay (default: the first received)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per interval (and one at the end)."),
) -> None:
    """Follow vLLM's KV-cache events (BlockStored / BlockRemoved / AllBlocksCleared) and print prefix-cache figures.

    What these events give: which content hashes enter and leave vLLM's prefix cache, so the cached working set
    (blocks and tokens per medium), store, reuse and eviction counts. What they cannot give: they carry no
    physical block ids, request ids or reference counts, so no U_kv, no F_ext or F_int, no allocator state and no
    victims for the policy. For those attach the plugin (pip install 'kvguard[vllm]'); for U_kv alone, `kvguard scrape`.
    """
    _follow_kv_events(endpoint, replay, topic, interval, duration, from_seq, as_json, engine="vLLM")


@ingest_app.command("sglang-kv-events")
def sglang_kv_events(
    endpoint: str = typer.Option(..., "--endpoint", help="SGLang's KV-event PUB socket, e.g. tcp://host:5557 "
                                                         "(--kv-events-config endpoint; DP rank r publishes on port + r)."),
    replay: str = typer.Option(None, "--replay", help="SGLang's replay ROUTER socket, e.g. tcp://host:5558 "
                                                      "(replay_endpoint): sequence gaps are filled from it."),
    topic: str = typer.Option("", "--topic", help="Topic prefix to subscribe to (--kv-events-config topic)."),
    interval: str = typer.Option("5s", "--interval", help="How often to print the figures."),
    duration: str = typer.Option(None, "--duration", help="Stop after this long (default: run until Ctrl-C)."),
    from_seq: int = typer.Option(None, "--from-seq", help="Treat this sequence number as the start: earlier "
                                                          "gaps are filled from --replay (default: the first received)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per interval (and one at the end)."),
) -> None:
    """Follow SGLang's KV-cache events (BlockStored / BlockRemoved / AllBlocksCleared, one hash per page) and print
    radix-cache figures.

    SGLang's publisher speaks vLLM's wire format (same frames, msgpack batches and replay), so the same reader and
    gap handling apply. What the events give: the pages entering and leaving SGLang's radix cache, per medium
    (GPU, or HiCache's host and disk tiers). What they cannot give: page ids, request ids, lock counts, free pages:
    no U_kv, F_ext, F_int or victims. For U_kv, `kvguard scrape --engine sglang`; for everything, the node plugin.
    """
    _follow_kv_events(endpoint, replay, topic, interval, duration, from_seq, as_json, engine="SGLang")


def _follow_kv_events(endpoint: str, replay: str | None, topic: str, interval: str, duration: str | None,
                      from_seq: int | None, as_json: bool, *, engine: str) -> None:
    from kvguard.cli.simulate import parse_duration
    from kvguard.producers.vllm.kv_events import KvEventsSubscriber, PrefixCacheState

    try:
        interval_s = parse_duration(interval)
        duration_s = parse_duration(duration) if duration else None
    except typer.BadParameter as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        subscriber = KvEventsSubscriber(endpoint, replay, topic=topic, from_seq=from_seq)
    except ImportError as exc:
        typer.echo(f"error: reading {engine} KV events needs pyzmq and msgspec "
                   f"(pip install 'kvguard[{engine.lower()}]'): {exc}",
                   err=True)
        raise typer.Exit(2) from None
    except Exception as exc:  # noqa: BLE001 - zmq.ZMQError for a malformed endpoint: one line, no traceback
        typer.echo(f"error: cannot connect to {endpoint}: {exc}", err=True)
        raise typer.Exit(2) from None
    state = PrefixCacheState()
    start = time.monotonic()
    next_print = start + interval_s
    try:
        while duration_s is None or time.monotonic() - start < duration_s:
            for batch in subscriber.poll(100):
                state.apply(batch)
            if time.monotonic() >= next_print:
                _print_kv(state, subscriber, endpoint, as_json)
                next_print += interval_s
    except KeyboardInterrupt:
        pass
    finally:
        subscriber.close()
    _print_kv(state, subscriber, endpoint, as_json, final=True)


def _print_kv(state, subscriber, endpoint: str, as_json: bool, final: bool = False) -> None:
    c = subscriber.counters
    record = {"type": "kv_events_summary" if final else "kv_events", "endpoint": endpoint, **state.figures(),
              "next_seq": subscriber.expected, "gaps": c.gaps, "replayed": c.replayed, "lost": c.lost,
              "duplicates": c.duplicates, "undecodable": c.undecodable}
    if as_json:
        sys.stdout.write(json.dumps(record, sort_keys=True) + "\n")
        sys.stdout.flush()
        return
    cached = ", ".join(f"{m} {n}" for m, n in record["cached_blocks"].items()) or "0"
    typer.echo(f"{'final ' if final else ''}batches {record['batches']}  cached blocks {cached}  stored "
               f"{record['stored_blocks']}  reused {record['reused_blocks']} ({record['reuse_frac']:.1%})  removed "
               f"{record['removed_blocks']}  cleared {record['cleared']}  gaps {c.gaps} (replayed {c.replayed}, "
               f"lost {c.lost})")


@ingest_app.command("torch-snapshot")
def torch_snapshot(
    file: Path = typer.Argument(..., help="A torch.cuda.memory._dump_snapshot() pickle (.pickle or .pickle.gz)."),
    events_out: Path = typer.Option(..., "--events-out", help="The event log to write (.jsonl.gz)."),
    node: str = typer.Option(None, "--node", help="Node id in the log (default: snapshot/<file stem>/gpu<device>)."),
    device: int = typer.Option(None, "--device", help="Which device's trace (default: the one with the most entries)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as one JSON object."),
) -> None:
    """Write a PyTorch memory snapshot's allocator history as kvguard allocator events (SEG_*/BLK_*, OOM).

    The segments and blocks alive when recording began come first, then one step per trace entry. Then
    `kvguard metrics --events LOG` and `kvguard rca --events LOG` read it; the last tick's alloc_reserved_bytes
    and alloc_allocated_bytes are the snapshot's totals. The log has no KV-cache layer (U_kv, F_ext and F_int
    are 0): a snapshot knows the caching allocator only.
    """
    from kvguard.contracts.node_id import check_node_id
    from kvguard.producers.torch_snapshot.snapshot import SnapshotError, load_snapshot
    from kvguard.producers.torch_snapshot.to_events import busiest_device, snapshot_to_batches
    from kvguard.wire.eventlog import write_event_log

    try:
        snapshot = load_snapshot(file)
    except (OSError, SnapshotError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    device = busiest_device(snapshot) if device is None else device
    # the file name as a node id part: characters a node id may not hold become '-' (kvguard.contracts.node_id)
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", file.name.split(".")[0]).strip("-._")[:30] or "file"
    node = node or f"snapshot/{stem}/gpu{device}"
    try:
        check_node_id(node, "--node")
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    batches, summary = snapshot_to_batches(snapshot, node, device=device)
    meta = {"source": "torch-snapshot", "file": file.name, "nodes": [node], "device": device,
            "summary": summary.to_dict()}
    try:
        write_event_log(events_out, batches, meta)
    except OSError as exc:
        typer.echo(f"error: cannot write {events_out}: {exc}", err=True)
        raise typer.Exit(1) from None
    out = {"events_out": str(events_out), "node": node, **summary.to_dict()}
    if as_json:
        sys.stdout.write(json.dumps(out, sort_keys=True) + "\n")
        return
    typer.echo(f"{events_out}: {summary.rows} allocator events from {summary.entries} trace entries of device "
               f"{device} ({summary.batches} batches, node {node}); reserved {summary.rows_reserved_bytes:,} B, "
               f"allocated {summary.rows_allocated_bytes:,} B at the end (snapshot: {summary.snapshot_reserved_bytes:,} / "
               f"{summary.snapshot_allocated_bytes:,} B)" + (f"; skipped {summary.skipped}" if summary.skipped else "")
               + (f"; {summary.ooms} OOM(s)" if summary.ooms else ""))
