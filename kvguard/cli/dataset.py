"""`kvguard dataset`: simulate runs (shadow engine, baseline) through the stream core and save tick
feature sequences with OOM labels as ``<out>.npz`` + ``<out>.json`` (manifest). Ticks while a GPU
restarts and ticks whose horizon runs past the end of their run are masked (``masked_ticks``);
runs identical to an earlier one are kept once (``duplicate_runs``)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from kvguard.cli.app import app


def progress_bar(console):
    """A rich progress bar on stderr (machines read stdout)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                    console=console, transient=False)


def build_with_progress(specs, console, tick_s: float = 10.0, stream_config=None):
    from kvguard.ml.dataset import build_dataset

    with progress_bar(console) as bar:
        task = bar.add_task("simulating runs", total=len(specs), info="")

        def report(i, n, spec, record):
            ooms = sum(len(s.oom_ts_ns) for s in record.sequences)
            bar.update(task, completed=i, info=f"{spec.key()} [{spec.split}]: {ooms} OOMs, {record.seconds:.1f}s")

        return build_dataset(specs, tick_s=tick_s, progress=report, stream_config=stream_config)


def logs_with_progress(paths, splits, console, tick_s: float = 10.0, stream_config=None):
    from kvguard.ml.dataset import dataset_from_logs

    with progress_bar(console) as bar:
        task = bar.add_task("reading event logs", total=len(paths), info="")

        def report(i, n, path, record):
            ooms = sum(len(s.oom_ts_ns) for s in record.sequences)
            bar.update(task, completed=i, info=f"{path.name}: {len(record.sequences)} nodes, {ooms} OOMs")

        return dataset_from_logs(paths, splits, tick_s=tick_s, progress=report, stream_config=stream_config)


def resolve_specs(preset: str | None, spec_file: Path | None):
    from kvguard.ml.dataset import PRESETS, DatasetError, RunSpec

    if spec_file is not None:
        try:
            rows = json.loads(spec_file.read_text())
            return [RunSpec(**row) for row in rows]
        except (OSError, json.JSONDecodeError, TypeError) as exc:
            raise DatasetError(f"{spec_file}: expected a JSON list of run specs "
                               f"(workload, rate_scale, profile, seed, duration_s, n_gpus, split): {exc}") from exc
    name = preset or "shipped"
    if name not in PRESETS:
        raise DatasetError(f"--preset {name!r}: expected one of {sorted(PRESETS)}")
    return PRESETS[name]()


@app.command("dataset")
def dataset_command(
    out: Path = typer.Option(Path("kvguard-dataset"), "--out", help="Output path; writes OUT.npz and OUT.json."),
    preset: str = typer.Option("shipped", "--preset", help="Named set of runs (shipped, small, tiny: the seed engine; vllm: the default engine under the operator's knobs; trend, trend-tiny: leak, neighbour and ramping-demand runs of the vLLM engine)."),
    spec_file: Path = typer.Option(None, "--spec", help="JSON list of run specs instead of a preset."),
    events: list[Path] = typer.Option(None, "--events", help="Recorded event log (kvguard simulate --events-out, "
                                      "kvguard record), one run per log, instead of simulating (repeatable)."),
    split: list[str] = typer.Option(None, "--split", help="With --events: the split (train, val, test) of every "
                                    "log, or one per log in order (repeatable). Default: train."),
    tick_s: float = typer.Option(10.0, "--tick-s", help="Tick length in seconds of event time."),
    as_json: bool = typer.Option(False, "--json", help="Print the manifest summary as JSON on stdout."),
) -> None:
    """Build a training/evaluation dataset from shadow-engine runs or recorded event logs
    (deterministic; records its inputs)."""
    from rich.console import Console

    from kvguard.config.settings import Settings
    from kvguard.ml.dataset import DatasetError
    from kvguard.runtime.bootstrap import bootstrap

    console = Console(stderr=True)
    try:
        # the stream core as the deployed worker runs it (tiers 1-2; the dataset trains tier 3)
        stream_config = bootstrap(Settings.load(), predictor=None).stream_config(tick_s=tick_s)
        if events:
            if spec_file is not None:
                raise DatasetError("--events and --spec: give one source of runs")
            ds = logs_with_progress(list(events), list(split or ["train"]), console, tick_s, stream_config)
        else:
            if split:
                raise DatasetError("--split goes with --events (a run spec carries its own split)")
            specs = resolve_specs(preset if spec_file is None else None, spec_file)
            ds = build_with_progress(specs, console, tick_s, stream_config)
    except (DatasetError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    npz, manifest = ds.save(out)
    summary = dict(ds.summary(), files={"npz": str(npz), "manifest": str(manifest)})
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        console.print_json(json.dumps(summary))
