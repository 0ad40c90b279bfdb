"""SGLang's own KV-event publisher (0.5.23, ``EventPublisherFactory`` from a ``--kv-events-config``,
fed by its own paged radix cache; tests/integration/sglang_kv_publisher.py runs it in a subprocess) on
loopback ZMQ sockets → kvguard's subscriber and ``kvguard ingest sglang-kv-events``.

The frames are SGLang's real ones. A gap is made as in production: the subscriber's socket goes
away while SGLang keeps publishing (PUB drops them), then comes back; the jump in ``seq`` is filled
from SGLang's replay socket. Needs sglang and pyzmq (``make venv``); not skipped without them.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import kvguard.cli  # noqa: F401 - registers the commands
from kvguard.cli.app import app
from kvguard.producers.sglang.kv_events import KvEventsSubscriber, PrefixCacheState

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SglangPublisher:
    def __init__(self):
        self.port, self.replay_port = free_port(), free_port()
        config = json.dumps({"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{self.port}", "bind": True,
                             "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}", "topic": "kv",
                             "buffer_steps": 100})
        self.proc = subprocess.Popen([sys.executable, str(HERE / "sglang_kv_publisher.py"), config],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ready = json.loads(self._line())
        assert ready == {"ready": True}
        self.next_seq = 0

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"SGLang's publisher exited: {self.proc.stderr.read()[-3000:]}")
        return line

    def send(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        out = json.loads(self._line())
        self.next_seq = out["seq"] + 1
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="module")
def publisher():
    """One SGLang publisher for the module (SGLang takes seconds to import); each test starts from its
    next seq, with the radix tree empty (the first test ends by evicting everything)."""
    p = SglangPublisher()
    yield p
    p.close()


def drain(sub: KvEventsSubscriber, state: PrefixCacheState, want_seq: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (sub.expected is None or sub.expected <= want_seq) and time.monotonic() < deadline:
        for batch in sub.poll(100):
            state.apply(batch)


def test_sglangs_frames_decode_and_a_gap_is_filled_from_its_replay_socket(publisher):
    start = publisher.next_seq
    sub = KvEventsSubscriber(f"tcp://127.0.0.1:{publisher.port}", f"tcp://127.0.0.1:{publisher.replay_port}",
                             topic="kv", from_seq=start)
    time.sleep(0.5)  # the SUB joins before the first batch
    state = PrefixCacheState()
    try:
        first = publisher.send(insert=2)
        drain(sub, state, first["seq"])
        assert sub.expected == first["seq"] + 1 and state.stored_blocks == first["stored_pages"] == 5
        sub.disconnect()  # the socket goes away; SGLang keeps publishing
        publisher.send(insert=3)
        publisher.send(insert=1)
        sub.connect()
        time.sleep(0.5)
        last = publisher.send(evict=1000)
        drain(sub, state, last["seq"])
    finally:
        sub.close()
    c = sub.counters
    assert c.gaps == 1 and c.replayed == 2 and c.lost == 0 and c.undecodable == 0
    f = state.figures()
    assert f["stored_blocks"] == last["stored_pages"] == 1 + 2 * 6  # the shared first page once, two own per prompt
    assert f["removed_blocks"] == last["removed_pages"] and f["cached_blocks"].get("GPU", 0) == 0
    assert f["batches"] == last["seq"] + 1 - start


def test_kvguard_ingest_sglang_kv_events_prints_the_figures(publisher):
    result = {}
    start = str(publisher.next_seq)

    def run():
        result["r"] = CliRunner().invoke(app, ["ingest", "sglang-kv-events", "--endpoint",
                                               f"tcp://127.0.0.1:{publisher.port}", "--replay",
                                               f"tcp://127.0.0.1:{publisher.replay_port}", "--topic", "kv",
                                               "--from-seq", start, "--interval", "1s", "--duration", "4s", "--json"])

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(1.0)
    publisher.send(insert=2)
    publisher.send(insert=1)
    thread.join(30)
    r = result["r"]
    assert r.exit_code == 0, r.output
    final = [json.loads(x) for x in r.output.splitlines() if x.startswith("{")][-1]
    assert final["type"] == "kv_events_summary" and final["stored_blocks"] == 7 and final["cached_blocks"] == {"GPU": 7}
    assert final["gaps"] == 0 and final["lost"] == 0
