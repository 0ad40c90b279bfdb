"""The in-process bus: Kafka's topic/key/partition/group semantics inside one asyncio loop.

Used by the embedded mode (``kvguard demo``) and by tests that do not need a broker. Like Kafka:
- a topic has N partitions; a keyed record goes to ``murmur2(key) % N`` (the same partition the Java
  client and aiokafka pick), an unkeyed one round-robin;
- every partition is an append-only log with offsets; retention keeps the newest
  ``retention_records`` records per partition (older ones are dropped and counted as ``expired``;
  a consumer that was behind them skips ahead and counts ``skipped``);
- consumer groups split partitions among their members (partition ``p`` of a topic goes to member
  ``p % n`` in join order) and keep committed offsets; a member that joins (or a group that restarts)
  starts at the committed offset, so records delivered but not committed are delivered again
  (at-least-once).
It never blocks on publish (memory is the retention bound), so ``dropped`` stays 0 here.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvguard.bus.base import (
    BusClosed,
    BusCounters,
    BusError,
    Delivery,
    Record,
    as_headers,
    as_key,
    partition_for_key,
)

TopicPartition = tuple[str, int]


@dataclass(slots=True)
class _Partition:
    base_offset: int = 0
    log: deque = field(default_factory=deque)  # (key, value, headers, timestamp_ms)

    @property
    def end_offset(self) -> int:
        return self.base_offset + len(self.log)


@dataclass(slots=True)
class _Group:
    committed: dict[TopicPartition, int] = field(default_factory=dict)
    members: list["InprocSubscription"] = field(default_factory=list)


@dataclass(slots=True)
class InprocCounters(BusCounters):
    expired: int = 0  # records dropped by the retention bound
    skipped: int = 0  # records a lagging consumer never saw because they had expired

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in (*BusCounters.__slots__, *self.__slots__)}


class InprocBus:
    def __init__(
        self,
        *,
        partitions: int | Mapping[str, int] = 6,
        retention_records: int = 1_000_000,
        auto_create: bool = True,
    ):
        if retention_records <= 0:
            raise ValueError(f"retention_records must be > 0, got {retention_records}")
        self.default_partitions = partitions if isinstance(partitions, int) else 6
        self.retention_records = retention_records
        self.auto_create = auto_create
        self.counters = InprocCounters()
        self._topics: dict[str, list[_Partition]] = {}
        self._groups: dict[str, _Group] = {}
        self._round_robin = itertools.count()
        self._started = False
        if not isinstance(partitions, int):
            for name, n in partitions.items():
                self.create_topic(name, n)

    @classmethod
    def from_settings(cls, settings, *, retention_records: int = 1_000_000) -> "InprocBus":
        """A bus with every kvguard topic created with its configured partition count."""
        return cls(
            partitions={name: spec.partitions for name, spec in settings.topics.all().items()},
            retention_records=retention_records,
        )

    # lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        self._started = True

    async def stop(self) -> None:
        for group in self._groups.values():
            for member in list(group.members):
                await member.close()
        self._started = False

    async def __aenter__(self) -> "InprocBus":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    # topics ----------------------------------------------------------------------------------
    def create_topic(self, name: str, partitions: int | None = None) -> bool:
        """Create a topic; False when it exists already (its partition count is kept)."""
        if name in self._topics:
            return False
        n = self.default_partitions if partitions is None else partitions
        if n <= 0:
            raise ValueError(f"topic {name!r}: partitions must be > 0, got {n}")
        self._topics[name] = [_Partition() for _ in range(n)]
        return True

    def partitions_for(self, topic: str) -> int:
        return len(self._partitions(topic))

    def end_offsets(self, topic: str) -> list[int]:
        return [p.end_offset for p in self._partitions(topic)]

    def committed(self, group: str) -> dict[TopicPartition, int]:
        return dict(self._groups[group].committed) if group in self._groups else {}

    def _partitions(self, topic: str) -> list[_Partition]:
        parts = self._topics.get(topic)
        if parts is None:
            if not self.auto_create:
                raise BusError(f"unknown topic {topic!r} (auto_create is off; create_topic() it first)")
            self.create_topic(topic)
            parts = self._topics[topic]
        return parts

    # publish ---------------------------------------------------------------------------------
    async def publish(
        self, topic: str, key: bytes | str | None, value: bytes | None, headers: Sequence[tuple[str, bytes]] = ()
    ) -> "asyncio.Future[Delivery]":
        delivery = self.append(topic, key, value, headers)
        future = asyncio.get_running_loop().create_future()
        future.set_result(delivery)
        return future

    def append(
        self, topic: str, key: bytes | str | None, value: bytes | None, headers: Sequence[tuple[str, bytes]] = ()
    ) -> Delivery:
        """Synchronous publish (the embedded runner calls it from plain code). A None value is a
        tombstone, as on Kafka: consumers get a record whose value is None."""
        if value is not None and not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError(f"value must be bytes or None (a tombstone), got {type(value).__name__}")
        parts = self._partitions(topic)
        key_bytes = as_key(key)
        if key_bytes is None:
            index = next(self._round_robin) % len(parts)
        else:
            index = partition_for_key(key_bytes, len(parts))
        part = parts[index]
        offset = part.end_offset
        part.log.append((key_bytes, None if value is None else bytes(value), as_headers(headers),
                         int(time.time() * 1000)))
        if len(part.log) > self.retention_records:
            part.log.popleft()
            part.base_offset += 1
            self.counters.expired += 1
        self.counters.published += 1
        self.counters.delivered += 1
        self._wake(topic)
        return Delivery(topic, index, offset)

    async def flush(self) -> None:
        return None

    def _wake(self, topic: str) -> None:
        for group in self._groups.values():
            for member in group.members:
                if topic in member.topics:
                    member._wakeup.set()

    # subscribe -------------------------------------------------------------------------------
    def subscribe(self, topics: Sequence[str], group: str) -> "InprocSubscription":
        if isinstance(topics, str):
            topics = [topics]
        for topic in topics:
            self._partitions(topic)
        sub = InprocSubscription(self, tuple(topics), group)
        self._join(sub)
        return sub

    def _join(self, sub: "InprocSubscription") -> None:
        group = self._groups.setdefault(sub.group, _Group())
        group.members.append(sub)
        self._rebalance(group)

    def _leave(self, sub: "InprocSubscription") -> None:
        group = self._groups.get(sub.group)
        if group is None or sub not in group.members:
            return
        group.members.remove(sub)
        self._rebalance(group)

    def _rebalance(self, group: _Group) -> None:
        wanted: dict[int, set[TopicPartition]] = {id(m): set() for m in group.members}
        topics = sorted({t for m in group.members for t in m.topics})
        for topic in topics:
            members = [m for m in group.members if topic in m.topics]
            for p in range(len(self._topics[topic])):
                wanted[id(members[p % len(members)])].add((topic, p))
        for member in group.members:
            member._assign(wanted[id(member)], group.committed)

    def _commit(self, group_name: str, tp: TopicPartition, next_offset: int) -> None:
        group = self._groups.setdefault(group_name, _Group())
        if next_offset > group.committed.get(tp, -1):
            group.committed[tp] = next_offset
        self.counters.committed += 1


class InprocSubscription:
    """One member of a consumer group. Async-iterate it, or ``getmany()`` for throughput."""

    def __init__(self, bus: InprocBus, topics: tuple[str, ...], group: str):
        self.bus = bus
        self.topics = topics
        self.group = group
        self._positions: dict[TopicPartition, int] = {}
        self._wakeup = asyncio.Event()
        self._closed = False
        self._next_tp = 0

    async def start(self) -> None:
        """Joined already at subscribe(); kept for symmetry with the Kafka subscription."""
        if self._closed:
            raise BusClosed(f"subscription of group {self.group!r} is closed")

    @property
    def assignment(self) -> list[TopicPartition]:
        return sorted(self._positions)

    def _assign(self, partitions: set[TopicPartition], committed: Mapping[TopicPartition, int]) -> None:
        kept = {tp: pos for tp, pos in self._positions.items() if tp in partitions}
        for tp in partitions - kept.keys():
            part = self.bus._topics[tp[0]][tp[1]]
            kept[tp] = committed.get(tp, part.base_offset)
        self._positions = kept
        self._wakeup.set()

    def _take(self, max_records: int) -> list[Record]:
        out: list[Record] = []
        tps = sorted(self._positions)
        if not tps:
            return out
        # round-robin across partitions so one busy partition does not starve the others
        start = self._next_tp % len(tps)
        self._next_tp += 1
        for tp in tps[start:] + tps[:start]:
            part = self.bus._topics[tp[0]][tp[1]]
            pos = self._positions[tp]
            if pos < part.base_offset:
                self.bus.counters.skipped += part.base_offset - pos
                pos = part.base_offset
            while pos < part.end_offset and len(out) < max_records:
                key, value, headers, ts_ms = part.log[pos - part.base_offset]
                out.append(Record(tp[0], tp[1], pos, key, value, headers, ts_ms, self._commit_record))
                pos += 1
            self._positions[tp] = pos
            if len(out) >= max_records:
                break
        self.bus.counters.received += len(out)
        return out

    async def getmany(self, max_records: int = 1000, timeout_s: float = 1.0) -> list[Record]:
        if self._closed:
            raise BusClosed(f"subscription of group {self.group!r} is closed")
        records = self._take(max_records)
        if records or timeout_s <= 0:
            return records
        self._wakeup.clear()
        try:
            await asyncio.wait_for(self._wakeup.wait(), timeout_s)
        except TimeoutError:
            return []
        if self._closed:
            raise BusClosed(f"subscription of group {self.group!r} is closed")
        return self._take(max_records)

    def __aiter__(self) -> "InprocSubscription":
        return self

    async def __anext__(self) -> Record:
        while not self._closed:
            records = self._take(1)
            if records:
                return records[0]
            self._wakeup.clear()
            await self._wakeup.wait()
        raise StopAsyncIteration

    async def _commit_record(self, record: Record) -> None:
        self.bus._commit(self.group, (record.topic, record.partition), record.offset + 1)

    async def commit(self) -> None:
        """Commit everything delivered so far on this member's partitions."""
        for tp, pos in self._positions.items():
            self.bus._commit(self.group, tp, pos)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.bus._leave(self)
        self._wakeup.set()

    async def __aenter__(self) -> "InprocSubscription":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
