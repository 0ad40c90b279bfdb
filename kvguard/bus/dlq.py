"""Decode consumed records; send what cannot be decoded to the DLQ and keep going.

``RecordDecoder`` is what every consumer loop uses between the bus and the core::

    decoder = RecordDecoder(bus, settings.topics.name("dlq"), component="streams", group="streams")
    async for record in subscription:
        batch = await decoder.decode_batch(record)   # None when it went to the DLQ
        if batch is not None:
            core.process(batch)
        await record.commit()

Decoding includes the semantic checks of ``kvguard.wire.validate`` (caps from ``limits``) and,
for records keyed by node, that the key names the record's node: a failure is dead-lettered as
``invalid`` with the reason. A record with a null value (a tombstone) is dead-lettered as
``tombstone``, an empty one as ``malformed``. A record that decoded but made its handler raise is
dead-lettered by the consumer through ``handler_failed(record, error)`` (counted, logged, reason
``processing_error``), and so is one whose decoding raised anything but a ``DecodeError``: one
poison record never stops a service or stalls its partition.

The DLQ record is bounded whatever the record held (``DlqRecord.of``: a value over 256 KiB travels
as its size, SHA-256 and first 4 KiB), so it fits the broker's default 1 MiB limit and a bad
record of any size reaches the DLQ.

Every path is counted in ``decoder.counters``: ``received``, ``decoded``, ``dead_lettered``
(per reason, ``processing_error`` for handlers that raised) and ``dlq_failed`` (the DLQ itself could not take the record: it
is then only counted and logged, so the consumer still never blocks on a poison record).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvguard.bus.base import Bus, Record
from kvguard.contracts.events import EventBatch
from kvguard.wire.schemas import DecodeError, DlqRecord, EventBatchRecord, WireModel, decode, dlq_key, make_headers
from kvguard.wire.validate import InvalidRecord, WireLimits, check_key

log = logging.getLogger(__name__)

PROCESSING_ERROR = "processing_error"  # DLQ reason: the record decoded, its handler raised


@dataclass(slots=True)
class DecodeCounters:
    received: int = 0
    decoded: int = 0
    dead_lettered: Counter = field(default_factory=Counter)  # reason -> records (processing_error: the handler raised)
    dlq_failed: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "received": self.received,
            "decoded": self.decoded,
            "dead_lettered": dict(self.dead_lettered),
            "dead_lettered_total": sum(self.dead_lettered.values()),
            "dlq_failed": self.dlq_failed,
        }


class RecordDecoder:
    def __init__(self, bus: Bus, dlq_topic: str, *, component: str, group: str = "",
                 limits: WireLimits | None = None):
        self.bus = bus
        self.dlq_topic = dlq_topic
        self.component = component
        self.group = group
        self.limits = limits
        self.counters = DecodeCounters()

    async def decode(self, kind: str, record: Record) -> WireModel | None:
        """The record's model, or None after sending it to the DLQ."""
        self.counters.received += 1
        try:
            model = decode(kind, record.value, record.headers, limits=self.limits)
            node = getattr(model, "node", None)
            if isinstance(node, str):
                check_key(record.key, node)
        except DecodeError as exc:
            await self.dead_letter(record, exc.reason, exc.detail)
            return None
        except InvalidRecord as exc:
            await self.dead_letter(record, "invalid", exc.detail)
            return None
        except Exception as exc:  # a decoder bug must not stop the consumer either
            log.error("%s: decoding %s/%d@%d raised %s: %s; dead-lettered, going on", self.component, record.topic,
                      record.partition, record.offset, type(exc).__name__, exc, exc_info=exc)
            await self.dead_letter(record, PROCESSING_ERROR, f"decoding raised {type(exc).__name__}: {exc}")
            return None
        self.counters.decoded += 1
        return model

    async def handler_failed(self, record: Record, error: BaseException) -> None:
        """The record decoded but its handler raised: log and dead-letter it (counted under
        ``dead_lettered["processing_error"]``)."""
        detail = f"{type(error).__name__}: {error}"
        log.error("%s: handling %s/%d@%d raised %s; dead-lettered, going on", self.component, record.topic,
                  record.partition, record.offset, detail)
        await self.dead_letter(record, PROCESSING_ERROR, detail)

    async def decode_batch(self, record: Record) -> EventBatch | None:
        model = await self.decode("events", record)
        if model is None:
            return None
        if not isinstance(model, EventBatchRecord):
            raise TypeError(f"events decoded to {type(model).__name__}")
        return model.to_batch()

    async def dead_letter(self, record: Record, reason: str, detail: str) -> None:
        """Send ``record`` to the DLQ with ``reason``; never raises (a failure is counted and logged)."""
        self.counters.dead_lettered[reason] += 1
        log.warning("%s: dead-lettered %s/%d@%d: %s: %s", self.component, record.topic, record.partition,
                    record.offset, reason, detail[:300])
        try:
            dead = DlqRecord.of(
                reason=reason, detail=detail, topic=record.topic, partition=record.partition,
                offset=record.offset, key=record.key, value=record.value, headers=record.headers,
                group=self.group, component=self.component, dead_lettered_at_ns=time.time_ns(),
            )
            future = await self.bus.publish(
                self.dlq_topic, dlq_key(record.key), dead.to_bytes(),
                make_headers("dlq", self.component, record_id=f"{record.topic}/{record.partition}/{record.offset}"),
            )
            await future
        except Exception as exc:  # a DLQ outage must not stop the consumer: count it and go on
            self.counters.dlq_failed += 1
            log.error("could not dead-letter %s/%d@%d (%s): %s", record.topic, record.partition,
                      record.offset, reason, exc)
