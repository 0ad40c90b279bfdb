"""`kvguard simulate`: run the shadow engine over a trace or scenario on N simulated GPUs."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import typer

from kvguard.cli import engine_flags as flags_
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


def overload_args(priority_mix: str | None, goodput: list[str] | None, router: str | None = None):
    """``--priority-mix``, ``--goodput`` and ``--router`` checked: (mix or None, SloTargets)."""
    from kvguard.producers.admission import parse_priority_mix
    from kvguard.producers.sim.fleet import ROUTERS
    from kvguard.producers.sim.run import DEFAULT_SLO, parse_goodput

    try:
        mix = parse_priority_mix(priority_mix) if priority_mix else None
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--priority-mix") from None
    try:
        slo = parse_goodput([part for item in goodput for part in item.split()]) if goodput else DEFAULT_SLO
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--goodput") from None
    if router is not None and router not in ROUTERS:
        raise typer.BadParameter(f"expected one of {', '.join(sorted(ROUTERS))}, got {router!r}", param_hint="--router")
    return mix, slo


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
    if out.get("admission"):
        a = out["admission"]
        console.print(f"admission: {a['held']} held, {a['released']} released, {a['refused']} refused (503 + "
                      f"Retry-After, retryable)")
    if out.get("slo_attainment") is not None:
        by = ", ".join(f"p{p} {v:.1%}" for p, v in (out.get("slo_attainment_by_priority") or {}).items())
        console.print(f"SLO {out['slo']}: {out['slo_attainment']:.1%} of requests" + (f" ({by})" if by else ""))
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
    profile: str = flags_.PROFILE,
    engine: str = typer.Option(None, "--engine", help="Engine the shadow fleet runs: vllm, sglang or seed (the "
                                                      "catalogue's default profile of that engine; with --profile, "
                                                      "the profile must be of that engine)."),
    seed: int = typer.Option(0, "--seed", help="Seed for synthetic arrivals and scenarios."),
    events_out: Path = typer.Option(None, "--events-out", help="Write the event log (gzip JSON lines) here."),
    drain: bool = typer.Option(True, "--drain/--no-drain", help="After the window, run until in-flight work ends."),
    gpu_memory_utilization: float = flags_.GPU_MEMORY_UTILIZATION,
    max_num_batched_tokens: int = flags_.MAX_NUM_BATCHED_TOKENS,
    alloc_conf: str = flags_.ALLOC_CONF,
    prompt_logprobs_frac: float = typer.Option(
        0.0, "--prompt-logprobs-frac", help="vLLM profiles: share of requests asking for prompt logprobs "
                                            "(echo + logprobs, as eval harnesses send; vllm#5907)."),
    logprobs_guard: bool = typer.Option(
        False, "--governor", "--logprobs-guard",
        help="vLLM profiles: kvguard's step governor, node side only (no closed loop): each step shrunk so its "
             "non-KV peak (prompt logprobs, long-context attention, speculative decoding) fits what the "
             "allocator can still give; requests that can never fit refused at arrival. --logprobs-guard is "
             "its old name."),
    # -- your model, GPU and `vllm serve` flags (shared with `kvguard plan`: kvguard/cli/engine_flags.py)
    model_config: str = flags_.MODEL_CONFIG,
    gpu: str = flags_.GPU,
    gpu_memory_gib: float = flags_.GPU_MEMORY_GIB,
    tensor_parallel_size: int = flags_.TENSOR_PARALLEL_SIZE,
    dtype: str = flags_.DTYPE,
    max_model_len: int = flags_.MAX_MODEL_LEN,
    kv_cache_memory_bytes: str = flags_.KV_CACHE_MEMORY_BYTES,
    watermark: float = flags_.WATERMARK,
    max_num_seqs: int = flags_.MAX_NUM_SEQS,
    scheduler_reserve_full_isl: bool = flags_.SCHEDULER_RESERVE_FULL_ISL,
    max_num_queued_reqs: int = flags_.MAX_NUM_QUEUED_REQS,
    max_num_queued_tokens: str = flags_.MAX_NUM_QUEUED_TOKENS,
    scheduling_policy: str = flags_.SCHEDULING_POLICY,
    num_speculative_tokens: int = flags_.NUM_SPECULATIVE_TOKENS,
    speculative_model_config: str = flags_.SPECULATIVE_MODEL_CONFIG,
    spec_acceptance_rate: float = typer.Option(None, "--spec-acceptance-rate", help="Probability each draft "
                                               "token is accepted (a workload property; default 0.7)."),
    enforce_eager: bool = flags_.ENFORCE_EAGER,
    model_runner: str = flags_.MODEL_RUNNER,
    attention_lse: str = flags_.ATTENTION_LSE,
    # -- memory outside vLLM and traffic shapes (failure classes C3, C4, C7)
    neighbour: str = typer.Option(None, "--neighbour", help="Another process on the GPU: SIZE[:RATE], e.g. "
                                  "2GiB or 2GiB:+3GiB/h (present at start-up, growing at RATE)."),
    leak: str = typer.Option(None, "--leak", help="Memory never returned: 1GiB/h, 4MiB/req or 1MiB/step (off by "
                              "default); a restart returns it."),
    long_context_frac: float = typer.Option(0.0, "--long-context-frac", help="Share of requests whose prompt is "
                                            "--long-context-len tokens."),
    long_context_len: int = typer.Option(0, "--long-context-len", min=0, help="Prompt length of the long-context "
                                         "share."),
    traffic: str = typer.Option(None, "--traffic", help="The request classes, spelled as for `kvguard plan`: "
                                "prompt_logprobs:SHARE, long_context:SHARE@TOKENS, spec_decode (the server's own "
                                "--num-speculative-tokens), e.g. prompt_logprobs:0.05,long_context:0.02@60000."),
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
    # -- overload (issue 29): priorities, the SLO, kvguard's admission gate
    priority_mix: str = typer.Option(None, "--priority-mix", help="Priorities (0-10, higher more important) for "
                                     "requests the trace gives none, e.g. 9:0.1,5:0.6,1:0.3 (a trace's own wins)."),
    goodput: list[str] = typer.Option(None, "--goodput", help="The SLO, as vllm bench serve spells it: KEY:MS "
                                      "pairs of ttft, tpot, e2el (default ttft:2000 tpot:100); repeat the flag "
                                      "or quote 'ttft:2000 tpot:100'."),
    admission: bool = typer.Option(False, "--admission", help="vLLM profiles: kvguard's memory- and SLO-aware "
                                   "admission gate on each node (held or refused with a retryable 503 + "
                                   "Retry-After); use with --scheduling-policy priority and --router kvguard."),
    router: str = typer.Option("least_loaded", "--router", help="The fleet's router: least_loaded, round_robin, "
                               "kvguard (reads kvguard's endpoint series) or llmd_utilization (llm-d-router's "
                               "utilization detector: KV 0.8, queue 5, sheds priority < 5 when saturated)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """Run the shadow engine over a workload and report OOMs, preemptions, latency and goodput.

    Bring your own model and GPU with --model-config and --gpu/--gpu-memory-gib, with vLLM 0.33's flag
    names and defaults; rerun a `vllm bench serve` benchmark with --workload random and its flags."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from kvguard.producers.sim.bench_serve import BenchArgsError
    from kvguard.producers.sim.model_config import ModelConfigError, UnsupportedArchitecture
    from kvguard.producers.sim.profiles import ProfileError, default_profile_name, load_profile
    from kvguard.producers.sim.vllm.external import ScheduleError
    from kvguard.producers.sim.vllm.memory import StartupRefused
    from kvguard.producers.sim.workloads import WorkloadError
    from kvguard.runtime.simulation import EventLogFailed, run_simulation

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
    if traffic is not None:
        prompt_logprobs_frac, long_context_frac, long_context_len = traffic_mix(
            traffic, prompt_logprobs_frac=prompt_logprobs_frac, long_context_frac=long_context_frac,
            long_context_len=long_context_len, speculates=num_speculative_tokens is not None)
    if not 0.0 <= prompt_logprobs_frac <= 1.0:
        raise typer.BadParameter(f"expected a share in [0, 1], got {prompt_logprobs_frac}",
                                 param_hint="--prompt-logprobs-frac")
    flags = flags_.engine_flag_values(
        gpu_memory_utilization=gpu_memory_utilization, max_num_batched_tokens=max_num_batched_tokens,
        alloc_conf=alloc_conf, max_model_len=max_model_len, kv_cache_memory_bytes=kv_cache_memory_bytes,
        watermark=watermark, max_num_seqs=max_num_seqs, max_num_queued_reqs=max_num_queued_reqs,
        max_num_queued_tokens=max_num_queued_tokens, scheduling_policy=scheduling_policy,
        num_speculative_tokens=num_speculative_tokens, speculative_model_config=speculative_model_config,
        enforce_eager=enforce_eager, model_runner=model_runner, attention_lse=attention_lse,
        scheduler_reserve_full_isl=scheduler_reserve_full_isl, spec_acceptance_rate=spec_acceptance_rate)
    duration_s = parse_duration(duration) if duration else None
    mix, slo = overload_args(priority_mix, goodput, router)
    try:
        knobs, engine_args = flags_.engine_settings(flags, model_config=model_config, gpu=gpu, gpu_memory_gib=gpu_memory_gib,
                                             tensor_parallel_size=tensor_parallel_size, dtype=dtype)
        bench, schedules = None, {}
        if workload == "random":
            bench = bench_run(engine_args, random_input_len, random_output_len, random_range_ratio, random_prefix_len,
                              num_prompts, seed, ignore_eos, max_concurrency, request_rate, burstiness)
        schedules = external_schedules(neighbour, leak)
    except (ProfileError, ModelConfigError, UnsupportedArchitecture, BenchArgsError, ScheduleError) as e:
        err.print(f"[red]error:[/] {e}", soft_wrap=True)
        raise typer.Exit(2) from None
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
                                 long_context_frac=long_context_frac, long_context_len=long_context_len,
                                 priority_mix=mix, slo=slo, admission=admission, router=router, **schedules)
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


def traffic_mix(text: str, *, prompt_logprobs_frac: float, long_context_frac: float, long_context_len: int,
                speculates: bool) -> tuple[float, float, int]:
    """``--traffic`` as the shadow engine's mix: (prompt-logprob share, long-context share, its length). The
    engine takes a share for prompt logprobs (the workload's prompts keep their lengths), a share and a length
    for long contexts, and speculates on every request when the server does; it has no sample-logprob path."""
    from kvguard.ops.traffic import TrafficError, parse_traffic

    try:
        classes = parse_traffic(text)
    except TrafficError as e:
        raise typer.BadParameter(str(e), param_hint="--traffic") from None
    pl, lc, lc_len = prompt_logprobs_frac, long_context_frac, long_context_len
    for c in classes:
        if c.name == "prompt_logprobs":
            if c.share is None or c.shape is not None or prompt_logprobs_frac:
                raise typer.BadParameter("simulate takes prompt_logprobs:SHARE (the workload sets the prompts' "
                                         "lengths), and not with --prompt-logprobs-frac", param_hint="--traffic")
            pl = c.share
        elif c.name == "long_context":
            if c.share is None or c.shape is None or long_context_frac:
                raise typer.BadParameter("simulate takes long_context:SHARE@TOKENS, and not with "
                                         "--long-context-frac", param_hint="--traffic")
            lc, lc_len = c.share, c.shape
        elif c.name == "spec_decode":
            if not speculates or c.share not in (None, 1.0) or c.shape is not None:
                raise typer.BadParameter("spec_decode is the server's speculative decoding: every request, with "
                                         "--num-speculative-tokens and --speculative-model-config",
                                         param_hint="--traffic")
        else:
            raise typer.BadParameter(f"the shadow engine does not model {c.name} requests (use `kvguard plan` for "
                                     f"their limits)", param_hint="--traffic")
    return pl, lc, lc_len


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
