"""`kvguard command`: an operator's signed command reaches a node's actuator the policy's way and is
acked (issue 12's knobs by hand: drain a node, hold long prompts, release, abort). The node is vLLM's
real v1 scheduler with the kvguard plugin attached; its ticks come from the stream core over the
plugin's own events."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import threading
import time
import uuid

import pytest
from typer.testing import CliRunner

from kvguard.bus.inproc import InprocBus
from kvguard.cli.app import app
from kvguard.config.settings import Settings
from kvguard.contracts.commands import AckOutcome, HeadroomPayload, HoldPayload, ReleasePayload
from kvguard.runtime.operator import (
    NodeClock,
    OperatorArgs,
    OperatorError,
    node_clock,
    operator_command,
    operator_payload,
    send_and_wait,
)
from kvguard.runtime.plugins import start_for
from kvguard.streams.core import StreamConfig, StreamCore
from kvguard.streams.outputs import output_records
from kvguard.wire.schemas import make_headers
from tests.conftest import fast_group_options
from tests.integration.test_vllm_plugin import Rig

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

SECRET = "9316105542c67d564fc4917482b8e69304928fda9f8d1c0f58bdb31371335442"


def publish_ticks(rig: Rig, bus, settings, core: StreamCore, loop) -> None:
    """The node's ticks on the metrics topic, as the stream worker would publish them."""
    ticks, alerts = core.process_many(rig.history)
    rig.history.clear()
    ticks += core.flush(rig.clock[0] + 20 * 10**9)[0]
    for record in output_records(ticks, alerts):
        asyncio.run_coroutine_threadsafe(
            bus.publish(settings.topics.name(record.kind), record.key, record.value, record.headers), loop).result(5)


def wall_clock_rig() -> Rig:
    """The rig with its plugin on wall-clock event time, as in vLLM (the actuator reads time.time_ns())."""
    rig = Rig(600)
    rig.clock[0] = time.time_ns()
    return rig


def started(rig: Rig, settings, bus=None):
    consumer = start_for(rig.plugin, settings=settings, bus=bus)
    deadline = time.monotonic() + 20
    while consumer._loop is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return consumer


def step_until(rig: Rig, done, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        rig.step()
        time.sleep(0.01)


def test_a_drain_from_the_operator_holds_every_admission_and_release_ends_it():
    settings = Settings.from_dict({"policy": {"hmac_secret": SECRET}, "node": {"journal_dir": None}})
    bus = InprocBus.from_settings(settings)
    rig = wall_clock_rig()
    rig.add("running", 200, max_tokens=300)
    for _ in range(3):
        rig.step()
    consumer = started(rig, settings, bus)
    try:
        publish_ticks(rig, bus, settings, StreamCore(StreamConfig(tick_s=1.0)), consumer._loop)
        clock = asyncio.run_coroutine_threadsafe(node_clock(bus, settings, rig.plugin.node, idle_timeout_s=0.5),
                                                 consumer._loop).result(10)
        assert clock is not None and clock.epoch == rig.plugin.translator.epoch and clock.ts_ns > 0
        drain = operator_command(rig.plugin.node, operator_payload("drain", OperatorArgs()), clock, SECRET.encode(),
                                 reason="node cordoned")
        pending = asyncio.run_coroutine_threadsafe(send_and_wait(bus, settings, drain), consumer._loop)
        step_until(rig, pending.done)
        ack = pending.result(1)
        assert ack is not None and ack.outcome is AckOutcome.EXECUTED and ack.variant == "operator"
        rig.add("new", 100, max_tokens=4)
        for _ in range(5):
            rig.step()
        assert "new" in {r.request_id for r in rig.sched.waiting}  # drained: nothing admitted
        release = operator_command(rig.plugin.node, ReleasePayload(), clock, SECRET.encode())
        pending = asyncio.run_coroutine_threadsafe(send_and_wait(bus, settings, release), consumer._loop)
        step_until(rig, pending.done)
        assert pending.result(1).outcome is AckOutcome.EXECUTED
        step_until(rig, lambda: "new" not in {r.request_id for r in rig.sched.waiting}, 5)
        assert "new" not in {r.request_id for r in rig.sched.waiting}
        # a command of another run of the node is refused, as the policy's would be
        stale = operator_command(rig.plugin.node, HoldPayload(), NodeClock(clock.node, clock.epoch - 1, clock.ts_ns),
                                 SECRET.encode())
        pending = asyncio.run_coroutine_threadsafe(send_and_wait(bus, settings, stale, wait_s=5), consumer._loop)
        step_until(rig, pending.done)
        assert pending.result(1).outcome is AckOutcome.REJECTED_EPOCH
    finally:
        consumer.stop()


def test_an_abort_needs_its_requests_and_unknown_nodes_are_a_clear_error(kafka_settings, tmp_path):
    with pytest.raises(OperatorError, match="--req"):
        operator_payload("abort", OperatorArgs())
    config = tmp_path / "kvguard.json"
    config.write_text(json.dumps({"policy": {"hmac_secret": SECRET},
                                  "kafka": {"bootstrap": kafka_settings.kafka.bootstrap, **fast_group_options()},
                                  "topics": {"prefix": kafka_settings.topics.prefix}}))
    result = CliRunner().invoke(app, ["command", "drain", "--node", "nowhere/gpu0", "--config", str(config)])
    assert result.exit_code == 2 and "no tick of node 'nowhere/gpu0'" in result.output
    weak = tmp_path / "weak.json"
    weak.write_text(json.dumps({"policy": {"hmac_secret": "changeme"}}))
    result = CliRunner().invoke(app, ["command", "drain", "--node", "x/gpu0", "--config", str(weak)])
    assert result.exit_code == 2 and "policy.hmac_secret" in result.output


def test_kvguard_command_over_kafka_aborts_a_request_on_vllm_and_prints_the_ack(kafka_settings, tmp_path):
    settings = kafka_settings.model_copy(update={"policy": kafka_settings.policy.model_copy(
        update={"hmac_secret": SECRET}), "node": kafka_settings.node.model_copy(update={"journal_dir": None})})
    rig = wall_clock_rig()
    rig.add("victim", 300, max_tokens=400)
    rig.step()
    consumer = started(rig, settings)
    config = tmp_path / "kvguard.json"
    config.write_text(json.dumps({"policy": {"hmac_secret": SECRET},
                                  "kafka": {"bootstrap": settings.kafka.bootstrap, **fast_group_options()},
                                  "topics": {"prefix": settings.topics.prefix}}))
    victim = rig.plugin.translator.req("victim")
    box = {}

    def run_cli():
        box["result"] = CliRunner().invoke(app, [
            "command", "abort", "--node", rig.plugin.node, "--req", str(victim), "--reason", "runaway request",
            "--epoch", str(rig.plugin.translator.epoch), "--at-ns", str(rig.clock[0]), "--wait", "30s",
            "--config", str(config), "--json"])

    try:
        cli = threading.Thread(target=run_cli)
        cli.start()
        step_until(rig, lambda: not cli.is_alive(), 60)
        cli.join(5)
        result = box["result"]
        assert result.exit_code == 0, result.output
        out = json.loads(result.stdout.strip().splitlines()[-1])
        assert out["ack"]["outcome"] == "executed" and out["command"]["payload"] == {"requests": [victim]}
        assert out["command"]["id"].startswith(f"operator/{rig.plugin.node}/abort/")
        for _ in range(3):
            rig.step()
        assert "victim" not in rig.sched.requests
    finally:
        consumer.stop()


def signed_record(node: str, epoch: int, at_ns: int, action: str, payload: dict) -> bytes:
    """A command record signed with the shared secret: what any holder of the secret (or a buggy policy)
    could publish, whatever its numbers."""
    d = {"schema": "2.0", "id": f"absurd/{action}/{len(str(payload))}", "node": node, "action": action,
         "payload": payload, "reason": "probe", "mode": "default", "variant": "probe", "issued_at_ns": at_ns,
         "ttl_ns": 60 * 10**9, "epoch": epoch}
    digest = hmac.new(SECRET.encode(), json.dumps(d, sort_keys=True, separators=(",", ":")).encode(), hashlib.sha256)
    return json.dumps(d | {"signature": digest.hexdigest()}).encode()


# issue 28 item 5: each of these was executed as something else (a stop of every admission, a drain, a release)
ABSURD = (("headroom", {"units": 2**63 - 1}, "payload.units"),
          ("hold", {"max_prompt_tokens": -1, "steps": -1}, "payload.max_prompt_tokens"),
          ("batch_cap", {"tokens": -5, "steps": 0}, "payload.tokens"))


def test_validly_signed_absurd_commands_over_kafka_are_refused_with_the_reason_and_change_nothing(kafka_settings):
    from kvguard.bus.kafka import KafkaBus
    from kvguard.wire.schemas import DlqRecord

    settings = kafka_settings.model_copy(update={"policy": kafka_settings.policy.model_copy(
        update={"hmac_secret": SECRET}), "node": kafka_settings.node.model_copy(update={"journal_dir": None})})
    rig = wall_clock_rig()
    rig.add("running", 200, max_tokens=400)
    rig.step()
    consumer = started(rig, settings)
    node, epoch, pool = rig.plugin.node, rig.plugin.translator.epoch, rig.plugin.executor_engine.pool_units
    clock = NodeClock(node, epoch, rig.clock[0])
    over_pool = operator_command(node, HeadroomPayload(units=pool + 1), clock, SECRET.encode(), reason="probe")

    async def probe():
        bus = KafkaBus(settings)
        await bus.start()
        try:
            for action, payload, _ in ABSURD:
                await (await bus.publish(settings.topics.name("commands"), node,
                                         signed_record(node, epoch, clock.ts_ns, action, payload),
                                         make_headers("commands", node)))
            ack = await send_and_wait(bus, settings, over_pool, wait_s=30)
            dlq = bus.subscribe([settings.topics.name("dlq")], f"dlq-reader-{uuid.uuid4().hex[:6]}")
            dead, deadline = [], time.monotonic() + 30
            while len(dead) < len(ABSURD) and time.monotonic() < deadline:
                dead += [DlqRecord.model_validate_json(r.value) for r in await dlq.getmany(100, 0.5)]
            await dlq.close()
            return ack, dead
        finally:
            await bus.stop()

    try:
        result = {}
        prober = threading.Thread(target=lambda: result.update(zip(("ack", "dead"), asyncio.run(probe()))))
        prober.start()
        step_until(rig, lambda: not prober.is_alive(), 90)
        prober.join(5)
        ack, dead = result["ack"], result["dead"]
        # a well-formed command beyond this node's pool: acked rejected with the reason, never journaled
        assert ack is not None and ack.outcome is AckOutcome.REJECTED_PAYLOAD
        assert f"exceeds this node's pool of {pool} units" in ack.errors[0]
        # absurd numbers are not a command at all: dead-lettered with the field named
        assert sorted(d.reason for d in dead) == ["invalid"] * len(ABSURD)
        for (_action, _payload, field), record in zip(ABSURD, sorted(dead, key=lambda d: d.offset)):
            assert field in record.detail, record.detail
        counters = consumer.actuator.counters
        assert (counters.executed, counters.noop, counters.failed, counters.rejected_payload) == (0, 0, 0, 1)
        # nothing changed on the node: no hold, no cap, no headroom; a new request is admitted
        actions = rig.plugin.actions
        assert (actions.hold_cap, actions.batch_cap, actions.headroom_blocks) == (None, None, 0)
        rig.add("new", 100, max_tokens=4)
        step_until(rig, lambda: "new" not in rig.waiting_ids(), 5)
        assert "new" not in rig.waiting_ids()
    finally:
        consumer.stop()
