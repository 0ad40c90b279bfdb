"""`kvguard command`: an operator's signed command to one node, and its ack (kvguard.runtime.operator)."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path

import typer

from kvguard.cli.app import app


@app.command()
def command(
    action: str = typer.Argument(..., help="hold (prompts over --max-prompt-tokens wait), drain (hold every "
                                           "admission; running requests finish), release (end a hold or drain), "
                                           "abort (end --req requests; their clients get a retryable error), "
                                           "empty-cache (torch.cuda.empty_cache()), batch-cap (--tokens per step)."),
    node: str = typer.Option(..., "--node", help="The node id, as on its ticks (host/gpuN)."),
    max_prompt_tokens: int = typer.Option(0, "--max-prompt-tokens", min=0, help="hold: prompts longer than this "
                                                                               "wait (0: every prompt, a drain)."),
    tokens: int = typer.Option(0, "--tokens", min=0, help="batch-cap: tokens per step (0 releases the cap)."),
    steps: int = typer.Option(0, "--steps", min=0, help="hold, batch-cap: for this many engine steps (0: until "
                                                       "released)."),
    req: list[int] = typer.Option(None, "--req", help="abort: the request id (kvguard's, as on the events; "
                                                      "repeatable)."),
    reason: str = typer.Option("", "--reason", help="Why, for the ack's log and the audit trail."),
    ttl: str = typer.Option("60s", "--ttl", help="How long the command stays valid."),
    epoch: int = typer.Option(None, "--epoch", help="The node's producer epoch (default: from its newest tick)."),
    at_ns: int = typer.Option(None, "--at-ns", help="The node's clock to issue at (default: its newest tick's)."),
    bootstrap: str = typer.Option(None, "--bootstrap", help="Kafka HOST:PORT (default: kafka.bootstrap in settings)."),
    wait: str = typer.Option("10s", "--wait", help="How long to wait for the node's ack."),
    config: Path = typer.Option(None, "--config", help="Settings file (TOML/JSON); policy.hmac_secret signs."),
    json_out: bool = typer.Option(False, "--json", help="Print the command and its ack as one JSON object."),
) -> None:
    """Send one signed command to a node's actuator and wait for its ack.

    The command goes the policy's way: the node checks the signature (policy.hmac_secret), the TTL, its node id and producer epoch, executes it once and acks. The epoch and the node's clock come from its newest tick on the metrics topic unless --epoch and --at-ns are given. Exit status: 0 executed, 3 acked otherwise (noop, rejected, failed), 4 no ack in time.
    """
    # the bus client is loaded when the command runs, so `kvguard --help` stays fast
    from kvguard.cli.simulate import parse_duration
    from kvguard.config.settings import ConfigError, Settings
    from kvguard.contracts.commands import AckOutcome
    from kvguard.runtime.bootstrap import BootstrapError
    from kvguard.runtime.bootstrap import bootstrap as build_graph
    from kvguard.runtime.operator import (
        NodeClock,
        OperatorArgs,
        OperatorError,
        node_clock,
        operator_command,
        operator_payload,
        send_and_wait,
    )

    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # a connection failure is reported once, below
    try:
        payload = operator_payload(action, OperatorArgs(max_prompt_tokens=max_prompt_tokens, tokens=tokens,
                                                        steps=steps, requests=tuple(req or ())))
        settings = Settings.load(config)
        graph = build_graph(settings, predictor=None, require_secret=True)
        ttl_s, wait_s = parse_duration(ttl), parse_duration(wait)
        carrier = graph.make_bus(f"kafka://{bootstrap or settings.kafka.bootstrap}")
    except (ConfigError, BootstrapError, ValueError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None

    async def main():
        await carrier.start()
        try:
            clock = NodeClock(node, epoch, at_ns) if epoch is not None and at_ns is not None else None
            if clock is None:
                seen = await node_clock(carrier, settings, node)
                if seen is None:
                    raise OperatorError(f"no tick of node {node!r} on {settings.topics.name('metrics')}: check the "
                                        "node id (kvguard export's node label), or give --epoch and --at-ns")
                clock = NodeClock(node, epoch if epoch is not None else seen.epoch,
                                  at_ns if at_ns is not None else seen.ts_ns)
            cmd = operator_command(node, payload, clock, graph.secret, reason=reason, ttl_s=ttl_s)
            return cmd, await send_and_wait(carrier, settings, cmd, wait_s=wait_s)
        finally:
            await carrier.stop()

    try:
        cmd, ack = asyncio.run(main())
    except OperatorError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    except Exception as err:  # noqa: BLE001 - an unreachable broker: one line and the next step, no traceback
        typer.echo(f"error: could not reach {bootstrap or settings.kafka.bootstrap} ({type(err).__name__}: {err}); "
                   "is the broker up and the address right (--bootstrap)?", err=True)
        raise typer.Exit(1) from None
    out = {"command": {"id": cmd.id, "node": cmd.node, "action": cmd.action.value, "payload": cmd.payload.to_dict(),
                       "epoch": cmd.epoch, "issued_at_ns": cmd.issued_at_ns},
           "ack": None if ack is None else {"outcome": ack.outcome.value, "units_freed": ack.units_freed,
                                            "errors": list(ack.errors)}}
    if json_out:
        sys.stdout.write(json.dumps(out) + "\n")
    elif ack is None:
        typer.echo(f"{cmd.id}: sent, no ack from {node} within {wait}", err=True)
    else:
        detail = "; ".join(ack.errors)
        typer.echo(f"{cmd.id}: {ack.outcome.value}" + (f" ({detail})" if detail else ""))
    if ack is None:
        raise typer.Exit(4)
    if ack.outcome is not AckOutcome.EXECUTED:
        raise typer.Exit(3)
