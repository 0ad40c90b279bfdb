"""vLLM's KV-cache events (``--kv-events-config``), decoded and turned into prefix-cache figures.

The wire format is vLLM 0.33's ``vllm/distributed/kv_events.py``: ``ZmqEventPublisher`` sends each
batch as one ZMQ PUB message of three frames, ``(topic, seq, payload)``: ``seq`` an 8-byte
big-endian counter from 0, ``payload`` a msgpack ``KVEventBatch`` (``array_like``: ``[ts, events,
data_parallel_rank]``) whose events are tagged maps: ``{"type": "BlockStored", "block_hashes": [...],
"parent_block_hash", "token_ids", "block_size", "medium", "group_idx", ...}``,
``{"type": "BlockRemoved", "block_hashes", "medium"}``, ``{"type": "AllBlocksCleared"}``. With a
``replay_endpoint`` it also binds a ROUTER: a client sends the first seq it wants (8 bytes, big
endian; with a DEALER: an empty delimiter frame first) and gets every buffered batch from there as
``(b"", topic, seq, payload)``, then ``(b"", b"", -1 as 8 bytes, b"")`` as the end marker.

What the events are: content hashes of blocks entering (``BlockStored``: computed and cached, or
reused from the prefix cache) and leaving (``BlockRemoved``: evicted) vLLM's prefix cache. So they
give the prefix-cache working set (blocks and tokens with a hash, per medium), the store, reuse and
eviction rates, and nothing more: no physical block ids, no request ids, no reference counts, no
free blocks. U_kv, F_ext, F_int, the allocator state and per-request victims need the plugin
(``producers.vllm.plugin``); ``kvguard scrape`` gives U_kv from ``/metrics``.

``KvEventsSubscriber`` (pyzmq, imported when it is built) receives in order, detects a gap in
``seq`` and fills it from the replay socket; what the replay no longer holds is counted as lost.
``PrefixCacheState`` is pure and keeps the figures.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
STORED, REMOVED, CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"


class KvEventsError(ValueError):
    """A frame that is not a vLLM KV-event batch; says what was expected."""


@dataclass(slots=True, frozen=True)
class KvEvent:
    kind: str  # STORED | REMOVED | CLEARED
    block_hashes: tuple = ()
    num_tokens: int = 0
    medium: str | None = None
    group: int | None = None


@dataclass(slots=True, frozen=True)
class KvBatch:
    seq: int
    ts: float
    events: tuple[KvEvent, ...]
    data_parallel_rank: int | None = None


def _hashable(h: Any) -> Any:
    return bytes(h) if isinstance(h, (bytearray, memoryview)) else h


def decode_payload(payload: bytes, seq: int = -1) -> KvBatch:
    """One msgpack ``KVEventBatch`` (module docstring) → ``KvBatch``. Raises ``KvEventsError``."""
    import msgspec  # msgspec: part of the optional vllm extra, loaded only to read KV events

    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as err:
        raise KvEventsError(f"seq {seq}: not msgpack ({err})") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise KvEventsError(f"seq {seq}: expected a KVEventBatch [ts, events, data_parallel_rank], got {type(raw).__name__}")
    events = []
    for item in raw[1]:
        if isinstance(item, dict):
            kind, fields = item.get("type"), item
        elif isinstance(item, list) and item and isinstance(item[0], str):  # array_like tagged structs
            kind, fields = item[0], {}
        else:
            raise KvEventsError(f"seq {seq}: an event is {type(item).__name__}, expected a tagged map")
        if kind == CLEARED:
            events.append(KvEvent(CLEARED))
        elif kind in (STORED, REMOVED):
            hashes = tuple(_hashable(h) for h in fields.get("block_hashes", ()))
            tokens = len(fields.get("token_ids") or ()) if kind == STORED else 0
            events.append(KvEvent(kind, hashes, tokens, fields.get("medium"), fields.get("group_idx")))
        else:
            raise KvEventsError(f"seq {seq}: unknown event type {kind!r} (vLLM 0.33 sends {STORED}, {REMOVED}, {CLEARED})")
    rank = raw[2] if len(raw) > 2 else None
    return KvBatch(seq, float(raw[0]), tuple(events), rank)


def decode_frames(frames: list[bytes]) -> KvBatch:
    """A PUB message ``[topic, seq, payload]`` → ``KvBatch``."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise KvEventsError(f"expected 3 frames (topic, 8-byte seq, payload), got {len(frames)}")
    seq = int.from_bytes(frames[1], "big")
    return decode_payload(frames[2], seq)


@dataclass(slots=True)
class PrefixCacheState:
    """The prefix cache as the events describe it: hashes present per medium, and counters."""

    present: dict[str, set] = field(default_factory=dict)
    tokens: dict[str, dict] = field(default_factory=dict)
    batches: int = 0
    events: int = 0
    stored_blocks: int = 0
    reused_blocks: int = 0  # BlockStored of a hash already present: a prefix-cache reuse report
    removed_blocks: int = 0
    cleared: int = 0
    last_ts: float = 0.0

    def apply(self, batch: KvBatch) -> None:
        self.batches += 1
        self.events += len(batch.events)
        self.last_ts = max(self.last_ts, batch.ts)
        for ev in batch.events:
            if ev.kind == CLEARED:
                self.cleared += 1
                self.present.clear()
                self.tokens.clear()
                continue
            medium = ev.medium or "GPU"
            present = self.present.setdefault(medium, set())
            tokens = self.tokens.setdefault(medium, {})
            if ev.kind == STORED:
                per_block = ev.num_tokens // max(1, len(ev.block_hashes))
                for h in ev.block_hashes:
                    if h in present:
                        self.reused_blocks += 1
                    else:
                        present.add(h)
                        self.stored_blocks += 1
                    tokens[h] = per_block
            else:
                for h in ev.block_hashes:
                    if h in present:
                        present.discard(h)
                        tokens.pop(h, None)
                    self.removed_blocks += 1

    def figures(self) -> dict:
        media = sorted(self.present)
        return {
            "cached_blocks": {m: len(self.present[m]) for m in media},
            "cached_tokens": {m: int(sum(self.tokens.get(m, {}).values())) for m in media},
            "stored_blocks": self.stored_blocks, "reused_blocks": self.reused_blocks,
            "removed_blocks": self.removed_blocks, "cleared": self.cleared,
            "reuse_frac": round(self.reused_blocks / (self.stored_blocks + self.reused_blocks), 6)
            if (self.stored_blocks + self.reused_blocks) else 0.0,
            "batches": self.batches, "events": self.events, "last_ts": self.last_ts,
        }


@dataclass(slots=True)
class GapCounters:
    gaps: int = 0
    replayed: int = 0
    lost: int = 0
    duplicates: int = 0
    undecodable: int = 0


class KvEventsSubscriber:
    """SUB on ``endpoint`` (and a DEALER on ``replay`` for gaps): ``poll`` returns batches in seq order."""

    def __init__(self, endpoint: str, replay: str | None = None, *, topic: str = "", replay_timeout_s: float = 2.0,
                 from_seq: int | None = None) -> None:
        import zmq  # pyzmq: part of the optional vllm extra

        self._zmq = zmq
        self.endpoint, self.replay_endpoint = endpoint, replay
        self.topic = topic.encode()
        self.replay_timeout_s = replay_timeout_s
        self.expected = from_seq
        self.counters = GapCounters()
        self._ctx = zmq.Context.instance()
        self._sub = None
        self._replay = None
        self.connect()

    def connect(self) -> None:
        zmq = self._zmq
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self._sub.connect(self.endpoint)
        if self.replay_endpoint and self._replay is None:
            self._replay = self._ctx.socket(zmq.DEALER)
            self._replay.connect(self.replay_endpoint)

    def disconnect(self) -> None:
        """Close the SUB socket (the publisher drops what it sends meanwhile: a gap)."""
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None

    def close(self) -> None:
        self.disconnect()
        if self._replay is not None:
            self._replay.close(linger=0)
            self._replay = None

    def poll(self, timeout_ms: int = 100) -> list[KvBatch]:
        """Batches received within ``timeout_ms`` (and what a gap needed from the replay), in order."""
        out: list[KvBatch] = []
        sub = self._sub
        if sub is None or not sub.poll(timeout_ms):
            return out
        while sub.poll(0):
            frames = sub.recv_multipart()
            try:
                batch = decode_frames(frames)
            except KvEventsError as err:
                self.counters.undecodable += 1
                log.warning("undecodable KV-event message: %s", err)
                continue
            out.extend(self._accept(batch))
        return out

    def _accept(self, batch: KvBatch) -> list[KvBatch]:
        if self.expected is None:
            self.expected = batch.seq
        if batch.seq < self.expected:
            self.counters.duplicates += 1
            return []
        out: list[KvBatch] = []
        if batch.seq > self.expected:
            self.counters.gaps += 1
            out.extend(self._fill(self.expected, batch.seq))
        out.append(batch)
        self.expected = batch.seq + 1
        return out

    def _fill(self, start: int, stop: int) -> list[KvBatch]:
        """Batches ``start .. stop - 1`` from the replay socket; what it lacks is lost."""
        got: dict[int, KvBatch] = {}
        if self._replay is not None:
            self._replay.send_multipart((b"", start.to_bytes(8, "big")))
            deadline = time.monotonic() + self.replay_timeout_s
            while time.monotonic() < deadline:
                if not self._replay.poll(int(max(1, (deadline - time.monotonic()) * 1000))):
                    break
                frames = self._replay.recv_multipart()
                if len(frames) == 4 and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) == 3 and frames[1] == END_SEQ:
                    break
                try:
                    batch = decode_frames(frames)
                except KvEventsError:
                    self.counters.undecodable += 1
                    continue
                if start <= batch.seq < stop:
                    got[batch.seq] = batch
        self.counters.replayed += len(got)
        self.counters.lost += (stop - start) - len(got)
        if len(got) < stop - start:
            log.warning("KV events %d..%d: %d not in the replay buffer (lost)", start, stop - 1,
                        (stop - start) - len(got))
        return [got[s] for s in sorted(got)]
