"""The Kafka carrier (aiokafka), plus topic provisioning.

aiokafka is imported inside functions and methods, never at import time of this module's callers'
pure code. Behaviour beyond aiokafka's own:
- a bounded send buffer: at most ``kafka.send_buffer_records`` records accepted and not yet
  acknowledged; ``publish()`` waits for room (backpressure) and, after
  ``kafka.send_buffer_timeout_s``, refuses the record with ``SendBufferFull`` and counts it in
  ``counters.dropped``;
- delivery failures (broker down past ``request_timeout_ms``) fail the returned future and are
  counted in ``counters.delivery_failed``; the caller (e.g. the node publisher) decides to retry;
- SASL/TLS and any other aiokafka option pass through from ``KafkaSettings``.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.helpers import create_ssl_context

from kvguard.bus.base import (
    BusClosed,
    BusCounters,
    BusError,
    Delivery,
    Record,
    SendBufferFull,
    as_headers,
    as_key,
)
from kvguard.config.settings import KafkaSettings, Settings, TopicSpec

TOPIC_ALREADY_EXISTS = 36


def _kafka_settings(config: KafkaSettings | Settings | str) -> KafkaSettings:
    if isinstance(config, Settings):
        return config.kafka
    if isinstance(config, str):
        return KafkaSettings(bootstrap=config)
    return config


def client_kwargs(kafka: KafkaSettings) -> dict[str, Any]:
    """Connection options shared by producer, consumer and admin client."""
    kwargs: dict[str, Any] = {
        "bootstrap_servers": kafka.bootstrap,
        "client_id": kafka.client_id,
        "security_protocol": kafka.security_protocol,
        "request_timeout_ms": kafka.request_timeout_ms,
    }
    if kafka.security_protocol in ("SSL", "SASL_SSL"):
        kwargs["ssl_context"] = create_ssl_context(
            cafile=kafka.ssl_cafile, certfile=kafka.ssl_certfile, keyfile=kafka.ssl_keyfile
        )
    if kafka.security_protocol.startswith("SASL"):
        kwargs["sasl_mechanism"] = kafka.sasl_mechanism or "PLAIN"
        kwargs["sasl_plain_username"] = kafka.sasl_username
        kwargs["sasl_plain_password"] = kafka.sasl_password
    return kwargs


def unknown_client_options(kafka: KafkaSettings) -> list[tuple[str, str]]:
    """(``producer_options`` | ``consumer_options``, key) of each pass-through option that
    aiokafka's producer or consumer does not take (read from their signatures), so a typo is refused
    at start with the key named instead of failing inside aiokafka."""
    out = []
    for section, options, client in (("producer_options", kafka.producer_options, AIOKafkaProducer),
                                     ("consumer_options", kafka.consumer_options, AIOKafkaConsumer)):
        accepted = set(inspect.signature(client.__init__).parameters) - {"self", "topics"}
        out += [(section, key) for key in options if key not in accepted]
    return out


async def create_topics(
    config: KafkaSettings | Settings | str, specs: Mapping[str, TopicSpec] | None = None
) -> dict[str, str]:
    """Create topics (full name -> spec); ``{name: "created" | "exists"}``. Idempotent.

    ``specs`` defaults to every kvguard topic of ``config`` (which must then be ``Settings``).
    Tansu does not auto-create topics, so every deployment runs this once (``kvguard topics create``).
    """
    if specs is None:
        if not isinstance(config, Settings):
            raise TypeError("create_topics needs Settings (for the topic list) when specs is not given")
        specs = config.topics.all()
    kafka = _kafka_settings(config)
    admin = AIOKafkaAdminClient(**client_kwargs(kafka))
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        wanted = [
            NewTopic(
                name,
                num_partitions=spec.partitions,
                replication_factor=spec.replication_factor,
                topic_configs={"retention.ms": str(spec.retention_ms)},
            )
            for name, spec in specs.items()
            if name not in existing
        ]
        result = {name: "exists" for name in specs if name in existing}
        if wanted:
            response = await admin.create_topics(wanted)
            for name, code, message in _topic_errors(response):
                if code == 0:
                    result[name] = "created"
                elif code == TOPIC_ALREADY_EXISTS:
                    result[name] = "exists"
                else:
                    raise BusError(f"creating topic {name!r} on {kafka.bootstrap} failed: error {code} {message or ''}")
        return result
    finally:
        await admin.close()


async def topic_partitions(config: KafkaSettings | Settings | str, names: Sequence[str]) -> dict[str, int]:
    """Partition counts of existing topics (names that do not exist are left out).

    Only existing names are described: Tansu 0.6 auto-creates a topic (with 4 partitions) when a
    metadata request names an unknown one."""
    admin = AIOKafkaAdminClient(**client_kwargs(_kafka_settings(config)))
    await admin.start()
    try:
        existing = [name for name in names if name in set(await admin.list_topics())]
        if not existing:
            return {}
        described = await admin.describe_topics(existing)
        return {item["topic"]: len(item["partitions"]) for item in described if item["error_code"] == 0}
    finally:
        await admin.close()


def _topic_errors(response) -> list[tuple[str, int, str | None]]:
    out = []
    for item in response.topic_errors:
        name, code = item[0], item[1]
        message = item[2] if len(item) > 2 else None
        out.append((name, code, message))
    return out


class KafkaBus:
    """A Kafka producer plus consumer factory with kvguard's counters and bounds."""

    def __init__(self, config: KafkaSettings | Settings | str):
        self.kafka = _kafka_settings(config)
        self.counters = BusCounters()
        self._producer = None
        self._slots: asyncio.Semaphore | None = None
        self._in_flight = 0
        self._subscriptions: list[KafkaSubscription] = []

    @property
    def bootstrap(self) -> str:
        return self.kafka.bootstrap

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def start(self) -> None:
        """Start the producer; raises (aiokafka's KafkaConnectionError) when no broker answers."""
        if self._producer is not None:
            return

        kafka = self.kafka
        options: dict[str, Any] = {
            **client_kwargs(kafka),
            "linger_ms": kafka.linger_ms,
            "max_batch_size": kafka.max_batch_bytes,
            "acks": "all" if kafka.idempotent else (kafka.acks if kafka.acks == "all" else int(kafka.acks)),
            "enable_idempotence": kafka.idempotent,
            "compression_type": kafka.compression,
            # the same limit the node publisher splits batches to (kafka.max_message_bytes)
            "max_request_size": kafka.max_message_bytes,
            **kafka.producer_options,
        }
        producer = AIOKafkaProducer(**options)
        try:
            await producer.start()
        except BaseException:
            await producer.stop()
            raise
        self._producer = producer
        self._slots = asyncio.Semaphore(kafka.send_buffer_records)

    async def stop(self) -> None:
        for sub in list(self._subscriptions):
            await sub.close()
        producer, self._producer = self._producer, None
        if producer is not None:
            await producer.stop()

    async def __aenter__(self) -> "KafkaBus":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def publish(
        self, topic: str, key: bytes | str | None, value: bytes, headers: Sequence[tuple[str, bytes]] = ()
    ) -> "asyncio.Future[Delivery]":
        if self._producer is None or self._slots is None:
            raise BusClosed("KafkaBus is not started (call await bus.start())")
        timeout_s = self.kafka.send_buffer_timeout_s
        try:
            await asyncio.wait_for(self._slots.acquire(), timeout_s)
        except TimeoutError:
            self.counters.dropped += 1
            raise SendBufferFull(topic, self._in_flight, self.kafka.send_buffer_records, timeout_s) from None
        self._in_flight += 1
        self.counters.published += 1
        result: asyncio.Future[Delivery] = asyncio.get_running_loop().create_future()
        try:
            sent = await self._producer.send(topic, value=value, key=as_key(key), headers=list(as_headers(headers)))
        except Exception as exc:  # metadata timeout, unknown topic, closed producer: a failed delivery
            self._settle(result, None, exc)
            return result
        sent.add_done_callback(lambda fut: self._on_sent(result, fut))
        return result

    def _on_sent(self, result: asyncio.Future, sent: asyncio.Future) -> None:
        if sent.cancelled():
            self._settle(result, None, BusClosed("producer stopped before delivery"))
        elif sent.exception() is not None:
            self._settle(result, None, sent.exception())
        else:
            meta = sent.result()
            self._settle(result, Delivery(meta.topic, meta.partition, meta.offset), None)

    def _settle(self, result: asyncio.Future, delivery: Delivery | None, error: BaseException | None) -> None:
        self._in_flight -= 1
        if self._slots is not None:
            self._slots.release()
        if error is None:
            self.counters.delivered += 1
            if not result.done():
                result.set_result(delivery)
        else:
            self.counters.delivery_failed += 1
            if not result.done():
                result.set_exception(error)
                # callers that fire and forget still see the failure in counters; mark it retrieved
                result.exception()

    async def flush(self) -> None:
        if self._producer is not None:
            await self._producer.flush()

    def subscribe(self, topics: Sequence[str], group: str, **consumer_options: Any) -> "KafkaSubscription":
        if isinstance(topics, str):
            topics = [topics]
        sub = KafkaSubscription(self, tuple(topics), group, consumer_options)
        self._subscriptions.append(sub)
        return sub


class KafkaSubscription:
    """One consumer-group member; starts its consumer on first use (``start()`` to do it early)."""

    def __init__(self, bus: KafkaBus, topics: tuple[str, ...], group: str, options: Mapping[str, Any]):
        self.bus = bus
        self.topics = topics
        self.group = group
        self.options = dict(options)
        self._consumer = None
        self._buffer: list[Record] = []
        self._positions: dict[Any, int] = {}  # TopicPartition -> next offset delivered
        self._closed = False

    async def start(self) -> None:
        if self._closed:
            raise BusClosed(f"subscription of group {self.group!r} is closed")
        if self._consumer is not None:
            return

        kafka = self.bus.kafka
        options: dict[str, Any] = {
            **client_kwargs(kafka),
            "group_id": self.group,
            "enable_auto_commit": False,
            "auto_offset_reset": "earliest",
            "session_timeout_ms": kafka.session_timeout_ms,
            "heartbeat_interval_ms": kafka.heartbeat_interval_ms,
            # how long a fetch may wait at the broker for records: each hop of a decision adds it
            "fetch_max_wait_ms": kafka.fetch_max_wait_ms,
            **kafka.consumer_options,
            **self.options,
        }
        consumer = AIOKafkaConsumer(*self.topics, **options)
        try:
            await consumer.start()
        except BaseException:
            await consumer.stop()
            raise
        self._consumer = consumer

    async def getmany(self, max_records: int = 1000, timeout_s: float = 1.0) -> list[Record]:
        await self.start()
        if self._buffer:
            out, self._buffer = self._buffer[:max_records], self._buffer[max_records:]
            return out
        batches = await self._consumer.getmany(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        out: list[Record] = []
        for tp, messages in batches.items():
            for msg in messages:
                out.append(
                    Record(msg.topic, msg.partition, msg.offset, msg.key, msg.value,
                           tuple(msg.headers or ()), msg.timestamp, self._commit_record)
                )
            if messages:
                self._positions[tp] = messages[-1].offset + 1
        self.bus.counters.received += len(out)
        return out

    def __aiter__(self) -> "KafkaSubscription":
        return self

    async def __anext__(self) -> Record:
        while not self._closed:
            if not self._buffer:
                self._buffer = await self.getmany(500, 1.0)
            if self._buffer:
                return self._buffer.pop(0)
        raise StopAsyncIteration

    async def _commit_record(self, record: Record) -> None:
        await self._consumer.commit({TopicPartition(record.topic, record.partition): record.offset + 1})
        self.bus.counters.committed += 1

    async def commit(self) -> None:
        """Commit every record delivered so far (records still buffered by ``__anext__`` excluded)."""
        if self._consumer is None or not self._positions:
            return
        positions = dict(self._positions)
        for record in self._buffer:  # delivered by getmany to the buffer, not yet to the caller
            tp = next((t for t in positions if t.topic == record.topic and t.partition == record.partition), None)
            if tp is not None and record.offset < positions[tp]:
                positions[tp] = record.offset
        await self._consumer.commit(positions)
        self.bus.counters.committed += 1

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            await consumer.stop()
        if self in self.bus._subscriptions:
            self.bus._subscriptions.remove(self)

    async def __aenter__(self) -> "KafkaSubscription":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

