"""`kvguard plan`: size a vLLM server before it starts, and say which requests will crash it (docs/PLAN.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from kvguard.cli import engine_flags as flags_
from kvguard.cli.app import app
from kvguard.cli.narrow_help import NarrowHelpCommand

GiB = 1 << 30
DEFAULT_WHAT_IF = "0.85,0.90,0.92,0.94,0.95,0.96,0.97,0.98,0.99"
PLAN_PANEL = "Traffic and output"


def _what_if(text: str) -> tuple[float, ...] | None:
    if text.strip().lower() in ("none", "no", ""):
        return None
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise typer.BadParameter(f"expected utilizations like 0.9,0.95 (or none), got {text!r}",
                                 param_hint="--what-if") from None
    if not all(0 < v <= 1 for v in values):
        raise typer.BadParameter(f"utilizations are in (0, 1], got {text!r}", param_hint="--what-if")
    return values


PLAN_HELP = (
    "Size a vLLM server before it starts, and say which requests will crash it.\n\n"
    "Prints what vLLM would log at start-up (consumed memory, peak activation, CUDA-graph memory, the KV cache, its "
    "blocks, tokens and concurrency at max_model_len) or vLLM's refusal, with vLLM's message.\n\n"
    "Then, per request class, the largest step that fits the headroom start-up leaves, with its margin: the longest "
    "prompt with prompt_logprobs, the largest batch with logprobs=N, the largest batch of speculative-decoding "
    "rows, the longest context whose last prefill chunk fits.\n\n"
    "With --traffic: the largest gpu_memory_utilization (and max_num_batched_tokens) at which every declared class "
    "fits, and the KV capacity each buys; a what-if table across utilizations.\n\n"
    "Takes kvguard simulate's model, GPU and vLLM flags and agrees with its shadow engine; --from-log reads a real "
    "server's start-up budget from its log instead of the model's estimate. docs/PLAN.md explains each number.")


@app.command(help=PLAN_HELP, cls=NarrowHelpCommand)
def plan(
    profile: str = flags_.PROFILE,
    model_config: str = flags_.MODEL_CONFIG,
    gpu: str = flags_.GPU,
    gpu_memory_gib: float = flags_.GPU_MEMORY_GIB,
    tensor_parallel_size: int = flags_.TENSOR_PARALLEL_SIZE,
    dtype: str = flags_.DTYPE,
    gpu_memory_utilization: float = flags_.GPU_MEMORY_UTILIZATION,
    kv_cache_memory_bytes: str = flags_.KV_CACHE_MEMORY_BYTES,
    max_model_len: int = flags_.MAX_MODEL_LEN,
    max_num_seqs: int = flags_.MAX_NUM_SEQS,
    max_num_batched_tokens: int = flags_.MAX_NUM_BATCHED_TOKENS,
    num_speculative_tokens: int = flags_.NUM_SPECULATIVE_TOKENS,
    speculative_model_config: str = flags_.SPECULATIVE_MODEL_CONFIG,
    alloc_conf: str = flags_.ALLOC_CONF,
    enforce_eager: bool = flags_.ENFORCE_EAGER,
    model_runner: str = flags_.MODEL_RUNNER,
    attention_lse: str = flags_.ATTENTION_LSE,
    watermark: float = flags_.WATERMARK,
    scheduler_reserve_full_isl: bool = flags_.SCHEDULER_RESERVE_FULL_ISL,
    max_num_queued_reqs: int = flags_.MAX_NUM_QUEUED_REQS,
    max_num_queued_tokens: str = flags_.MAX_NUM_QUEUED_TOKENS,
    scheduling_policy: str = flags_.SCHEDULING_POLICY,
    traffic: str = typer.Option(None, "--traffic", help="The request classes the server must survive, "
                                "CLASS[:SHARE]\\[@SHAPE] separated by commas, e.g. prompt_logprobs:0.05,long_context:0.02"
                                "@60000,spec_decode. Classes: prompt_logprobs (@longest prompt), logprobs (@N), "
                                "long_context (@prompt tokens), spec_decode (@concurrent sequences).",
                                rich_help_panel=PLAN_PANEL),
    from_log: Path = typer.Option(None, "--from-log", help="A real server's vLLM log (or - for stdin): its start-up "
                                  "budget replaces the model's estimate; pass the model and engine flags it ran "
                                  "with.", rich_help_panel=PLAN_PANEL),
    what_if: str = typer.Option(DEFAULT_WHAT_IF, "--what-if", help="Utilizations for the what-if table (none: no "
                                "table).", rich_help_panel=PLAN_PANEL),
    search: bool = typer.Option(True, "--search/--no-search", help="Search the largest gpu_memory_utilization and "
                                "max_num_batched_tokens at which every --traffic class fits.",
                                rich_help_panel=PLAN_PANEL),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout.", rich_help_panel=PLAN_PANEL),
) -> None:
    """``kvguard plan`` (``PLAN_HELP``)."""
    from rich.console import Console

    from kvguard.ops.startup_log import StartupLogError
    from kvguard.ops.traffic import TrafficError, parse_traffic
    from kvguard.producers.sim.model_config import ModelConfigError, UnsupportedArchitecture
    from kvguard.producers.sim.profiles import ProfileError
    from kvguard.runtime.planning import PlanError, plan_server

    err = Console(stderr=True)
    flags = flags_.engine_flag_values(
        gpu_memory_utilization=gpu_memory_utilization, max_num_batched_tokens=max_num_batched_tokens,
        alloc_conf=alloc_conf, max_model_len=max_model_len, kv_cache_memory_bytes=kv_cache_memory_bytes,
        watermark=watermark, max_num_seqs=max_num_seqs, max_num_queued_reqs=max_num_queued_reqs,
        max_num_queued_tokens=max_num_queued_tokens, scheduling_policy=scheduling_policy,
        num_speculative_tokens=num_speculative_tokens, speculative_model_config=speculative_model_config,
        enforce_eager=enforce_eager, model_runner=model_runner, attention_lse=attention_lse,
        scheduler_reserve_full_isl=scheduler_reserve_full_isl)
    if profile is not None and model_config is not None:
        raise typer.BadParameter("either --profile or --model-config, not both", param_hint="--profile")
    try:
        classes = parse_traffic(traffic) if traffic is not None else ()
    except TrafficError as e:
        raise typer.BadParameter(str(e), param_hint="--traffic") from None
    utilizations = _what_if(what_if)
    log_text = None
    if from_log is not None:
        try:
            log_text = sys.stdin.read() if str(from_log) == "-" else from_log.read_text(errors="replace")
        except OSError as e:
            raise typer.BadParameter(f"cannot read {from_log}: {e.strerror}", param_hint="--from-log") from None
    try:
        knobs, engine_args = flags_.engine_settings(flags, model_config=model_config, gpu=gpu,
                                                    gpu_memory_gib=gpu_memory_gib,
                                                    tensor_parallel_size=tensor_parallel_size, dtype=dtype)
        report = plan_server(engine_args=engine_args, profile_name=profile, knobs=knobs, flags=flags,
                             traffic=classes, log_text=log_text, what_if=utilizations, search=search)
    except (ProfileError, ModelConfigError, UnsupportedArchitecture, PlanError, StartupLogError) as e:
        err.print(f"[red]error:[/] {e}", soft_wrap=True)
        raise typer.Exit(2) from None
    if as_json:
        sys.stdout.write(json.dumps(report, sort_keys=False) + "\n")
    else:
        print_plan(report)


def _gib(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    return f"{nbytes / GiB:.2f} GiB" if abs(nbytes) >= GiB else f"{nbytes / (1 << 20):.0f} MiB"


def _limit(c: dict) -> str:
    if c["refused"]:
        return "n/a"
    if c["limit"] is None:
        return "none fits"
    return f"all ({c['limit']:,})" if c["unlimited"] else f"{c['limit']:,}"


def print_plan(report: dict) -> None:
    """The readable form of ``plan_server``'s report."""
    from rich import box
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    u = report["gpu_memory_utilization"]
    console.print(f"[bold]kvguard plan[/] {escape(report['title'])}")
    console.print(f"  budget: {'the log ' + report['log_format'] if report['source'] == 'log' else 'the model'}"
                  f", gpu_memory_utilization {u:g}")
    if report["log_lines"]:
        console.print("[bold]What vLLM logs at start-up[/]" + (" (read from the log)" if report["source"] == "log"
                                                                else ""))
        for line in report["log_lines"]:
            console.print(f"  [dim]{escape(line)}[/]", soft_wrap=True)
    if report["refused"]:
        console.print(f"[bold red]vLLM refuses to start:[/] {escape(report['refused'])}", soft_wrap=True)
    else:
        budget = Table(box=box.SIMPLE_HEAD, show_header=True, header_style="bold", pad_edge=False)
        budget.add_column("start-up budget")
        budget.add_column("", justify="right")
        cfg = report["config"]
        rows = [("consumed memory (weights + non-torch)", _gib(report["consumed_bytes"])),
                ("peak activation", _gib(report["peak_activation_bytes"])),
                ("CUDA-graph memory", _gib(report["cudagraph_bytes"])),
                ("KV cache", _gib(report["kv_cache_bytes"])),
                ("GPU blocks", f"{report['num_gpu_blocks']:,} x {cfg['block_size']} tokens"),
                ("KV token capacity", f"{report['kv_cache_tokens']:,} tokens"),
                (f"max concurrency at {report['max_model_len']:,} tokens", f"{report['max_concurrency']:.2f}x"),
                ("headroom for one step (free + cached)", _gib(report["headroom_bytes"]))]
        for label, value in rows:
            budget.add_row(label, value)
        console.print(budget)
        _print_classes(console, report, u)
    _print_boundary(console, report)
    _print_what_if(console, report)
    console.print("[bold]Assumptions[/]")
    for line in report["assumptions"]:
        console.print(f"  - {escape(line)}", soft_wrap=True)


def _print_classes(console, report: dict, u: float) -> None:
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    from kvguard.ops.plan import ClassLimit, class_sentence

    table = Table(title=f"Request classes at {u:g}: the largest step that fits (tensors: its own peak there; "
                        f"margin: what the device still had at its worst moment)", box=box.SIMPLE_HEAD,
                  header_style="bold", title_justify="left", pad_edge=False)
    for col, just in (("class", "left"), ("declared", "right"), ("limit", "right"), ("tensors", "right"),
                      ("headroom", "right"), ("margin", "right"), ("", "left")):
        table.add_column(col, justify=just, no_wrap=True)
    unit = {"tokens": "tok", "sequences": "seq"}
    for c in report["classes"]:
        declared = "-" if c["declared"] is None else f"{c['declared']:,} {unit[c['unit']]}"
        verdict = {True: "[green]fits[/]", False: "[red]OOMs[/]", None: ""}[c["declared_fits"]]
        table.add_row(c["name"] + (f" ({c['share']:g})" if c["share"] is not None else ""), declared,
                      _limit(c), "-" if c["refused"] else _gib(c["peak_bytes"]), _gib(c["headroom_bytes"]),
                      _gib(c["margin_bytes"]), verdict)
    console.print(table)
    for c in report["classes"]:
        limit = ClassLimit(c["name"], c["unit"], c["share"], c["declared"], c["largest_schedulable"], c["limit"],
                           c["peak_bytes"], c["next_peak_bytes"], c["headroom_bytes"], c["margin_bytes"],
                           c["declared_fits"], c["refused"])
        console.print(f"  {escape(class_sentence(limit, u))}", soft_wrap=True)


def _print_boundary(console, report: dict) -> None:
    b = report["boundary"]
    if not b:
        return
    console.print("[bold]Boundaries[/]")
    if b["highest_starting_utilization"] is None or b["lowest_starting_utilization"] is None:
        console.print("  vLLM starts at no gpu_memory_utilization with these flags")
        return
    console.print(f"  vLLM starts for gpu_memory_utilization {b['lowest_starting_utilization']:g} to "
                  f"{b['highest_starting_utilization']:g} (below: too little KV cache for one max_model_len request; "
                  f"above: too little beyond the KV cache: free memory, the warm-up or the CUDA-graph capture)")
    traffic = ", ".join(report["traffic"])
    if not traffic:
        console.print("  no --traffic declared: nothing more to fit")
        return
    if b["largest_utilization"] is None:
        console.print(f"  no utilization vLLM starts at fits every class of {traffic}")
    else:
        tokens = b["kv_cache_tokens_at_largest_utilization"]
        console.print(f"  every class of {traffic} fits up to gpu_memory_utilization {b['largest_utilization']:g} "
                      f"(KV cache {_gib(b['kv_cache_bytes_at_largest_utilization'])}, {tokens:,} tokens)")
    if b["largest_max_num_batched_tokens"] is None:
        console.print("  no max_num_batched_tokens on the searched grid fits them at the configured utilization")
    else:
        tokens = b["kv_cache_tokens_at_largest_max_num_batched_tokens"]
        console.print(f"  at the configured utilization: max_num_batched_tokens up to "
                      f"{b['largest_max_num_batched_tokens']:,} (KV cache {tokens:,} tokens; grid of 256 from "
                      f"{b['max_num_batched_tokens_searched'][0]:,} to {b['max_num_batched_tokens_searched'][1]:,})")


SHORT = {"full_step": "full step", "prompt_logprobs": "prompt lp", "logprobs": "logprobs", "long_context": "long ctx",
         "spec_decode": "spec"}


def _print_what_if(console, report: dict) -> None:
    from rich import box
    from rich.table import Table

    rows = report["what_if"]
    if not rows:
        return
    names = [c["name"] for c in rows[0]["classes"] if not c["refused"]] if rows[0]["classes"] else \
        [c["name"] for c in report["classes"] if not c["refused"]]
    table = Table(title="What if: gpu_memory_utilization (each class's limit; all: every size fits)",
                  box=box.SIMPLE_HEAD, header_style="bold", title_justify="left", pad_edge=False)
    for col in ("util", "KV cache", "KV tokens", "headroom", *(SHORT[n] for n in names)):
        table.add_column(col, justify="right", no_wrap=True)
    for row in rows:
        s = row["startup"]
        if s["refused"]:
            reason = "refused: KV cache" if s["refused_for_kv_cache"] else (
                "refused: free memory" if "less than desired" in s["refused"] else "crashes at start")
            table.add_row(f"{s['gpu_memory_utilization']:g}", reason, *[""] * (2 + len(names)))
            continue
        limits = {c["name"]: ("all" if c["unlimited"] else "none" if c["limit"] is None else f"{c['limit']:,}")
                  for c in row["classes"]}
        table.add_row(f"{s['gpu_memory_utilization']:g}", _gib(s["kv_cache_bytes"]), f"{s['kv_cache_tokens']:,}",
                      _gib(s["headroom_bytes"]), *[limits.get(n, "") for n in names])
    console.print(table)
