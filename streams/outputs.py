"""What a stream core's outputs become on the bus: one place for every path that publishes them.

The embedded demo loop, the bus-backed ``StreamsService`` and the Faust worker all publish the
ticks and alerts of a ``StreamCore`` call. They share this module so that the three carry
byte-identical records with the same keys and the same CloudEvents ids: a consumer deduplicates
redeliveries by id, so an id that differed by path (as it once did for alerts) would let the same
alert through twice, or drop a resolve that shared its firing's id.

Record ids are deterministic: ``<node>/<ts_ns>`` for a tick and ``<node>/<ts_ns>/<rule>/<state>``
for an alert (a rule can fire and resolve at the same tick time).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import orjson

from kvguard.contracts.tick import Tick
from kvguard.streams.alerts import Alert, alert_record
from kvguard.streams.metrics import tick_record
from kvguard.wire.schemas import Alert as AlertModel
from kvguard.wire.schemas import MetricTick, make_headers

SOURCE = "kvguard-streams"


@dataclass(frozen=True, slots=True)
class OutputRecord:
    """One record for the topic of ``kind`` ("metrics" or "alerts"), keyed by its node."""

    kind: str
    key: str
    value: bytes
    headers: list[tuple[str, bytes]]


def encode_tick(tick: Tick) -> bytes:
    """A ``kvguard.metrics`` record: validated against ``MetricTick``, every Tick field kept."""
    record = tick_record(tick)
    MetricTick.model_validate(record)
    return orjson.dumps(record)


def encode_alert(alert: Alert) -> bytes:
    """A ``kvguard.alerts`` record: validated against the wire ``Alert``, every Alert field kept."""
    record = alert_record(alert)
    AlertModel.model_validate(record)
    return orjson.dumps(record)


def tick_record_id(tick: Tick) -> str:
    return f"{tick.node}/{tick.ts_ns}"


def alert_record_id(alert: Alert) -> str:
    return f"{alert.node}/{alert.ts_ns}/{alert.rule}/{alert.state}"


def output_records(ticks: Iterable[Tick], alerts: Iterable[Alert]) -> list[OutputRecord]:
    """The records of one core call, ticks first, each in the order the core produced it."""
    out = [OutputRecord("metrics", t.node, encode_tick(t), make_headers("metrics", SOURCE, record_id=tick_record_id(t)))
           for t in ticks]
    out += [OutputRecord("alerts", a.node, encode_alert(a), make_headers("alerts", SOURCE, record_id=alert_record_id(a)))
            for a in alerts]
    return out
