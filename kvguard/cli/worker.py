"""`kvguard worker`: run the streams Faust worker (kvguard.events -> kvguard.metrics / kvguard.alerts)."""

from __future__ import annotations

from pathlib import Path

import typer

from kvguard.cli.app import app


@app.command("worker")
def worker(
    config: Path = typer.Option(None, "--config", help="TOML/JSON settings file (else $KVGUARD_CONFIG)"),
    bootstrap: str = typer.Option(None, "--bootstrap", help="host:port[,host:port]; default kafka.bootstrap"),
    prefix: str = typer.Option(None, "--prefix", help="topic name prefix; default topics.prefix (kvguard.)"),
    app_id: str = typer.Option("kvguard-streams", "--app-id", help="Faust app id (consumer group, table topics)"),
    model: Path = typer.Option(None, "--model", help="LSTM model for tier 3 (`kvguard train`); off by default"),
    checkpoint_every_ticks: int = typer.Option(6, "--checkpoint-every-ticks", min=1,
                                               help="ticks of a node between state checkpoints"),
    create_topics: bool = typer.Option(True, "--create-topics/--no-create-topics",
                                       help="create kvguard's and Faust's topics first (Tansu has no auto-create)"),
    compact_changelog: bool = typer.Option(False, "--compact-changelog/--no-compact-changelog",
                                           help="create the state changelog compacted (Kafka; not Tansu 0.6)"),
    datadir: Path = typer.Option(None, "--datadir", help="Faust data directory (default: a temp dir)"),
    loglevel: str = typer.Option("warning", "--loglevel", help="debug, info, warning, error"),
) -> None:
    """Start a Faust worker of the stream processors.

    Several workers with the same --app-id split the partitions of kvguard.events; per-node state
    survives restarts through the changelog.
    """
    import asyncio

    from kvguard.config.settings import ConfigError, Settings

    overrides: dict = {}
    if bootstrap:
        overrides["kafka"] = {"bootstrap": bootstrap}
    if prefix is not None:
        overrides["topics"] = {"prefix": prefix}
    try:
        settings = Settings.load(config, overrides=overrides)
    except ConfigError as exc:
        typer.echo(f"config error: {exc}", err=True)
        raise typer.Exit(2) from None
    predictor = None
    model_path = model or (Path(settings.predictor.model_path) if settings.predictor.model_path else None)
    if model_path is not None:
        from kvguard.streams.loader import ModelError, load_predictor
        from kvguard.streams.metrics import FEATURE_NAMES

        try:
            predictor = load_predictor(model_path, expected_features=list(FEATURE_NAMES))
        except ModelError as exc:
            typer.echo(f"model: {exc}", err=True)
            raise typer.Exit(2) from None

    from faust import Worker

    from kvguard.streams.app import build_app, ensure_topics, fetch_max_wait_ms

    try:
        fetch_wait_ms = fetch_max_wait_ms(settings)
    except ValueError as exc:
        typer.echo(f"config error: {exc}", err=True)
        raise typer.Exit(2) from None

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    if create_topics:
        try:
            loop.run_until_complete(ensure_topics(settings, app_id, compact_changelog=compact_changelog))
        except Exception as exc:  # connection refused, auth, broker error: name the broker
            typer.echo(f"could not create topics on {settings.kafka.bootstrap}: {type(exc).__name__}: {exc}",
                       err=True)
            raise typer.Exit(1) from None
    faust_app, _ = build_app(settings, predictor=predictor, app_id=app_id,
                             datadir=str(datadir) if datadir else None,
                             checkpoint_every_ticks=checkpoint_every_ticks)
    typer.echo(f"kvguard worker {app_id}: {settings.topics.name('events')} on {settings.kafka.bootstrap} "
               f"(fetch wait {fetch_wait_ms} ms, chunks of {settings.streams.chunk_max_records} "
               f"within {settings.streams.chunk_max_wait_s:g} s)", err=True)
    Worker(faust_app, loop=loop, loglevel=loglevel, quiet=True).execute_from_commandline()
