"""`kvguard simulate`: run the shadow engine over a trace or scenario on N simulated GPUs."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import typer

from kvguard.cli.app import app

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


def parse_duration(text: str) -> float:
    """'30m', '90s', '1h', '1h30m', '250ms' or plain seconds ('45') -> seconds."""
    t = text.strip().lower()
    try:
        value = float(t)
    except ValueError:
        pos, value = 0, 0.0
        for m in _DURATION.finditer(t):
            if m.start() != pos:
                break
            value += float(m.group(1)) * _UNIT_S[m.group(2)]
            pos = m.end()
        if pos != len(t) or not t:
            raise typer.BadParameter(f"expected a duration like 30m, 90s, 1h or 1h30m, got {text!r}",
                                     param_hint="--duration") from None
    if value <= 0:
        raise typer.BadParameter(f"expected a positive duration, got {text!r}", param_hint="--duration")
    return value


def run_simulation(workload: str, *, gpus: int = 1, duration_s: float | None = None, rate_scale: float = 1.0,
                   profile_name: str | None = None, seed: int = 0, events_out: Path | None = None,
                   drain: bool = True, flush_s: float = 10.0, progress=None) -> dict:
    """The command's core, callable from Python: returns the JSON summary as a dict."""
    from kvguard.contracts.units import NS_PER_S
    from kvguard.producers.fleet import Fleet
    from kvguard.producers.profiles import load_profile
    from kvguard.producers.workloads import load_workload

    profile = load_profile(profile_name)
    # prompts that could never fit one GPU's KV region (or the model's context) are capped, and said so
    max_prompt = min(profile.max_model_len - 1024, int(profile.capacity_tokens * 0.6))
    wl = load_workload(workload, rate_scale=rate_scale, window=duration_s, seed=seed, max_prompt_tokens=max_prompt)
    fleet = Fleet(gpus, profile, seed=seed)
    fleet.submit_workload(wl)
    last_arrival_ns = wl.requests[-1].arrival_ns if wl.requests else 0
    end_ns = int(duration_s * NS_PER_S) if duration_s is not None else last_arrival_ns + int(flush_s * NS_PER_S)
    drain_cap_ns = end_ns + 1800 * NS_PER_S  # at most 30 simulated minutes to finish what is in flight
    step_ns = int(flush_s * NS_PER_S)
    meta = {"workload": workload, "profile": profile.name, "gpus": gpus, "rate_scale": rate_scale, "seed": seed,
            "duration_s": duration_s, "nodes": fleet.nodes, "workload_notes": wl.notes}
    writer = None
    if events_out is not None:
        from kvguard.wire.eventlog import EventLogWriter

        writer = EventLogWriter(events_out, meta).__enter__()
    wall0 = time.perf_counter()
    t = 0
    try:
        while True:
            t += step_ns
            fleet.advance(t)
            batches = fleet.take_batches(t)
            if writer is not None:
                for b in batches:
                    writer.write(b)
            if progress is not None:
                progress(min(t, end_ns) / NS_PER_S, end_ns / NS_PER_S)
            if t >= end_ns:
                idle = fleet.pending == 0 and all(not (e._running or e._waiting or e._swapped) for e in fleet.engines)
                if not drain or idle or t >= drain_cap_ns:
                    break
    finally:
        if writer is not None:
            writer.__exit__(None, None, None)
    wall = time.perf_counter() - wall0
    out = fleet.summary().to_dict()
    out["wall_seconds"] = round(wall, 3)
    out["sim_speed_x"] = round(out["sim_seconds"] * gpus / wall, 1) if wall > 0 else None
    out.update({"gpus": gpus, "profile": profile.name, "workload": wl.describe(), "rate_scale": rate_scale,
                "seed": seed, "events_out": str(events_out) if events_out else None})
    per_gpu = fleet.per_gpu()
    for d, e in zip(per_gpu, fleet.engines):
        d["oom_fragmentation"] = sum(o["fragmentation"] for o in e.oom_log)
        d["oom_log"] = e.oom_log[:20]
    out["priority_defaulted"] = sum(d["priority_defaulted"] for d in per_gpu)
    out["ooms_from_fragmentation"] = sum(d["oom_fragmentation"] for d in per_gpu)
    out["per_gpu"] = per_gpu
    return out


def _print_table(out: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console.width = 120  # piped output: wide enough for the table
    wl = out["workload"]
    console.print(f"[bold]kvguard simulate[/] {wl['name']} x{out['rate_scale']:g} on {out['gpus']} GPU(s), "
                  f"profile {out['profile']}, seed {out['seed']}")
    for note in wl["notes"]:
        console.print(f"  [dim]{note}[/]")
    table = Table(show_header=True, header_style="bold")
    table.add_column("node", no_wrap=True, min_width=10)
    for col in ("req", "done", "failed", "rejected", "OOM", "preempt", "TTFT p99", "TPOT p50", "goodput", "down s"):
        table.add_column(col, justify="right", no_wrap=True)

    def row(name, d):
        fmt = lambda v: "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))  # noqa: E731
        table.add_row(name, fmt(d["requests"]), fmt(d["completed"]), fmt(d["failed"]), fmt(d["rejected"]),
                      fmt(d["ooms"]), fmt(d["preemptions"]), fmt(d["ttft_p99_s"]), fmt(d["tpot_p50_s"]),
                      fmt(d["goodput_tokens_per_s"]), fmt(d["downtime_s"]))

    for d in out["per_gpu"]:
        row(d["node"], d)
    row("[bold]fleet[/]", out)
    console.print(table)
    console.print("[dim]TTFT/TPOT in s, goodput in output tokens/s of completed requests; failed: lost in an OOM "
                  "crash; rejected: refused (GPU restarting, or a prompt that could never fit)[/]")
    if out["unfinished"]:
        console.print(f"{out['unfinished']} requests were still queued or running when the run ended")
    console.print(f"{out['sim_seconds']:.0f} simulated s in {out['wall_seconds']:.1f} wall s "
                  f"({out['sim_speed_x']}x real time per GPU summed), {out['events']} events, "
                  f"{out['ooms_from_fragmentation']} of {out['ooms']} OOMs from fragmentation")
    if out["events_out"]:
        console.print(f"event log: {out['events_out']}")


@app.command()
def simulate(
    workload: str = typer.Option(..., "--workload", "-w",
                                 help="Trace file (Azure CSV, Mooncake JSONL, ShareGPT CSV; .gz ok), a bundled "
                                      "trace (azure-conv, azure-code, mooncake-sample, sharegpt-sample) or a "
                                      "scenario (mixed, sessions, rag, drill)."),
    gpus: int = typer.Option(1, "--gpus", min=1, help="Simulated GPUs behind a least-loaded router."),
    duration: str = typer.Option(None, "--duration", help="Arrival window, e.g. 30m, 90s, 1h (default: whole trace)."),
    rate_scale: float = typer.Option(1.0, "--rate-scale", help="Multiply the arrival rate (inter-arrival times / X)."),
    profile: str = typer.Option(None, "--profile", help="Model/GPU profile (default: llama3-8b-24gb)."),
    seed: int = typer.Option(0, "--seed", help="Seed for synthetic arrivals and scenarios."),
    events_out: Path = typer.Option(None, "--events-out", help="Write the event log (gzip JSON lines) here."),
    drain: bool = typer.Option(True, "--drain/--no-drain", help="After the window, run until in-flight work ends."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """Run the shadow engine over a workload and report OOMs, preemptions, latency and goodput."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from kvguard.producers.profiles import ProfileError
    from kvguard.producers.workloads import WorkloadError

    if rate_scale <= 0:
        raise typer.BadParameter(f"expected > 0, got {rate_scale}", param_hint="--rate-scale")
    duration_s = parse_duration(duration) if duration else None
    err = Console(stderr=True)
    bar = Progress(TextColumn("simulating"), BarColumn(), TextColumn("{task.completed:.0f}/{task.total:.0f} sim s"),
                   TimeElapsedColumn(), console=err, transient=True, disable=not err.is_terminal)
    task = bar.add_task("sim", total=1.0)

    def progress(done_s: float, total_s: float) -> None:
        bar.update(task, completed=done_s, total=total_s)

    try:
        with bar:
            out = run_simulation(workload, gpus=gpus, duration_s=duration_s, rate_scale=rate_scale,
                                 profile_name=profile, seed=seed, events_out=events_out, drain=drain,
                                 progress=progress)
    except (WorkloadError, ProfileError) as e:
        err.print(f"[red]error:[/] {e}")
        raise typer.Exit(2) from None
    if as_json:
        sys.stdout.write(json.dumps(out, sort_keys=False) + "\n")
    else:
        _print_table(out)
