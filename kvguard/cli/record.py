"""`kvguard record`: capture a fleet's events topic into an event log (for `metrics`, `rca`, `dataset`)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import typer

from kvguard.cli.app import app


def parse_time_ms(text: str | None, *, now_ms: int, option: str) -> int | None:
    """An ISO-8601 time (``2026-12-01T07:00:00Z``) or a duration ago (``15m``, ``2h``) → epoch ms."""
    from kvguard.cli.simulate import parse_duration

    if not text:
        return None
    if re.fullmatch(r"[0-9.]+(ms|s|m|h|d)?([0-9.]+(ms|s|m|h|d))*", text.strip().lower()):
        return now_ms - int(parse_duration(text) * 1000)
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise typer.BadParameter(f"expected an ISO-8601 time or a duration ago such as 15m, got {text!r}",
                                 param_hint=option) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return int(when.timestamp() * 1000)


@app.command()
def record(
    out: Path = typer.Option(..., "-o", "--out", help="The event log to write (.jsonl.gz)."),
    bootstrap: str = typer.Option(None, "--bootstrap", help="Kafka HOST:PORT (default: kafka.bootstrap in settings)."),
    since: str = typer.Option(None, "--since", help="Only batches the broker stamped at or after this: an ISO-8601 "
                                                    "time or a duration ago (15m)."),
    until: str = typer.Option(None, "--until", help="Only batches stamped before this (same forms)."),
    node: list[str] = typer.Option(None, "--node", help="Only this node id (repeatable)."),
    idle_timeout: str = typer.Option("3s", "--idle-timeout", help="Stop after nothing new arrived for this long."),
    config: Path = typer.Option(None, "--config", help="Settings file (TOML/JSON)."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as one JSON object."),
) -> None:
    """Capture the events topic into an event log that `kvguard metrics`, `rca` and `dataset` read.

    Reads from the beginning with a private consumer group that never commits, so the fleet's own consumers are not disturbed, and stops once it has caught up with the topic.
    """
    # the bus client is loaded when the command runs, so `kvguard --help` stays fast
    from rich.console import Console

    from kvguard.cli.simulate import parse_duration
    from kvguard.config.settings import ConfigError, Settings
    from kvguard.runtime.bootstrap import BootstrapError
    from kvguard.runtime.bootstrap import bootstrap as build_graph
    from kvguard.runtime.record import record_events

    console = Console(stderr=True)
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # a connection failure is reported once, below
    now_ms = int(time.time() * 1000)
    since_ms = parse_time_ms(since, now_ms=now_ms, option="--since")
    until_ms = parse_time_ms(until, now_ms=now_ms, option="--until")
    try:
        settings = Settings.load(config)
        carrier = build_graph(settings, predictor=None).make_bus(f"kafka://{bootstrap or settings.kafka.bootstrap}")
        idle_s = parse_duration(idle_timeout)
    except (ConfigError, BootstrapError, ValueError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None

    async def main():
        await carrier.start()
        try:
            with console.status("recording…") as status:
                return await record_events(
                    carrier, settings, out, since_ms=since_ms, until_ms=until_ms, nodes=set(node or ()) or None,
                    idle_timeout_s=idle_s,
                    on_progress=lambda s: status.update(f"recording… {s.batches} batches, {s.events} events, "
                                                        f"{len(s.nodes) or ''} nodes"))
        finally:
            await carrier.stop()

    try:
        summary = asyncio.run(main())
    except OSError as err:
        typer.echo(f"error: cannot write {out}: {err}", err=True)
        raise typer.Exit(1) from None
    except Exception as err:  # noqa: BLE001 - an unreachable broker: one line and the next step, no traceback
        typer.echo(f"error: could not read {settings.topics.name('events')} from "
                   f"{bootstrap or settings.kafka.bootstrap} ({type(err).__name__}: {err}); is the broker up "
                   "and the address right (--bootstrap)?", err=True)
        raise typer.Exit(1) from None
    if json_out:
        sys.stdout.write(json.dumps(summary.to_dict()) + "\n")
    else:
        console.print(f"{out}: {summary.batches} batches, {summary.events} events from {len(summary.nodes)} node(s)"
                      + (f"; {summary.undecodable} undecodable record(s) skipped" if summary.undecodable else "")
                      + (f"; {summary.tombstones} tombstone(s) skipped" if summary.tombstones else ""))
