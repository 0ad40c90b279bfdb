"""`kvguard eval`: run workloads through the shadow engine (baseline, no policy) and the stream core
with all three alert tiers, and score the OOM predictor: AUC, recall at FPR <= 5 %, per-tier lead
times and false alarms (definitions: ``kvguard.ml.evaluation``).

Several ``--workload``/``--rate-scale``/``--seed``/``--profile`` values run every combination and
report one pooled result (per-run figures under ``runs``); a run identical to an earlier one (a
trace workload replays the same arrivals for every seed) is scored once and listed under
``duplicates``. ``--data`` scores a saved dataset's split offline instead (no simulation).

Besides the LSTM's figures the JSON holds ``bands`` (per lead band), ``auc_ci`` (event bootstrap),
``events`` (OOMs after merging fleet cascades), ``false_alarms_per_gpu_hour`` and ``baselines``:
the threshold and slope tiers, logistic regression and gradient boosting (fitted on the ``train``
runs of ``--data`` or of ``--baseline-data``, threshold from their ``val`` runs) and the LSTM,
each scored on the same ticks.

With ``--gpus`` > 1 the JSON also holds ``fleet_risk``: the per-fleet hazard of
``kvguard.ml.fleet_risk`` scored on its own (label: any OOM of the fleet within the horizon; figures
of ``kvguard.ml.evaluation.evaluate_fleet_risk``, its alarm threshold taken on these same ticks, so
optimistic; ``bench/eval_fleet_risk.py`` calibrates it on training workloads instead). ``--data``
holds no ticks to compute it from; there the block says so when the dataset has multi-GPU runs.
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
    baseline_data: Path = typer.Option(None, "--baseline-data", help="Dataset whose train/val runs fit the "
                                       "logistic and boosting baselines (default: --data's)."),
    bootstrap: int = typer.Option(500, "--bootstrap", help="Event-bootstrap draws for the AUC intervals (0: none)."),
    lowo: bool = typer.Option(False, "--lowo", help="With --data: also leave each workload out in turn, "
                              "refit every model without it and score it on its runs."),
    lowo_lstm_epochs: int = typer.Option(20, "--lowo-lstm-epochs", help="With --lowo: LSTM epochs per fold "
                                                                          "(0: leave the LSTM out)."),
    leak: str = typer.Option("", "--leak", help="vLLM profiles: memory never returned in every run, as "
                             "`kvguard simulate --leak` (1GiB/h, 4MiB/req, 1MiB/step; class C7)."),
    neighbour: str = typer.Option("", "--neighbour", help="vLLM profiles: another process on each GPU, "
                                  "SIZE[:RATE] as `kvguard simulate --neighbour` (e.g. 1GiB:+6GiB/h; class C4)."),
    ramp: float = typer.Option(1.0, "--ramp", help="The arrival rate rises linearly to this multiple of the "
                               "start's by the end of each run (KV-demand storms, class C6)."),
    report: Path = typer.Option(None, "--report", help="Directory for roc.png, lead_times.png, bands.md, eval.json."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """Evaluate OOM prediction (the shipped model, or --model) beside the threshold and slope tiers and the baselines."""
    from rich.console import Console

    from kvguard.cli.dataset import progress_bar
    from kvguard.cli.simulate import parse_duration
    from kvguard.config.extras import require
    from kvguard.config.settings import ConfigError, Settings
    from kvguard.ml.dataset import DatasetError, RunSpec, run_fingerprint, simulate_run
    from kvguard.ml.evaluation import NodeTrace, evaluate_traces, plot_lead_times, plot_roc
    from kvguard.runtime.bootstrap import bootstrap as build_graph
    from kvguard.streams.loader import ModelError, load_predictor
    from kvguard.streams.metrics import FEATURE_NAMES

    require("sklearn")  # the baselines; checked before the runs, not after them
    if report is not None:
        require("matplotlib")
    console = Console(stderr=True)
    duration_s = parse_duration(duration)
    try:
        predictor = load_predictor(model, expected_features=list(FEATURE_NAMES))
        settings = Settings.load()
    except (ModelError, ConfigError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    meta = predictor.metadata
    # the stream core as the deployed worker runs this model, at the model's tick
    stream_config = build_graph(settings, predictor=predictor).stream_config(tick_s=meta.tick_s)
    traces: list[NodeTrace] = []
    records = []  # (spec, record) of simulated runs: the per-target block reads their sequences
    workload_of: list[str] = []  # per trace
    runs_out = []
    duplicates = []
    fleet_traces = []  # one per multi-GPU run: the fleet hazard's trace
    if data is not None:
        traces, workload_of, runs_out, title = _offline(predictor, data, split, mode)
    else:
        if not workload:
            typer.echo("error: give --workload (or --data)", err=True)
            raise typer.Exit(2)
        specs = [RunSpec(w, rate_scale=r, profile=p, seed=s, duration_s=duration_s, n_gpus=gpus, split="test",
                         leak=leak, neighbour=neighbour, ramp=ramp)
                 for w, r, p, s in itertools.product(workload, rate_scale, profile, seed)]
        seen: dict[str, str] = {}
        with progress_bar(console) as bar:
            task = bar.add_task("evaluating", total=len(specs), info="")
            for i, spec in enumerate(specs):
                try:
                    record = simulate_run(spec, tick_s=meta.tick_s, predictor=predictor, keep_ticks=gpus > 1,
                                          stream_config=stream_config)
                except (DatasetError, ValueError, FileNotFoundError) as exc:
                    typer.echo(f"error: {spec.key()}: {exc}", err=True)
                    raise typer.Exit(2)
                fingerprint = run_fingerprint(record.sequences)
                if fingerprint in seen:
                    duplicates.append({"run": spec.key(), "same_as": seen[fingerprint]})
                    bar.update(task, completed=i + 1, info=f"{spec.key()}: same as {seen[fingerprint]}")
                    continue
                seen[fingerprint] = spec.key()
                records.append((spec, record))
                run_traces = [_trace(spec.key(), s, meta) for s in record.sequences]
                if gpus > 1:
                    fleet_traces.append(_fleet_trace(spec, record, meta))
                traces.extend(run_traces)
                workload_of.extend([spec.workload] * len(run_traces))
                per_run = evaluate_traces(run_traces, horizon_s=meta.horizon_s, bootstrap_draws=0).to_dict()
                runs_out.append({"run": spec.key(), "in_training": _trained_on(meta, spec.workload),
                                 "engine": record.summary, "auc": per_run["auc"], "ooms": per_run["ooms"],
                                 "positive_ticks": per_run["positive_ticks"],
                                 "negative_ticks": per_run["negative_ticks"],
                                 "lead_time_median_s": per_run["lead_time_median_s"],
                                 "false_alarms_per_hour": per_run["false_alarms_per_hour"]})
                bar.update(task, completed=i + 1, info=f"{spec.key()}: {per_run['ooms']} OOMs")
        title = ", ".join(sorted(set(workload)))
    result = evaluate_traces(traces, horizon_s=meta.horizon_s, threshold=meta.threshold, bootstrap_draws=bootstrap)
    out = result.to_dict()
    try:
        models = _fit_baselines(baseline_data or data)
    except (DatasetError, ValueError) as exc:
        typer.echo(f"error: baselines: {exc}", err=True)
        raise typer.Exit(2)
    baselines = _baselines(traces, meta, models, bootstrap)
    by_workload = {w: _baselines([t for t, tw in zip(traces, workload_of) if tw == w], meta, models, bootstrap)
                   for w in sorted(set(workload_of))} if len(set(workload_of)) > 1 else {}
    if lowo:
        if data is None:
            typer.echo("error: --lowo needs --data", err=True)
            raise typer.Exit(2)
        out["leave_one_workload_out"] = _lowo(data, meta, lowo_lstm_epochs, bootstrap)
    trend = _targets(predictor, model, records, data, split, baseline_data, bootstrap, lowo)
    if trend is not None:
        out["targets"] = trend
    fleet = _fleet_block(fleet_traces, data, split, bootstrap)
    if fleet is not None:
        out["fleet_risk"] = fleet
    lstm, thr = out["lead_time_median_s"]["lstm"], out["lead_time_median_s"]["threshold"]
    out.update({
        "lstm_lead_vs_threshold": None if not lstm or not thr else round(lstm / thr, 3),
        "lstm_threshold": round(meta.threshold, 6),
        "model": {"path": str(model) if model else "shipped", "version": meta.version,
                  "trained_on": sorted({r.get("workload") for r in meta.training.get("runs", [])
                                        if r.get("split") in ("train", "val")})},
        "held_out": not any(r["in_training"] for r in runs_out),
        "baselines": baselines,
        "by_workload": by_workload,
        "duplicates": duplicates,
        "runs": runs_out,
    })
    if report is not None:
        report.mkdir(parents=True, exist_ok=True)
        plot_roc(result, str(report / "roc.png"), title=f"P(OOM within 5 min) on {title}")
        plot_lead_times(result, str(report / "lead_times.png"), title=f"Warning lead time before OOM: {title}")
        tables = [f"## {title}\n\n" + band_table(baselines)]
        tables += [f"## {w}\n\n" + band_table(b) for w, b in by_workload.items()]
        (report / "bands.md").write_text("\n".join(tables))
        (report / "eval.json").write_text(json.dumps(out, indent=1) + "\n")
        out["report"] = {"roc": str(report / "roc.png"), "lead_times": str(report / "lead_times.png"),
                         "bands": str(report / "bands.md")}
        console.print("\n".join(tables))
    if as_json:
        typer.echo(json.dumps(out))
    else:
        console.print_json(json.dumps(out))


def band_table(baselines: dict) -> str:
    """The models side by side as a markdown table: AUC with its interval overall and per lead band,
    recall at FPR <= 5 %, median lead time, false alarms per GPU-hour."""

    def auc_cell(row: dict) -> str:
        if row.get("auc") is None:
            return f"n/a ({row.get('positives', 0)} +)" if "positives" in row else "n/a"
        ci = row.get("auc_ci")
        return f"{row['auc']:.3f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")

    def num(x, fmt="{:.2f}") -> str:
        return "n/a" if x is None else fmt.format(x)

    models = [(k, v) for k, v in baselines.items() if isinstance(v, dict)]
    bands = next((v["bands"] for _, v in models), [])
    head = ["model", "AUC [95 % CI]", "recall @ FPR 5 %"]
    head += [f"{lo:g}-{hi:g} s: AUC / recall" for lo, hi in (b["band_s"] for b in bands)]
    head += ["median lead (s)", "false alarms / GPU-h"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in models:
        cells = [name, auc_cell(row), num(row["recall_at_fpr_5pct"])]
        cells += [f"{auc_cell(b)} / {num(b['recall_at_fpr_5pct'])}" for b in row["bands"]]
        cells += [num(row["lead_time_median_s"], "{:.0f}"), num(row["false_alarms_per_gpu_hour"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _trace(run_key: str, seq, meta):
    from kvguard.ml.evaluation import NodeTrace

    down, censored = seq.masks(meta.horizon_s)
    return NodeTrace(node=f"{run_key}:{seq.node}", ts_ns=seq.ts_ns, p_oom=seq.p_oom, firing=seq.firing,
                     oom_ts_ns=seq.oom_ts_ns, tick_s=meta.tick_s, down=down, censored=censored, fleet=run_key,
                     features=seq.features)


def _fleet_trace(spec, record, meta):
    from kvguard.contracts.units import NS_PER_S
    from kvguard.ml.evaluation import fleet_trace_from_ticks

    ooms = [t for seq in record.sequences for t in seq.oom_ts_ns.tolist()]
    return fleet_trace_from_ticks(spec.key(), record.ticks, ooms, int(spec.duration_s * NS_PER_S),
                                  tick_s=meta.tick_s, horizon_s=meta.horizon_s)


def _fleet_block(fleet_traces: list, data: Path | None, split: str, bootstrap: int) -> dict | None:
    """The fleet hazard's figures over the simulated multi-GPU runs; for a dataset with multi-GPU runs
    a note (it keeps features, not the ticks the hazard reads); None when there is no fleet."""
    from kvguard.ml.evaluation import evaluate_fleet_risk

    if fleet_traces:
        return evaluate_fleet_risk(fleet_traces, bootstrap_draws=bootstrap)
    runs = json.loads(data.with_suffix(".json").read_text()).get("runs", []) if data is not None else []
    if any(int(r.get("n_gpus") or 1) > 1 for r in runs if r.get("split") == split):
        return {"note": "a dataset keeps tick features, not the ticks the fleet hazard reads: score it with "
                        "`kvguard eval --workload W --gpus N` or `python bench/eval_fleet_risk.py`"}
    return None


def _targets(predictor, model: Path | None, records: list, data: Path | None, split: str,
             calib_data: Path | None, bootstrap: int, lowo: bool) -> dict | None:
    """Per target (``oom``; ``storm`` when its model ships beside), the trend model and the
    operators' baselines on the same ticks (``kvguard.ml.trend_eval.targets_block``); None unless the
    model is a trend model."""
    from kvguard.ml.dataset import TickDataset, assemble, spec_dict
    from kvguard.ml.trend_eval import derived_matrix, lowo as trend_lowo, targets_block
    from kvguard.streams.loader import SHIPPED_DIR
    from kvguard.streams.trend_model import TrendPredictor, is_trend_model, load_trend_model
    from kvguard.streams.metrics import FEATURE_NAMES

    if not isinstance(predictor, TrendPredictor):
        return None
    predictors = {predictor.metadata.target: predictor}
    storm_path = (model.parent if model is not None and model.suffix else (model or SHIPPED_DIR))
    storm_path = storm_path / "storm_trees" if Path(storm_path).is_dir() else storm_path
    if "storm" not in predictors and is_trend_model(storm_path):
        predictors["storm"] = load_trend_model(storm_path, expected_features=list(FEATURE_NAMES))
    if data is not None:
        ds = TickDataset.load(data)
    else:
        ds = assemble(list(FEATURE_NAMES), [(dict(spec_dict(spec), key=spec.key()), rec.sequences)
                                            for spec, rec in records], horizon_s=predictor.metadata.horizon_s,
                      tick_s=predictor.metadata.tick_s)
        split = "test"
    calib = TickDataset.load(calib_data) if calib_data is not None else None
    out = targets_block(ds, predictors, split=split, calib=calib, bootstrap=bootstrap)
    if lowo and data is not None:
        from kvguard.ml.trend_eval import target_dataset

        for target in out:
            tds = target_dataset(ds, target)
            out[target]["leave_one_workload_out"] = trend_lowo(tds, derived_matrix(tds))
    return out


def _fit_baselines(fit_data: Path | None) -> dict | None:
    """The fitted baselines of ``kvguard.ml.baselines`` (None without a dataset to learn from)."""
    from kvguard.ml.baselines import fit_tick_models
    from kvguard.ml.dataset import TickDataset

    return None if fit_data is None else fit_tick_models(TickDataset.load(fit_data))


def _baselines(traces, meta, models: dict | None, bootstrap: int) -> dict:
    """The alert tiers, the fitted ``models`` and the LSTM, scored on ``traces``' ticks."""
    from kvguard.ml import baselines as bl
    from kvguard.ml.training import hysteresis

    out = {tier: bl.summarise(bl.tier_traces(traces, tier), meta.horizon_s, bootstrap_draws=bootstrap)
           for tier in bl.TIER_BASELINES}
    if models is not None:
        for name, model in models.items():
            scores = [model.score(tr.features) for tr in traces]
            firing = [hysteresis(tr.ts_ns, p, model.threshold, meta.resolve_after_s) for tr, p in zip(traces, scores)]
            out[name] = bl.summarise(bl.as_model_traces(traces, scores, firing), meta.horizon_s,
                                     threshold=model.threshold, bootstrap_draws=bootstrap)
    else:
        out["note"] = "logistic and boosting need a dataset to learn from: give --data or --baseline-data"
    lstm = bl.as_model_traces(traces, [tr.p_oom for tr in traces], [tr.firing["lstm"] for tr in traces])
    out["lstm"] = bl.summarise(lstm, meta.horizon_s, threshold=meta.threshold, bootstrap_draws=bootstrap)
    return out


def _lowo(data: Path, meta, lstm_epochs: int, bootstrap: int) -> dict:
    from kvguard.ml.baselines import leave_one_workload_out
    from kvguard.ml.dataset import TickDataset
    from kvguard.ml.training import TrainConfig

    config = TrainConfig(epochs=lstm_epochs) if lstm_epochs > 0 else None
    return leave_one_workload_out(TickDataset.load(data), horizon_s=meta.horizon_s,
                                  resolve_after_s=meta.resolve_after_s, lstm_config=config, bootstrap_draws=bootstrap)


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
    if hasattr(predictor, "net"):  # the LSTM: exact windows, or its stateful path
        scores = score_dataset(predictor.net, ds, ids, meta.normalisation, meta.window_ticks, mode)
    elif hasattr(predictor, "score_derived"):  # the trend trees: each tick over its own window
        from kvguard.streams.trend_model import derive_sequence

        scores = [predictor.score_derived(derive_sequence(ds.features[ds.seq_offsets[s]:ds.seq_offsets[s + 1]],
                                                          ds.feature_names, meta.window_ticks, tick_s=meta.tick_s))
                  for s in ids]
    else:  # a per-tick model (the one-tick trees): each tick on its own, whatever the mode
        scores = [predictor.score(ds.features[ds.seq_offsets[s]:ds.seq_offsets[s + 1]]) for s in ids]
    traces = traces_for(ds, ids, scores, meta.threshold, meta.resolve_after_s)
    runs = sorted({int(ds.seq_run[s]) for s in ids})
    runs_out = [{"run": ds.runs[r].get("key", ds.runs[r]["workload"]), "in_training": False} for r in runs]
    title = ", ".join(sorted({ds.runs[r]["workload"] for r in runs}))
    return traces, [ds.runs[int(ds.seq_run[s])]["workload"] for s in ids], runs_out, title
