"""A dependency that is wrong at start stops the service there, in one line (issue 28, items 6 and 10):
the real processes against a real broker (Tansu) and a real redis-server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from kvguard.bus.kafka import KafkaBus
from kvguard.config.settings import Settings
from kvguard.contracts.units import NS_PER_S
from kvguard.testing.rigs.net import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SECRET = "fail-fast-test-secret-0f3a9c2e7b14d8a6"
NODE = "ff-0/gpu0"


def kvguard(*args: str, env: dict[str, str] | None = None, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from kvguard.cli import main; main()", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout_s,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})))


def config_file(settings: Settings, tmp_path: Path) -> str:
    path = tmp_path / "settings.json"
    path.write_text(settings.model_copy(update={"policy": settings.policy.model_copy(
        update={"hmac_secret": SECRET})}).model_dump_json())
    return str(path)


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_a_redis_url_of_another_scheme_is_refused_naming_the_option(kafka_settings, tmp_path):
    result = kvguard("policy", "--config", config_file(kafka_settings, tmp_path), "--redis", "http://x",
                     "--max-seconds", "5")
    assert result.returncode == 2, result.stderr
    line = one_line_error(result)
    assert "--redis" in line and "redis://" in line


def test_a_policy_whose_redis_does_not_answer_stops_at_start(kafka_settings, tmp_path):
    result = kvguard("policy", "--config", config_file(kafka_settings, tmp_path),
                     "--redis", f"redis://:pw@127.0.0.1:{free_port()}/0", "--max-seconds", "5")
    assert result.returncode == 1, result.stderr
    line = one_line_error(result)
    assert "--redis" in line and "unreachable" in line and ":pw@" not in line


def hot_tick(ts_s: int) -> bytes:
    """A tick with F_ext over the budget's threshold: the policy debits the budget for it."""
    return orjson.dumps({"schema": "1.0", "node": NODE, "ts_ns": ts_s * NS_PER_S, "tick_s": 10.0, "u_kv": 0.5,
                         "f_ext": 0.9, "f_int": 0.0, "psi": 0.5, "free_units": 400, "largest_free_run_units": 40})


async def test_a_policy_that_lost_buffered_ledger_writes_exits_non_zero_saying_how_many(kafka_settings, redis_server,
                                                                                        tmp_path):
    server = redis_server()
    log = tmp_path / "policy.log"
    policy = subprocess.Popen(
        [sys.executable, "-c", "from kvguard.cli import main; main()", "policy", "--config",
         config_file(kafka_settings, tmp_path), "--redis", server.url, "--max-seconds", "15", "--json"],
        stdout=subprocess.PIPE, stderr=open(log, "wb"), stdin=subprocess.DEVNULL, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)), start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while "kvguard policy:" not in log.read_text(errors="replace"):
            assert policy.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.1)
        server.stop()  # Redis goes away under the running policy
        bus = KafkaBus(kafka_settings)
        await bus.start()
        try:
            for ts_s in range(10, 60, 10):
                await (await bus.publish(kafka_settings.topics.name("metrics"), NODE, hot_tick(ts_s)))
        finally:
            await bus.stop()
        out, _ = policy.communicate(timeout=60)
    finally:
        if policy.poll() is None:
            os.killpg(policy.pid, signal.SIGKILL)
            policy.wait(10)
    stderr = log.read_text(errors="replace")
    counters = json.loads(out.strip().splitlines()[-1])
    assert counters["ticks"] == 5 and counters["ledger"]["budget"]["buffered"] == 5, counters
    assert policy.returncode == 1, stderr
    assert "5 budget debit(s) and 0 SLO record(s) were never written to Redis" in stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize("command, section", [
    (("policy", "--max-seconds", "5"), "producer_options"),
    (("worker", "--no-create-topics"), "consumer_options"),
    (("export", "--listen", "127.0.0.1:0", "--max-seconds", "5"), "consumer_options"),
    (("node", "--no-actuator", "--duration", "20s", "--speed", "100"), "producer_options"),
])
def test_an_unknown_pass_through_kafka_option_is_refused_naming_the_key(kafka_settings, tmp_path, command, section):
    env = {f"KVGUARD_KAFKA__{section.upper()}": json.dumps({"linger_msec": 5})}
    result = kvguard(command[0], "--config", config_file(kafka_settings, tmp_path), *command[1:], env=env)
    assert result.returncode == 2, result.stderr
    assert f"kafka.{section}.linger_msec" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("command", [
    ("policy", "--bus", "kafka://127.0.0.1:{port}", "--max-seconds", "5"),
    ("worker", "--no-create-topics", "--bootstrap", "127.0.0.1:{port}"),
])
def test_an_unreachable_broker_is_one_line_not_a_traceback(tmp_path, command):
    port = free_port()
    result = kvguard(command[0], "--config", config_file(Settings(), tmp_path),
                     *(arg.format(port=port) for arg in command[1:]))
    assert result.returncode == 1, result.stderr
    line = one_line_error(result)
    assert f"no Kafka broker answers at 127.0.0.1:{port}" in line
