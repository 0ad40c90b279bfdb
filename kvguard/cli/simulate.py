"""`kvguard simulate`: run the shadow engine over a trace or scenario on N simulated GPUs."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import typer

from kvguard.cli.app import app

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|d|h|m|s)")
_UNIT_S = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
MAX_DURATION_S = 30 * 86400.0  # a month of simulated arrivals is plenty; more is a typo
MAX_RATE_SCALE = 1000.0


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
    if not math.isfinite(value) or value <= 0:
        raise typer.BadParameter(f"expected a positive duration, got {text!r}", param_hint="--duration")
    if value > MAX_DURATION_S:
        raise typer.BadParameter(f"expected at most 30 days ({MAX_DURATION_S:g} s), got {text!r}",
                                 param_hint="--duration")
    return value


def check_rate_scale(value: float) -> float:
    if not math.isfinite(value) or not 0 < value <= MAX_RATE_SCALE:
        raise typer.BadParameter(f"expected a finite number in (0, {MAX_RATE_SCALE:g}], got {value}",
                                 param_hint="--rate-scale")
    return value


TABLE_WIDTH = 80


def _print_table(out: dict) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console(width=TABLE_WIDTH) if not Console().is_terminal else Console()
    console.width = min(console.width, TABLE_WIDTH)
    wl = out["workload"]
    console.print(f"[bold]kvguard simulate[/] {wl['name']} x{out['rate_scale']:g}, {out['gpus']} GPU(s), "
                  f"{out['profile']} ({out['engine']} engine), seed {out['seed']}")
    for note in wl["notes"]:
        console.print(f"  [dim]{note}[/]")
    table = Table(show_header=True, header_style="bold", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                  padding=(0, 0, 0, 1))  # one space either side of the separator: 11 columns in 80
    table.add_column("node", no_wrap=True)
    for col in ("req", "done", "fail", "rej", "OOM", "preempt", "TTFT", "TPOT", "tok/s", "down"):
        table.add_column(col, justify="right", no_wrap=True)

    def fmt(v, digits=3):
        return "-" if v is None else (f"{v:.{digits}f}" if isinstance(v, float) else str(v))

    def row(name, d):
        table.add_row(name, fmt(d["requests"]), fmt(d["completed"]), fmt(d["failed"]), fmt(d["rejected"]),
                      fmt(d["ooms"]), fmt(d["preemptions"]), fmt(d["ttft_p99_s"], 2), fmt(d["tpot_p50_s"]),
                      fmt(d["goodput_tokens_per_s"], 0), fmt(d["downtime_s"], 0))

    for d in out["per_gpu"]:
        row(d["node"], d)
    row("[bold]fleet[/]", out)
    console.print(table)
    console.print("[dim]TTFT p99 and TPOT p50 in s; tok/s: output tokens/s of completed requests; down: s "
                  "restarting; fail: lost in an OOM crash; rej: rejected (GPU restarting, prompt too long)[/]")
    if out["ooms"]:
        causes = ", ".join(f"{c} {n}" for c, n in out["ooms_by_cause"].items())
        console.print(f"OOMs by cause: {causes}")
    if out["rejected_by_reason"]:
        console.print("rejected: " + ", ".join(f"{r} {n}" for r, n in out["rejected_by_reason"].items()))
    allocators = [d["allocator"] for d in out["per_gpu"] if d.get("allocator")]
    if allocators:
        gib = 1 << 30
        console.print(f"allocator peak reserved {max(a['peak_reserved_bytes'] for a in allocators) / gib:.2f} GiB, "
                      f"peak allocated {max(a['peak_allocated_bytes'] for a in allocators) / gib:.2f} GiB, "
                      f"retries {sum(a['num_alloc_retries'] for a in allocators)} (max over GPUs; retries summed)")
    if out["unfinished"]:
        console.print(f"{out['unfinished']} requests were still queued or running when the run ended")
    console.print(f"{out['sim_seconds']:.0f} simulated s in {out['wall_seconds']:.1f} wall s "
                  f"({out['sim_speed_x']}x real time per GPU summed), {out['events']} events")
    if out["events_out"]:
        console.print(f"event log: {out['events_out']}")


@app.command()
def simulate(
    workload: str = typer.Option(..., "--workload", "-w",
                                 help="Trace file (Azure CSV, Mooncake JSONL, ShareGPT CSV; .gz ok), a bundled "
                                      "trace (azure-conv, azure-code, mooncake-sample, sharegpt-sample) or a "
                                      "scenario (mixed, sessions, rag, drill)."),
    gpus: int = typer.Option(1, "--gpus", min=1, help="Simulated GPUs behind a least-loaded router."),
    duration: str = typer.Option(None, "--duration", help="Arrival window, e.g. 30m, 90s, 1h, 2d, at most 30 days "
                                                          "(default: whole trace)."),
    rate_scale: float = typer.Option(1.0, "--rate-scale", help="Multiply the arrival rate (inter-arrival times / X), "
                                                               "0 < X <= 1000."),
    profile: str = typer.Option(None, "--profile", help="Model/GPU profile (default: the profiles file's default)."),
    seed: int = typer.Option(0, "--seed", help="Seed for synthetic arrivals and scenarios."),
    events_out: Path = typer.Option(None, "--events-out", help="Write the event log (gzip JSON lines) here."),
    drain: bool = typer.Option(True, "--drain/--no-drain", help="After the window, run until in-flight work ends."),
    gpu_memory_utilization: float = typer.Option(
        None, "--gpu-memory-utilization", help="vLLM profiles: vLLM's --gpu-memory-utilization (default: the "
                                               "profile's, 0.9); the KV cache is re-sized by the profiling run."),
    max_num_batched_tokens: int = typer.Option(
        None, "--max-num-batched-tokens", min=1, help="vLLM profiles: the per-step token budget."),
    alloc_conf: str = typer.Option(
        None, "--alloc-conf", help="vLLM profiles: PYTORCH_CUDA_ALLOC_CONF, e.g. expandable_segments:True."),
    prompt_logprobs_frac: float = typer.Option(
        0.0, "--prompt-logprobs-frac", help="vLLM profiles: share of requests asking for prompt logprobs "
                                            "(echo + logprobs, as eval harnesses send; vllm#5907)."),
    logprobs_guard: bool = typer.Option(
        False, "--logprobs-guard", help="vLLM profiles: kvguard's node-side guard that sizes each step so the "
                                        "logits of prompt-logprob requests fit the allocator's headroom."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """Run the shadow engine over a workload and report OOMs, preemptions, latency and goodput."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from kvguard.producers.sim.profiles import EngineKnobs, ProfileError
    from kvguard.producers.sim.workloads import WorkloadError
    from kvguard.runtime.simulation import EventLogFailed, run_simulation

    check_rate_scale(rate_scale)
    if not 0.0 <= prompt_logprobs_frac <= 1.0:
        raise typer.BadParameter(f"expected a share in [0, 1], got {prompt_logprobs_frac}",
                                 param_hint="--prompt-logprobs-frac")
    knobs = EngineKnobs(gpu_memory_utilization=gpu_memory_utilization, max_num_batched_tokens=max_num_batched_tokens,
                        allocator_conf=alloc_conf)
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
                                 progress=progress, knobs=knobs, prompt_logprobs_frac=prompt_logprobs_frac,
                                 logprobs_guard=logprobs_guard)
    except (WorkloadError, ProfileError) as e:
        err.print(f"[red]error:[/] {e}")
        raise typer.Exit(2) from None
    except EventLogFailed as e:
        _print(e.summary, as_json)
        err.print(f"[red]error:[/] {e}", soft_wrap=True)
        raise typer.Exit(1) from None
    _print(out, as_json)


def _print(out: dict, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(out, sort_keys=False) + "\n")
    else:
        _print_table(out)
