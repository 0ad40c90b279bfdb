"""A newcomer's first commands: one-line errors with the next step, help that renders literally,
a bad --workload that lists the valid names."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvguard.cli import app
from kvguard.producers.sim.workloads import SCENARIOS, TRACE_ALIASES, WorkloadError, load_workload

CLI = [sys.executable, "-c", "from kvguard.cli import main; main()"]
SECRET = secrets.token_hex(32)  # what a node needs to start its actuator


def closed_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60, check=False,
                          env={**os.environ, "KVGUARD_CONFIG": "", **env})


@pytest.mark.parametrize("command", [
    ["export", "--max-seconds", "5", "--listen", "127.0.0.1:0"],
    ["node", "--duration", "10s"],
])
def test_an_unreachable_broker_is_one_line_that_says_what_to_do(command):
    bootstrap = f"127.0.0.1:{closed_port()}"
    done = run(*command, "--bus", f"kafka://{bootstrap}", KVGUARD_POLICY__HMAC_SECRET=SECRET)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and len(errors) == 1, done.stderr
    assert f"no Kafka broker answers at {bootstrap}" in errors[0]
    assert "--bus kafka://HOST:PORT" in errors[0] and "KVGUARD_KAFKA__BOOTSTRAP" in errors[0]


@pytest.mark.parametrize("command", [["budget", "status", "--help"], ["slo", "report", "--help"]])
def test_help_shows_the_redis_table_literally(command):
    result = CliRunner().invoke(app, command, env={"COLUMNS": "400"})
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert "the [redis] table of $KVGUARD_CONFIG" in text
    assert "redis://[:password@]host:port/db" in text


def test_a_bad_workload_lists_the_valid_names():
    with pytest.raises(WorkloadError) as caught:
        load_workload("no-such-workload")
    message = str(caught.value)
    assert all(name in message for name in (*SCENARIOS, *TRACE_ALIASES)), message
    assert "no-such-workload" in message and "trace file" in message


def test_node_reports_a_bad_workload_in_one_line():
    done = run("node", "--workload", "no-such-workload", "--duration", "10s", "--bus", "inproc://",
               KVGUARD_POLICY__HMAC_SECRET=SECRET)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "error: --workload no-such-workload" in done.stderr and "mixed" in done.stderr


def test_export_refuses_two_paging_paths_and_an_unknown_one():
    both = CliRunner().invoke(app, ["export", "--paging", "prometheus", "--alertmanager", "http://127.0.0.1:9"])
    assert both.exit_code == 2 and "page each alert twice" in both.output
    unknown = CliRunner().invoke(app, ["export", "--paging", "pager"])
    assert unknown.exit_code == 2 and "expected one of forwarder, prometheus" in unknown.output
