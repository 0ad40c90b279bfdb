"""`kvguard train`: fit the tier-3 OOM LSTM, calibrate its threshold, write weights + metadata.

The shipped model (``streams/models/oom_lstm.{pt,json}``) is rebuilt with::

    kvguard train --preset shipped --out streams/models

which simulates the ``shipped`` preset's runs (``kvguard.ml.dataset.PRESETS``), trains with the
default ``TrainConfig`` and seed 0, and writes the artifact. Deterministic up to torch's CPU kernels.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from kvguard.cli.app import app


@app.command("train")
def train_command(
    data: Path = typer.Option(None, "--data", help="Dataset from `kvguard dataset` (.npz); default: simulate --preset."),
    preset: str = typer.Option("shipped", "--preset", help="Runs to simulate when --data is not given."),
    epochs: int = typer.Option(None, "--epochs", help="Training epochs (default: TrainConfig's)."),
    out: Path = typer.Option(Path("kvguard-model"), "--out", help="Directory (or path stem) for the artifact."),
    seed: int = typer.Option(0, "--seed", help="Seed for weight init and chunk order."),
    threads: int = typer.Option(1, "--threads", help="torch CPU threads (the machine is shared: keep it small)."),
    save_data: Path = typer.Option(None, "--save-data", help="Also save the simulated dataset here (.npz + .json)."),
    model: str = typer.Option("lstm", "--model", help="lstm (2-layer LSTM over 30 minutes of ticks), boosting "
                              "(gradient-boosted trees over one tick; exported to arrays) or trend (trees over "
                              "5/15/30-minute levels and slopes, for the TREND classes; exported to arrays)."),
    target: str = typer.Option("oom", "--target", help="With --model trend: oom (an OOM within 5 min) or storm "
                               "(a preemption storm begins within 5 min)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary on stdout."),
) -> None:
    """Train the OOM predictor (an LSTM, or gradient-boosted trees) and save the model artifact."""
    from rich.console import Console

    from kvguard.cli.dataset import build_with_progress, progress_bar, resolve_specs
    from kvguard.config.extras import require
    from kvguard.config.settings import Settings
    from kvguard.ml.dataset import DatasetError, TickDataset
    from kvguard.runtime.bootstrap import bootstrap

    if model not in ("lstm", "boosting", "trend"):
        typer.echo(f"error: --model {model!r}: expected lstm, boosting or trend", err=True)
        raise typer.Exit(2)
    require("torch" if model == "lstm" else "sklearn")  # before a long simulation, not after it
    console = Console(stderr=True)
    try:
        if data is not None:
            ds = TickDataset.load(data)
        else:
            stream_config = bootstrap(Settings.load(), predictor=None).stream_config()
            ds = build_with_progress(resolve_specs(preset, None), console, stream_config.tick_s, stream_config)
            if save_data is not None:
                ds.save(save_data)
    except (DatasetError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    command = ("kvguard train " + (f"--data {data}" if data else f"--preset {preset}") + f" --seed {seed}"
               + (f" --model {model}" if model != "lstm" else "") + (f" --epochs {epochs}" if epochs else ""))
    if model == "trend":
        _train_trend(ds, target, seed, out, as_json, console, {"data": str(data) if data else None,
                                                              "preset": None if data else preset,
                                                              "command": command + f" --target {target}"})
        return
    if model == "boosting":
        _train_trees(ds, seed, out, as_json, console, {"data": str(data) if data else None,
                                                      "preset": None if data else preset, "command": command})
        return
    from kvguard.ml.training import TrainConfig, train
    from kvguard.streams.lstm import count_parameters, describe, save_model

    config = TrainConfig(seed=seed, threads=threads)
    if epochs is not None:
        config.epochs = epochs
    with progress_bar(console) as bar:
        task = bar.add_task("training", total=None, info="")

        def report(done, total, info):
            bar.update(task, completed=done, total=total, info=f"epoch {info['epoch']} loss {info['loss']:.4f}")

        result = train(ds, config, progress=report)
    result.metadata.training["source"] = {"data": str(data) if data else None,
                                          "preset": None if data else preset, "command": command}
    weights, meta_path = save_model(result.net, result.metadata, out)
    summary = dict(describe(result.metadata), weights=str(weights), metadata=str(meta_path),
                   parameters=count_parameters(result.net), weights_bytes=weights.stat().st_size,
                   train_seconds=round(result.seconds, 1),
                   history=result.history)
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        console.print_json(json.dumps(summary))


def _train_trend(ds, target: str, seed: int, out: Path, as_json: bool, console, source: dict) -> None:
    from kvguard.ml.trend_eval import train_trend_model
    from kvguard.streams.trend_model import save_trend_model

    with console.status(f"fitting the trend trees ({target}) on the train runs' scored ticks"):
        try:
            predictor = train_trend_model(ds, target=target, seed=seed)
        except ValueError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2)
    predictor.metadata.training["source"] = source
    stem = out / f"{target}_trees" if out.is_dir() else out
    npz, meta_path = save_trend_model(predictor.trees, predictor.metadata, stem)
    meta = predictor.metadata
    summary = {"model": "trend", "target": target, "version": meta.version, "threshold": round(meta.threshold, 6),
               "trees": meta.metrics["trees"], "nodes": meta.metrics["nodes"], "arrays": str(npz),
               "metadata": str(meta_path)}
    typer.echo(json.dumps(summary)) if as_json else console.print_json(json.dumps(summary))


def _train_trees(ds, seed: int, out: Path, as_json: bool, console, source: dict) -> None:
    import time

    from kvguard.ml.tick_training import train_tick_model
    from kvguard.streams.tick_model import save_tick_model

    started = time.monotonic()
    with console.status("fitting gradient-boosted trees on the train runs' scored ticks"):
        try:
            predictor = train_tick_model(ds, seed=seed)
        except ValueError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2)
    predictor.metadata.training["source"] = source
    npz, meta_path = save_tick_model(predictor.trees, predictor.metadata, out)
    meta = predictor.metadata
    summary = {"model": "boosting", "version": meta.version, "threshold": round(meta.threshold, 6),
               "features": len(meta.feature_names), "trees": meta.metrics["trees"], "nodes": meta.metrics["nodes"],
               "arrays": str(npz), "metadata": str(meta_path), "arrays_bytes": npz.stat().st_size,
               "train_seconds": round(time.monotonic() - started, 1), "trained_with": meta.trained_with}
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        console.print_json(json.dumps(summary))
