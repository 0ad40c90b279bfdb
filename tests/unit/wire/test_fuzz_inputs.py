"""Fuzzing every decoder and handler (issue 15): random bytes, valid envelopes with random contents,
extreme numbers. Each input ends as a ``DecodeError`` / ``EventLogError`` (the DLQ's reasons) or is
accepted and handled; no other exception escapes, and nothing stalls (hypothesis' deadline)."""

from __future__ import annotations

import asyncio
import gzip
import json

import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvguard.contracts.events import COLUMNS, EventBatch, EventKind
from kvguard.wire.schemas import KINDS, DecodeError, decode
from tests.unit.actuators.test_actuator import NODE, SECRET
from tests.unit.actuators.test_executor import running_engine
from tests.unit.streams.test_stream_hostile import two_node_stream

FUZZ = settings(max_examples=60, deadline=3000, suppress_health_check=[HealthCheck.too_slow])

# numbers a hostile or broken producer may send: huge, negative, beyond 64 bits, non-finite
any_int = st.one_of(st.integers(-3, 300), st.integers(-(2**63), 2**63 - 1), st.integers(2**63, 2**80),
                    st.sampled_from([0, 1, 2**62, 2**63 - 1, -(2**63)]))
finite_float = st.one_of(st.floats(allow_nan=False, allow_infinity=False),
                         st.sampled_from([1e308, -1e308, 1.7e308, 5e-324, 0.0, 1.0, 1.0000001, 1e15, 1e16]))
any_float = st.one_of(finite_float, st.floats(allow_nan=True, allow_infinity=True))
any_number = st.one_of(any_int, any_float)
json_leaf = st.one_of(st.none(), st.booleans(), any_number, st.text(max_size=8))
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=6), inner, max_size=4), max_leaves=12)


def dumps(obj) -> bytes:
    return json.dumps(obj).encode()  # the stdlib writes big ints and NaN/Infinity, as a broken producer might


def decoded_or_refused(kind: str, raw: bytes):
    try:
        return decode(kind, raw)
    except DecodeError as err:
        assert err.reason in DecodeError.REASONS
        return None


# ---- random bytes and random JSON on every record kind --------------------------------------------


@FUZZ
@given(kind=st.sampled_from(KINDS), raw=st.binary(max_size=300))
def test_random_bytes_on_any_topic_are_refused_or_accepted(kind, raw):
    decoded_or_refused(kind, raw)


@FUZZ
@given(kind=st.sampled_from(KINDS), body=st.dictionaries(st.text(max_size=12), json_value, max_size=8))
def test_random_json_objects_on_any_topic_are_refused_or_accepted(kind, body):
    decoded_or_refused(kind, dumps({"schema": "1.0", **body}))


# ---- event batches: valid envelopes with random contents, through the stream core -----------------

KNOWN_KINDS = [int(k) for k in EventKind]


@st.composite
def event_envelopes(draw):
    n = draw(st.integers(0, 12))
    # mostly contents the schema accepts (so they reach the core), now and then anything at all
    extreme = draw(st.integers(0, 3)) == 0
    small = st.integers(-2, 140)  # around the region of the node below (D = 128)
    number = st.one_of(small, any_int) if extreme else small
    column = {"kind": st.one_of(st.sampled_from(KNOWN_KINDS), st.integers(0, 255)),
              "cls": st.integers(0, 3), "flags": st.integers(0, 3)}
    cols = {}
    for name in COLUMNS:
        cols[name] = draw(st.lists(column.get(name, number), min_size=n, max_size=n))
    times = st.one_of(st.integers(0, 10**12), any_int) if extreme else st.integers(0, 10**12)
    cols["ts_ns"] = sorted(draw(st.lists(times, min_size=n, max_size=n)), key=lambda x: (abs(x) > 2**62, x))
    record = {"schema": "1.0", "node": "n", "epoch": draw(st.one_of(st.just(0), any_int)),
              "seq": draw(st.one_of(st.integers(1, 6), any_int)), "cols": cols}
    if draw(st.booleans()):
        record["geometry"] = {"total_bytes": draw(st.one_of(st.just(10**9), any_int)), "weights_bytes": 0,
                              "context_bytes": 0, "gpu_memory_utilization": draw(st.one_of(st.just(0.9), any_float)),
                              "unit_tokens": 4, "kv_bytes_per_token": 1024,
                              "dynamic_units": draw(st.one_of(st.just(128), any_int)),
                              "page_classes": draw(st.lists(st.one_of(st.sampled_from([1, 16]), any_int),
                                                            min_size=1, max_size=3))}
    if draw(st.booleans()):
        rows = draw(st.integers(0, 3))
        record["state"] = {name: draw(st.lists(number, min_size=rows, max_size=rows))
                           for name in ("offset", "size", "state", "cls", "tokens")}
        record["state"]["refs"] = [draw(st.lists(small, max_size=3)) for _ in range(rows)]
    return record


def warmed_core():
    from kvguard.streams.core import StreamCore

    core = StreamCore()
    first = next(b for b in two_node_stream() if b.node == "a")
    core.process_many([EventBatch(node="n", seq=0, events=first.events, geometry=first.geometry)])
    return core


@FUZZ
@given(records=st.lists(event_envelopes(), min_size=1, max_size=4))
def test_event_batches_with_random_contents_are_refused_rejected_or_applied(records):
    core = warmed_core()
    for record in records:
        model = decoded_or_refused("events", dumps(record))
        if model is None:
            continue
        batch = model.to_batch()
        core.process_many([batch])  # applied, or listed in core.rejected: never raises
        assert all(r.reason in ("invalid", "processing_error") for r in getattr(core, "rejected", []))
    core.flush(10**13)


# ---- the policy: ticks with extreme numbers ------------------------------------------------------

TICK_FLOATS = ["u_kv", "f_ext", "f_int", "psi", "slope_per_min", "p_oom", "tokens_per_s", "alloc_fail_per_s",
               "pages_per_request_p99", "s_since_oom", "util_free"]
TICK_INTS = ["ts_ns", "epoch", "free_units", "largest_free_run_units", "dynamic_units", "ooms", "live_units",
             "requests_waiting"]


@st.composite
def tick_envelopes(draw):
    record = {"schema": "1.0", "node": draw(st.sampled_from(["n", "m"])), "ts_ns": 10**10, "u_kv": 0.5, "f_ext": 0.1,
              "f_int": 0.0, "psi": 0.6, "tick_s": 10.0}
    for name in draw(st.lists(st.sampled_from(TICK_FLOATS), max_size=4)):
        record[name] = draw(st.one_of(finite_float, st.floats(0, 1), any_float))
    for name in draw(st.lists(st.sampled_from(TICK_INTS), max_size=4)):
        record[name] = draw(st.one_of(any_int, st.integers(0, 5000)))
    if draw(st.booleans()):
        record["u_kv_forecast"] = draw(st.lists(st.one_of(finite_float, st.floats(0, 1)), max_size=4))
    if draw(st.booleans()):
        record["candidates"] = [{"req": draw(any_int), "priority": draw(st.one_of(st.integers(0, 10), any_int)),
                                 "units": draw(st.one_of(st.integers(0, 500), any_int)),
                                 "prompt_tokens": draw(st.one_of(st.integers(0, 9000), any_int)),
                                 "tokens": draw(st.one_of(st.integers(0, 9000), any_int))}
                                for _ in range(draw(st.integers(0, 3)))]
    return record


@FUZZ
@given(records=st.lists(tick_envelopes(), min_size=1, max_size=5))
@example(records=[{"schema": "1.0", "node": "n", "ts_ns": 10**10, "u_kv": 1e308, "f_ext": 0.1, "f_int": 0.0,
                   "psi": 0.6, "tick_s": 10.0}])  # the planner's OverflowError of issue 15
def test_ticks_with_extreme_numbers_are_refused_or_decided(records):
    from kvguard.config.settings import Settings
    from kvguard.policy.engine import EngineConfig, PolicyEngine
    from kvguard.policy.service import PolicyService

    service = PolicyService(PolicyEngine(EngineConfig(dynamic_units=1000, unit_tokens=4), b"k" * 32), Settings())
    for record in records:
        model = decoded_or_refused("metrics", dumps(record))
        if model is not None:
            service.handle_tick(model.to_tick())  # decided (or skipped as stale), never raises


# ---- the actuator: signed commands with random contents ------------------------------------------


def _counts(draw):
    return draw(st.one_of(st.integers(0, 64), st.integers(-3, -1), any_int))


# each action's payload fields, drawn in and out of their bounds (and now and then a field it lacks)
PAYLOAD_FIELDS = {
    "evict": lambda draw: {"targets": draw(st.lists(st.lists(st.one_of(st.integers(-2, 8), any_int), min_size=2,
                                                             max_size=2), max_size=4)),
                           "granularity": draw(st.sampled_from(["request", "block", "token", "page"])),
                           "handling": draw(st.sampled_from(["recompute", "swap", "checkpoint", "retain"]))},
    "abort": lambda draw: {"requests": draw(st.lists(st.one_of(st.integers(-2, 8), any_int), max_size=4))},
    "compact": lambda draw: {"max_moves": _counts(draw)},
    "reclaim": lambda draw: {"units": _counts(draw)},
    "headroom": lambda draw: {"units": _counts(draw)},
    "batch_cap": lambda draw: {"tokens": _counts(draw), "steps": _counts(draw)},
    "hold": lambda draw: {"max_prompt_tokens": _counts(draw), "steps": _counts(draw)},
    "release": lambda draw: {},
    "empty_cache": lambda draw: {},
    "explode": lambda draw: {"x": _counts(draw)},
}


@st.composite
def command_envelopes(draw):
    action = draw(st.sampled_from(sorted(PAYLOAD_FIELDS)))
    payload = PAYLOAD_FIELDS[action](draw)
    if draw(st.integers(0, 9)) == 0:
        payload["units_needed"] = _counts(draw)  # a field no payload has
    record = {"schema": draw(st.sampled_from(["2.0", "2.0", "2.0", "1.0"])), "id": draw(st.text(min_size=1, max_size=6)),
              "node": NODE, "action": action, "payload": payload,
              "mode": draw(st.sampled_from(["default", "emergency"])),
              "issued_at_ns": draw(st.one_of(st.integers(0, 2 * 10**10), any_int)),
              "ttl_ns": draw(st.one_of(st.integers(0, 10**11), any_int)), "epoch": draw(st.one_of(st.just(0), any_int))}
    if draw(st.integers(0, 9)) == 0:
        del record["payload"]  # a flat record's shape
    return record


@FUZZ
@given(records=st.lists(command_envelopes(), min_size=1, max_size=4), signed=st.booleans())
def test_commands_with_random_contents_are_refused_or_acked(records, signed):
    from dataclasses import replace

    from kvguard.actuators.actuator import Actuator
    from kvguard.actuators.executor import Executor
    from kvguard.contracts.commands import Ack, Command, CommandError, sign

    engine = running_engine()
    actuator = Actuator(NODE, Executor(engine), SECRET)
    for record in records:
        model = decoded_or_refused("commands", dumps(record))
        if model is None:
            continue
        try:
            command = Command.from_dict(model.model_dump())
        except CommandError:
            continue  # dead-lettered as invalid by run_actuators
        if signed:
            command = sign(replace(command, signature=""), SECRET)
        assert isinstance(actuator.handle(command, engine.now_ns), Ack)


# ---- the services end to end over the in-process bus: every record is accounted for ----------


@settings(max_examples=15, deadline=10_000, suppress_health_check=[HealthCheck.too_slow])
@given(records=st.lists(st.one_of(event_envelopes().map(dumps), st.binary(max_size=60)), min_size=1, max_size=6))
def test_the_stream_service_accounts_for_every_record(records):
    from kvguard.bus.inproc import InprocBus
    from kvguard.config.settings import Settings
    from kvguard.runtime.mapping import stream_config
    from kvguard.streams.embedded import StreamsService

    async def run():
        settings = Settings()
        bus = InprocBus.from_settings(settings)
        service = StreamsService(bus, settings, config=stream_config(settings))
        for value in records:
            await bus.publish(settings.topics.name("events"), "n", value)
        await asyncio.wait_for(service.run(idle_timeout_s=0.2), timeout=8)
        c = service.decoder.counters
        assert c.received == len(records) == c.decoded + sum(c.dead_lettered.values()) - service.counters.rejected
        assert await bus.subscribe([settings.topics.name("events")], service.group).getmany(timeout_s=0) == []

    asyncio.run(run())


# ---- event logs ----------------------------------------------------------------------------------


@FUZZ
@given(lines=st.lists(st.one_of(event_envelopes().map(lambda r: {**r, "type": "batch"}),
                                st.dictionaries(st.text(max_size=5), json_value, max_size=4)), max_size=4),
       garbage=st.binary(max_size=40))
@example(lines=[], garbage=b"\xc2")  # a torn UTF-8 sequence at the end: UnicodeDecodeError before
def test_event_logs_with_random_lines_read_or_fail_with_the_line(tmp_path_factory, lines, garbage):
    from kvguard.wire.eventlog import EventLogError, read_event_log

    path = tmp_path_factory.mktemp("fuzz") / "log.jsonl.gz"
    body = [json.dumps({"type": "header", "schema": "1.0", "meta": {}})] + [json.dumps(x) for x in lines]
    with gzip.open(path, "wb") as fh:
        fh.write(("\n".join(body) + "\n").encode() + garbage)
    try:
        _, batches = read_event_log(path)
        for batch in batches:
            assert batch.events.dtype.names == COLUMNS and np.all(batch.events["ts_ns"] >= 0)
    except EventLogError as err:
        assert err.line_no >= 1


@FUZZ
@given(raw=st.binary(max_size=200))
def test_random_files_are_not_event_logs(tmp_path_factory, raw):
    from kvguard.wire.eventlog import EventLogError, read_event_log

    path = tmp_path_factory.mktemp("fuzz") / "random.gz"
    path.write_bytes(raw)
    try:
        _, batches = read_event_log(path)
        list(batches)
    except EventLogError:
        pass
