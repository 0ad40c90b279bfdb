"""vLLM's own KV-event publisher (``vllm.distributed.kv_events.ZmqEventPublisher``, 0.33) on loopback
ZMQ sockets → kvguard's subscriber (``producers.vllm.kv_events``) and ``kvguard ingest vllm-kv-events``.

The frames are vLLM's real ones (its publisher thread, its msgpack encoder, its ROUTER replay). A gap
is made the way it happens in production: the subscriber's socket goes away while the publisher
keeps sending (PUB drops what no subscriber takes), then comes back; the subscriber sees the jump
in ``seq`` and fills it from the replay socket. What the replay buffer no longer holds is counted
as lost. Needs vllm and pyzmq (``make venv``); not skipped without them.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from kvguard.producers.vllm.kv_events import KvBatch, KvEvent, KvEventsSubscriber, PrefixCacheState, decode_payload

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Publisher:
    """vLLM's ZmqEventPublisher, and every batch it was handed (seq = publish order, from 0)."""

    def __init__(self, buffer_steps: int = 1000, topic: str = "kv"):
        from vllm.distributed import kv_events as ke

        self.ke = ke
        self.port, self.replay_port = free_port(), free_port()
        self.pub = ke.ZmqEventPublisher(0, endpoint=f"tcp://*:{self.port}",
                                        replay_endpoint=f"tcp://*:{self.replay_port}", buffer_steps=buffer_steps,
                                        topic=topic)
        self.sent: list = []
        self.next_hash = 1

    def publish(self, n_stored: int = 2, remove_oldest: bool = False, clear: bool = False) -> int:
        ke = self.ke
        events = []
        for _ in range(n_stored):
            h = self.next_hash.to_bytes(32, "big")
            self.next_hash += 1
            events.append(ke.BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=list(range(16)),
                                         block_size=16, lora_id=None, medium="GPU", lora_name=None))
        if remove_oldest and self.next_hash > 3:
            events.append(ke.BlockRemoved(block_hashes=[(self.next_hash - 3).to_bytes(32, "big")], medium="GPU"))
        if clear:
            events.append(ke.AllBlocksCleared())
        self.pub.publish(ke.KVEventBatch(ts=time.time(), events=events))
        self.sent.append(events)
        return len(self.sent) - 1

    def wait_sent(self) -> None:
        """Until the publisher thread has sent (and buffered for replay) everything handed to it."""
        # by seq, not by buffer length: a small replay buffer is full long before the last batch is sent
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            buffered = self.pub._buffer
            if self.pub._event_queue.empty() and buffered and buffered[-1][0] >= len(self.sent) - 1:
                return
            time.sleep(0.01)
        raise AssertionError(f"vLLM's publisher thread did not send {len(self.sent)} batches within 5 s")

    def close(self) -> None:
        self.pub.shutdown()


def receive_until(sub: KvEventsSubscriber, pub: Publisher, wanted: int, timeout_s: float = 10.0) -> list:
    """Publish (through ZMQ's slow-joiner window) until a batch with seq >= ``wanted`` arrives."""
    got = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not got or got[-1].seq < wanted:
            pub.publish()
        got.extend(sub.poll(50))
        if got and got[-1].seq >= wanted:
            return got
    raise AssertionError(f"no batch with seq >= {wanted} within {timeout_s} s (got {[b.seq for b in got]})")


@pytest.fixture()
def publisher():
    pub = Publisher()
    yield pub
    pub.close()


def test_vllms_frames_decode_and_a_gap_is_filled_from_the_replay_socket(publisher):
    pub = publisher
    sub = KvEventsSubscriber(f"tcp://127.0.0.1:{pub.port}", f"tcp://127.0.0.1:{pub.replay_port}", topic="kv")
    try:
        got = receive_until(sub, pub, 0)
        first = got[0].seq  # the slow-joiner window dropped everything before it
        for _ in range(5):
            pub.publish(remove_oldest=True)
        got += receive_until(sub, pub, len(pub.sent) - 1)
        sub.disconnect()
        for _ in range(4):  # sent while nobody listens: PUB drops them
            pub.publish(remove_oldest=True)
        pub.wait_sent()
        sub.connect()
        got += receive_until(sub, pub, len(pub.sent) - 1)
    finally:
        sub.close()
    seqs = [b.seq for b in got]
    assert seqs == list(range(first, seqs[-1] + 1))  # in order, nothing missing, nothing twice
    assert sub.counters.gaps >= 1 and sub.counters.replayed >= 4 and sub.counters.lost == 0

    # every decoded batch is what vLLM was handed, and the prefix-cache state follows the events
    reference = PrefixCacheState()
    for batch in got:
        events = pub.sent[batch.seq]
        assert [e.kind for e in batch.events] == [type(e).__name__ for e in events]
        assert [list(e.block_hashes) for e in batch.events] == [getattr(e, "block_hashes", []) for e in events]
    state = PrefixCacheState()
    for batch in got:
        state.apply(batch)
    for seq in range(first, seqs[-1] + 1):
        reference.apply(KvBatch(seq, 0.0, tuple(
            KvEvent(type(e).__name__, tuple(getattr(e, "block_hashes", ())), len(getattr(e, "token_ids", ()) or ()),
                    getattr(e, "medium", None)) for e in pub.sent[seq])))
    assert state.figures()["cached_blocks"] == reference.figures()["cached_blocks"]
    assert state.figures()["removed_blocks"] > 0 and state.figures()["cached_tokens"]["GPU"] > 0


def test_what_the_replay_buffer_no_longer_holds_is_counted_as_lost():
    pub = Publisher(buffer_steps=2)
    sub = KvEventsSubscriber(f"tcp://127.0.0.1:{pub.port}", f"tcp://127.0.0.1:{pub.replay_port}", topic="kv")
    try:
        receive_until(sub, pub, 0)
        sub.disconnect()
        for _ in range(6):
            pub.publish()
        pub.wait_sent()
        sub.connect()
        receive_until(sub, pub, len(pub.sent) - 1)
    finally:
        sub.close()
        pub.close()
    assert sub.counters.gaps >= 1 and sub.counters.lost >= 4


def test_all_blocks_cleared_empties_the_prefix_cache_state():
    import msgspec
    from vllm.distributed import kv_events as ke

    payload = msgspec.msgpack.Encoder().encode(ke.KVEventBatch(ts=1.0, events=[
        ke.BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=list(range(32)), block_size=16,
                       lora_id=None, medium="GPU", lora_name=None),
        ke.BlockStored(block_hashes=[2], parent_block_hash=1, token_ids=list(range(16)), block_size=16,
                       lora_id=None, medium="GPU", lora_name=None)]))
    state = PrefixCacheState()
    state.apply(decode_payload(payload, 0))
    assert state.figures()["cached_blocks"] == {"GPU": 2} and state.reused_blocks == 1
    assert state.figures()["cached_tokens"] == {"GPU": 32}
    state.apply(decode_payload(msgspec.msgpack.Encoder().encode(ke.KVEventBatch(ts=2.0, events=[ke.AllBlocksCleared()])), 1))
    assert state.figures()["cached_blocks"] == {} and state.cleared == 1


def test_kvguard_ingest_vllm_kv_events_prints_the_figures(publisher):
    from typer.testing import CliRunner

    import kvguard.cli
    import kvguard.cli.ingest  # noqa: F401 - until kvguard/cli/__init__.py imports it
    from kvguard.cli.app import app

    pub = publisher
    stop = threading.Event()

    def keep_publishing():
        while not stop.is_set():
            pub.publish(remove_oldest=True)
            time.sleep(0.02)

    thread = threading.Thread(target=keep_publishing, daemon=True)
    thread.start()
    try:
        result = CliRunner().invoke(app, ["ingest", "vllm-kv-events", "--endpoint", f"tcp://127.0.0.1:{pub.port}",
                                          "--replay", f"tcp://127.0.0.1:{pub.replay_port}", "--topic", "kv",
                                          "--interval", "500ms", "--duration", "1500ms", "--json"])
    finally:
        stop.set()
        thread.join()
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    final = lines[-1]
    assert final["type"] == "kv_events_summary" and final["batches"] > 10
    assert final["cached_blocks"]["GPU"] > 0 and final["lost"] == 0
    assert any(line["type"] == "kv_events" for line in lines[:-1])
