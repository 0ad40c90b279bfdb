"""The command side of the vLLM plugin: ``kvguard.commands`` -> Actuator -> Executor -> vLLM, per engine.

The plugin (``kvguard.producers.vllm.plugin``) lives in the producers wing and may not import the
actuators wing; this runtime module composes them. It is a second ``vllm.general_plugins`` entry
point (``kvguard-actuator = "kvguard.runtime.plugins:register"``): ``register`` asks the plugin
to call ``start_for(plugin)`` for every engine it attaches.

``start_for`` builds the node's ``Actuator`` exactly as ``kvguard node`` does (``Graph.actuators``:
HMAC secret ``policy.hmac_secret``, the applied-id journal in ``node.journal_dir``, the plugin's
producer epoch, ``node.command_max_*``) over ``Executor(ExecutorEngine)``, and runs
``run_actuators`` on a background thread with its own event loop and Kafka consumer group
``kvguard-actuators-<node id>`` (one group per engine, so each sees every command and keeps its own).
The actuator verifies on that thread; ``EngineThreadExecutor`` hands the execution to the engine
thread (``VllmActions.submit``, run before the next ``schedule()``) and waits for it, at most
``timeout_s``: an idle engine (nothing scheduled, so nothing to act on) acks the command FAILED with
the reason, and the policy's next tick decides anew. Nothing starts without a bootstrap address and a
secret; the reason is logged.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvguard.actuators.threaded import EngineThreadExecutor

if TYPE_CHECKING:  # vLLM imports this module in each of its processes: the rest only when an engine attaches
    from kvguard.actuators.actuator import Actuator
    from kvguard.bus.base import Bus
    from kvguard.config.settings import Settings

log = logging.getLogger("kvguard.vllm")


class CommandConsumer:
    """``run_actuators`` for one engine on a daemon thread with its own event loop."""

    def __init__(self, settings: Settings, actuator: Actuator, bus: Bus) -> None:
        self.settings = settings
        self.actuator = actuator
        self.bus = bus
        self.acks: list = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True,
                                        name=f"kvguard-actuator-{actuator.node}")

    def start(self) -> CommandConsumer:
        self._thread.start()
        return self

    async def _main(self) -> None:
        # the actuator loop and the Kafka client (aiokafka): loaded on the consumer's own thread
        from kvguard.actuators.actuator import run_actuators

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        await self.bus.start()
        try:
            node = self.actuator.node
            await run_actuators(self.bus, self.settings, {node: self.actuator},
                                node_time_ns=lambda _node: time.time_ns(),  # the plugin's event time
                                group=f"kvguard-actuators-{node}", stop=self._stop, on_ack=self.acks.append)
        finally:
            await self.bus.stop()

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=timeout_s)


def start_for(plugin: Any, settings: Settings | None = None, bus: Bus | None = None) -> CommandConsumer | None:
    """Start the command consumer of one attached engine (None, with the reason logged, when it
    cannot). ``plugin``: the vLLM plugin of ``kvguard.producers.vllm.plugin`` (duck-typed here: the
    producers wing is not this module's to import at load time). The actuator, its secret and its
    Kafka bus come from the composition root, as for ``kvguard node``."""
    # the bootstrap loads the policy side's config (pydantic, a profile): only when an engine attaches
    from kvguard.config.settings import ConfigError, Settings
    from kvguard.runtime.bootstrap import BootstrapError, bootstrap

    try:
        if settings is None:
            if not plugin.config.bootstrap:
                log.info("kvguard: no KVGUARD_BOOTSTRAP: %s executes no commands", plugin.node)
                return None
            address = plugin.config.bootstrap
            settings = Settings.load(overrides={} if address == "settings" else {"kafka": {"bootstrap": address}})
        graph = bootstrap(settings, predictor=None, require_secret=True)
        bus = bus if bus is not None else graph.make_bus()
    except (BootstrapError, ConfigError) as err:
        log.warning("kvguard: %s executes no commands: %s", plugin.node, err)
        return None
    journal = settings.node.journal_dir
    actuator = graph.actuators([plugin.executor_engine], journal_dir=Path(journal).expanduser() if journal else None,
                               epoch=plugin.translator.epoch)[plugin.node]
    actuator.executor = EngineThreadExecutor(actuator.executor, plugin.actions)
    consumer = CommandConsumer(settings, actuator, bus).start()
    plugin.command_consumer = consumer
    log.info("kvguard: %s consumes %s (group kvguard-actuators-%s)", plugin.node, settings.topics.name("commands"),
             plugin.node)
    return consumer


def register() -> None:
    """The second ``vllm.general_plugins`` entry point: commands for every attached engine."""
    if os.environ.get("KVGUARD_VLLM_PLUGIN", "").lower() in ("0", "false", "no", "off"):
        return
    # vLLM imports every plugin module in each of its processes: the plugin itself only when called
    from kvguard.producers.vllm import plugin as vllm_plugin

    vllm_plugin.on_attach(lambda plugin: start_for(plugin))
