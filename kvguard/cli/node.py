"""`kvguard node`: one or more simulated GPUs — shadow engine, producer and actuator — over a bus.

The shadow engine runs a workload on simulated time paced by the wall clock (``--speed``
simulated seconds per wall second). Its events go to ``kvguard.events`` through the node
publisher; the actuator consumes the node's commands from ``kvguard.commands``, executes them on
the engine between its steps (``Engine.now_ns`` is the node's clock for TTLs) and acks on
``kvguard.acks``. Executed actions are pool events like any other and reach ``kvguard.events``
with the next batch. ``--no-actuator`` runs the bare engine (a baseline).

Each ``kvguard node`` process is one producer run: its batches carry a fresh, increasing
``epoch`` (the wall clock in ns at its start), since its simulated clock starts at 0 again. The
stream, the policy and the exporter take a newer epoch as the node restarted and start its state
over; with the seed as epoch a restarted node's batches would be dropped as redeliveries.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import typer

from kvguard.cli.app import app


@app.command()
def node(
    workload: str = typer.Option("mixed", "--workload", help="Scenario or trace (see kvguard simulate)."),
    gpus: int = typer.Option(1, "--gpus", min=1, help="Simulated GPUs in this process."),
    duration: str = typer.Option("15m", "--duration", help="Simulated duration."),
    rate_scale: float = typer.Option(1.0, "--rate-scale"),
    speed: float = typer.Option(10.0, "--speed", min=0.01, help="Simulated seconds per wall second."),
    seed: int = typer.Option(0, "--seed"),
    host: str = typer.Option(None, "--host", help="Node ids are <host>/gpu<i> (default: the host part of "
                                                 "node.node_id, e.g. KVGUARD_NODE__NODE_ID=$(NODE_NAME)/gpu0, else sim-0)."),
    profile: str = typer.Option(None, "--profile"),
    gpu_memory_utilization: float = typer.Option(
        None, "--gpu-memory-utilization", min=0.01, max=1.0,
        help="Engines that take vLLM's start-up knobs: the operator's setting (default: the profile's)."),
    model_runner: str = typer.Option(None, "--model-runner", help="vLLM profiles: v2 (vLLM 0.33's default) or v1 "
                                     "(VLLM_USE_V2_MODEL_RUNNER=0)."),
    prompt_logprobs_frac: float = typer.Option(
        0.0, "--prompt-logprobs-frac", min=0.0, max=1.0,
        help="Engines with a sampler: share of requests asking for prompt logprobs (eval traffic)."),
    bus: str = typer.Option(None, "--bus", help="kafka://HOST:PORT (default: kafka.bootstrap from settings)."),
    journal_dir: Path = typer.Option(None, "--journal-dir",
                                     help="Where actuators keep their applied-id journals (default: node.journal_dir)."),
    insecure_dev: bool = typer.Option(False, "--insecure-dev",
                                      help="Accept a short or placeholder policy.hmac_secret (throwaway setups only)."),
    no_actuator: bool = typer.Option(False, "--no-actuator", help="Run the bare engine (baseline)."),
    governor: bool = typer.Option(True, "--governor/--no-governor",
                                  help="With the actuator: kvguard's step governor in the engine (vLLM profiles); "
                                       "--no-governor leaves prevention to the policy's commands alone."),
    config: Path = typer.Option(None, "--config", help="Settings file (TOML/JSON)."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as one JSON object."),
) -> None:
    """Run simulated GPUs (shadow engine + producer + actuator) against the bus."""
    # the runtime loads the whole system: imported when the command runs, so `kvguard --help` stays fast
    from kvguard.cli.export import BrokerUnreachable, broker_unreachable, quiet_kafka_client
    from kvguard.cli.simulate import parse_duration
    from kvguard.config.settings import ConfigError, Settings
    from kvguard.contracts.node_id import check_node_id
    from kvguard.producers.sim.profiles import EngineKnobs, load_profile
    from kvguard.producers.sim.registry import engine_kind
    from kvguard.producers.sim.workloads import WorkloadError
    from kvguard.runtime.bootstrap import BootstrapError, bootstrap
    from kvguard.runtime.embedded import demo_workload
    from kvguard.runtime.node import run_node

    try:
        settings = Settings.load(config)
        kind = engine_kind(load_profile(profile))
        knobs = EngineKnobs(gpu_memory_utilization=gpu_memory_utilization, model_runner=model_runner) \
            if gpu_memory_utilization or model_runner else None
        node_config = kind.node_config(prompt_logprobs_frac=prompt_logprobs_frac) if prompt_logprobs_frac else None
        graph = bootstrap(settings, profile=profile, knobs=knobs, node_config=node_config, predictor=None,
                          require_secret=not no_actuator, insecure_dev=insecure_dev)
        carrier = graph.make_bus(bus)
    except (ConfigError, BootstrapError, ValueError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    # each node process needs its own ids (and so its own actuator consumer group): from settings when set
    host = host or (settings.node.node_id.rsplit("/", 1)[0] if settings.node.node_id else "sim-0")
    try:  # the longest id this process will name its GPUs by; consumers refuse an id past the rule
        check_node_id(f"{host}/gpu{gpus - 1}", "--host: the node id")
    except ValueError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    duration_s = parse_duration(duration)
    try:
        wl = demo_workload(graph.profile, workload=workload, rate_scale=rate_scale, duration_s=duration_s, seed=seed)
    except WorkloadError as err:
        typer.echo(f"error: --workload {err}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"kvguard node {host}: {gpus} GPU(s), {len(wl.requests)} requests over {duration_s:g} s at "
               f"{speed:g}x, actuator {'off' if no_actuator else 'on'}", err=True)

    # this process is a new producer run: its simulated clock starts at 0, so its batches must carry
    # an epoch newer than any earlier run of the same host (the edge may read the clock)
    epoch = time.time_ns()

    async def main() -> dict:
        try:
            with quiet_kafka_client():
                await carrier.start()
        except Exception as err:  # aiokafka's KafkaConnectionError and kin: the broker did not answer
            await carrier.stop()
            raise BrokerUnreachable(broker_unreachable(getattr(carrier, "bootstrap", "the broker"), err)) from None
        try:
            return await run_node(graph, carrier, wl, n_gpus=gpus, duration_s=duration_s, speed=speed, seed=seed,
                                  host=host, actuate=not no_actuator, epoch=epoch, governor=governor,
                                  journal_dir=journal_dir if journal_dir is not None else settings.node.journal_dir)
        finally:
            await carrier.stop()

    try:
        summary = asyncio.run(main())
    except BrokerUnreachable as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(1) from None
    if json_out:
        sys.stdout.write(json.dumps(summary, default=str) + "\n")
    else:
        typer.echo(json.dumps({k: summary[k] for k in ("requests", "completed", "failed", "ooms", "preemptions",
                                                        "goodput_tokens_per_s")}), err=True)
