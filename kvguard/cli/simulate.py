"""`kvguard simulate`: run the shadow engine over a trace or scenario on N simulated GPUs."""

from __future__ import annotations

import json
import math
import re
import sys
import time
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


class EventLogFailed(OSError):
    """The event log could not be written; the run itself finished (``summary`` holds its result)."""

    def __init__(self, path, error: OSError, summary: dict):
        self.path, self.error, self.summary = path, error, summary
        super().__init__(f"could not write the event log {path}: {error.strerror or error}")


def run_simulation(workload: str, *, gpus: int = 1, duration_s: float | None = None, rate_scale: float = 1.0,
                   profile_name: str | None = None, seed: int = 0, events_out: Path | None = None,
                   drain: bool = True, flush_s: float = 10.0, progress=None, knobs=None,
                   prompt_logprobs_frac: float = 0.0, logprobs_guard: bool = False) -> dict:
    """The command's core, callable from Python: returns the JSON summary as a dict. ``knobs``: an
    ``EngineKnobs`` over the (vLLM) profile; ``prompt_logprobs_frac``: the share of requests asking
    for prompt logprobs (``echo`` + ``logprobs``, as lm-eval-harness's loglikelihood tasks do);
    ``logprobs_guard``: kvguard's node-side logprob guard on (vLLM profiles)."""
    from kvguard.contracts.units import NS_PER_S
    from kvguard.producers.sim.fleet import Fleet
    from kvguard.producers.sim.profiles import ProfileError, load_profile, prompt_cap_tokens
    from kvguard.producers.sim.vllm.engine import VllmEngineConfig
    from kvguard.producers.sim.workloads import load_workload

    profile = load_profile(profile_name, knobs=knobs)
    if prompt_logprobs_frac and profile.engine != "vllm":
        raise ProfileError(profile.name, "engine", "'vllm' for --prompt-logprobs-frac (the seed engine has no sampler)")
    # the seed engine caps prompts that could never fit one GPU's KV region (said in the notes); the
    # vLLM engine takes them as they are and rejects those over max_model_len, as vLLM does
    wl = load_workload(workload, rate_scale=rate_scale, window=duration_s, seed=seed,
                       max_prompt_tokens=prompt_cap_tokens(profile))
    if logprobs_guard and profile.engine != "vllm":
        raise ProfileError(profile.name, "engine", "'vllm' for --logprobs-guard (the seed engine has no sampler)")
    config = VllmEngineConfig(prompt_logprobs_frac=prompt_logprobs_frac, logprobs_guard=logprobs_guard) \
        if profile.engine == "vllm" else None
    fleet = Fleet(gpus, profile, seed=seed, config=config)
    fleet.submit_workload(wl)
    last_arrival_ns = wl.requests[-1].arrival_ns if wl.requests else 0
    end_ns = int(duration_s * NS_PER_S) if duration_s is not None else last_arrival_ns + int(flush_s * NS_PER_S)
    drain_cap_ns = end_ns + 1800 * NS_PER_S  # at most 30 simulated minutes to finish what is in flight
    step_ns = int(flush_s * NS_PER_S)
    meta = {"workload": workload, "profile": profile.name, "gpus": gpus, "rate_scale": rate_scale, "seed": seed,
            "duration_s": duration_s, "nodes": fleet.nodes, "workload_notes": wl.notes}
    writer, write_error = None, None
    if events_out is not None:
        from kvguard.wire.eventlog import EventLogWriter

        try:
            writer = EventLogWriter(events_out, meta).__enter__()
        except OSError as e:
            write_error = e
    state = {"writer": writer, "error": write_error}

    def write(batches) -> None:
        if state["writer"] is None:
            return
        try:
            for b in batches:
                state["writer"].write(b)
        except OSError as e:  # the disk filled up or went away: finish the run, then say so
            state["error"], state["writer"] = e, _close_quietly(state["writer"])

    wall0 = time.perf_counter()
    try:
        fleet.run(end_ns, step_ns=step_ns, drain=drain, drain_cap_ns=drain_cap_ns, on_batches=write,
                  progress=progress)
    finally:
        writer, write_error = state["writer"], state["error"]
        if writer is not None:
            try:
                writer.__exit__(None, None, None)
            except OSError as e:
                write_error = write_error or e
    wall = time.perf_counter() - wall0
    out = fleet.summary().to_dict()
    out["wall_seconds"] = round(wall, 3)
    out["sim_speed_x"] = round(out["sim_seconds"] * gpus / wall, 1) if wall > 0 else None
    out.update({"gpus": gpus, "profile": profile.name, "workload": wl.describe(), "rate_scale": rate_scale,
                "seed": seed, "events_out": str(events_out) if events_out else None,
                "knobs": knobs.to_dict() if knobs is not None else {}, "prompt_logprobs_frac": prompt_logprobs_frac,
                "logprobs_guard": logprobs_guard})
    if logprobs_guard:
        out["logprobs_guard_steps"] = sum(e.logprobs_guard_steps for e in fleet.engines)
    if profile.memory is not None:
        out["kv_blocks"] = profile.memory.num_gpu_blocks
    per_gpu = fleet.per_gpu()
    for d, e in zip(per_gpu, fleet.engines):
        d["oom_fragmentation"] = sum(o["fragmentation"] for o in e.oom_log)
        d["oom_log"] = e.oom_log[:20]
    out["priority_defaulted"] = sum(d["priority_defaulted"] for d in per_gpu)
    out["ooms_from_fragmentation"] = sum(d["oom_fragmentation"] for d in per_gpu)
    out["ooms_by_cause"] = fleet.ooms_by_cause()
    out["rejected_by_reason"] = fleet.rejected_by_reason()
    out["engine"] = profile.engine
    out["per_gpu"] = per_gpu
    if write_error is not None:
        raise EventLogFailed(events_out, write_error, out)
    return out


def _close_quietly(writer) -> None:
    try:
        writer.__exit__(None, None, None)
    except OSError:
        pass


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
    engine: str = typer.Option(None, "--engine", help="Engine the shadow fleet runs: vllm, sglang or seed (the "
                                                      "catalogue's default profile of that engine; with --profile, "
                                                      "the profile must be of that engine)."),
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

    from kvguard.producers.sim.profiles import EngineKnobs, ProfileError, default_profile_name, load_profile
    from kvguard.producers.sim.workloads import WorkloadError

    check_rate_scale(rate_scale)
    err = Console(stderr=True)
    if engine is not None:
        try:
            if profile is None:
                profile = default_profile_name(engine)
            elif load_profile(profile).engine != engine:
                raise ProfileError(profile, "engine", f"{engine!r} (--engine), got {load_profile(profile).engine!r}")
        except ProfileError as e:
            err.print(f"[red]error:[/] {e}")
            raise typer.Exit(2) from None
    if not 0.0 <= prompt_logprobs_frac <= 1.0:
        raise typer.BadParameter(f"expected a share in [0, 1], got {prompt_logprobs_frac}",
                                 param_hint="--prompt-logprobs-frac")
    knobs = EngineKnobs(gpu_memory_utilization=gpu_memory_utilization, max_num_batched_tokens=max_num_batched_tokens,
                        allocator_conf=alloc_conf)
    duration_s = parse_duration(duration) if duration else None
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
