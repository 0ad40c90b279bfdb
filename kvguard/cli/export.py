"""`kvguard export`: Prometheus `/metrics` and Alertmanager/webhook forwarding from the bus."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import typer

from kvguard.cli.app import app


def broker_unreachable(bootstrap: str, err: BaseException, option: str = "--bus kafka://HOST:PORT") -> str:
    """One line for a broker that does not answer, with what to do next (``option``: the command's
    flag for the broker's address)."""
    reason = str(err).removeprefix(f"{type(err).__name__}: ")
    cause = type(err).__name__ if not reason or "Unable to bootstrap" in reason else f"{type(err).__name__}: {reason}"
    return (f"error: no Kafka broker answers at {bootstrap} ({cause}). Start it, or point kvguard at yours with "
            f"{option} or KVGUARD_KAFKA__BOOTSTRAP=HOST:PORT.")


@contextlib.contextmanager
def quiet_kafka_client() -> Iterator[None]:
    """Silence aiokafka's own log lines while connecting: the caller reports a failure in one line."""
    logger = logging.getLogger("aiokafka")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


class BrokerUnreachable(Exception):
    """The Kafka broker did not answer; the message is the one line to print."""


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
    ttl: float = typer.Option(None, "--ttl-s", help="Drop a node's series after this many silent wall seconds "
                              "(default: export.ttl_s, 300)."),
    max_nodes: int = typer.Option(None, "--max-nodes", min=1, help="Hold at most this many nodes; records of "
                                  "further nodes are refused and counted (default: export.max_nodes, 5000)."),
    model_label: str = typer.Option(None, "--model-label", help="The `model` label (the served model) of nodes "
                                    "whose ticks name none (default: export.model_label, empty)."),
    paging: str = typer.Option(None, "--paging", help="Who pages on kvguard's alerts: forwarder (this exporter, "
                               "to --alertmanager) or prometheus (the rules in deploy/prometheus); default: "
                               "export.paging, forwarder."),
    queue_bound: int = typer.Option(1000, "--queue-bound", help="Alerts buffered per receiver (oldest dropped)."),
    resend: float = typer.Option(60.0, "--resend-s", help="Resend firing alerts to Alertmanager this often "
                                 "(endsAt 4 periods ahead); 0: send transitions only."),
    generator_url: str = typer.Option("", "--generator-url", help="generatorURL put on forwarded alerts."),
    max_seconds: float = typer.Option(None, "--max-seconds", help="Stop after this many wall seconds."),
    config: Path = typer.Option(None, "--config", help="Settings file (TOML/JSON)."),
    json_out: bool = typer.Option(False, "--json", help="On exit, print the counters as one JSON object."),
) -> None:
    """Serve kvguard's metrics to Prometheus and forward its alerts to Alertmanager (and a webhook)."""
    from kvguard.cli._service import stop_event
    from kvguard.config.settings import ConfigError, Settings
    from kvguard.ops.export_service import EXPORT_KINDS, ExportService
    from kvguard.ops.exporter import ExportError
    from kvguard.runtime.bootstrap import BootstrapError, bootstrap

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    try:
        host, port = parse_listen(listen)
        settings = Settings.load(config)
        bus_url = bus or f"kafka://{settings.kafka.bootstrap}"
        carrier = bootstrap(settings, predictor=None).make_bus(bus_url)
        section = settings.export
        paging = paging or section.paging
        service = ExportService(carrier, {kind: settings.topics.name(kind) for kind in EXPORT_KINDS},
                                host=host, port=port, group=group, alertmanager_url=alertmanager,
                                webhook_url=webhook, generator_url=generator_url,
                                ttl_s=ttl if ttl is not None else section.ttl_s,
                                max_nodes=max_nodes if max_nodes is not None else section.max_nodes,
                                model=model_label if model_label is not None else section.model_label,
                                paging=paging, queue_bound=queue_bound, resend_s=resend)
    except (ConfigError, BootstrapError, ExportError, typer.BadParameter) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None

    async def main() -> None:
        stop = stop_event(max_seconds)
        try:
            try:
                with quiet_kafka_client():
                    await carrier.start()
                    await service.start()
            except OSError:  # --listen: the address is taken or not ours
                raise
            except Exception as err:  # aiokafka's KafkaConnectionError and kin: the broker did not answer
                raise BrokerUnreachable(broker_unreachable(bus_url.removeprefix("kafka://"), err)) from None
            receivers = ", ".join(s.url for s in service.sinks) or "no alert receivers"
            typer.echo(f"kvguard export: {service.url}/metrics; alerts -> {receivers} (paging: {paging})", err=True)
            await stop.wait()
        finally:
            await service.stop()
            await carrier.stop()

    try:
        asyncio.run(main())
    except BrokerUnreachable as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(1) from None
    except OSError as err:
        typer.echo(f"error: --listen {listen}: {err}", err=True)
        raise typer.Exit(2) from None
    if json_out:
        sys.stdout.write(json.dumps(service.counters()) + "\n")
