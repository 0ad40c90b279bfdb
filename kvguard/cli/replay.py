"""`kvguard replay`: streams, predictor and policy over a recorded event log (a dry run), optionally
a what-if with another policy, and an offline HTML timeline."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import typer

from kvguard.cli.app import app


@app.command()
def replay(
    log: Path = typer.Argument(..., help="An event log (kvguard record or kvguard simulate --events-out)."),
    policy: Path = typer.Option(None, "--policy", help="A settings file (TOML/JSON) with the policy to try: the "
                                                       "log's requests re-run on the shadow engine with it."),
    report: Path = typer.Option(None, "--report", help="Write an offline HTML timeline (index.html) here."),
    profile: str = typer.Option(None, "--profile", help="Model/GPU profile for the what-if (default: the profiles "
                                                        "file's)."),
    gpus: int = typer.Option(None, "--gpus", min=1, help="GPUs for the what-if (default: the log's node count)."),
    no_lstm: bool = typer.Option(False, "--no-lstm", help="Run without the predictor."),
    config: Path = typer.Option(None, "--config", help="Settings file for the dry run (TOML/JSON)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Replay a log through streams, predictor and policy, executing nothing; with --policy, a what-if."""
    # the runtime loads the whole system: imported when the command runs, so `kvguard --help` stays fast
    from rich.console import Console

    from kvguard.config.settings import ConfigError, Settings
    from kvguard.ops.timeline_report import write_timeline_report
    from kvguard.runtime.bootstrap import bootstrap
    from kvguard.runtime.replay import dry_run, what_if, workload_from_log
    from kvguard.wire.eventlog import EventLogError, read_event_log

    console = Console(stderr=True)
    skipped = []  # invalid batch lines: named and left out, the replay goes on (the worker's DLQ)

    def skip(s) -> None:
        skipped.append(s.to_dict())
        typer.echo(f"warning: {s.describe()}", err=True)

    try:
        settings = Settings.load(config)
        graph = bootstrap(settings, profile=profile, predictor=None if no_lstm else "shipped")
        _, batches = read_event_log(log, on_invalid=skip)
        batches = list(batches)
    except (ConfigError, ValueError, OSError, EventLogError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    if skipped and not batches:
        typer.echo(f"error: {log}: no valid batch ({len(skipped)} skipped)", err=True)
        raise typer.Exit(2)
    with console.status("replaying…") as status:
        result = dry_run(graph, batches, progress=lambda n: status.update(f"replaying… {n}/{len(batches)} batches"))
    result.skipped[:0] = skipped
    out = {"log": str(log), "dry_run": result.summary(), "predictor": graph.predictor_note}
    if policy is not None:
        try:
            other = bootstrap(Settings.load(policy), profile=profile, predictor=None if no_lstm else "shipped")
        except (ConfigError, ValueError) as err:
            typer.echo(f"error: --policy {policy}: {err}", err=True)
            raise typer.Exit(2) from None
        workload = workload_from_log(batches)
        n = gpus or max(1, len(result.nodes))
        with console.status("what-if…") as status:
            out["what_if"] = asyncio.run(what_if(other, workload, n_gpus=n, progress=lambda d, t: status.update(
                f"what-if… {d:.0f}/{t:.0f} simulated s")))
        out["what_if"]["gpus"] = n
    if report is not None:
        out["report"] = str(write_timeline_report(report, result, title=f"kvguard replay of {log.name}",
                                                  notes=[f"predictor: {graph.predictor_note}",
                                                         "commands are what the policy would have issued; "
                                                         "nothing was executed"]))
    if json_out:
        sys.stdout.write(json.dumps(out, default=str) + "\n")
    else:
        s = out["dry_run"]
        console.print(f"{s['nodes']} node(s), {s['ticks']} ticks, {s['alerts']} alerts, {s['ooms']} OOM(s); the "
                      f"policy would have issued {s['commands']} command(s) {s['commands_by_action']}"
                      + (f"; {len(s['skipped_batches'])} invalid batch(es) skipped" if s["skipped_batches"] else ""))
        if "what_if" in out:
            w = out["what_if"]
            for label in ("without_policy", "with_policy"):
                r = w[label]
                console.print(f"what-if {label}: OOMs {r['ooms']}, preemptions {r['preemptions']}, failed "
                              f"{r['failed']}, rejected {r.get('rejected')}, TTFT p99 {r['ttft_p99_s']} s")
        if report is not None:
            console.print(f"report: {out['report']}")
