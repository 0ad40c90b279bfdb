"""`kvguard export`: Prometheus `/metrics` and Alertmanager/webhook forwarding from the bus."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import typer

from kvguard.cli.app import app


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:9464`` for IPv6) -> (host, port); ``typer.BadParameter`` otherwise."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise typer.BadParameter(f"expected HOST:PORT (e.g. 127.0.0.1:9464), got {text!r}")
    return host, int(port)


@app.command("export")
def export(
    listen: str = typer.Option("127.0.0.1:9464", "--listen", help="HOST:PORT of the /metrics endpoint."),
    alertmanager: str = typer.Option(None, "--alertmanager", help="Alertmanager base URL, e.g. http://am:9093."),
    webhook: str = typer.Option(None, "--webhook", help="Generic JSON webhook URL (one POST per alert)."),
    bus: str = typer.Option(None, "--bus", help="kafka://HOST:PORT (default: kafka.bootstrap from settings)."),
    group: str = typer.Option("kvguard-export", "--group", help="Consumer group."),
    ttl: float = typer.Option(300.0, "--ttl-s", help="Drop a node's series after this many silent seconds."),
    queue_bound: int = typer.Option(1000, "--queue-bound", help="Alerts buffered per receiver (oldest dropped)."),
    resend: float = typer.Option(60.0, "--resend-s", help="Resend firing alerts to Alertmanager this often "
                                 "(endsAt 4 periods ahead); 0: send transitions only."),
    generator_url: str = typer.Option("", "--generator-url", help="generatorURL put on forwarded alerts."),
    max_seconds: float = typer.Option(None, "--max-seconds", help="Stop after this many wall seconds."),
    config: Path = typer.Option(None, "--config", help="Settings file (TOML/JSON)."),
    json_out: bool = typer.Option(False, "--json", help="On exit, print the counters as one JSON object."),
) -> None:
    """Serve kvguard's metrics to Prometheus and forward its alerts to Alertmanager (and a webhook)."""
    import logging

    from kvguard.cli._service import stop_event
    from kvguard.ops.export_service import EXPORT_KINDS, ExportService
    from kvguard.ops.exporter import ExportError
    from kvguard.runtime.bootstrap import BootstrapError, make_bus
    from kvguard.wire.settings import ConfigError, Settings

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    try:
        host, port = parse_listen(listen)
        settings = Settings.load(config)
        carrier = make_bus(settings, bus or f"kafka://{settings.kafka.bootstrap}")
        service = ExportService(carrier, {kind: settings.topics.name(kind) for kind in EXPORT_KINDS},
                                host=host, port=port, group=group, alertmanager_url=alertmanager,
                                webhook_url=webhook, generator_url=generator_url, ttl_s=ttl,
                                queue_bound=queue_bound, resend_s=resend)
    except (ConfigError, BootstrapError, ExportError, typer.BadParameter) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None

    async def main() -> None:
        stop = stop_event(max_seconds)
        await carrier.start()
        try:
            async with service:
                receivers = ", ".join(s.url for s in service.sinks) or "no alert receivers"
                typer.echo(f"kvguard export: {service.url}/metrics; alerts -> {receivers}", err=True)
                await stop.wait()
        finally:
            await carrier.stop()

    try:
        asyncio.run(main())
    except OSError as err:
        typer.echo(f"error: --listen {listen}: {err}", err=True)
        raise typer.Exit(2) from None
    if json_out:
        sys.stdout.write(json.dumps(service.counters()) + "\n")
