"""`kvguard eval`: run workloads through the shadow engine (baseline, no policy) and the stream core
with all three alert tiers, and score the OOM predictor: AUC, recall at FPR <= 5 %, per-tier lead
times and false alarms (definitions: ``kvguard.ml.evaluation``).

Several ``--workload``/``--rate-scale``/``--seed``/``--profile`` values run every combination and
report one pooled result (per-run figures under ``runs``). ``--data`` scores a saved dataset's
split offline instead (no simulation).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import typer

from kvguard.cli.app import app


def _trained_on(meta, workload: str) -> bool:
    runs = meta.training.get("runs", [])
    return any(r.get("workload") == workload and r.get("split") in ("train", "val") for r in runs)


@app.command("eval")
def eval_command(
    workload: list[str] = typer.Option(None, "--workload", help="Trace file, bundled alias or scenario (repeatable)."),
    model: Path = typer.Option(None, "--model", help="Model artifact (.pt/.json stem or dir); default: shipped."),
    rate_scale: list[float] = typer.Option([1.0], "--rate-scale", help="Arrival-rate multiplier (repeatable)."),
    profile: list[str] = typer.Option(["llama3-8b-24gb"], "--profile", help="GPU/model profile (repeatable)."),
    seed: list[int] = typer.Option([0], "--seed", help="Simulation seed (repeatable)."),
    duration: str = typer.Option("1h", "--duration", help="Simulated time per run, e.g. 30m, 90s, 1h, 3600."),
    gpus: int = typer.Option(1, "--gpus", help="GPUs per simulated fleet."),
    data: Path = typer.Option(None, "--data", help="Score a saved dataset offline instead of simulating."),
    split: str = typer.Option("test", "--split", help="With --data: which split to score."),
    mode: str = typer.Option("window", "--mode", help="With --data: 'window' (the stream's 180-tick windows) "
                                                      "or 'stateful' (LSTMPredictor.step, one step per tick)."),
    report: Path = typer.Option(None, "--report", help="Directory for roc.png, lead_times.png and eval.json."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """Evaluate OOM prediction (LSTM) and the threshold/slope tiers on workloads, baseline engine."""
    from rich.console import Console

    from kvguard.cli.dataset import progress_bar
    from kvguard.cli.simulate import parse_duration
    from kvguard.ml.dataset import DatasetError, RunSpec, simulate_run
    from kvguard.ml.evaluation import NodeTrace, evaluate_traces, plot_lead_times, plot_roc
    from kvguard.streams.lstm import ModelError, load_model
    from kvguard.streams.metrics import FEATURE_NAMES

    console = Console(stderr=True)
    duration_s = parse_duration(duration)
    try:
        predictor = load_model(model, expected_features=list(FEATURE_NAMES))
    except ModelError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    meta = predictor.metadata
    traces: list[NodeTrace] = []
    runs_out = []
    if data is not None:
        traces, runs_out, title = _offline(predictor, data, split, mode)
    else:
        if not workload:
            typer.echo("error: give --workload (or --data)", err=True)
            raise typer.Exit(2)
        specs = [RunSpec(w, rate_scale=r, profile=p, seed=s, duration_s=duration_s, n_gpus=gpus, split="test")
                 for w, r, p, s in itertools.product(workload, rate_scale, profile, seed)]
        with progress_bar(console) as bar:
            task = bar.add_task("evaluating", total=len(specs), info="")
            for i, spec in enumerate(specs):
                try:
                    record = simulate_run(spec, tick_s=meta.tick_s, predictor=predictor)
                except (DatasetError, ValueError, FileNotFoundError) as exc:
                    typer.echo(f"error: {spec.key()}: {exc}", err=True)
                    raise typer.Exit(2)
                run_traces = [NodeTrace(node=f"{spec.key()}:{s.node}", ts_ns=s.ts_ns, p_oom=s.p_oom, firing=s.firing,
                                        oom_ts_ns=s.oom_ts_ns, tick_s=meta.tick_s) for s in record.sequences]
                traces.extend(run_traces)
                per_run = evaluate_traces(run_traces, horizon_s=meta.horizon_s).to_dict()
                runs_out.append({"run": spec.key(), "in_training": _trained_on(meta, spec.workload),
                                 "engine": record.summary, "auc": per_run["auc"], "ooms": per_run["ooms"],
                                 "positive_ticks": per_run["positive_ticks"],
                                 "negative_ticks": per_run["negative_ticks"],
                                 "lead_time_median_s": per_run["lead_time_median_s"],
                                 "false_alarms_per_hour": per_run["false_alarms_per_hour"]})
                bar.update(task, completed=i + 1, info=f"{spec.key()}: {per_run['ooms']} OOMs")
        title = ", ".join(sorted(set(workload)))
    result = evaluate_traces(traces, horizon_s=meta.horizon_s, threshold=meta.threshold)
    out = result.to_dict()
    lstm, thr = out["lead_time_median_s"]["lstm"], out["lead_time_median_s"]["threshold"]
    out.update({
        "lstm_lead_vs_threshold": None if not lstm or not thr else round(lstm / thr, 3),
        "lstm_threshold": round(meta.threshold, 6),
        "model": {"path": str(model) if model else "shipped", "version": meta.version,
                  "trained_on": sorted({r.get("workload") for r in meta.training.get("runs", [])
                                        if r.get("split") in ("train", "val")})},
        "held_out": not any(r["in_training"] for r in runs_out),
        "runs": runs_out,
    })
    if report is not None:
        report.mkdir(parents=True, exist_ok=True)
        plot_roc(result, str(report / "roc.png"), title=f"P(OOM within 5 min) on {title}")
        plot_lead_times(result, str(report / "lead_times.png"), title=f"Warning lead time before OOM: {title}")
        (report / "eval.json").write_text(json.dumps(out, indent=1) + "\n")
        out["report"] = {"roc": str(report / "roc.png"), "lead_times": str(report / "lead_times.png")}
    if as_json:
        typer.echo(json.dumps(out))
    else:
        console.print_json(json.dumps(out))


def _offline(predictor, data: Path, split: str, mode: str):
    """Score a saved dataset's split as the stream would (exact 180-tick windows, or stateful)."""
    from kvguard.ml.dataset import DatasetError, TickDataset
    from kvguard.ml.training import score_dataset, traces_for

    try:
        ds = TickDataset.load(data)
        ids = ds.sequences_in(split)
    except DatasetError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    meta = predictor.metadata
    if list(ds.feature_names) != list(meta.feature_names):
        typer.echo(f"error: {data}: dataset features differ from the model's", err=True)
        raise typer.Exit(2)
    if mode not in ("window", "stateful"):
        typer.echo(f"error: --mode {mode!r}: expected 'window' or 'stateful'", err=True)
        raise typer.Exit(2)
    scores = score_dataset(predictor.net, ds, ids, meta.normalisation, meta.window_ticks, mode)
    traces = traces_for(ds, ids, scores, meta.threshold, meta.resolve_after_s)
    runs = sorted({int(ds.seq_run[s]) for s in ids})
    runs_out = [{"run": ds.runs[r].get("key", ds.runs[r]["workload"]), "in_training": False} for r in runs]
    title = ", ".join(sorted({ds.runs[r]["workload"] for r in runs}))
    return traces, runs_out, title
