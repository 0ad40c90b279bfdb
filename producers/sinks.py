"""Where an in-engine producer's batches go, and the node id it publishes them under.

Any engine plugin (vLLM's today) hands each step's ``EventBatch`` to one sink on the engine
thread: ``KafkaSink`` (``kvguard.events`` through ``NodePublisher`` on a background thread; the
engine thread only appends to a deque), ``EventLogSink`` (a file ``kvguard metrics/rca --events``
read), or ``DiscardSink`` (no destination configured: counted, logged once). ``make_sink`` picks
one from the plugin's configuration.

Node id (``node_id_from_env``): ``KVGUARD_NODE_ID`` (or the setting ``KVGUARD_NODE__NODE_ID``); else
``<host>/gpu<index>`` with host = ``KVGUARD_HOST``, else ``NODE_NAME`` (Kubernetes downward API),
else the hostname, and index = the first entry of ``CUDA_VISIBLE_DEVICES``, else the given device
index, else 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from collections import deque
from collections.abc import Mapping
from typing import Any

from kvguard.contracts.events import EventBatch
from kvguard.contracts.node_id import fit_node_id, node_id_problem
from kvguard.wire.eventlog import write_event_log

log = logging.getLogger("kvguard.sinks")


def node_id_from_env(env: Mapping[str, str] | None = None, device_index: int | None = None) -> str:
    """The node id (module docstring): ``KVGUARD_NODE_ID``, else ``<host>/gpu<index>``."""
    env = os.environ if env is None else env
    explicit = env.get("KVGUARD_NODE_ID", "").strip() or env.get("KVGUARD_NODE__NODE_ID", "").strip()
    if explicit:
        return usable_node_id(explicit, "KVGUARD_NODE_ID")
    host = env.get("KVGUARD_HOST", "").strip() or env.get("NODE_NAME", "").strip() or socket.gethostname()
    visible = env.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    index = visible or str(device_index if device_index is not None else 0)
    return usable_node_id(f"{host}/gpu{index}", "the host name and GPU")


def usable_node_id(raw: str, source: str) -> str:
    """``raw`` as a node id every consumer takes (``fit_node_id``): an engine plugin must never stop
    its engine from serving over a name, so a long or odd one is shortened, and the log says to what."""
    node = fit_node_id(raw)
    if node != raw:
        log.warning("kvguard: the node id %r from %s %s; publishing as %r (set KVGUARD_NODE_ID to choose one)",
                    raw[:120], source, node_id_problem(raw), node)
    return node


class DiscardSink:
    """No destination configured: batches are counted and dropped (logged once)."""

    def __init__(self) -> None:
        self.batches = self.events = 0

    def publish(self, batch: EventBatch) -> None:
        if not self.batches:
            log.warning("kvguard: no KVGUARD_BOOTSTRAP or KVGUARD_EVENTS_OUT set: events are counted, not published")
        self.batches += 1
        self.events += len(batch)

    def close(self, timeout_s: float = 0.0) -> None:
        return None


class EventLogSink:
    """Batches into an event log file (``kvguard.wire.eventlog``), held in memory and written on
    close (at exit, or ``VllmPlugin.close``): for short runs and checks, not for a serving engine."""

    def __init__(self, path: str, meta: dict | None = None) -> None:
        self.path = path
        self.meta = dict(meta or {})
        self._batches: deque[EventBatch] = deque()
        self._lock = threading.Lock()

    def publish(self, batch: EventBatch) -> None:
        self._batches.append(batch)

    def close(self, timeout_s: float = 0.0) -> None:
        with self._lock:
            batches = list(self._batches)
            if batches:
                write_event_log(self.path, batches, self.meta)


class KafkaSink:
    """Batches to ``kvguard.events`` through ``NodePublisher`` on a background thread with its own
    event loop. ``publish`` only appends to a deque (thread-safe, O(1)); the publisher drains it every
    ``node.flush_interval_s``, encodes, buffers through outages (bounded, oldest dropped) and sends."""

    def __init__(self, settings: Any, bus: Any = None) -> None:
        self.settings = settings
        self._bus = bus
        self._queue: deque[EventBatch] = deque()
        self._publisher: Any = None
        self._loop: Any = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvguard-publisher", daemon=True)
        self._thread.start()
        self._ready.wait(timeout=5.0)

    def publish(self, batch: EventBatch) -> None:
        self._queue.append(batch)

    def _take(self) -> list[EventBatch]:
        out = []
        queue = self._queue
        while queue:
            out.append(queue.popleft())
        return out

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        # the publisher brings the wire schemas (pydantic, orjson): loaded only when Kafka is the sink
        from kvguard.producers.publisher import NodePublisher

        if self._bus is None:
            from kvguard.bus.kafka import KafkaBus  # aiokafka: loaded only when Kafka is the sink

            self._bus = KafkaBus(self.settings.kafka)
        self._loop = asyncio.get_running_loop()
        self._publisher = NodePublisher.from_settings(self._bus, self.settings, self._take)
        self._ready.set()
        try:
            await self._bus.start()
        except Exception as err:  # noqa: BLE001 - the broker may come up later; the publisher retries
            log.warning("kvguard: Kafka at %s did not answer (%s); buffering, will retry",
                        getattr(self._bus, "bootstrap", "?"), err)
        try:
            await self._publisher.run()
        finally:
            await self._bus.stop()

    @property
    def counters(self) -> dict:
        return self._publisher.counters.as_dict() if self._publisher is not None else {}

    def close(self, timeout_s: float = 5.0) -> None:
        if self._publisher is not None and self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._publisher.stop)
        self._thread.join(timeout=timeout_s)


def make_sink(bootstrap: str | None, events_out: str | None, node: str, *, source: str = "plugin") -> Any:
    """Kafka when ``bootstrap`` is set (``"settings"``: the address from kvguard's settings), else an
    event log when ``events_out`` names a file, else nothing (counted)."""
    if bootstrap:
        # settings are pydantic models: loaded only when a broker is configured
        from kvguard.config.settings import Settings

        settings = Settings.load()
        if bootstrap != "settings":
            settings = settings.model_copy(update={"kafka": settings.kafka.model_copy(
                update={"bootstrap": bootstrap})})
        return KafkaSink(settings)
    if events_out:
        return EventLogSink(events_out, {"source": source, "nodes": [node]})
    return DiscardSink()
