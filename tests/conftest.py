"""Shared fixtures: real broker and real redis-server rigs (never mocks, never the shared Redis).

- ``kafka_bootstrap`` (session): ``$KAFKA_BOOTSTRAP`` when set, else a private Tansu broker on a free
  loopback port, with the default ``kvguard.*`` topics created; stopped at session end.
- ``redis_url`` (session): ``$REDIS_URL`` when set, else a private ``redis-server`` on a free port
  (no persistence, temp dir); stopped at session end.
- ``topic_prefix`` (function): a unique prefix (``t<hex>.``) so tests never see each other's records.
- ``kafka_settings`` (function): ``Settings`` pointing at ``kafka_bootstrap`` with ``topic_prefix``,
  its six topics created (3 partitions each), and short consumer-group timeouts for Tansu
  (``fast_group_options()``; use them too when you build Settings by hand for a private broker).
- ``tansu_broker`` (function): a factory for private brokers a test may stop and restart:
  ``broker = tansu_broker(); broker.stop(); broker.start()`` (same port; created topics come back).
- ``redis_server`` (function): a factory for private redis-servers with ``stop()``/``start()``.
"""

from __future__ import annotations

import os
import uuid

import pytest

from kvguard.testing.rigs import RedisServer, TansuBroker
from kvguard.testing.rigs.tansu import create_topics_sync

TEST_TOPIC_PARTITIONS = 3


def fast_group_options() -> dict:
    """Consumer-group timeouts for the private Tansu broker.

    Tansu 0.6 answers JoinGroup only after about half the session timeout, and a member that left
    is only forgotten when its session expires, so Kafka's usual 10 s session makes every
    subscribe take ~5 s and a consumer restart ~15 s. A 1 s session keeps tests fast. A real Kafka
    broker (``KAFKA_BOOTSTRAP``) refuses sessions under ``group.min.session.timeout.ms`` (6 s), so
    then the defaults stay.
    """
    if os.environ.get("KAFKA_BOOTSTRAP"):
        return {}
    return {"session_timeout_ms": 1000, "heartbeat_interval_ms": 250}


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = str(item.fspath)
        if f"{os.sep}integration{os.sep}" in path:
            item.add_marker(pytest.mark.integration)
        elif f"{os.sep}e2e{os.sep}" in path:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def kafka_bootstrap():
    from kvguard.config.settings import Settings

    given = os.environ.get("KAFKA_BOOTSTRAP")
    if given:
        settings = Settings(kafka={"bootstrap": given})
        create_topics_sync(given, {name: spec.partitions for name, spec in settings.topics.all().items()})
        yield given
        return
    broker = TansuBroker().start()
    try:
        broker.create_topics({name: spec.partitions for name, spec in Settings().topics.all().items()})
        yield broker.bootstrap
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def redis_url():
    given = os.environ.get("REDIS_URL")
    if given:
        yield given
        return
    server = RedisServer().start()
    try:
        yield server.url
    finally:
        server.cleanup()


@pytest.fixture
def topic_prefix() -> str:
    return f"t{uuid.uuid4().hex[:12]}."


@pytest.fixture
def kafka_settings(kafka_bootstrap, topic_prefix):
    """Settings for one test: its own topics (created, 3 partitions each) on the session broker."""
    from kvguard.config.settings import TOPIC_KINDS, Settings

    settings = Settings(
        kafka={"bootstrap": kafka_bootstrap, "client_id": "kvguard-test", **fast_group_options()},
        topics={"prefix": topic_prefix, **{kind: {"partitions": TEST_TOPIC_PARTITIONS} for kind in TOPIC_KINDS}},
    )
    create_topics_sync(kafka_bootstrap, {name: spec.partitions for name, spec in settings.topics.all().items()})
    return settings


@pytest.fixture
def tansu_broker():
    brokers: list[TansuBroker] = []

    def make(port: int | None = None) -> TansuBroker:
        broker = TansuBroker(port).start()
        brokers.append(broker)
        return broker

    yield make
    for broker in brokers:
        broker.stop()


@pytest.fixture
def redis_server():
    servers: list[RedisServer] = []

    def make(port: int | None = None, password: str | None = None) -> RedisServer:
        server = RedisServer(port, password=password).start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.cleanup()
