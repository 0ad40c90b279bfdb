"""`kvguard export` as a service: bus in, Prometheus ``/metrics`` and Alertmanager/webhook out.

One consumer (group ``kvguard-export`` by default) reads ``kvguard.metrics``, ``kvguard.alerts``,
``kvguard.commands``, ``kvguard.acks`` and ``kvguard.dlq``, folds them into a
``kvguard.ops.exporter.ExportState`` and commits after each fetched batch (at-least-once; the state
deduplicates redeliveries). An aiohttp server serves the exposition on ``/metrics`` (the 0.0.4 text
format, or OpenMetrics when the scraper's ``Accept`` asks for it, as Prometheus does) and
``/healthz``; the exposition comes from prometheus_client's encoders over two custom collectors (the
state's and this service's own health). Alerts go to ``AlertSink``s:
each has a bounded queue (oldest dropped and counted when full), retries with exponential backoff
on connection errors, 5xx, 408 and 429, and gives up (counted as ``rejected``) on other 4xx, since
resending a body the receiver refuses would block the queue forever. An alert is offered once per
(fingerprint, status, started_at_ns), so a redelivered record is not sent twice.

One paging path per alert (``paging``): with ``"forwarder"`` this service posts kvguard's own
alerts (the stream's tiers, the LSTM and the budget) to Alertmanager, and the Prometheus rules of
the same alerts stay silent; with ``"prometheus"`` it posts none to Alertmanager and the rules page.
The choice is served as ``kvguard_exporter_paging_info{path=...}``, which the rules test
(deploy/prometheus/kvguard-rules.yaml). A webhook (a chat bridge) gets the alerts in both modes.

Replicas share the consumer group: each reads the partitions it owns, so each alert record reaches
one replica and is forwarded once (a rebalance may replay a batch that was not yet committed to the
new owner; Alertmanager merges an alert it already has, by its labels, and the webhook may see it
twice). Each replica serves the nodes of its partitions; Prometheus scrapes every replica.

Records that cannot be decoded are counted (``kvguard_exporter_decode_errors_total``, by kind and
reason: ``tombstone`` for a null value), not dead-lettered: the exporter only observes, and the
topic's owning consumer dead-letters them. A record whose folding raises is counted the same way
(reason ``processing_error``) and logged; no record stops the consumer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvguard.bus.base import BusError
from kvguard.ops.exporter import (
    CONTENT_TYPE,
    OPENMETRICS_CONTENT_TYPE,
    BoundedKeys,
    ExportCollector,
    ExportError,
    ExportState,
    alert_dedupe_key,
    alert_fingerprint,
    alertmanager_alert,
    encode,
    wants_openmetrics,
    webhook_payload,
)
from kvguard.wire.schemas import Ack, Alert, Command, DecodeError, DlqRecord, MetricTick, decode

log = logging.getLogger(__name__)

EXPORT_KINDS: tuple[str, ...] = ("metrics", "alerts", "commands", "acks", "dlq")
PAGING_PATHS: tuple[str, ...] = ("forwarder", "prometheus")
_RETRYABLE_STATUS = frozenset({408, 429})


@dataclass(slots=True)
class SinkCounters:
    queued: int = 0
    sent: int = 0  # alerts acknowledged with 2xx
    dropped: int = 0  # pushed out of a full queue
    failed_attempts: int = 0  # POSTs that failed and were retried
    rejected: int = 0  # alerts refused with a non-retryable 4xx (given up)

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


class AlertSink:
    """One HTTP receiver of alerts. ``batch=True`` posts a JSON list (Alertmanager ``/api/v2/alerts``);
    otherwise one JSON object per POST (a generic webhook)."""

    def __init__(self, name: str, url: str, *, batch: bool, queue_bound: int = 1000, batch_max: int = 64,
                 backoff_initial_s: float = 0.2, backoff_max_s: float = 30.0, request_timeout_s: float = 10.0):
        if queue_bound <= 0:
            raise ExportError(f"{name}.queue_bound", f"must be > 0, got {queue_bound}")
        if not url.startswith(("http://", "https://")):
            raise ExportError(f"{name}.url", f"expected http(s)://HOST:PORT/…, got {url!r}")
        self.name, self.url, self.batch = name, url, batch
        self.queue_bound, self.batch_max = queue_bound, batch_max if batch else 1
        self.backoff_initial_s, self.backoff_max_s = backoff_initial_s, backoff_max_s
        self.request_timeout_s = request_timeout_s
        self.queue: deque[dict[str, Any]] = deque()
        self.counters = SinkCounters()
        self._wake = asyncio.Event()

    def offer(self, body: dict[str, Any]) -> None:
        self.queue.append(body)
        self.counters.queued += 1
        self._trim()
        self._wake.set()

    def _trim(self) -> None:
        while len(self.queue) > self.queue_bound:
            self.queue.popleft()
            self.counters.dropped += 1

    async def run(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        backoff_s = self.backoff_initial_s
        while not stop.is_set():
            if not self.queue:
                self._wake.clear()
                await _wait_either(self._wake, stop)
                continue
            items = [self.queue.popleft() for _ in range(min(self.batch_max, len(self.queue)))]
            outcome = await self._post(session, items)
            if outcome == "sent":
                self.counters.sent += len(items)
                backoff_s = self.backoff_initial_s
            elif outcome == "rejected":
                self.counters.rejected += len(items)
            else:
                self.counters.failed_attempts += 1
                self.queue.extendleft(reversed(items))
                self._trim()
                await _sleep_or_stop(backoff_s, stop)
                backoff_s = min(backoff_s * 2, self.backoff_max_s)

    async def _post(self, session: aiohttp.ClientSession, items: list[dict[str, Any]]) -> str:
        body: Any = items if self.batch else items[0]
        try:
            async with session.post(self.url, json=body,
                                    timeout=aiohttp.ClientTimeout(total=self.request_timeout_s)) as response:
                if 200 <= response.status < 300:
                    return "sent"
                text = (await response.text())[:300]
                if 400 <= response.status < 500 and response.status not in _RETRYABLE_STATUS:
                    log.error("%s %s refused %d alert(s) with %d: %s", self.name, self.url, len(items),
                              response.status, text)
                    return "rejected"
                log.warning("%s %s answered %d: %s (retrying)", self.name, self.url, response.status, text)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            log.warning("%s %s unreachable: %s (retrying)", self.name, self.url, exc)
        return "retry"


async def _wait_either(event: asyncio.Event, stop: asyncio.Event) -> None:
    waiters = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(stop.wait())]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()


async def _sleep_or_stop(seconds: float, stop: asyncio.Event) -> None:
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except asyncio.TimeoutError:
        pass


class ExportService:
    """Consumer + HTTP server + alert sinks. Use ``async with ExportService(...) as service`` or
    ``start()`` / ``stop()``; ``service.port`` is the bound port (``port=0`` picks a free one)."""

    def __init__(self, bus: Any, topics: dict[str, str], *, host: str = "127.0.0.1", port: int = 9464,
                 group: str = "kvguard-export", alertmanager_url: str | None = None,
                 webhook_url: str | None = None, generator_url: str = "", ttl_s: float = 300.0,
                 max_nodes: int = 5000, model: str = "", paging: str = "forwarder",
                 queue_bound: int = 1000, backoff_initial_s: float = 0.2, backoff_max_s: float = 30.0,
                 resend_s: float = 60.0, clock: Callable[[], int] = time.time_ns):
        missing = [kind for kind in EXPORT_KINDS if kind not in topics]
        if missing:
            raise ExportError("topics", f"no topic name for {', '.join(missing)}")
        if paging not in PAGING_PATHS:
            raise ExportError("paging", f"expected one of {', '.join(PAGING_PATHS)}, got {paging!r}")
        if paging == "prometheus" and alertmanager_url:
            raise ExportError("paging", "is 'prometheus' (the Prometheus rules page), so forwarding to Alertmanager "
                                        "would page each alert twice: drop --alertmanager, or use --paging forwarder")
        self.bus, self.host, self.port, self.group = bus, host, port, group
        self.paging = paging
        self.topic_kinds = {topics[kind]: kind for kind in EXPORT_KINDS}
        self.generator_url = generator_url
        self.clock = clock
        self.state = ExportState(ttl_s=ttl_s, max_nodes=max_nodes, model=model)
        self._collector = ExportCollector(self.state, clock)
        self.sinks: list[AlertSink] = []
        if alertmanager_url:
            self.sinks.append(AlertSink("alertmanager", alertmanager_url.rstrip("/") + "/api/v2/alerts", batch=True,
                                        queue_bound=queue_bound, backoff_initial_s=backoff_initial_s,
                                        backoff_max_s=backoff_max_s))
        if webhook_url:
            self.sinks.append(AlertSink("webhook", webhook_url, batch=False, queue_bound=queue_bound,
                                        backoff_initial_s=backoff_initial_s, backoff_max_s=backoff_max_s))
        self.records: dict[str, int] = {kind: 0 for kind in EXPORT_KINDS}
        self.last_record_ns: dict[str, int] = {}  # kind -> wall time of the newest record folded
        self.decode_errors: dict[tuple[str, str], int] = {}
        self.alerts_duplicate = 0
        self.bus_errors = 0
        if resend_s < 0:
            raise ExportError("resend_s", f"must be >= 0 (0: never resend), got {resend_s}")
        self.resend_s = resend_s
        self.resent = 0
        self.active: dict[str, Alert] = {}  # fingerprint -> newest firing record, resent to Alertmanager
        # fingerprint -> (started_at_ns, wall ns of the episode's first record): startsAt of alerts
        # whose event time is a simulator's; one entry per firing (node, rule), dropped on resolve
        self._episode_wall: dict[str, tuple[int, int]] = {}
        self._alerts_seen = BoundedKeys(100_000)
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._subscription: Any = None

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self._subscription = self.bus.subscribe(list(self.topic_kinds), self.group)
        await self._subscription.start()
        self._session = aiohttp.ClientSession()
        self._tasks = [asyncio.create_task(sink.run(self._session, self._stop), name=f"export-{sink.name}")
                       for sink in self.sinks]
        self._tasks.append(asyncio.create_task(self._consume(), name="export-consume"))
        if self.resend_s > 0 and any(sink.batch for sink in self.sinks):
            self._tasks.append(asyncio.create_task(self._resend_loop(), name="export-resend"))

    async def stop(self) -> None:
        self._stop.set()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception) as exc:  # noqa: PERF203 - shutdown, log and go on
                if not isinstance(exc, asyncio.CancelledError):
                    log.error("export task %s ended with %r", task.get_name(), exc)
        if self._subscription is not None:
            await self._subscription.close()
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()

    async def __aenter__(self) -> ExportService:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- consuming -------------------------------------------------------------------------------

    async def _consume(self) -> None:
        while not self._stop.is_set():
            try:
                records = await self._subscription.getmany(1000, 0.5)
                for record in records:
                    self.handle(record.topic, record.value, record.headers)
                if records:
                    await self._subscription.commit()
            except BusError as exc:  # the broker went away: keep serving what we have, retry
                self.bus_errors += 1
                log.warning("export: bus error, retrying in 1 s: %s", exc)
                await _sleep_or_stop(1.0, self._stop)

    def handle(self, topic: str, value: bytes, headers: Sequence[tuple[str, bytes]] = ()) -> None:
        """Fold one record from ``topic`` (decode errors counted, never raised)."""
        kind = self.topic_kinds[topic]
        now_ns = self.clock()
        try:
            model = decode(kind, value, headers)
            self.records[kind] += 1
            self.last_record_ns[kind] = now_ns
            if isinstance(model, MetricTick):
                self.state.observe_tick(model, now_ns)
            elif isinstance(model, Alert):
                self.state.observe_alert(model, now_ns)
                self._forward(model, now_ns)
            elif isinstance(model, Command):
                self.state.observe_command(model, now_ns)
            elif isinstance(model, Ack):
                self.state.observe_ack(model, now_ns)
            elif isinstance(model, DlqRecord):
                self.state.observe_dlq(model)
        except DecodeError as exc:
            self._decode_error(kind, exc.reason, exc.detail)
        except ExportError as exc:
            self._decode_error(kind, "invalid", str(exc))
        except Exception as exc:  # one poison record must not stop the exporter's consumer
            log.error("export: folding a %s record raised %s: %s", kind, type(exc).__name__, exc, exc_info=exc)
            self._decode_error(kind, "processing_error", f"{type(exc).__name__}: {exc}")

    def _decode_error(self, kind: str, reason: str, detail: str) -> None:
        self.decode_errors[(kind, reason)] = self.decode_errors.get((kind, reason), 0) + 1
        log.warning("export: %s record not exported (%s): %s", kind, reason, detail[:300])

    def _forward(self, alert: Alert, now_ns: int) -> None:
        if not self.sinks:
            return
        if not self._alerts_seen.add(alert_dedupe_key(alert)):
            self.alerts_duplicate += 1
            return
        fingerprint = alert_fingerprint(alert)
        first_ns = self._first_received_ns(alert, now_ns)
        mapped = self._mapped(alert, now_ns)
        if alert.status == "resolved":
            self.active.pop(fingerprint, None)
            self._episode_wall.pop(fingerprint, None)
        else:
            self.active[fingerprint] = alert
            self._episode_wall[fingerprint] = (alert.started_at_ns or alert.ts_ns, first_ns)
        for sink in self.sinks:
            if sink.batch:
                sink.offer(mapped)
            else:
                sink.offer(webhook_payload(alert, alert.model_dump(mode="json", by_alias=True),
                                           generator_url=self.generator_url, received_ns=now_ns,
                                           first_received_ns=first_ns))

    def _mapped(self, alert: Alert, now_ns: int) -> dict[str, Any]:
        """The Alertmanager body: wall times of receipt stand in for a simulator's event times."""
        valid_until_ns = now_ns + int(4 * self.resend_s * 1e9) if self.resend_s > 0 else None
        return alertmanager_alert(alert, generator_url=self.generator_url, valid_until_ns=valid_until_ns,
                                  received_ns=now_ns, first_received_ns=self._first_received_ns(alert, now_ns))

    def _first_received_ns(self, alert: Alert, now_ns: int) -> int:
        """Wall time this episode of the alert (fingerprint, started_at_ns) was first received."""
        episode = self._episode_wall.get(alert_fingerprint(alert))
        return episode[1] if episode is not None and episode[0] == (alert.started_at_ns or alert.ts_ns) else now_ns

    async def _resend_loop(self) -> None:
        """Resend firing alerts every ``resend_s`` (endsAt 4 periods ahead), as Prometheus does, so
        Alertmanager neither resolves them on its own nor keeps them after kvguard stops. Alerts of
        nodes the state has dropped (silent past the TTL) stop being resent."""
        while not self._stop.is_set():
            await _sleep_or_stop(self.resend_s, self._stop)
            now_ns = self.clock()
            self.state.expire(now_ns)
            for fingerprint, alert in list(self.active.items()):
                if alert.node not in self.state.nodes:
                    del self.active[fingerprint]
                    self._episode_wall.pop(fingerprint, None)
                    continue
                mapped = self._mapped(alert, now_ns)
                for sink in self.sinks:
                    if sink.batch:
                        sink.offer(mapped)
                self.resent += 1

    # -- HTTP ------------------------------------------------------------------------------------

    def render(self, *, openmetrics: bool = False) -> str:
        return encode(self._collector, self, openmetrics=openmetrics).decode()

    def collect(self) -> list[Metric]:
        """The service's own health as metric families (a prometheus_client custom collector)."""
        families = [
            _counter("kvguard_exporter_records_total", "Records the exporter folded, by kind.", ("kind",),
                     [((kind,), n) for kind, n in self.records.items()]),
            _gauge("kvguard_exporter_last_record_timestamp_seconds",
                   "Wall time the exporter last folded a record, by kind.", ("kind",),
                   [((kind,), ns / 1e9) for kind, ns in sorted(self.last_record_ns.items())]),
            _counter("kvguard_exporter_decode_errors_total", "Records the exporter could not decode, by kind and "
                     "reason.", ("kind", "reason"), [(key, n) for key, n in sorted(self.decode_errors.items())]),
            _counter("kvguard_exporter_bus_errors_total", "Bus errors the consumer retried after.", (),
                     [((), self.bus_errors)]),
            _gauge("kvguard_exporter_paging_info", "1, labelled with the paging path of kvguard's alerts: forwarder "
                   "(kvguard export posts them to Alertmanager) or prometheus (the rules page).", ("path",),
                   [((self.paging,), 1)]),
            _counter("kvguard_exporter_alerts_resent_total", "Firing alerts resent to Alertmanager to keep them "
                     "active.", (), [((), self.resent)]),
            _gauge("kvguard_exporter_alerts_active", "Firing alerts the exporter keeps resending.", (),
                   [((), len(self.active))]),
            _counter("kvguard_exporter_alerts_duplicate_total", "Redelivered alerts not forwarded again.", (),
                     [((), self.alerts_duplicate)]),
        ]
        for name in SinkCounters.__slots__:
            families.append(_counter(f"kvguard_exporter_alerts_{name}_total",
                                     f"Alerts {name.replace('_', ' ')} by each receiver.", ("receiver",),
                                     [((sink.name,), getattr(sink.counters, name)) for sink in self.sinks]))
        families.append(_gauge("kvguard_exporter_alert_queue_length", "Alerts waiting for each receiver.",
                               ("receiver",), [((sink.name,), len(sink.queue)) for sink in self.sinks]))
        return [family for family in families if family.samples]

    async def _metrics(self, request: web.Request) -> web.Response:
        openmetrics = wants_openmetrics(request.headers.get("Accept", ""))
        return web.Response(body=self.render(openmetrics=openmetrics).encode(),
                            headers={"Content-Type": OPENMETRICS_CONTENT_TYPE if openmetrics else CONTENT_TYPE})

    async def _healthz(self, request: web.Request) -> web.Response:
        """200 while every task runs; 503 (with the counters) once one has died."""
        dead = [task.get_name() for task in self._tasks if task.done()]
        return web.json_response({"ok": not dead, "dead_tasks": dead, **self.counters()},
                                 status=503 if dead else 200)

    def counters(self) -> dict[str, Any]:
        state = self.state.counters
        return {"records": dict(self.records),
                "decode_errors": {f"{kind}/{reason}": n for (kind, reason), n in self.decode_errors.items()},
                "alerts_duplicate": self.alerts_duplicate, "alerts_resent": self.resent,
                "bus_errors": self.bus_errors,
                "state": {name: getattr(state, name) for name in state.__slots__},
                "sinks": {sink.name: sink.counters.as_dict() for sink in self.sinks}}


def _counter(name: str, help_text: str, labels: tuple[str, ...], samples: list[tuple[tuple, float]]) -> Metric:
    family = CounterMetricFamily(name, help_text, labels=list(labels))
    for values, value in samples:
        family.add_metric(list(values), float(value))
    return family


def _gauge(name: str, help_text: str, labels: tuple[str, ...], samples: list[tuple[tuple, float]]) -> Metric:
    family = GaugeMetricFamily(name, help_text, labels=list(labels))
    for values, value in samples:
        family.add_metric(list(values), float(value))
    return family
