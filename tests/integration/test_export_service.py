"""`kvguard export` on the real broker: scrape /metrics over HTTP, forward alerts to a live receiver."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

from kvguard.bus.kafka import KafkaBus
from kvguard.contracts.units import NS_PER_S
from kvguard.ops.export_service import EXPORT_KINDS, ExportService
from kvguard.ops.exporter import ExportError, rfc3339
from kvguard.wire.schemas import Ack, Alert, Command, DlqRecord, MetricTick, make_headers
from tests.unit.ops.test_exporter import parse, value

NODES = ("sim-0/gpu0", "sim-0/gpu1")


class FakeAlertmanager:
    """A tiny receiver on a free loopback port: records each POST body; answers 503 ``fail_first`` times."""

    def __init__(self, fail_first: int = 0):
        self.fail_first = fail_first
        self.attempts = 0
        self.alerts: list[dict] = []
        self.hooks: list[dict] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def _alerts(self, request: web.Request) -> web.Response:
        self.attempts += 1
        if self.attempts <= self.fail_first:
            return web.Response(status=503, text="not ready")
        body = await request.json()
        assert isinstance(body, list), body
        self.alerts.extend(body)
        return web.json_response({})

    async def _hook(self, request: web.Request) -> web.Response:
        self.hooks.append(await request.json())
        return web.Response(status=204)

    async def __aenter__(self) -> "FakeAlertmanager":
        app = web.Application()
        app.router.add_post("/api/v2/alerts", self._alerts)
        app.router.add_post("/hook", self._hook)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


@pytest.fixture
async def bus(kafka_settings):
    carrier = KafkaBus(kafka_settings)
    await carrier.start()
    yield carrier
    await carrier.stop()


def service_for(bus, settings, **kw) -> ExportService:
    kw.setdefault("resend_s", 0.0)
    return ExportService(bus, {kind: settings.topics.name(kind) for kind in EXPORT_KINDS}, port=0,
                         backoff_initial_s=0.05, backoff_max_s=0.2, **kw)


async def publish(bus, settings, kind: str, records) -> None:
    for record in records:
        node = getattr(record, "node", "dlq")
        future = await bus.publish(settings.topics.name(kind), node, record.to_bytes(), make_headers(kind, node))
        await future


async def wait_for(condition, what: str, limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what} after {limit_s} s")
        await asyncio.sleep(0.05)


def tick(node: str, ts_s: int, u_kv: float, ooms: int = 0, p_oom: float | None = None) -> MetricTick:
    return MetricTick(node=node, ts_ns=ts_s * NS_PER_S, u_kv=u_kv, f_ext=0.5, f_int=0.25, psi=u_kv + 0.05,
                      slope_per_min=0.02, ooms=ooms, p_oom=p_oom)


async def scrape(url: str) -> tuple[dict, str]:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = await response.text()
    return parse(text)[0], text


async def test_scrape_shows_newest_ticks_and_counts_redeliveries_once(bus, kafka_settings):
    ticks = [tick(node, ts, 0.5 + ts / 100, ooms=1, p_oom=0.1 * i + 0.2)
             for i, node in enumerate(NODES) for ts in (10, 20)]
    redelivered = [tick(NODES[0], 20, 0.7, ooms=1, p_oom=0.2), tick(NODES[0], 10, 0.01, ooms=1)]
    dead = DlqRecord.of(reason="malformed", detail="not JSON", topic="kvguard.events", partition=1, offset=4,
                        key=b"sim-0/gpu0", value=b"\x00", group="streams")
    ack = Ack(command_id="c-1", node=NODES[1], outcome="done", executed_at_ns=21 * NS_PER_S, action="evict",
              units_freed=12)
    async with service_for(bus, kafka_settings) as service:
        await publish(bus, kafka_settings, "metrics", ticks + redelivered)
        await publish(bus, kafka_settings, "dlq", [dead, dead])
        await publish(bus, kafka_settings, "acks", [ack, ack])
        await bus.publish(kafka_settings.topics.name("metrics"), NODES[0], b"{not json",
                          make_headers("metrics", NODES[0]))
        await wait_for(lambda: service.records["metrics"] == 6 and service.records["dlq"] == 2
                       and service.records["acks"] == 2 and service.decode_errors, "all records folded")
        samples, text = await scrape(service.url)
        async with aiohttp.ClientSession() as session, session.get(f"{service.url}/healthz") as response:
            health = (response.status, await response.json())
    assert health[0] == 200 and health[1]["ok"] and health[1]["state"]["ticks_duplicate"] == 2
    assert value(samples, "kvguard_u_kv", node=NODES[0]) == pytest.approx(0.7)
    assert value(samples, "kvguard_u_kv", node=NODES[1]) == pytest.approx(0.7)
    assert value(samples, "kvguard_p_oom", node=NODES[1]) == pytest.approx(0.3)
    assert value(samples, "kvguard_tick_timestamp_seconds", node=NODES[0]) == 20
    assert value(samples, "kvguard_ooms_total", node=NODES[0]) == 2
    assert value(samples, "kvguard_ooms_total", node=NODES[1]) == 2
    assert value(samples, "kvguard_dlq_records_total", reason="malformed") == 1
    assert value(samples, "kvguard_acks_total", node=NODES[1], action="evict", outcome="done") == 1
    assert value(samples, "kvguard_exporter_decode_errors_total", kind="metrics", reason="malformed") == 1
    assert text.count("# TYPE kvguard_u_kv gauge") == 1


def stream_alert(status: str, ts_s: int, **kw) -> Alert:
    fields = dict(node=NODES[0], ts_ns=ts_s * NS_PER_S, name="KVCacheOOMRisk", tier="slope", severity="critical",
                  status=status, fingerprint="fp-oomrisk-gpu0", started_at_ns=1_800_000_000 * NS_PER_S,
                  ends_at_ns=ts_s * NS_PER_S if status == "resolved" else None, value=0.6, threshold=0.5,
                  summary="nearly full and fragmented")
    return Alert(**{**fields, **kw})


async def test_alerts_reach_alertmanager_and_webhook_once_then_resolve(bus, kafka_settings):
    firing, resolved = stream_alert("firing", 1_800_000_000), stream_alert("resolved", 1_800_000_090)
    async with FakeAlertmanager() as receiver, service_for(
            bus, kafka_settings, alertmanager_url=receiver.url, webhook_url=f"{receiver.url}/hook",
            generator_url="http://kvguard.example/alerts") as service:
        await publish(bus, kafka_settings, "alerts", [firing, firing])
        await wait_for(lambda: receiver.alerts and receiver.hooks, "the firing alert")
        samples, _ = await scrape(service.url)
        assert value(samples, "kvguard_alert_firing", node=NODES[0], alertname="KVCacheOOMRisk",
                     severity="critical", tier="slope") == 1
        await publish(bus, kafka_settings, "alerts", [resolved, resolved, firing])
        await wait_for(lambda: service.records["alerts"] == 5 and len(receiver.alerts) >= 2, "the resolved alert")
        await asyncio.sleep(0.3)  # room for a wrong extra send to show up
        samples, text = await scrape(service.url)
    assert [a.get("endsAt") for a in receiver.alerts] == [None, "2027-01-15T08:01:30.000Z"]
    first = receiver.alerts[0]
    assert first["labels"] == {"alertname": "KVCacheOOMRisk", "node": NODES[0], "severity": "critical",
                               "tier": "slope"}
    assert first["annotations"]["summary"] == "nearly full and fragmented"
    assert first["startsAt"] == "2027-01-15T08:00:00.000Z"
    assert first["generatorURL"] == "http://kvguard.example/alerts"
    assert [h["status"] for h in receiver.hooks] == ["firing", "resolved"]
    assert "kvguard_alert_firing{" not in text
    assert value(samples, "kvguard_exporter_alerts_duplicate_total") == 3
    assert value(samples, "kvguard_exporter_alerts_sent_total", receiver="alertmanager") == 2


async def test_alert_arrives_exactly_once_after_the_receiver_recovers(bus, kafka_settings):
    async with FakeAlertmanager(fail_first=3) as receiver, service_for(
            bus, kafka_settings, alertmanager_url=receiver.url) as service:
        await publish(bus, kafka_settings, "alerts", [stream_alert("firing", 1_800_000_000)])
        await wait_for(lambda: receiver.alerts, "the alert after the receiver recovered")
        await asyncio.sleep(0.3)
        counters = service.sinks[0].counters
    assert receiver.attempts == 4 and len(receiver.alerts) == 1
    assert (counters.failed_attempts, counters.sent, counters.dropped) == (3, 1, 0)


async def test_firing_alerts_are_resent_with_a_future_end_until_resolved(bus, kafka_settings):
    now_ns = time.time_ns()
    firing = stream_alert("firing", now_ns // NS_PER_S)
    resolved = stream_alert("resolved", now_ns // NS_PER_S + 60)
    async with FakeAlertmanager() as receiver, service_for(
            bus, kafka_settings, alertmanager_url=receiver.url, resend_s=0.2) as service:
        await publish(bus, kafka_settings, "metrics", [tick(NODES[0], now_ns // NS_PER_S, 0.95)])
        await publish(bus, kafka_settings, "alerts", [firing])
        await wait_for(lambda: len(receiver.alerts) >= 3, "two resends of the firing alert")
        await publish(bus, kafka_settings, "alerts", [resolved])
        await wait_for(lambda: receiver.alerts[-1].get("endsAt") == rfc3339(resolved.ends_at_ns), "the resolve")
        sent = len(receiver.alerts)
        await asyncio.sleep(0.6)  # three resend periods: nothing more may come
        assert len(receiver.alerts) == sent and not service.active
    firing_sends = receiver.alerts[:-1]
    assert all(a["endsAt"] > rfc3339(now_ns) for a in firing_sends)
    assert {a["annotations"]["fingerprint"] for a in receiver.alerts} == {"fp-oomrisk-gpu0"}


async def test_the_inproc_bus_feeds_the_same_service(kafka_settings):
    from kvguard.bus.inproc import InprocBus

    carrier = InprocBus.from_settings(kafka_settings)
    await carrier.start()
    try:
        async with service_for(carrier, kafka_settings) as service:
            await publish(carrier, kafka_settings, "metrics", [tick(NODES[1], 30, 0.93, ooms=1)] * 2)
            await wait_for(lambda: service.records["metrics"] == 2, "two ticks")
            samples, _ = await scrape(service.url)
    finally:
        await carrier.stop()
    assert value(samples, "kvguard_u_kv", node=NODES[1]) == pytest.approx(0.93)
    assert value(samples, "kvguard_ooms_total", node=NODES[1]) == 1


def test_cli_serves_and_reports_counters(kafka_settings, tmp_path):
    import json
    import subprocess
    import sys

    config = tmp_path / "kvguard.json"
    config.write_text(json.dumps({"kafka": kafka_settings.kafka.model_dump(),
                                  "topics": {"prefix": kafka_settings.topics.prefix}}))
    cli = [sys.executable, "-c", "from kvguard.cli import main; main()", "export", "--config", str(config)]
    done = subprocess.run([*cli, "--listen", "127.0.0.1:0", "--max-seconds", "2", "--json"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "/metrics; alerts -> no alert receivers" in done.stderr
    assert json.loads(done.stdout)["records"] == {"metrics": 0, "alerts": 0, "commands": 0, "acks": 0, "dlq": 0}
    bad = subprocess.run([*cli, "--listen", "nowhere"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "expected HOST:PORT" in bad.stderr


async def scrape_openmetrics(url: str) -> str:
    headers = {"Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"}
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics", headers=headers) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("application/openmetrics-text")
        return await response.text()


async def test_openmetrics_when_asked_commands_counted_and_the_paging_path_served(bus, kafka_settings):
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    command = Command(id="cmd-7", node=NODES[0], action="evict", payload={"targets": [[3, 0]]}, mode="default",
                      issued_at_ns=NS_PER_S, ttl_ns=NS_PER_S)
    async with service_for(bus, kafka_settings, paging="prometheus") as service:
        await publish(bus, kafka_settings, "metrics", [tick(NODES[0], 10, 0.5, ooms=1)])
        await publish(bus, kafka_settings, "commands", [command, command])
        await wait_for(lambda: service.records["metrics"] == 1 and service.records["commands"] == 2, "records")
        families = {f.name: f for f in text_string_to_metric_families(await scrape_openmetrics(service.url))}
        samples, _ = await scrape(service.url)
    assert families["kvguard_ooms"].type == "counter"
    assert value(samples, "kvguard_commands_total", node=NODES[0], action="evict") == 1
    assert value(samples, "kvguard_exporter_paging_info", path="prometheus") == 1
    assert value(samples, "kvguard_u_kv", node=NODES[0], gpu="0", instance="sim-0") == pytest.approx(0.5)
    assert value(samples, "kvguard_exporter_last_record_timestamp_seconds", kind="metrics") > 1.7e9


def test_paging_through_prometheus_refuses_a_second_path_to_alertmanager(kafka_settings):
    with pytest.raises(ExportError, match="page each alert twice"):
        service_for(None, kafka_settings, paging="prometheus", alertmanager_url="http://127.0.0.1:9")


async def test_a_simulated_alert_reaches_alertmanager_with_wall_times_not_1970(bus, kafka_settings):
    firing = stream_alert("firing", 583, started_at_ns=563 * NS_PER_S)
    resolved = stream_alert("resolved", 600, started_at_ns=563 * NS_PER_S)
    before = rfc3339(time.time_ns() - NS_PER_S)
    async with FakeAlertmanager() as receiver, service_for(
            bus, kafka_settings, alertmanager_url=receiver.url, webhook_url=f"{receiver.url}/hook"):
        await publish(bus, kafka_settings, "alerts", [firing])
        await wait_for(lambda: receiver.alerts and receiver.hooks, "the firing alert")
        await asyncio.sleep(0.05)
        await publish(bus, kafka_settings, "alerts", [resolved])
        await wait_for(lambda: len(receiver.alerts) >= 2 and len(receiver.hooks) >= 2, "the resolved alert")
    first, last = receiver.alerts[0], receiver.alerts[-1]
    assert first["startsAt"] >= before and last["startsAt"] == first["startsAt"]
    assert last["endsAt"] > first["startsAt"]
    assert first["annotations"]["event_time"].startswith("583.0 s")
    assert all(h["alert"]["startsAt"] == first["startsAt"] for h in receiver.hooks)
