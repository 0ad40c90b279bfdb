"""`kvguard metrics`: replay an event log through the stream core and print its ticks (and alerts)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from kvguard.cli.app import app


@app.command("metrics")
def metrics(
    events: Path = typer.Option(..., "--events", help="event log (gzip JSON lines, `kvguard simulate --events-out`)"),
    tick: str = typer.Option("10s", "--tick", help="tick of event time: 10s, 1m, 500ms …"),
    alerts: bool = typer.Option(False, "--alerts", help="also print the alerts the tiers raise"),
    as_json: bool = typer.Option(False, "--json", help="one JSON object per line: type tick|alert"),
    candidates: bool = typer.Option(False, "--candidates", help="include victim candidates on ticks"),
    model: Path = typer.Option(None, "--model", help="tier-3 model artifact (`kvguard train`), at its calibrated "
                                                     "threshold; off by default"),
    config: Path = typer.Option(None, "--config", help="TOML/JSON settings file (thresholds, alpha, beta, …)"),
) -> None:
    """Replay an event log through the stream core: one line per tick and node (and per alert).

    Per tick and node: U_kv, F_ext, F_int, Ψ, slope, the allocator family and the rest of
    docs/ARCHITECTURE.md "Metrics"; with --alerts the tier 1–2 (and, with --model, tier 3) alerts.
    Each node's last, partial tick is included (marked partial). A batch that is no valid batch is
    named (line, node, epoch, seq, reason; a `skipped_batch` line with --json) and left out, and the
    replay goes on. Deterministic: the same log gives the same lines.
    """
    from kvguard.cli.simulate import parse_duration
    from kvguard.config.settings import ConfigError, Settings
    from kvguard.runtime.bootstrap import BootstrapError, bootstrap
    from kvguard.streams.alerts import alert_record
    from kvguard.streams.core import StreamConfigError
    from kvguard.streams.embedded import run_event_log
    from kvguard.streams.metrics import tick_record
    from kvguard.wire.eventlog import EventLogError

    if not events.exists():
        typer.echo(f"--events {events}: no such file", err=True)
        raise typer.Exit(2)
    try:
        tick_s = parse_duration(tick)
    except typer.BadParameter as exc:
        typer.echo(f"--tick: {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        settings = Settings.load(config)
        graph = bootstrap(settings, predictor=model)
        stream_config = graph.stream_config(tick_s=tick_s)
    except (ConfigError, StreamConfigError, BootstrapError) as exc:
        typer.echo(f"config error: {exc}", err=True)
        raise typer.Exit(2) from None
    predictor = graph.predictor
    if model is not None and predictor is None:
        typer.echo(f"--model: {graph.predictor_note}", err=True)
        raise typer.Exit(2)
    n_ticks = n_alerts = 0
    out = sys.stdout
    skipped = []

    def skip(s) -> None:  # an invalid batch: named and left out, the replay goes on (the worker's DLQ)
        skipped.append(s)
        if as_json:
            out.write(json.dumps({"type": "skipped_batch", **s.to_dict()}) + "\n")
        else:
            typer.echo(f"warning: {s.describe()}", err=True)

    try:
        for ticks, raised in run_event_log(events, stream_config, predictor, finish=True, on_invalid=skip):
            for t in ticks:
                n_ticks += 1
                record = tick_record(t)
                if not candidates:
                    record.pop("candidates")
                record["type"] = "tick"
                out.write(json.dumps(record) + "\n" if as_json else _tick_line(record))
            for a in raised if alerts else ():
                n_alerts += 1
                record = alert_record(a)
                record["type"] = "alert"
                out.write(json.dumps(record) + "\n" if as_json else _alert_line(record))
    except EventLogError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    if skipped and not n_ticks:
        typer.echo(f"{events}: no valid batch ({len(skipped)} skipped)", err=True)
        raise typer.Exit(2)
    if not as_json:
        typer.echo(f"{n_ticks} ticks" + (f", {n_alerts} alerts" if alerts else "")
                   + (f", {len(skipped)} batch(es) skipped" if skipped else ""), err=True)


def _tick_line(r: dict) -> str:
    flag = ("" if r["synced"] else "  (unsynced)") + ("  (partial: the log ends inside this tick)" if r.get("partial") else "")
    return (f"{r['ts_s']:>10.1f}s {r['node']:<16} u_kv {r['u_kv']:.3f}  f_ext {r['f_ext']:.3f}  "
            f"f_int {r['f_int']:.3f}  psi {r['psi']:.3f}  slope {r['slope_per_min']:+.4f}/min  "
            f"running {r['requests_running']}  ooms {r['ooms']}{flag}\n")


def _alert_line(r: dict) -> str:
    return (f"{r['ts_s']:>10.1f}s {r['node']:<16} ALERT {r['name']} {r['status']} "
            f"[{r['severity']}, {r['tier']}] value {r['value']:.4f}\n")

