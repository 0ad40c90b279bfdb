"""`kvguard policy`: the policy engine as a service on a bus.

Consumes ``kvguard.metrics``, debits the fragmentation budget and records prediction outcomes,
OOMs with per-tier lead times and evictions (at command time) in the SLO ledger (both in Redis with
``--redis``, else in memory), decides, and publishes signed commands on ``kvguard.commands`` and mode changes and
budget alerts on ``kvguard.alerts``. Runs until interrupted (or ``--max-seconds``).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import typer

from kvguard.cli.app import app


@app.command()
def policy(
    bus: str = typer.Option(None, "--bus", help="kafka://HOST:PORT (default: kafka.bootstrap from settings)."),
    redis: str = typer.Option(None, "--redis", help="redis://… for the budget and SLO ledgers (default: in memory)."),
    profile: str = typer.Option(None, "--profile", help="Model/GPU profile of the nodes."),
    group: str = typer.Option("kvguard-policy", "--group", help="Consumer group."),
    max_seconds: float = typer.Option(None, "--max-seconds", help="Stop after this many wall seconds."),
    config: Path = typer.Option(None, "--config", help="Settings file (TOML/JSON)."),
    json_out: bool = typer.Option(False, "--json", help="On exit, print the counters as one JSON object."),
    insecure_dev: bool = typer.Option(False, "--insecure-dev",
                                      help="Accept a short or placeholder policy.hmac_secret (throwaway setups only)."),
) -> None:
    """Run the policy engine: ticks in, signed commands out.

    With --redis the ledgers must answer at start; a policy that stops with ledger writes it could
    not store (Redis gone since) says how many and exits 1.
    """
    import logging

    from kvguard.cli._service import stop_event
    from kvguard.cli.export import BrokerUnreachable, broker_unreachable, quiet_kafka_client
    from kvguard.config.settings import ConfigError, Settings
    from kvguard.policy.budget import LedgerUnavailable
    from kvguard.runtime.bootstrap import BootstrapError, bootstrap, make_ledger, make_slo_ledger, redis_ledgers
    from kvguard.runtime.embedded import ledger_summary

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    try:
        settings = Settings.load(config)
        # the fleet's model, for its operating threshold: the SLO labels predictions where the workers' tier 3 fires
        graph = bootstrap(settings, profile=profile, require_secret=True, insecure_dev=insecure_dev)
        carrier = graph.make_bus(bus)
        ledger, slo_ledger = (redis_ledgers(settings, redis) if redis
                              else (make_ledger(settings), make_slo_ledger(settings)))
    except (ConfigError, BootstrapError, ValueError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    except LedgerUnavailable as err:
        typer.echo(f"error: {err}; start it, or point --redis at yours", err=True)
        raise typer.Exit(1) from None
    graph.bus, graph.ledger, graph.slo_ledger = carrier, ledger, slo_ledger
    service = graph.policy_service()

    async def main() -> None:
        stop = stop_event(max_seconds)
        try:
            with quiet_kafka_client():
                await carrier.start()
        except Exception as err:  # aiokafka's KafkaConnectionError and kin: the broker did not answer
            await carrier.stop()
            raise BrokerUnreachable(broker_unreachable(settings.kafka.bootstrap if not bus else
                                                       bus.removeprefix("kafka://"), err)) from None
        typer.echo(f"kvguard policy: {settings.topics.name('metrics')} -> {settings.topics.name('commands')} "
                   f"({'redis' if redis else 'memory'} budget ledger; SLO predictions at P(OOM) >= "
                   f"{service.slo.threshold:.4f})", err=True)
        try:
            await service.run(group=group, stop=stop)
        finally:
            await carrier.stop()

    try:
        asyncio.run(main())
    except BrokerUnreachable as err:
        for led in (ledger, slo_ledger):
            led.close()
        typer.echo(str(err), err=True)
        raise typer.Exit(1) from None
    ledgers, _ = ledger_summary(ledger, slo_ledger, redis)
    for led in (ledger, slo_ledger):
        led.close()
    decoder = getattr(service, "decoder", None)
    counters = {"ticks": service.ticks, "engine": service.engine.counters.as_dict(),
                "errors": service.errors, "rejected": service.rejected,
                "decoder": decoder.counters.as_dict() if decoder is not None else None,
                "slo": service.slo.counters.as_dict() if service.slo else None,
                "ledger": {name: ledgers[name] for name in ("budget", "slo")},
                "mode_changes": [c.to_dict() for c in service.mode_changes],
                "canary": None if service.canary is None else {
                    "rollout": service.canary.rollout, "percent": service.canary.percent,
                    "state": None if service.canary.state is None else {
                        "stage": service.canary.state.stage, "status": service.canary.state.status,
                        "reason": service.canary.state.reason},
                    "moves": len(service.canary_changes), "errors": service.canary.errors}}
    if json_out:
        sys.stdout.write(json.dumps(counters) + "\n")
    else:
        typer.echo(json.dumps(counters["engine"]), err=True)
    lost = {name: ledgers[name].get("buffered", 0) + ledgers[name].get("dropped", 0) for name in ("budget", "slo")}
    if any(lost.values()):
        typer.echo(f"error: {lost['budget']} budget debit(s) and {lost['slo']} SLO record(s) were never written to "
                   f"Redis (still buffered or dropped when the policy stopped): {'; '.join(ledgers['problems'])}",
                   err=True)
        raise typer.Exit(1)
