"""`kvguard demo`: the same workload twice on N simulated GPUs — the baseline engine, then
kvguard's closed loop — with a live view, a comparison table and a report on disk.

Embedded (the default) is one process and deterministic (``kvguard.runtime.embedded``). With
``--bus kafka://…`` the same parts run as concurrent services over the broker
(``kvguard.runtime.overbus``) (on run-private topics ``kvguard-demo-<run>.*``, deleted
at the end unless ``--keep-topics``); the baseline (the bare engine, which needs no bus) still
runs embedded.

Ledgers: the guarded run debits the fragmentation budget and records the SLO ledger (prediction
outcomes at the operating threshold, OOMs with per-tier lead times, evictions and what became of
the evicted requests) — in memory, or in Redis with ``--redis``. Simulated time starts at the
epoch, so every run's ticks fall in week 1970-W01 and are idempotent per (node, tick time): with
``--redis`` (or ``--bus``) the node ids carry a random run id, ``demo-<run>/gpu<i>``, so that two
runs never merge (``kvguard budget status --node demo-<run>/gpu0`` reads one). The embedded
in-memory demo keeps ``sim-0/gpu<i>`` and is deterministic for a seed. Ledger outages are logged
on stderr, their figures are in ``--json`` under ``ledger``, and the exit status is 3 when
writes were still unstored at the end.

Arms (vLLM-engine profiles, the default): the same requests run as ``vllm_default`` (the profile
as shipped: vLLM's defaults), ``tuned_static`` (the best static knobs of the sweep on the training
workloads, ``kvguard/ops/tuned_static.json``), ``baseline`` (the operator's knobs —
``--gpu-memory-utilization``, 0.95 by default — without kvguard) and ``kvguard`` (the same knobs with
kvguard: the closed loop and its node side); ``--no-arms`` runs only the last two. Every arm serves the same share of requests
asking for prompt logprobs (``--prompt-logprobs-frac``, 5 %: eval traffic), whose logits vLLM's
profiling run does not count (vllm#5907, #5067): at 0.95 the caching allocator then runs out
during such a request's prefill chunk and the worker dies with its queue. kvguard's node-side
logprob guard sizes each step so such logits fit the allocator's headroom (``producers.sim.vllm.engine``),
and its allocator guard caps the per-step token budget on allocator pressure (``policy.engine``,
point 6); README.md, "Figures", has where that beats the static settings and where it does not.

On the seed's alternative profiles (``--profile llama3-8b-24gb``) the baseline fills its KV arena
and admits on a request's first prefill chunk only; a burst of long prompts then takes the last
free units and a step's workspace buffer finds no contiguous run (a fragmentation OOM that vLLM's
uniform blocks and full-sequence admission do not have). There kvguard holds admission headroom,
compacts and evicts (``kvguard.policy.engine``).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import typer

from kvguard.cli.app import app

# The bundled stress: the `mixed` scenario (long and short prompts) at twice its base rate on the
# default profile, 4 GPUs. With seed 0 the baseline crashes 9 times: the first fragmentation OOM
# at ~615 s on gpu0, and the load it sheds onto the other GPUs cascades through all four until
# ~780 s (the arrival mix varies by seed: seeds 3 and 4 give 35 and 15 baseline OOMs, seed 2
# none). --quick packs the arrivals denser (×2.25 for 15 minutes): 8 baseline OOMs with seed 0.
# Measured with this policy (`kvguard demo --json`, seed 0): guarded 0 OOMs in both.
DEMO_WORKLOAD = "mixed"
DEMO_RATE_SCALE = 2.0
DEMO_DURATION_S = 1800.0
QUICK_RATE_SCALE = 2.25
QUICK_DURATION_S = 900.0
# On vLLM-engine profiles the demo serves as an operator who raised --gpu-memory-utilization to 0.95
# for KV room, with 5 % of requests asking for prompt logprobs (eval traffic): the condition under
# which vLLM's profiled peak undercounts memory and real servers crash (vllm#5907, #5067, #38830).
DEMO_GPU_MEMORY_UTILIZATION = 0.95
DEMO_PROMPT_LOGPROBS_FRAC = 0.05
ARM_FIELDS = ("requests", "completed", "ooms", "preemptions", "failed", "rejected", "unfinished", "slo_attainment",
              "slo_goodput_tokens_per_s", "goodput_tokens_per_s", "ttft_p99_s", "ttft_p99_all_s")


class LiveView:
    """Per-GPU live table on stderr (U_kv, F_ext, Ψ, P(OOM), alerts, actions, OOMs)."""

    def __init__(self, enabled: bool, nodes: list[str], title: str) -> None:
        self.enabled = enabled
        self.nodes = nodes
        self.title = title
        self.rows: dict[str, dict] = {n: {} for n in nodes}
        self._live = None
        self._last = 0.0

    def __enter__(self) -> "LiveView":
        if self.enabled:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(self._table(), console=Console(stderr=True), refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.update(self._table())
            self._live.__exit__(*exc)

    def update(self, node: str, sim_s: float, **values: Any) -> None:
        row = self.rows.setdefault(node, {})
        row.update(values)
        row["t"] = sim_s
        now = time.monotonic()
        if self._live is not None and now - self._last > 0.2:
            self._last = now
            self._live.update(self._table())

    def _table(self):
        from rich.table import Table

        t = Table(title=self.title, expand=False)
        for col in ("GPU", "sim t", "U_kv", "F_ext", "Ψ", "P(OOM)", "alerts", "actions", "OOMs", "preempt"):
            t.add_column(col, justify="right" if col != "GPU" else "left")
        for node in self.nodes:
            r = self.rows.get(node, {})
            psi = r.get("psi")
            style = "red" if psi is not None and psi >= 0.95 else ("yellow" if psi is not None and psi >= 0.85 else "")
            p = r.get("p_oom")
            t.add_row(node, f"{r.get('t', 0):.0f}s", _fmt(r.get("u_kv")), _fmt(r.get("f_ext")), _fmt(psi),
                      "-" if p is None else f"{p:.2f}", str(r.get("alerts", 0)), str(r.get("actions", 0)),
                      str(r.get("ooms", 0)), str(r.get("preemptions", 0)), style=style)
        return t


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _print_comparison(result: dict, console) -> None:
    from rich.table import Table

    b, g = result["baseline"], result["guarded"]
    arms = result.get("arms")
    if arms and len(arms) > 2:
        t = Table(title="kvguard demo: arms on the same workload, seed and fleet (every request counted)")
        t.add_column("metric")
        for name in arms:
            t.add_column(name, justify="right")
        for key in ARM_FIELDS:
            t.add_row(key, *(str(arm.get(key)) for arm in arms.values()))
        console.print(t)
        for name, arm in arms.items():
            console.print(f"  [dim]{name}: {arm['config']}[/dim]")
        _print_governor(result, console)
        return
    t = Table(title="kvguard demo: baseline vs closed loop (same workload, same seed)")
    t.add_column("metric")
    t.add_column("baseline", justify="right")
    t.add_column("kvguard", justify="right")
    for key in ("requests", "completed", "failed", "rejected", "unfinished", "ooms", "preemptions", "ttft_p50_s",
                "ttft_p99_s", "tpot_p99_s", "goodput_tokens_per_s", "downtime_s"):
        t.add_row(key, str(b.get(key)), str(g.get(key)))
    console.print(t)
    console.print(f"OOM reduction {_pct(result['oom_reduction'])} · preemption reduction "
                  f"{_pct(result['preemption_reduction'])} · goodput ×{result['goodput_ratio']} · "
                  f"TTFT p99 ×{result['ttft_p99_ratio']}")


def _print_governor(result: dict, console) -> None:
    gov = result.get("governor")
    if gov:
        console.print(f"step governor (kvguard arm): {gov['steps_governed']} steps shrunk "
                      f"{gov['by_cause'] or ''}, {gov['cache_releases']} cache releases, "
                      f"{gov['never_fits']} requests refused as never fitting (^ on the report's timeline)")


def _pct(x: float | None) -> str:
    return "n/a (baseline had none)" if x is None else f"{x * 100:.0f}%"


@app.command()
def demo(
    quick: bool = typer.Option(False, "--quick", help=f"A {QUICK_DURATION_S / 60:.0f}-minute workload instead of "
                                                      f"{DEMO_DURATION_S / 60:.0f} (under two minutes here)."),
    gpus: int = typer.Option(4, "--gpus", min=1, help="Simulated GPUs."),
    workload: str = typer.Option(DEMO_WORKLOAD, "--workload", help="Scenario or trace (see kvguard simulate)."),
    rate_scale: float = typer.Option(None, "--rate-scale", help=f"Arrival-rate multiplier (default "
                                                              f"{DEMO_RATE_SCALE:g}, --quick {QUICK_RATE_SCALE:g})."),
    duration: str = typer.Option("", "--duration", help="Simulated duration (e.g. 30m); overrides --quick."),
    profile: str = typer.Option(None, "--profile", help="Model/GPU profile (default: the profiles file's)."),
    gpu_memory_utilization: float = typer.Option(
        DEMO_GPU_MEMORY_UTILIZATION, "--gpu-memory-utilization",
        help="vLLM profiles: the operator's setting that the baseline and kvguard run with."),
    prompt_logprobs_frac: float = typer.Option(
        DEMO_PROMPT_LOGPROBS_FRAC, "--prompt-logprobs-frac",
        help="vLLM profiles: share of requests asking for prompt logprobs (eval traffic)."),
    arms: bool = typer.Option(True, "--arms/--no-arms", help="vLLM profiles: also run vllm_default (vLLM's defaults) "
                                                             "and tuned_static (the best static knobs of the "
                                                             "training sweep, bench/sweep_static.py)."),
    seed: int = typer.Option(0, "--seed"),
    priority_mix: str = typer.Option(None, "--priority-mix", help="Priorities 0-10 for requests the trace gives "
                                     "none, e.g. 9:0.1,5:0.6,1:0.3 (summaries then split SLO attainment by them)."),
    report: Path = typer.Option(Path("kvguard-report"), "--report", help="Directory for the report and plots "
                                                                         "(its path is printed on stderr)."),
    no_report: bool = typer.Option(False, "--no-report", help="Do not write the report."),
    no_lstm: bool = typer.Option(False, "--no-lstm", help="Run without the predictor tier (tier 3)."),
    bus: str = typer.Option(None, "--bus", help="kafka://HOST:PORT runs the parts as services over Kafka."),
    redis: str = typer.Option(None, "--redis", help="redis://… puts the budget and SLO ledgers in Redis (node ids "
                                                     "then carry a run id: demo-<run>/gpu<i>)."),
    speed: float = typer.Option(10.0, "--speed", min=0.1, help="With --bus: simulated seconds per wall second."),
    keep_topics: bool = typer.Option(False, "--keep-topics", help="With --bus: keep the run's kvguard-demo-<run>.* "
                                                                  "topics (default: deleted at the end)."),
    config: Path = typer.Option(None, "--config", help="Settings file (TOML/JSON)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """Run a stressing workload through each arm (vLLM's defaults, the tuned static knobs, the
    operator's knobs without and with kvguard) and compare, counting every request.

    Exit status 3 when ledger writes could not be stored in Redis by the end of the run (an
    outage that outlasted it); the figures are printed all the same.
    """
    import logging
    import secrets

    from rich.console import Console

    # the runtime loads the whole system: imported when the command runs, so `kvguard --help` stays fast
    from kvguard.cli.simulate import overload_args, parse_duration
    from kvguard.config.extras import require
    from kvguard.config.settings import ConfigError, Settings
    from kvguard.producers.sim.profiles import EngineKnobs, load_profile
    from kvguard.producers.sim.registry import engine_kind
    from kvguard.runtime.bootstrap import bootstrap, make_ledger, make_slo_ledger
    from kvguard.runtime.embedded import budget_f_ext, compare, demo_workload, ledger_summary, static_arms
    from kvguard.runtime.overbus import run_over_bus

    if not no_report:
        require("matplotlib")  # the report's plots: said before the runs, not after them
    logging.basicConfig(level=logging.ERROR, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for name in LOUD_LOGGERS:  # outages and retries are the demo's business to show (on stderr)
        logging.getLogger(name).setLevel(logging.WARNING)
    console = Console(stderr=True)
    duration_s = parse_duration(duration) if duration else (QUICK_DURATION_S if quick else DEMO_DURATION_S)
    if rate_scale is None:
        rate_scale = QUICK_RATE_SCALE if quick else DEMO_RATE_SCALE
    try:
        settings = Settings.load(config)
        kind = engine_kind(load_profile(profile))
        knobs = EngineKnobs(gpu_memory_utilization=gpu_memory_utilization) if kind.takes_knobs else None
        node_config = kind.node_config(prompt_logprobs_frac=prompt_logprobs_frac) \
            if kind.capabilities.prompt_logprobs else None
        graph = bootstrap(settings, profile=profile, knobs=knobs, node_config=node_config,
                          predictor=None if no_lstm else "shipped")
    except (ConfigError, ValueError) as err:
        console.print(f"[red]error:[/red] {err}")
        raise typer.Exit(2) from None
    # A shared ledger (Redis) or broker outlives the run: the run's node ids carry a run id so that
    # another run's debits (idempotent per node and tick, and simulated time starts at 0) never
    # merge with this one's. The embedded in-memory run keeps sim-0 (deterministic for a seed).
    run_id = secrets.token_hex(4) if (redis or bus) else None
    host = f"demo-{run_id}" if run_id else "sim-0"
    mix = overload_args(priority_mix, None)[0]
    wl = demo_workload(graph.profile, workload=workload, rate_scale=rate_scale, duration_s=duration_s, seed=seed,
                       priority_mix=mix)
    console.print(f"kvguard demo: {len(wl.requests)} requests ({workload} ×{rate_scale:g}, "
                  f"{duration_s / 60:.0f} min) on {gpus} × {graph.profile.name}; {graph.predictor_note}"
                  + (f"; run {run_id}, nodes {host}/gpu0…" if run_id else ""))
    live = not json_out and console.is_terminal
    try:
        graph.ledger = make_ledger(settings, redis)
        graph.slo_ledger = make_slo_ledger(settings, redis)
    except ValueError as err:  # a --redis URL that is no Redis URL
        console.print(f"[red]error:[/red] {err}")
        raise typer.Exit(2) from None
    try:
        baseline = _run(graph, wl, gpus, duration_s, seed, False, live, console, host)
        if bus:
            console.print(f"closed loop over {bus} ({'redis' if redis else 'in-memory'} ledgers) at "
                          f"{speed:g}× real time: about {duration_s / speed:.0f} s")
            try:
                guarded = asyncio.run(run_over_bus(graph, wl, bus=bus, n_gpus=gpus, duration_s=duration_s,
                                                   seed=seed, speed=speed, run_id=run_id, keep_topics=keep_topics))
            except Exception as err:  # broker unreachable: say which, do not dump a traceback
                console.print(f"[red]error:[/red] {type(err).__name__}: {err}")
                raise typer.Exit(1) from None
        else:
            guarded = _run(graph, wl, gpus, duration_s, seed, True, live, console, host)
        static_runs = {}
        if kind.takes_knobs and arms:  # the static arms are other start-up knobs of the same engine
            for name, arm_graph in static_arms(graph, profile, node_config).items():
                static_runs[name] = (_run(arm_graph, wl, gpus, duration_s, seed, False, live, console, host,
                                          label=name), arm_graph.profile.name)
        ledgers, lost = ledger_summary(graph.ledger, graph.slo_ledger, redis)
    finally:
        graph.ledger.close()
        graph.slo_ledger.close()
    result = compare(baseline.summary, guarded.summary)
    result["workload"] = {"name": workload, "rate_scale": rate_scale, "duration_s": duration_s, "seed": seed,
                          "requests": len(wl.requests), "notes": wl.notes}
    result["profile"] = graph.profile.name
    described = {"vllm_default": "vLLM's defaults", "tuned_static": "the best static knobs of the sweep on the "
                 "training workloads", "baseline": "the operator's knobs, no kvguard",
                 "kvguard": "the operator's knobs with kvguard: the closed loop and, on vLLM, the node-side step governor"}
    runs = {**static_runs, "baseline": (baseline, graph.profile.name), "kvguard": (guarded, graph.profile.name)}
    result["arms"] = {name: arm_summary(run.summary, prof, described[name]) for name, (run, prof) in runs.items()}
    result["governor"] = guarded.summary.get("governor")  # steps the step governor shrank (marked ^ on the timeline)
    result["prompt_logprobs_frac"] = prompt_logprobs_frac if kind.capabilities.prompt_logprobs else None
    result["mode"] = "kafka" if bus else "embedded"
    result["run_id"] = run_id
    result["nodes"] = [f"{host}/gpu{i}" for i in range(gpus)]
    result["ledger"] = ledgers
    # what the run's own ticks say the budget ledger should hold (F_ext of the fragmented layer above the line)
    line, tick_s = settings.budget.f_ext_threshold, settings.streams.tick_s
    ledgers["ticks"] = {node: {"ticks": len(rows),
                               "over_threshold_s": tick_s * sum(1 for r in rows if budget_f_ext(r) > line)}
                        for node, rows in sorted(guarded.series.items())}
    if not no_report:
        from kvguard.ops.demo_report import write_report

        path = write_report(report, result, baseline, guarded)
        result["report"] = str(path)
    if lost:
        console.print(f"[red]ledger:[/red] {lost}")
    if json_out:
        sys.stdout.write(json.dumps(result, default=str) + "\n")
    else:
        _print_comparison(result, console)
    if not no_report:
        console.print(f"report: {result['report']}")
    if lost:
        raise typer.Exit(3)


# loggers whose warnings the demo shows although it logs at ERROR otherwise
LOUD_LOGGERS = ("kvguard.budget", "policy.delivery", "policy.ledger", "kvguard.actuators.actuator")


def arm_summary(summary: dict, profile_name: str, config: str) -> dict:
    """One arm's outcomes (``ARM_FIELDS``), the profile (with its knobs) it ran and what it stands for."""
    return {**{k: summary.get(k) for k in ARM_FIELDS}, "profile": profile_name, "config": f"{config} ({profile_name})"}


def _run(graph, wl, gpus, duration_s, seed, guarded, live, console, host="sim-0", label=None):
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from kvguard.runtime.embedded import run_embedded  # see demo(): loaded on use

    label = label or ("kvguard closed loop" if guarded else "baseline engine")
    nodes = [f"{host}/gpu{i}" for i in range(gpus)]
    with LiveView(live, nodes, label) as view:
        if live:
            return asyncio.run(run_embedded(graph, wl, n_gpus=gpus, duration_s=duration_s, seed=seed,
                                            guarded=guarded, view=view, host=host))
        with Progress(TextColumn(label), BarColumn(), TextColumn("{task.completed:.0f}/{task.total:.0f} sim s"),
                      TimeElapsedColumn(), console=console, transient=True) as bar:
            task = bar.add_task(label, total=duration_s)
            return asyncio.run(run_embedded(graph, wl, n_gpus=gpus, duration_s=duration_s, seed=seed,
                                            guarded=guarded, host=host,
                                            progress=lambda d, t: bar.update(task, completed=d)))
