"""`kvguard command`: an operator's signed command reaches a node's actuator the policy's way and is
acked (issue 12's knobs by hand: drain a node, hold long prompts, release, abort). The node is vLLM's
real v1 scheduler with the kvguard plugin attached; its ticks come from the stream core over the
plugin's own events."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from typer.testing import CliRunner

from kvguard.bus.inproc import InprocBus
from kvguard.cli.app import app
from kvguard.config.settings import Settings
from kvguard.contracts.commands import AckOutcome, Action
from kvguard.runtime.operator import NodeClock, OperatorError, node_clock, operator_command, send_and_wait
from kvguard.runtime.plugins import start_for
from kvguard.streams.core import StreamConfig, StreamCore
from kvguard.streams.outputs import output_records
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
        drain = operator_command(rig.plugin.node, Action.HOLD, clock, SECRET.encode(), reason="node cordoned")
        pending = asyncio.run_coroutine_threadsafe(send_and_wait(bus, settings, drain), consumer._loop)
        step_until(rig, pending.done)
        ack = pending.result(1)
        assert ack is not None and ack.outcome is AckOutcome.EXECUTED and ack.variant == "operator"
        rig.add("new", 100, max_tokens=4)
        for _ in range(5):
            rig.step()
        assert "new" in {r.request_id for r in rig.sched.waiting}  # drained: nothing admitted
        release = operator_command(rig.plugin.node, Action.RELEASE, clock, SECRET.encode())
        pending = asyncio.run_coroutine_threadsafe(send_and_wait(bus, settings, release), consumer._loop)
        step_until(rig, pending.done)
        assert pending.result(1).outcome is AckOutcome.EXECUTED
        step_until(rig, lambda: "new" not in {r.request_id for r in rig.sched.waiting}, 5)
        assert "new" not in {r.request_id for r in rig.sched.waiting}
        # a command of another run of the node is refused, as the policy's would be
        stale = operator_command(rig.plugin.node, Action.HOLD, NodeClock(clock.node, clock.epoch - 1, clock.ts_ns),
                                 SECRET.encode())
        pending = asyncio.run_coroutine_threadsafe(send_and_wait(bus, settings, stale, wait_s=5), consumer._loop)
        step_until(rig, pending.done)
        assert pending.result(1).outcome is AckOutcome.REJECTED_EPOCH
    finally:
        consumer.stop()


def test_an_abort_needs_its_requests_and_unknown_nodes_are_a_clear_error(kafka_settings, tmp_path):
    with pytest.raises(OperatorError, match="--req"):
        operator_command("n/gpu0", Action.ABORT, NodeClock("n/gpu0", 1, 1), b"k" * 32)
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
        assert out["ack"]["outcome"] == "executed" and out["command"]["targets"] == [victim]
        assert out["command"]["id"].startswith(f"operator/{rig.plugin.node}/abort/")
        for _ in range(3):
            rig.step()
        assert "victim" not in rig.sched.requests
    finally:
        consumer.stop()
