"""The bus interface shared by the Kafka carrier and the in-process carrier.

Semantics (both carriers):
- ``await bus.publish(topic, key, value, headers)`` returns once the record is accepted into the
  carrier's send buffer (it waits while the buffer is full: backpressure) and gives back a future
  that resolves to a ``Delivery`` (partition, offset) once the broker has it. ``publish_and_wait``
  awaits both.
- Records with the same key go to the same partition (Kafka's murmur2 partitioner), so one node's
  records stay in order.
- ``bus.subscribe(topics, group)`` is an async iterator of ``Record``; members of one group split the
  partitions. Consumption starts at the group's committed offset (earliest when none).
  ``await record.commit()`` commits that record and everything before it on its partition;
  ``await subscription.commit()`` commits everything delivered so far. Records not committed are
  delivered again to the next consumer of the group (at-least-once).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

Headers = tuple[tuple[str, bytes], ...]


class BusError(RuntimeError):
    """Base class of carrier errors."""


class SendBufferFull(BusError):
    """publish() waited ``timeout_s`` for room in the send buffer; the record was not accepted."""

    def __init__(self, topic: str, in_flight: int, bound: int, timeout_s: float):
        self.topic, self.in_flight, self.bound, self.timeout_s = topic, in_flight, bound, timeout_s
        super().__init__(
            f"send buffer full ({in_flight}/{bound} records in flight) for {timeout_s} s publishing "
            f"to {topic!r}; the broker is slow or unreachable (raise kafka.send_buffer_records or "
            f"kafka.send_buffer_timeout_s to wait longer)"
        )


class BusClosed(BusError):
    """The bus or subscription was stopped."""


# Kafka protocol error codes that refuse the record itself (org.apache.kafka.common.protocol.Errors:
# 10 MESSAGE_TOO_LARGE, 18 RECORD_LIST_TOO_LARGE): sending it again cannot succeed. Any other
# failure may pass (a broker restarting; a topic being re-created, which Tansu answers with the
# UNKNOWN_SERVER_ERROR code -1 meanwhile), so it is worth retrying.
RECORD_REFUSED_CODES = frozenset({10, 18})


def refused_for_good(error: BaseException) -> bool:
    """True when ``error`` (a failed delivery) refuses the record itself; read from the Kafka error
    code the client puts on it (aiokafka's ``errno``), so no client is imported here."""
    return getattr(error, "errno", None) in RECORD_REFUSED_CODES


@dataclass(slots=True, frozen=True)
class Delivery:
    topic: str
    partition: int
    offset: int


@dataclass(slots=True)
class Record:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None  # None: a tombstone (a record with a null value); consumers must expect one
    headers: Headers = ()
    timestamp_ms: int = 0
    _committer: Callable[["Record"], Awaitable[None]] | None = field(default=None, repr=False, compare=False)

    def header(self, name: str) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    async def commit(self) -> None:
        """Commit this record and everything before it on its partition, for its group."""
        if self._committer is None:
            raise BusError("this record was not delivered by a subscription; nothing to commit")
        await self._committer(self)


@dataclass(slots=True)
class BusCounters:
    """Every path has a counter: nothing is dropped silently."""

    published: int = 0  # accepted by publish()
    delivered: int = 0  # acknowledged by the broker
    dropped: int = 0  # refused by publish() (send buffer full past its timeout)
    delivery_failed: int = 0  # accepted, then failed at the broker (counted, future raises)
    received: int = 0  # handed to a subscriber
    committed: int = 0  # commit calls

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


@runtime_checkable
class Subscription(Protocol):
    async def start(self) -> None:
        """Join the group now (otherwise the first read does it)."""
        ...

    def __aiter__(self) -> AsyncIterator[Record]: ...

    async def __anext__(self) -> Record: ...

    async def getmany(self, max_records: int = 1000, timeout_s: float = 1.0) -> list[Record]:
        """Up to ``max_records`` records, waiting at most ``timeout_s`` for the first one."""
        ...

    async def commit(self) -> None: ...

    async def close(self) -> None: ...


@runtime_checkable
class Bus(Protocol):
    counters: BusCounters

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def publish(
        self, topic: str, key: bytes | str | None, value: bytes, headers: Sequence[tuple[str, bytes]] = ()
    ) -> "asyncio.Future[Delivery]": ...

    async def flush(self) -> None:
        """Wait until every accepted record is delivered or failed."""
        ...

    def subscribe(self, topics: Sequence[str], group: str) -> Subscription: ...


async def publish_and_wait(
    bus: Bus, topic: str, key: bytes | str | None, value: bytes, headers: Sequence[tuple[str, bytes]] = ()
) -> Delivery:
    future = await bus.publish(topic, key, value, headers)
    return await future


def as_key(key: bytes | str | None) -> bytes | None:
    if key is None or isinstance(key, bytes):
        return key
    return key.encode("utf-8")


def as_headers(headers: Sequence[tuple[str, bytes | str]] | None) -> Headers:
    if not headers:
        return ()
    return tuple((name, value.encode("utf-8") if isinstance(value, str) else bytes(value)) for name, value in headers)


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 (seed 0x9747b28c) as a signed 32-bit int, as the Java client computes it."""
    length = len(data)
    seed = 0x9747B28C
    m = 0x5BD1E995
    r = 24
    h = (seed ^ length) & 0xFFFFFFFF
    length4 = length // 4
    for i in range(length4):
        i4 = i * 4
        k = data[i4] | (data[i4 + 1] << 8) | (data[i4 + 2] << 16) | (data[i4 + 3] << 24)
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> r
        k = (k * m) & 0xFFFFFFFF
        h = (h * m) & 0xFFFFFFFF
        h ^= k
    extra = length % 4
    tail = length4 * 4
    if extra >= 3:
        h ^= data[tail + 2] << 16
    if extra >= 2:
        h ^= data[tail + 1] << 8
    if extra >= 1:
        h ^= data[tail]
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def partition_for_key(key: bytes, partitions: int) -> int:
    """Kafka's default partition for a non-null key: ``toPositive(murmur2(key)) % partitions``."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions
