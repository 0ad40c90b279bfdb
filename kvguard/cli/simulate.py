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
                   prompt_logprobs_frac: float = 0.0, logprobs_guard: bool = False, engine_args=None,
                   bench=None, max_concurrency: int | None = None, neighbour=None, leak=None,
                   long_context_frac: float = 0.0, long_context_len: int = 0) -> dict:
    """The command's core, callable from Python: returns the JSON summary as a dict. ``knobs``: an
    ``EngineKnobs`` over the (vLLM) profile; ``prompt_logprobs_frac``: the share of requests asking
    for prompt logprobs (``echo`` + ``logprobs``, as lm-eval-harness's loglikelihood tasks do);
    ``logprobs_guard``: kvguard's node-side logprob guard on (vLLM profiles). ``engine_args``: an
    ``EngineArgs`` (your model config, GPU and ``vllm serve`` flags) instead of a bundled profile;
    ``bench``: a ``BenchRun`` (``vllm bench serve``'s random dataset and client) for ``--workload random``;
    ``max_concurrency``: a closed-loop client over any workload; ``neighbour``/``leak``: memory outside
    vLLM (``sim.vllm.external``); ``long_context_*``: a share of prompts made that long (class C3)."""
    from kvguard.contracts.units import NS_PER_S
    from kvguard.producers.sim.fleet import Fleet
    from kvguard.producers.sim.profiles import ProfileError, load_profile, prompt_cap_tokens
    from kvguard.producers.sim.vllm.engine import VllmEngineConfig
    from kvguard.producers.sim.workloads import load_workload, with_long_context

    profile = engine_args.profile() if engine_args is not None else load_profile(profile_name, knobs=knobs)
    if prompt_logprobs_frac and profile.engine != "vllm":
        raise ProfileError(profile.name, "engine", "'vllm' for --prompt-logprobs-frac (the seed engine has no sampler)")
    # the seed engine caps prompts that could never fit one GPU's KV region (said in the notes); the
    # vLLM engine takes them as they are and rejects those over max_model_len, as vLLM does
    if bench is not None:
        wl = bench.workload()
    else:
        wl = load_workload(workload, rate_scale=rate_scale, window=duration_s, seed=seed,
                           max_prompt_tokens=prompt_cap_tokens(profile))
    if long_context_frac:
        wl = with_long_context(wl, long_context_frac, long_context_len, seed)
    if logprobs_guard and profile.engine != "vllm":
        raise ProfileError(profile.name, "engine", "'vllm' for --logprobs-guard (the seed engine has no sampler)")
    if (neighbour is not None or leak is not None) and profile.engine != "vllm":
        raise ProfileError(profile.name, "engine", "'vllm' for --neighbour / --leak (the seed engine has no device)")
    config = VllmEngineConfig(prompt_logprobs_frac=prompt_logprobs_frac, logprobs_guard=logprobs_guard,
                              neighbour=neighbour, leak=leak) if profile.engine == "vllm" else None
    fleet = Fleet(gpus, profile, seed=seed, config=config)
    if bench is not None or max_concurrency is not None:
        return _run_closed_loop(fleet, wl, profile, bench, max_concurrency, duration_s, events_out, progress,
                                knobs, seed, gpus, prompt_logprobs_frac, logprobs_guard, flush_s)
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
    out = _summary(fleet, profile, wl, wall, gpus, rate_scale, seed, events_out, knobs, prompt_logprobs_frac,
                   logprobs_guard)
    if write_error is not None:
        raise EventLogFailed(events_out, write_error, out)
    return out


class _EventLog:
    """The optional event log of a run: opened at the start, written per batch, closed at the end; a
    failed write stops writing and is reported after the run (``EventLogFailed``)."""

    def __init__(self, path: Path | None, meta: dict):
        self.path, self.writer, self.error = path, None, None
        if path is not None:
            from kvguard.wire.eventlog import EventLogWriter

            try:
                self.writer = EventLogWriter(path, meta).__enter__()
            except OSError as e:
                self.error = e

    def write(self, batches) -> None:
        if self.writer is None:
            return
        try:
            for b in batches:
                self.writer.write(b)
        except OSError as e:
            self.error, self.writer = e, _close_quietly(self.writer)

    def close(self) -> OSError | None:
        if self.writer is not None:
            try:
                self.writer.__exit__(None, None, None)
            except OSError as e:
                self.error = self.error or e
        return self.error


def _run_closed_loop(fleet, wl, profile, bench, max_concurrency, duration_s, events_out, progress, knobs, seed,
                     gpus, prompt_logprobs_frac, logprobs_guard, flush_s) -> dict:
    """``vllm bench serve``'s client over the fleet (``producers.sim.bench_serve``)."""
    from kvguard.contracts.units import NS_PER_S
    from kvguard.producers.sim.bench_serve import ClosedLoopClient

    limit = bench.max_concurrency if bench is not None else max_concurrency
    client = ClosedLoopClient(fleet, wl, limit)
    log = _EventLog(events_out, {"workload": wl.name, "profile": profile.name, "gpus": gpus, "seed": seed,
                                 "nodes": fleet.nodes, "workload_notes": wl.notes})
    cap_s = duration_s if duration_s is not None else 7 * 86400.0
    wall0 = time.perf_counter()
    try:
        client.run(cap_ns=int(cap_s * NS_PER_S), on_batches=log.write, flush_ns=int(flush_s * NS_PER_S))
    finally:
        write_error = log.close()
    wall = time.perf_counter() - wall0
    if progress is not None:
        progress(1.0, 1.0)
    out = _summary(fleet, profile, wl, wall, gpus, 1.0, seed, events_out, knobs, prompt_logprobs_frac,
                   logprobs_guard)
    out["bench"] = client.metrics()
    out["bench"]["preemptions"] = out["preemptions"]
    out["bench"]["kv_token_capacity"] = out.get("kv_token_capacity")
    out["bench"]["max_concurrency"] = limit
    if bench is not None:
        out["bench"].update(bench.describe())
    if write_error is not None:
        raise EventLogFailed(events_out, write_error, out)
    return out


def _summary(fleet, profile, wl, wall, gpus, rate_scale, seed, events_out, knobs, prompt_logprobs_frac,
             logprobs_guard) -> dict:
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
        out["kv_token_capacity"] = profile.memory.kv_token_capacity
        out["max_model_len"] = profile.max_model_len
        out["startup_log"] = profile.memory.log_lines()
    engines = fleet.engines
    if any(getattr(e, "num_spec", 0) for e in engines):
        drafts = sum(e.spec_drafts for e in engines)
        accepted = sum(e.spec_accepted for e in engines)
        out["spec_decode"] = {"num_speculative_tokens": engines[0].num_spec, "draft_tokens": drafts,
                              "accepted_tokens": accepted,
                              "acceptance_rate": round(accepted / drafts, 4) if drafts else None}
    out["startups_refused"] = sum(getattr(e, "startups_refused", 0) for e in engines)
    per_gpu = fleet.per_gpu()
    for d, e in zip(per_gpu, fleet.engines):
        d["oom_fragmentation"] = sum(o["fragmentation"] for o in e.oom_log)
        d["oom_log"] = e.oom_log[:20]
    out["priority_defaulted"] = sum(d["priority_defaulted"] for d in per_gpu)
    out["ooms_from_fragmentation"] = sum(d["oom_fragmentation"] for d in per_gpu)
    out["ooms_by_cause"] = fleet.ooms_by_cause()
    out["rejected_by_reason"] = fleet.rejected_by_reason()
    from kvguard.producers.sim.vllm.engine import RETRYABLE_REASONS  # the CLI's imports are lazy (cli/app.py)

    out["rejected_retryable"] = sum(n for reason, n in out["rejected_by_reason"].items() if reason in RETRYABLE_REASONS)
    out["engine"] = profile.engine
    out["per_gpu"] = per_gpu
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
    if out.get("bench"):
        _print_bench(console, out["bench"])
    if out.get("startup_log"):
        for line in out["startup_log"]:
            console.print(f"  [dim]{line}[/]")
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
                                               "profile's: vLLM 0.33's 0.92); the KV cache is re-sized by the "
                                               "profiling run."),
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
    # -- your model, GPU and `vllm serve` flags (vLLM 0.33's names and defaults)
    model_config: str = typer.Option(None, "--model-config", help="A Hugging Face config.json (or its directory) "
                                     "of a dense Llama/Mistral/Qwen2/Qwen3 decoder, instead of --profile."),
    gpu: str = typer.Option(None, "--gpu", help="With --model-config: h100-80gb, h200, b200, a100-40gb, l40s, "
                            "rtx4090, rtx3090, rtx5090 (capacities as CUDA reports them)."),
    gpu_memory_gib: float = typer.Option(None, "--gpu-memory-gib", help="With --model-config: the GPU's capacity "
                                         "in GiB instead of a named --gpu (default 80)."),
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", "-tp", min=1,
                                             help="With --model-config: one simulated GPU is one TP rank."),
    dtype: str = typer.Option("auto", "--dtype", help="With --model-config: auto, half, float16, bfloat16, float, "
                              "float32."),
    max_model_len: int = typer.Option(None, "--max-model-len", help="vLLM's --max-model-len (-1: fit it to the KV "
                                      "cache)."),
    kv_cache_memory_bytes: str = typer.Option(None, "--kv-cache-memory-bytes", help="vLLM's fixed KV cache size "
                                              "(bytes, or 8G / 8589934592 as vLLM parses it) instead of "
                                              "the utilization formula."),
    watermark: float = typer.Option(None, "--watermark", help="vLLM's --watermark: share of KV blocks kept free "
                                    "when admitting a waiting request (0.0 default, [0, 1))."),
    max_num_seqs: int = typer.Option(None, "--max-num-seqs", min=1, help="vLLM's --max-num-seqs."),
    scheduler_reserve_full_isl: bool = typer.Option(
        None, "--scheduler-reserve-full-isl/--no-scheduler-reserve-full-isl", help="vLLM's full-sequence "
        "admission gate (on by default in 0.33)."),
    max_num_queued_reqs: int = typer.Option(None, "--max-num-queued-reqs", min=0, help="vLLM's 503 cap on "
                                            "unfinished requests (retryable rejections, counted by reason)."),
    max_num_queued_tokens: str = typer.Option(None, "--max-num-queued-tokens", help="vLLM's 503 cap on the "
                                              "prefill token backlog (10k accepted)."),
    scheduling_policy: str = typer.Option(None, "--scheduling-policy", help="fcfs (default) or priority "
                                          "(lower value first, then arrival; preempts the largest)."),
    num_speculative_tokens: int = typer.Option(None, "--num-speculative-tokens", min=1, help="Speculative "
                                               "decoding, draft_model method: drafts per step (with "
                                               "--speculative-model-config)."),
    speculative_model_config: str = typer.Option(None, "--speculative-model-config", help="The draft model's "
                                                 "config.json (same vocabulary as the target)."),
    spec_acceptance_rate: float = typer.Option(None, "--spec-acceptance-rate", help="Probability each draft "
                                               "token is accepted (a workload property; default 0.7)."),
    enforce_eager: bool = typer.Option(None, "--enforce-eager/--no-enforce-eager", help="vLLM's --enforce-eager: "
                                       "no CUDA graphs, no graph estimate, no JIT kernel warm-up."),
    model_runner: str = typer.Option(None, "--model-runner", help="v2 (vLLM 0.33's default) or v1 "
                                     "(VLLM_USE_V2_MODEL_RUNNER=0)."),
    attention_lse: str = typer.Option(None, "--attention-lse", help="FlashAttention LSE layout: total_q (vLLM "
                                      "0.33), max_seqlen_q (FA2 before Dao-AILab PR#970) or max_seq_len "
                                      "(padded by the context, club-3090 'Cliff 1')."),
    # -- memory outside vLLM and traffic shapes (failure classes C3, C4, C7)
    neighbour: str = typer.Option(None, "--neighbour", help="Another process on the GPU: SIZE[:RATE], e.g. "
                                  "2GiB or 2GiB:+3GiB/h (present at start-up, growing at RATE)."),
    leak: str = typer.Option(None, "--leak", help="Memory never returned: 1GiB/h, 4MiB/req or 1MiB/step (off by "
                              "default); a restart returns it."),
    long_context_frac: float = typer.Option(0.0, "--long-context-frac", help="Share of requests whose prompt is "
                                            "--long-context-len tokens."),
    long_context_len: int = typer.Option(0, "--long-context-len", min=0, help="Prompt length of the long-context "
                                         "share."),
    # -- `vllm bench serve` (with --workload random, or --max-concurrency over any workload)
    random_input_len: int = typer.Option(1024, "--random-input-len", min=0, help="vllm bench serve: input length."),
    random_output_len: int = typer.Option(128, "--random-output-len", min=0, help="vllm bench serve: output length."),
    random_range_ratio: float = typer.Option(0.0, "--random-range-ratio", help="vllm bench serve: lengths uniform "
                                             "in [L(1-r), L(1+r)], r in [0, 1)."),
    random_prefix_len: int = typer.Option(0, "--random-prefix-len", min=0, help="vllm bench serve: a shared "
                                          "prefix added to every prompt."),
    num_prompts: int = typer.Option(1000, "--num-prompts", min=1, help="vllm bench serve: requests."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="vllm bench serve: generate the full output "
                                    "length (the shadow engine never stops early)."),
    max_concurrency: int = typer.Option(None, "--max-concurrency", help="vllm bench serve: at most N requests in "
                                        "flight (a closed-loop client)."),
    request_rate: float = typer.Option(math.inf, "--request-rate", help="vllm bench serve: requests/s (inf: all "
                                       "at once)."),
    burstiness: float = typer.Option(1.0, "--burstiness", help="vllm bench serve: gamma shape of the "
                                     "inter-arrivals (1: Poisson)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """Run the shadow engine over a workload and report OOMs, preemptions, latency and goodput.

    Bring your own model and GPU with --model-config and --gpu/--gpu-memory-gib, with vLLM 0.33's flag
    names and defaults; rerun a `vllm bench serve` benchmark with --workload random and its flags."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from kvguard.producers.sim.bench_serve import BenchArgsError
    from kvguard.producers.sim.model_config import ModelConfigError, UnsupportedArchitecture
    from kvguard.producers.sim.profiles import ProfileError
    from kvguard.producers.sim.vllm.external import ScheduleError
    from kvguard.producers.sim.vllm.memory import StartupRefused
    from kvguard.producers.sim.workloads import WorkloadError

    check_rate_scale(rate_scale)
    if not 0.0 <= prompt_logprobs_frac <= 1.0:
        raise typer.BadParameter(f"expected a share in [0, 1], got {prompt_logprobs_frac}",
                                 param_hint="--prompt-logprobs-frac")
    flags = dict(gpu_memory_utilization=gpu_memory_utilization, max_num_batched_tokens=max_num_batched_tokens,
                 alloc_conf=alloc_conf, max_model_len=max_model_len,
                 kv_cache_memory_bytes=_human_int(kv_cache_memory_bytes, "--kv-cache-memory-bytes"),
                 watermark=watermark, max_num_seqs=max_num_seqs, max_num_queued_reqs=max_num_queued_reqs,
                 max_num_queued_tokens=_human_int(max_num_queued_tokens, "--max-num-queued-tokens"),
                 scheduling_policy=scheduling_policy, num_speculative_tokens=num_speculative_tokens,
                 speculative_model_config=speculative_model_config, spec_acceptance_rate=spec_acceptance_rate,
                 enforce_eager=enforce_eager, model_runner=model_runner, attention_lse=attention_lse,
                 scheduler_reserve_full_isl=scheduler_reserve_full_isl)
    duration_s = parse_duration(duration) if duration else None
    try:
        knobs, engine_args = engine_settings(flags, model_config=model_config, gpu=gpu, gpu_memory_gib=gpu_memory_gib,
                                             tensor_parallel_size=tensor_parallel_size, dtype=dtype)
        bench, schedules = None, {}
        if workload == "random":
            bench = bench_run(engine_args, random_input_len, random_output_len, random_range_ratio, random_prefix_len,
                              num_prompts, seed, ignore_eos, max_concurrency, request_rate, burstiness)
        schedules = external_schedules(neighbour, leak)
    except (ProfileError, ModelConfigError, UnsupportedArchitecture, BenchArgsError, ScheduleError) as e:
        Console(stderr=True).print(f"[red]error:[/] {e}", soft_wrap=True)
        raise typer.Exit(2) from None
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
                                 logprobs_guard=logprobs_guard, engine_args=engine_args, bench=bench,
                                 max_concurrency=max_concurrency if bench is None else None,
                                 long_context_frac=long_context_frac, long_context_len=long_context_len, **schedules)
    except (WorkloadError, ProfileError, ModelConfigError, UnsupportedArchitecture, BenchArgsError,
            StartupRefused) as e:  # StartupRefused: e.g. a neighbour at start-up, vLLM's free-memory check
        err.print(f"[red]error:[/] {e}", soft_wrap=True)
        raise typer.Exit(2) from None
    except EventLogFailed as e:
        _print(e.summary, as_json)
        err.print(f"[red]error:[/] {e}", soft_wrap=True)
        raise typer.Exit(1) from None
    _print(out, as_json)


def _print_bench(console, b: dict) -> None:
    """The result block ``vllm bench serve`` prints (``benchmarks/serve.py``), plus preemptions and KV size."""
    rows = [("Successful requests:", b["completed"]), ("Failed requests:", b["failed"]),
            ("Maximum request concurrency:", b.get("max_concurrency")),
            ("Benchmark duration (s):", f"{b['duration']:.2f}"), ("Total input tokens:", b["total_input_tokens"]),
            ("Total generated tokens:", b["total_output_tokens"]),
            ("Request throughput (req/s):", b["request_throughput"]),
            ("Output token throughput (tok/s):", b["output_throughput"]),
            ("Total token throughput (tok/s):", b["total_token_throughput"]),
            ("Peak concurrent requests:", b["max_concurrent_requests"]),
            ("Preemptions:", b["preemptions"]), ("GPU KV cache size (tokens):", b.get("kv_token_capacity"))]
    console.print("[bold]============ Serving Benchmark Result ============[/]")
    for label, value in rows:
        console.print(f"{label:<40}{value}")
    for title, key in (("Time to First Token", "ttft"), ("Time per Output Token (excl. 1st token)", "tpot"),
                       ("Inter-token Latency", "itl")):
        console.print(f"[bold]{title:-^50}[/]")
        for stat in ("mean", "median", "p99"):
            console.print(f"{stat.capitalize() if stat != 'p99' else 'P99'} {key.upper()} (ms):".ljust(40)
                          + f"{b[f'{stat}_{key}_ms']:.2f}")


def _human_int(text: str | None, flag: str) -> int | None:
    """vLLM's ``human_readable_int``: 1k = 1000, 1K = 1024, 8G = 8 * 2**30 (no decimals with binary suffixes)."""
    if text is None:
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", text.strip())
    if m:
        number, suffix = m.groups()
        if suffix.islower():
            return int(float(number) * 10 ** (3 * "kmgt".index(suffix) + 3))
        if "." in number:
            raise typer.BadParameter(f"Decimals are not allowed with binary suffixes like {suffix}. Did you mean to "
                                     f"use {number}{suffix.lower()} instead?", param_hint=flag)
        return int(number) * 2 ** (10 * ("KMGT".index(suffix) + 1))
    try:
        return int(text)
    except ValueError:
        raise typer.BadParameter(f"expected an integer like 8589934592, 8G or 10k, got {text!r}",
                                 param_hint=flag) from None


def engine_settings(flags: dict, *, model_config, gpu, gpu_memory_gib, tensor_parallel_size, dtype):
    """(``EngineKnobs`` over a bundled profile, ``EngineArgs`` for your own model): the same flags either way."""
    from kvguard.producers.sim.engine_args import EngineArgs
    from kvguard.producers.sim.profiles import EngineKnobs

    given = {k: v for k, v in flags.items() if v is not None}
    if model_config is None:
        if gpu is not None or gpu_memory_gib is not None or tensor_parallel_size != 1 or dtype != "auto":
            raise typer.BadParameter("--gpu, --gpu-memory-gib, --tensor-parallel-size and --dtype need "
                                     "--model-config (a bundled --profile fixes them)", param_hint="--model-config")
        renamed = {("allocator_conf" if k == "alloc_conf" else k): v for k, v in given.items()}
        return EngineKnobs(**renamed), None
    args = {("alloc_conf" if k == "alloc_conf" else k): v for k, v in given.items()}
    return None, EngineArgs(model_config=model_config, gpu=gpu, gpu_memory_gib=gpu_memory_gib,
                            tensor_parallel_size=tensor_parallel_size, dtype=dtype, **args)


def bench_run(engine_args, input_len, output_len, range_ratio, prefix_len, num_prompts, seed, ignore_eos,
              max_concurrency, request_rate, burstiness):
    """``vllm bench serve --dataset-name random`` with these flags (``producers.sim.bench_serve``)."""
    from kvguard.producers.sim.bench_serve import BenchRun, RandomDataset

    special, vocab = 1, 128256
    if engine_args is not None:
        from kvguard.producers.sim.model_config import load_model_config

        model = load_model_config(engine_args.model_config)
        vocab = int(model.hf_config["vocab_size"])
        special = 0 if model.architecture.startswith("Qwen") else 1  # Llama/Mistral tokenizers add a BOS
    dataset = RandomDataset(num_prompts=num_prompts, input_len=input_len, output_len=output_len,
                            range_ratio=range_ratio, prefix_len=prefix_len, seed=seed, num_special_tokens=special,
                            vocab_size=vocab)
    return BenchRun(dataset, request_rate=request_rate, burstiness=burstiness, max_concurrency=max_concurrency,
                    ignore_eos=ignore_eos)


def external_schedules(neighbour: str | None, leak: str | None) -> dict:
    from kvguard.producers.sim.vllm.external import Leak, Neighbour

    return {"neighbour": Neighbour.parse(neighbour) if neighbour else None,
            "leak": Leak.parse(leak) if leak else None}


def _print(out: dict, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(out, sort_keys=False) + "\n")
    else:
        _print_table(out)
