"""`kvguard rca`: root-cause analysis of the OOMs in a recorded event log (core: ``kvguard.ops.rca``)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from kvguard.cli.app import app


@app.command("rca")
def rca_command(
    events: Path = typer.Option(..., "--events", help="Event log (gzip JSON lines: `simulate --events-out`, "
                                                      "`kvguard record`, the vLLM plugin's log)."),
    node: str = typer.Option(None, "--node", help="Only this node's OOMs."),
    model: Path = typer.Option(None, "--model", help="Model artifact for the predictor tier (trees or LSTM); default: shipped."),
    no_lstm: bool = typer.Option(False, "--no-lstm", help="Tiers 1-2 only (no P(OOM))."),
    tick: str = typer.Option(None, "--tick", help="Tick interval, e.g. 10s (default: settings streams.tick_s)."),
    window: str = typer.Option("30m", "--window", help="How far back before each OOM the plots reach."),
    report: Path = typer.Option(None, "--report", help="Directory for rca.md and one PNG per OOM."),
    snapshot: Path = typer.Option(None, "--snapshot", help="A PyTorch snapshot of the crashing process "
                                                           "(torch.cuda.memory._dump_snapshot, .pickle or .pickle.gz): "
                                                           "its allocator figures (largest free block, what "
                                                           "empty_cache() could return) for the OOM it was taken at."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """Explain each OOM and incident of a recorded event log.

    For each OOM, its cause (the failure class: prompt logprobs, long context, speculative decoding, a
    neighbour, a leak; the allocator's peak or fragmentation; the KV arena's capacity or fragmentation),
    the allocation requested against device free, reserved, allocated and reserved-but-unallocated
    bytes, the crashing step and the shapes of its requests, the headroom start-up left, what would
    have prevented it, and each alert tier's lead time. Then the incidents that are not OOMs: preemption
    storms, refusals and long queueing stretches, each with its cause. Reads `simulate --events-out`,
    `kvguard record` and the vLLM plugin's logs; invalid batches are named and left out.
    """
    from rich.console import Console

    from kvguard.cli.simulate import parse_duration
    from kvguard.config.extras import require
    from kvguard.config.settings import Settings
    from kvguard.ops import rca
    from kvguard.ops.rca_incidents import plot_incidents
    from kvguard.runtime.bootstrap import bootstrap
    from kvguard.wire.eventlog import EventLogError, read_event_log

    err = Console(stderr=True)
    if report is not None:
        require("matplotlib")  # the report's plots: said before the replay, not after it
    window_s = parse_duration(window)
    settings = Settings.load()
    if tick is not None:
        tick_s = parse_duration(tick)
        settings = settings.model_copy(update={"streams": settings.streams.model_copy(update={"tick_s": tick_s})})
    if no_lstm and model is not None:
        raise typer.BadParameter("give --model or --no-lstm, not both", param_hint="--model")
    predictor = None if no_lstm else (str(model) if model is not None else "shipped")
    graph = bootstrap(settings, predictor=predictor)
    if not no_lstm and graph.predictor is None:
        typer.echo(f"error: {graph.predictor_note}", err=True)
        raise typer.Exit(2)
    model_tick = getattr(getattr(graph.predictor, "metadata", None), "tick_s", None)
    if model_tick is not None and abs(model_tick - settings.streams.tick_s) > 1e-9:
        err.print(f"[yellow]warning:[/] the model was trained on {model_tick:g} s ticks, replaying at "
                  f"{settings.streams.tick_s:g} s: P(OOM) is off its calibration")
    core = graph.stream_core(with_predictor=not no_lstm)
    snap = None
    if snapshot is not None:
        from kvguard.producers.torch_snapshot.figures import SnapshotError, snapshot_figures

        try:
            snap = snapshot_figures(snapshot)
        except SnapshotError as exc:
            typer.echo(f"error: --snapshot {snapshot}: {exc}", err=True)
            raise typer.Exit(2) from None
    skipped = []  # invalid batch lines: reported and left out, as the stream worker dead-letters them
    try:
        meta, batches = read_event_log(events, on_invalid=_warn_skipped(err, skipped))
        with err.status(f"replaying {events}") as status:
            rep = rca.replay(batches, core, node=node, policy=graph.policy_engine(),
                             progress=lambda n: status.update(f"replaying {events}: {n:,} events"))
    except EventLogError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    if node is not None and node not in rep.nodes:
        typer.echo(f"error: --node {node!r}: not in {events} (nodes: {meta.get('nodes', '?')})", err=True)
        raise typer.Exit(2)
    if skipped and not any(nr.events for nr in rep.nodes.values()):
        typer.echo(f"error: {events}: no valid batch ({len(skipped)} skipped, the first: {skipped[0].describe()})",
                   err=True)
        raise typer.Exit(2)
    rep.skipped[:0] = [s.to_dict() for s in skipped]
    reports = rca.analyse(rep, window_s=window_s, snapshot=snap)
    incidents = rca.incidents(rep)
    summ = rca.summary(rep, reports, incidents)
    out = {"events": str(events), "meta": meta, "ooms": [r.to_dict() for r in reports],
           "incidents": [i.to_dict() for i in incidents],
           "nodes": rca.node_summaries(rep, reports), "summary": summ, "predictor": graph.predictor_note,
           "skipped_batches": rep.skipped}
    if snap is not None:
        out["snapshot"] = snap
    if report is not None:
        report.mkdir(parents=True, exist_ok=True)
        images = {}
        for i, r in enumerate(reports):
            name = f"oom_{i + 1:03d}_{_safe(r.node)}.png"
            nr = rep.nodes[r.node]
            rca.plot_oom(r, [t for t in nr.ticks if t.epoch == r.epoch], str(report / name), window_s=window_s,
                         other_ooms_ns=[o.ts_ns for o in nr.ooms if o.epoch == r.epoch],
                         commands=[(ts, a) for ts, a, e in nr.commands if e == r.epoch],
                         policy_rows=[row for row in nr.policy_rows if row[-1] == r.epoch])
            images[i] = name
        incident_images = {}
        for name_ in sorted({i.node for i in incidents}):
            nr = rep.nodes[name_]
            last = max(i.epoch for i in incidents if i.node == name_)  # the node's latest run with incidents
            png = f"incidents_{_safe(name_)}.png"
            plot_incidents(name_, [t for t in nr.ticks if t.epoch == last],
                               [i for i in incidents if i.node == name_ and i.epoch == last], str(report / png),
                               commands=[c for c in nr.commands if c[2] == last],
                               policy_rows=[r_ for r_ in nr.policy_rows if r_[-1] == last])
            incident_images[name_] = png
        (report / "rca.md").write_text(rca.markdown(reports, summ, images, str(events), incidents=incidents,
                                                    skipped=rep.skipped, incident_images=incident_images))
        out["report"] = {"markdown": str(report / "rca.md"), "images": [str(report / n) for n in images.values()],
                         "incident_images": [str(report / n) for n in incident_images.values()]}
    if as_json:
        typer.echo(json.dumps(out))
    else:
        _print(out, reports)


def _warn_skipped(err, skipped: list):
    """``read_event_log``'s ``on_invalid``: say which batch was left out and why, keep it for the report."""
    def note(s) -> None:
        skipped.append(s)
        typer.echo(f"warning: {s.describe()}", err=True)
    return note


def _safe(node: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in node)


def _print(out: dict, reports) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from kvguard.contracts.units import NS_PER_S

    console = Console()
    if not console.is_terminal:
        console.width = 120
    s = out["summary"]
    causes = ", ".join(f"{k} {v}" for k, v in s.get("ooms_by_cause", {}).items())
    console.print(f"[bold]kvguard rca[/] {out['events']}: {s['ooms']} OOM(s) on {s['nodes']} node(s)"
                  + (f" ({causes})" if causes else "") + f"  [dim]({out['predictor']})[/]")
    if not reports:
        console.print("[green]No OOM in this log.[/]")
    for skipped in out.get("skipped_batches", [])[:10]:
        console.print(f"[yellow]skipped[/] line {skipped.get('line') or '-'}: node {skipped.get('node')} epoch "
                      f"{skipped.get('epoch')} seq {skipped.get('seq')}: {escape(str(skipped.get('reason')))}")
    for i, r in enumerate(reports):
        epoch = f" (producer run {r.epoch})" if r.epoch else ""
        if r.allocator:
            ex = r.explanation or {}
            console.print(f"\n[bold]OOM {i + 1}[/] {r.node} at t={r.ts_s:.1f} s{epoch}: [red]{r.cause_key}[/] — "
                          f"{escape(ex.get('title', ''))}")
            for d in ex.get("details", []):
                console.print(f"  {escape(d)}")
            for p in ex.get("prevention", []):
                console.print(f"  [green]would have prevented it:[/] {escape(p)}")
        else:
            kind = "[red]fragmentation OOM[/]" if r.fragmentation else "[magenta]capacity OOM[/]"
            free = "?" if r.free_units is None else r.free_units
            console.print(f"\n[bold]OOM {i + 1}[/] {r.node} at t={r.ts_s:.1f} s{epoch}: {kind} — requested "
                          f"{r.requested_units} units, largest free run {r.largest_free_run}, free {free}")
        leads = ", ".join(f"{t.tier} [bold]{t.lead_s:.0f} s[/]" + (f" ({', '.join(t.rules_firing)})" if t.rules_firing
                                                                   else "") for t in r.tiers.values())
        console.print(f"  lead time: {leads}")
        if r.trigger is not None and not r.allocator:
            console.print(f"  likely trigger: request {r.trigger.req}, prompt {r.trigger.prompt_tokens} tokens, "
                          f"admitted {(r.ts_ns - r.trigger.admit_ts_ns) / NS_PER_S:.1f} s before "
                          f"({len(r.admitted)} admitted in the minute before)")
        if not r.last_ticks:
            console.print("  [dim]no tick before the OOM (the log starts less than a tick before it)[/]")
            continue
        table = Table(show_header=True, header_style="bold", box=None, padding=(0, 1))
        if r.allocator:
            for col in ("t (s)", "U_kv", "reserved GiB", "allocated GiB", "resv-unalloc GiB", "alloc F_ext", "waiting",
                        "P(OOM)"):
                table.add_column(col, justify="right")
            for t in r.last_ticks:
                table.add_row(f"{t.ts_ns / NS_PER_S:.0f}", f"{t.u_kv:.3f}", f"{t.alloc_reserved_bytes / 2**30:.2f}",
                              f"{t.alloc_allocated_bytes / 2**30:.2f}",
                              f"{(t.alloc_reserved_bytes - t.alloc_allocated_bytes) / 2**30:.2f}",
                              f"{t.alloc_f_ext:.3f}", str(t.requests_waiting),
                              "-" if t.p_oom is None else f"{t.p_oom:.3f}")
            console.print(table)
            continue
        for col in ("t (s)", "U_kv", "F_ext", "F_int", "Ψ", "run/req", "waiting", "P(OOM)"):
            table.add_column(col, justify="right")
        for t in r.last_ticks:
            table.add_row(f"{t.ts_ns / NS_PER_S:.0f}", f"{t.u_kv:.3f}", f"{t.f_ext:.3f}", f"{t.f_int:.3f}",
                          f"{t.psi:.3f}", f"{t.largest_free_run_units}/{r.requested_units}", str(t.requests_waiting),
                          "-" if t.p_oom is None else f"{t.p_oom:.3f}")
        console.print(table)
    incidents = out.get("incidents", [])
    if incidents:
        console.print(f"\n[bold]{len(incidents)} incident(s)[/] that are not OOMs: "
                      + ", ".join(f"{k} {v}" for k, v in s.get("incidents_by_kind", {}).items()))
        for inc in incidents[:20]:
            console.print(f"  {inc['kind']} {inc['node']} t={inc['start_s']:.0f}–{inc['end_s']:.0f} s: [bold]"
                          f"{escape(inc['cause'])}[/] — {escape(inc['title'])}")
    if "report" in out:
        console.print(f"\nreport: {out['report']['markdown']}")
