"""`kvguard conformance vllm|sglang`: kvguard's schedulers against vLLM's v1 scheduler and SGLang's, step by step.

Needs vLLM's scheduler on CPU (`scripts/install-vllm-cpu.sh .venv`) and SGLang's scheduler modules
(`scripts/install-sglang-cpu.sh .venv`), both done by `make venv`; no GPU, no model weights. The
comparisons themselves are ``kvguard.producers.sim.vllm.conformance`` and
``kvguard.producers.sim.sglang.conformance``.
"""

from __future__ import annotations

import json
import sys

import typer

from kvguard.cli.app import app

conformance_app = typer.Typer(help="Check kvguard's node side against the real engines it models.",
                              no_args_is_help=True)
app.add_typer(conformance_app, name="conformance")


@conformance_app.command("vllm")
def vllm(
    workload: str = typer.Option("azure-conv", "--workload", help="Scenario or trace (see kvguard simulate)."),
    rate_scale: float = typer.Option(1.0, "--rate-scale", min=0.01, max=1000.0, help="Arrival-rate multiplier."),
    duration: str = typer.Option("2m", "--duration", help="Arrivals within this window (e.g. 90s, 5m)."),
    gpu_blocks: int = typer.Option(2000, "--gpu-blocks", min=16, help="KV blocks on both sides (16 tokens each)."),
    max_num_seqs: int = typer.Option(64, "--max-num-seqs", min=1),
    max_num_batched_tokens: int = typer.Option(2048, "--max-num-batched-tokens", min=16),
    max_steps: int = typer.Option(20_000, "--max-steps", min=1, help="Stop after this many engine steps."),
    policy: str = typer.Option("fcfs", "--policy", "--scheduling-policy", help="Scheduling policy: fcfs or priority "
                               "(each request's priority as its workload gives it; lower first in vLLM)."),
    watermark: float = typer.Option(0.0, "--watermark", help="vLLM's --watermark on both sides."),
    full_isl: bool = typer.Option(True, "--scheduler-reserve-full-isl/--no-scheduler-reserve-full-isl",
                                  help="vLLM's full-sequence admission gate (default on, as in 0.33)."),
    max_concurrency: int = typer.Option(None, "--max-concurrency", min=1, help="A closed-loop client: at most N "
                                        "unfinished requests (vllm bench serve's semaphore)."),
    random_input_len: int = typer.Option(1024, "--random-input-len", min=1, help="With --workload random."),
    random_output_len: int = typer.Option(128, "--random-output-len", min=1, help="With --workload random."),
    random_range_ratio: float = typer.Option(0.0, "--random-range-ratio", help="With --workload random."),
    num_prompts: int = typer.Option(200, "--num-prompts", min=1, help="With --workload random."),
    seed: int = typer.Option(0, "--seed"),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Drive vLLM's Scheduler and kvguard's with the same requests; compare every step.

    Compared: scheduled requests and token counts, preemptions, block ids and KV usage. Exit
    status 1 on any mismatch, 2 when vLLM is not installed. ``--workload random`` is ``vllm bench
    serve``'s random dataset (with ``--max-concurrency``, its closed-loop client).
    """
    # vLLM takes seconds to import: loaded when the command runs
    from kvguard.cli.simulate import parse_duration
    from kvguard.producers.sim.bench_serve import BenchArgsError, RandomDataset, random_workload
    from kvguard.producers.sim.vllm.conformance import VllmMissing, run_conformance
    from kvguard.producers.sim.workloads import WorkloadError, load_workload

    try:
        if workload == "random":
            wl = random_workload(RandomDataset(num_prompts=num_prompts, input_len=random_input_len,
                                               output_len=random_output_len, range_ratio=random_range_ratio, seed=seed,
                                               vocab_size=32000))
        else:
            wl = load_workload(workload, rate_scale=rate_scale, window=parse_duration(duration), seed=seed)
    except (WorkloadError, BenchArgsError, ValueError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    try:
        result = run_conformance(wl.requests, num_gpu_blocks=gpu_blocks, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max_num_batched_tokens, max_steps=max_steps, policy=policy,
                                 watermark=watermark, scheduler_reserve_full_isl=full_isl,
                                 max_concurrency=max_concurrency)
    except VllmMissing as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    result["workload"] = {"name": workload, "rate_scale": rate_scale, "requests": len(wl.requests)}
    if json_out:
        sys.stdout.write(json.dumps(result, default=str) + "\n")
    else:
        p = result.get("preemptions", {})
        typer.echo(f"{result.get('steps')} steps, {result.get('requests')} requests: scheduled mismatch "
                   f"{result.get('scheduled_mismatch_frac')}, usage max |diff| {result.get('usage_max_abs_diff')}, "
                   f"preemptions vLLM {p.get('vllm')} / kvguard {p.get('kvguard')}")
        if result.get("first_mismatch"):
            typer.echo(f"first mismatch: {json.dumps(result['first_mismatch'], default=str)}")
    if result.get("scheduled_mismatch_frac") or result.get("usage_max_abs_diff"):
        raise typer.Exit(1)


@conformance_app.command("sglang")
def sglang(
    workload: str = typer.Option("azure-conv", "--workload", help="Scenario or trace (see kvguard simulate)."),
    rate_scale: float = typer.Option(4.0, "--rate-scale", min=0.01, max=1000.0, help="Arrival-rate multiplier."),
    duration: str = typer.Option("10s", "--duration", help="Arrivals within this window (e.g. 90s, 5m)."),
    max_total_tokens: int = typer.Option(6000, "--max-total-tokens", min=16,
                                         help="The KV pool in tokens on both sides (SGLang's --max-total-tokens)."),
    page_size: int = typer.Option(1, "--page-size", min=1, help="SGLang's --page-size."),
    max_running_requests: int = typer.Option(32, "--max-running-requests", min=1),
    chunked_prefill_size: int = typer.Option(2048, "--chunked-prefill-size",
                                             help="SGLang's --chunked-prefill-size (-1: off)."),
    max_prefill_tokens: int = typer.Option(16384, "--max-prefill-tokens", min=1),
    schedule_conservativeness: float = typer.Option(1.0, "--schedule-conservativeness", min=0.01),
    context_length: int = typer.Option(8192, "--context-length", min=16),
    tree: str = typer.Option("radix", "--tree", help="SGLang's tree: radix (RadixCache) or unified "
                                                      "(UnifiedRadixCache, what 0.5.23's scheduler builds)."),
    max_steps: int = typer.Option(3000, "--max-steps", min=1, help="Stop after this many engine steps."),
    seed: int = typer.Option(0, "--seed"),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Drive SGLang 0.5.23's own scheduler classes and kvguard's model of them with the same requests; compare
    every step.

    Compared: the batch (prefill requests with cached prefix and extend length, or the decoding ones),
    retracted, aborted and finished requests, free/evictable/protected tokens, new_token_ratio and the
    allocator's free-page order. Exit status 1 on any mismatch, 2 when SGLang is not installed
    (scripts/install-sglang-cpu.sh .venv).
    """
    # SGLang runs in a subprocess; the harness itself is light
    from kvguard.cli.simulate import parse_duration
    from kvguard.producers.sim.sglang.conformance import TREES, SglangMissing, run_conformance
    from kvguard.producers.sim.sglang.scheduler import SchedulerConfig
    from kvguard.producers.sim.workloads import WorkloadError, load_workload

    if tree not in TREES:
        raise typer.BadParameter(f"expected one of {list(TREES)}, got {tree!r}", param_hint="--tree")
    try:
        wl = load_workload(workload, rate_scale=rate_scale, window=parse_duration(duration), seed=seed)
        config = SchedulerConfig(max_total_num_tokens=max_total_tokens, page_size=page_size,
                                 max_running_requests=max_running_requests, max_prefill_tokens=max_prefill_tokens,
                                 chunked_prefill_size=None if chunked_prefill_size == -1 else chunked_prefill_size,
                                 schedule_conservativeness=schedule_conservativeness, context_len=context_length)
    except (WorkloadError, ValueError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    try:
        result = run_conformance(wl.requests, config=config, max_steps=max_steps, tree=tree)
    except SglangMissing as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    result["workload"] = {"name": workload, "rate_scale": rate_scale, "requests": len(wl.requests)}
    if json_out:
        sys.stdout.write(json.dumps(result, default=str) + "\n")
    else:
        typer.echo(f"{result['steps']} steps, {result['requests']} requests, SGLang {result['sglang_version']} "
                   f"({result['sglang_tree']}): mismatching steps {result['mismatch_steps']}, retracted "
                   f"{result['retracted']}, prefix-hit tokens {result['prefix_hit_tokens']}, finished {result['finished']}")
        if result["first_mismatch"]:
            typer.echo(f"first mismatch: {json.dumps(result['first_mismatch'], default=str)}")
    if result["mismatch_steps"]:
        raise typer.Exit(1)
