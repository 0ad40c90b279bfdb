"""`kvguard topics`: provision kvguard's topics on a Kafka-compatible broker.

Tansu (and any broker with auto-creation off) needs this once per deployment; it is idempotent.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from kvguard.cli.app import app

topics_app = typer.Typer(help="Create and list kvguard's Kafka topics.", no_args_is_help=True)
app.add_typer(topics_app, name="topics")


def _settings(config: Path | None, bootstrap: str | None, prefix: str | None):
    from kvguard.config.settings import ConfigError, Settings
    from kvguard.runtime.bootstrap import BootstrapError, check_kafka_options

    overrides: dict = {}
    if bootstrap:
        overrides["kafka"] = {"bootstrap": bootstrap}
    if prefix is not None:
        overrides["topics"] = {"prefix": prefix}
    try:
        settings = Settings.load(config, overrides=overrides)
        check_kafka_options(settings)
        return settings
    except (ConfigError, BootstrapError) as exc:
        typer.echo(f"config error: {exc}", err=True)
        raise typer.Exit(2) from None


@topics_app.command("create")
def create(
    bootstrap: str = typer.Option(None, "--bootstrap", help="host:port; default kafka.bootstrap from settings"),
    config: Path = typer.Option(None, "--config", help="TOML/JSON settings file (else $KVGUARD_CONFIG)"),
    prefix: str = typer.Option(None, "--prefix", help="topic name prefix; default topics.prefix (kvguard.)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Create every kvguard topic with its configured partitions and retention (existing ones are fine)."""
    import asyncio

    from kvguard.bus.kafka import create_topics, topic_partitions

    settings = _settings(config, bootstrap, prefix)
    specs = settings.topics.all()

    async def provision() -> tuple[dict[str, str], dict[str, int]]:
        result = await create_topics(settings, specs)
        return result, await topic_partitions(settings, list(specs))

    try:
        result, actual = asyncio.run(provision())
    except Exception as exc:  # connection refused, auth failure, broker error: say which broker
        typer.echo(f"could not create topics on {settings.kafka.bootstrap}: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(1) from None
    for name, spec in specs.items():
        if name in actual and actual[name] != spec.partitions:
            typer.echo(f"warning: {name} exists with {actual[name]} partitions, configured {spec.partitions} "
                       f"(partitions are not changed on existing topics)", err=True)
    if as_json:
        typer.echo(json.dumps({
            "bootstrap": settings.kafka.bootstrap,
            "topics": {name: {"status": result[name], "partitions": spec.partitions,
                              "actual_partitions": actual.get(name), "retention_ms": spec.retention_ms}
                       for name, spec in specs.items()},
        }))
        return
    for name, spec in specs.items():
        typer.echo(f"{result[name]:8} {name}  partitions={actual.get(name, spec.partitions)} "
                   f"retention_ms={spec.retention_ms}")


@topics_app.command("list")
def list_topics(
    bootstrap: str = typer.Option(None, "--bootstrap", help="host:port; default kafka.bootstrap from settings"),
    config: Path = typer.Option(None, "--config", help="TOML/JSON settings file (else $KVGUARD_CONFIG)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """List the topics on the broker."""
    import asyncio

    from aiokafka.admin import AIOKafkaAdminClient

    from kvguard.bus.kafka import client_kwargs

    settings = _settings(config, bootstrap, None)

    async def fetch() -> list[str]:
        admin = AIOKafkaAdminClient(**client_kwargs(settings.kafka))
        await admin.start()
        try:
            return sorted(await admin.list_topics())
        finally:
            await admin.close()

    try:
        names = asyncio.run(fetch())
    except Exception as exc:
        typer.echo(f"could not list topics on {settings.kafka.bootstrap}: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(json.dumps({"bootstrap": settings.kafka.bootstrap, "topics": names}))
    else:
        for name in names:
            typer.echo(name)
