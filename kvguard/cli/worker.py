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
    model: Path = typer.Option(None, "--model", help="tier-3 model artifact (`kvguard train`); default: "
                                                     "predictor.model_path, else the shipped model"),
    no_predictor: bool = typer.Option(False, "--no-predictor", help="no tier 3 (as predictor.enabled = false)"),
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
    survives restarts through the changelog. Tier 3 runs the shipped model at its calibrated
    threshold unless told otherwise (--model, --no-predictor, the predictor settings), as the demo does.
    """
    import asyncio

    from kvguard.cli.export import broker_unreachable, quiet_kafka_client
    from kvguard.config.settings import ConfigError, Settings
    from kvguard.runtime.bootstrap import BootstrapError, check_kafka_options
    from kvguard.runtime.bootstrap import bootstrap as build_graph

    if model is not None and no_predictor:
        typer.echo("error: give --model or --no-predictor, not both", err=True)
        raise typer.Exit(2)
    overrides: dict = {}
    if bootstrap:
        overrides["kafka"] = {"bootstrap": bootstrap}
    if prefix is not None:
        overrides["topics"] = {"prefix": prefix}
    try:
        settings = Settings.load(config, overrides=overrides)
        check_kafka_options(settings)
        graph = build_graph(settings, predictor=None if no_predictor else (model or "shipped"))
        stream_config = graph.core_config()
    except (ConfigError, BootstrapError) as exc:
        typer.echo(f"config error: {exc}", err=True)
        raise typer.Exit(2) from None
    if graph.predictor is None and (model is not None or (settings.predictor.enabled and not no_predictor)):
        # asked for and not loaded: a worker must not run on without the tier it was deployed with
        source = "--model" if model is not None else "predictor.model_path" if settings.predictor.model_path else \
            "the shipped model"
        typer.echo(f"error: {source}: {graph.predictor_note}", err=True)
        raise typer.Exit(2)

    from faust import Worker

    from kvguard.streams.app import broker_reachable, build_app, ensure_topics, fetch_max_wait_ms

    try:
        fetch_wait_ms = fetch_max_wait_ms(settings)
    except ValueError as exc:
        typer.echo(f"config error: {exc}", err=True)
        raise typer.Exit(2) from None

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        with quiet_kafka_client():
            if create_topics:
                loop.run_until_complete(ensure_topics(settings, app_id, compact_changelog=compact_changelog))
            else:
                loop.run_until_complete(broker_reachable(settings))
    except Exception as exc:  # connection refused, auth, broker error: name the broker, in one line
        if create_topics:
            typer.echo(f"could not create topics on {settings.kafka.bootstrap}: {type(exc).__name__}: {exc}", err=True)
        else:
            typer.echo(broker_unreachable(settings.kafka.bootstrap, exc, "--bootstrap HOST:PORT"), err=True)
        raise typer.Exit(1) from None
    faust_app, _ = build_app(settings, config=stream_config, predictor=graph.predictor, app_id=app_id,
                             datadir=str(datadir) if datadir else None,
                             checkpoint_every_ticks=checkpoint_every_ticks)
    typer.echo(f"kvguard worker {app_id}: {settings.topics.name('events')} on {settings.kafka.bootstrap} "
               f"(fetch wait {fetch_wait_ms} ms, chunks of {settings.streams.chunk_max_records} "
               f"within {settings.streams.chunk_max_wait_s:g} s); {graph.tier3()}", err=True)
    Worker(faust_app, loop=loop, loglevel=loglevel, quiet=True).execute_from_commandline()
