"""Publish a list of records and await every delivery, retrying through a broker outage.

Shared by every service that must not commit its input before its output is on the bus (the
policy service's commands and alerts, the actuators' acks).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from kvguard.bus.base import BusClosed, SendBufferFull

log = logging.getLogger("policy.delivery")  # the name operators and the demo already watch

async def deliver_all(bus: Any, records: list[tuple], *, stop: Any = None, label: str = "kvguard",
                      backoff_s: float = 0.1, max_backoff_s: float = 5.0) -> bool:
    """Publish ``records`` ((topic, key, value, headers) tuples) and await every delivery.

    ``bus.publish`` only queues a record; its future says whether the broker took it. A record
    refused with ``SendBufferFull`` or whose delivery failed is published again after a backoff
    (doubling up to ``max_backoff_s``), in the original order, until all are delivered. A
    retried record may arrive twice or after a later one: commands are idempotent (id) and
    headroom is a level, so that is safe. Returns False when ``stop`` (an asyncio.Event) is set
    while records are still undelivered; ``BusClosed`` propagates (retrying cannot help).
    """
    pending = list(records)
    delay = backoff_s
    attempt = 0
    while pending:
        attempt += 1
        queued: list[tuple[tuple, Any]] = []
        failed: list[tuple] = []
        error: BaseException | None = None
        for i, record in enumerate(pending):
            try:
                queued.append((record, await bus.publish(*record)))
            except SendBufferFull as err:
                error = err
                failed.extend(pending[i:])  # the buffer is full: the rest would wait the same
                break
        results = await asyncio.gather(*(fut for _, fut in queued), return_exceptions=True)
        for (record, _), result in zip(queued, results):
            if isinstance(result, BusClosed):
                raise result
            if isinstance(result, BaseException):
                failed.append(record)
                error = error or result
        if not failed:
            if attempt > 1:
                log.warning("%s: delivered after %d attempts", label, attempt)
            return True
        order = {id(r): i for i, r in enumerate(pending)}
        pending = sorted(failed, key=lambda r: order[id(r)])
        log.warning("%s: %d record(s) not delivered (%s: %s); retrying in %.1f s", label, len(pending),
                    type(error).__name__, error, delay)
        if stop is not None and stop.is_set():
            return False
        if stop is None:
            await asyncio.sleep(delay)
        else:
            try:
                await asyncio.wait_for(stop.wait(), delay)
                return False
            except TimeoutError:
                pass
        delay = min(max_backoff_s, delay * 2)
    return True
