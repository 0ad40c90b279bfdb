"""Allocator events: the pure, columnar contract between a node's pool and everything downstream.

The pool (``producers.sim.seed.pool``) records events; the stream mirror (``streams.mirror``) rebuilds the
allocator from them; the event log, the bus and the replay all carry them unchanged. This module
is pure: numpy and the standard library only (no pydantic, Kafka, Faust or Redis).

One event is one row of ``EVENT_DTYPE``. The meaning of each column per kind:

============  =====  ======================================================================
kind          req    offset / size (units)  tokens               cls / flags / aux
============  =====  ======================================================================
ARRIVE        req    -/-                    prompt tokens        cls=priority (0-10), aux=max output tokens,
                                                                   flags=F_PRIORITY_DEFAULTED when missing,
                                                                   | F_PROMPT_LOGPROBS when it asks for them
ADMIT         req    -/-                    -                    -
FINISH        req    -/-                    tokens generated     flags=Outcome; REJECTED: aux=Refusal (0 unknown)
PREEMPT       req    -/-                    tokens to recompute  -   (its pages are released by FREE rows first)
ALLOC         req    page run               tokens written       cls=page class index; a new live page, refcount 1
SHARE         req    page run               tokens in page       cls; req takes a reference to a live page, or
                                                                   revives a cached page (cached -> live)
FREE          req    page run               tokens in page       cls; req drops its reference. When it was the last:
                                                                   flags & F_TO_CACHE -> page becomes cached,
                                                                   else its units become free
FILL          -      -/-                    tokens appended      aggregate: tokens written into already
                                                                   allocated live pages since the last FILL
RECLAIM       -      page run               -                    cls; a cached page is dropped, units free
EVICT         req    page run               tokens in page       cls; policy/preemption takes the page from req.
                                                                   flags=Handling: RECOMPUTE frees the units,
                                                                   SWAP/CHECKPOINT copy it out then free the units,
                                                                   RETAIN keeps the units occupied (retained) for remap
SWAP_OUT      req    page run               tokens in page       cls; page copied to host swap, units free
SWAP_IN       req    page run               tokens in page       cls; a new live page for req from host swap
REMAP         req    page run               tokens in page       cls; a retained page becomes live again for req
EXPIRE        -      page run               -                    cls; a retained page's TTL ran out, units free
MIGRATE       req    old run                tokens in page       aux=new offset (same size); live/cached/retained
                                                                   page moves, state unchanged
WS_ALLOC      -      buffer run             batched tokens       workspace buffer of one engine step
WS_FREE       -      buffer run             -                    -
ALLOC_FAIL    req    -/requested units      -                    aux=largest free run at that moment, cls=class
OOM           req    -/requested units      -                    aux=largest free run; the engine crashed
                                                                   (cls=OomLayer, flags=OomCause; allocator: below)
RESET         -      -/-                    -                    every run is free again (after an OOM restart)
STEP          -      -/batched tokens       decode tokens        aux=step duration ns; one per engine step
SNAPSHOT      -      largest run/#free runs tokens stored        aux=free_runs_checksum(); the batch carries the
                                                                   full state (``PoolState``) for resync
SEG_ALLOC     -      segment addr/bytes     -                    cls=Pool, flags=stream; the caching allocator
                                                                   reserved a segment (cudaMalloc); aux=SEG_MAPPED:
                                                                   pages of an expandable segment mapped
SEG_FREE      -      segment addr/bytes     -                    cls=Pool; a segment went back to the device
                                                                   (empty_cache, or release-and-retry);
                                                                   aux=SEG_MAPPED: expandable pages unmapped
BLK_ALLOC     -      block addr/bytes       requested bytes      cls=Pool, aux=segment addr; a block that outlives
                                                                   the engine step that allocated it
BLK_FREE      -      block addr/bytes       -                    cls=Pool, aux=segment addr; such a block freed
ALLOC_RETRY   -      -/-                    -                    a malloc found no cached block and no device
                                                                   memory: cached blocks were released, retried
GOVERN        req|-1 headroom/predicted     token budget set     the step governor (producers.vllm.governor) shrank
                     bytes                                       the next step: cls=OomCause of the class that made
                                                                   it not fit (PROMPT_LOGPROBS, LONG_CONTEXT,
                                                                   SPEC_DECODE, else PEAK), flags=F_GOV_* (what it
                                                                   did), aux=tokens taken off vLLM's budget (with
                                                                   F_GOV_SEQS alone: sequences not admitted); offset =
                                                                   bytes the allocator can give less the margin, size =
                                                                   predicted peak of the unshrunk step. With
                                                                   F_GOV_REFUSED: req refused at arrival (never fits;
                                                                   its FINISH has Outcome.NEVER_FITS), size = its need
OOM_STEP      req    (by cls, below)        (by cls)             the step an OOM row right after it crashed
                                                                   (cls=OomStepRow; bytes, tokens; for kvguard rca)
ADMISSION     req    retry-after ms/        prompt tokens        cls=Decision (producers.admission: 1 held,
                     saturation x1000                              2 refused, 3 released), aux=predicted queueing
                                                                   delay ms; a refusal is then FINISH REFUSED
                                                                   req -1: the node's state for a typical
                                                                   request (cls 0 admit), at most once a second:
                                                                   the router series (Tick endpoint_*)
============  =====  ======================================================================

Units are the KV pool's unit (``Geometry.unit_tokens`` tokens of KV). Every KV offset is in
units from the start of the dynamic region D. ``ts_ns`` is event time, passed in by the caller.

The caching-allocator rows (SEG_* and BLK_*, ALLOC_RETRY; PyTorch's CUDACachingAllocator as
twinned by ``kvguard.producers.sim.torch_allocator.caching_allocator``) are in bytes and device addresses. They are
emitted at engine-step granularity: a block allocated and freed within one step (activations,
workspaces, sampler logits) produces no row, so the rows rebuild the allocator's state exactly
at every step boundary, while every segment the step's peak needed appears as SEG_ALLOC. An OOM
of the allocator layer is an OOM row with ``cls=OomLayer.ALLOCATOR``, ``size`` the requested
bytes, ``aux`` the reserved-but-unallocated bytes, and ``flags`` its ``OomCause``.

OOM_STEP rows (written right before an allocator OOM row, contiguous with it; what PyTorch's OOM message
and the engine's scheduler output say about the crashing step, which the OOM row alone cannot):
``cls=OomStepRow.DEVICE``: ``size`` device free bytes, ``offset`` reserved bytes, ``tokens`` allocated
bytes, ``aux`` the bytes the allocator tried to get from the device (the request rounded up);
``cls=STEP``: ``size`` tokens scheduled, ``tokens`` sequences, ``offset`` prompt-logprob positions in
the step, ``aux`` the headroom start-up left (device free + reserved-but-unallocated bytes once the
engine was up); ``cls=REQUEST``, one per scheduled request: ``req``, ``tokens`` its tokens in the step,
``offset`` its prompt tokens, ``size`` its context length once the step is done, ``aux`` its speculative
tokens, ``flags`` F_PROMPT_LOGPROBS when it asks for prompt logprobs; ``cls=EXTERNAL``: ``size`` bytes
another process holds on the device now, ``offset`` what it held at start-up, ``tokens`` bytes leaked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

SEG_MAPPED = 1  # SEG_ALLOC / SEG_FREE ``aux``: pages of an expandable segment mapped / unmapped


class EventKind(IntEnum):
    ARRIVE = 1
    ADMIT = 2
    FINISH = 3
    PREEMPT = 4
    ALLOC = 5
    SHARE = 6
    FREE = 7
    FILL = 8
    RECLAIM = 9
    EVICT = 10
    SWAP_OUT = 11
    SWAP_IN = 12
    REMAP = 13
    EXPIRE = 14
    MIGRATE = 15
    WS_ALLOC = 16
    WS_FREE = 17
    ALLOC_FAIL = 18
    OOM = 19
    RESET = 20
    STEP = 21
    SNAPSHOT = 22
    SEG_ALLOC = 23
    SEG_FREE = 24
    BLK_ALLOC = 25
    BLK_FREE = 26
    ALLOC_RETRY = 27
    GOVERN = 28
    ADMISSION = 29  # the node's admission gate held, refused or released a request (issue 29)
    OOM_STEP = 30  # the crashing step of the OOM row that follows (cls=OomStepRow)


ALLOCATOR_KINDS = (EventKind.SEG_ALLOC, EventKind.SEG_FREE, EventKind.BLK_ALLOC, EventKind.BLK_FREE,
                   EventKind.ALLOC_RETRY)


class OomStepRow(IntEnum):
    """OOM_STEP ``cls``: which part of the crashing step the row describes (the module docstring)."""

    DEVICE = 0
    STEP = 1
    REQUEST = 2
    EXTERNAL = 3


class Pool(IntEnum):
    """SEG_*/BLK_* ``cls``: the caching allocator's pool (blocks ≤ 1 MiB are small)."""

    SMALL = 0
    LARGE = 1


class OomLayer(IntEnum):
    """OOM ``cls``: which layer could not allocate."""

    KV_ARENA = 0  # a page or workspace run of the KV arena (the seed's alternative profiles)
    ALLOCATOR = 1  # the caching allocator (the vLLM-faithful profiles): a CUDA OOM


class OomCause(IntEnum):
    """OOM ``flags``: why the allocation failed."""

    OTHER = 0
    PEAK = 1  # the request exceeds what the device has left even after releasing every cached block
    FRAGMENTATION = 2  # reserved-but-unallocated bytes would have covered the request
    # The failure class whose bytes, absent, would have let the step fit (the shadow engine's
    # attribution, docs/NODE_MEMORY.md "Failure classes"); the allocator-level reason is then in its log.
    PROMPT_LOGPROBS = 3  # C2: prompt-logprob logits the profiling run never made
    LONG_CONTEXT = 4  # C3: attention buffers sized by the context (padded LSE, split-KV accumulators)
    SPEC_DECODE = 5  # C8: speculative decoding's logits rows, verification copy, drafter
    NEIGHBOUR = 6  # C4: another process took device memory after start-up
    LEAK = 7  # C7: memory held and never returned (per hour, request or step)


class Outcome(IntEnum):
    """FINISH ``flags``: how a request ended."""

    COMPLETED = 0
    FAILED_OOM = 1  # the engine crashed under it
    REJECTED = 2  # could never fit (prompt larger than the pool), or the engine was down (restarting)
    ABORTED = 3  # cancelled by the caller or the policy
    REFUSED = 4  # refused at admission (overload), retryable: answered with Retry-After (issue 29)
    NEVER_FITS = 5  # refused at arrival by the step governor: its smallest step can never fit this node


class Refusal(IntEnum):
    """FINISH REJECTED ``aux``: why the server turned the request away (0 where the producer does not say)."""

    UNKNOWN = 0
    RESTARTING = 1  # the engine was down (restarting after a crash)
    QUEUE_REQS = 2  # vLLM's 503: unfinished requests over --max-num-queued-reqs
    QUEUE_TOKENS = 3  # vLLM's 503: the prefill backlog over --max-num-queued-tokens
    PROMPT_TOO_LONG = 4  # the prompt does not fit the model's context (max_model_len), or is empty
    OTHER = 5


class Handling(IntEnum):
    """EVICT ``flags``: what happens to an evicted page's contents."""

    RECOMPUTE = 0
    SWAP = 1
    CHECKPOINT = 2
    RETAIN = 3


# FREE flags
F_TO_CACHE = 1
# ARRIVE flags
F_PRIORITY_DEFAULTED = 1
F_PROMPT_LOGPROBS = 2  # the request asks for prompt logprobs: logits for every prompt position it prefills

EVENT_DTYPE = np.dtype(
    [
        ("ts_ns", "<i8"),
        ("kind", "u1"),
        ("cls", "u1"),
        ("flags", "u1"),
        ("req", "<i8"),
        ("offset", "<i8"),
        ("size", "<i8"),
        ("tokens", "<i8"),
        ("aux", "<i8"),
    ]
)
COLUMNS: tuple[str, ...] = EVENT_DTYPE.names  # type: ignore[assignment]

SCHEMA_VERSION = "1.0"


@dataclass(slots=True, frozen=True)
class Geometry:
    """The device ledger of one GPU, in the units the events use.

    D (``dynamic_units``) is M*u - W - C expressed in units; KV pages and workspace buffers share it.
    ``page_classes`` are page sizes in units (each a power of two), largest last.
    """

    total_bytes: int
    weights_bytes: int
    context_bytes: int
    gpu_memory_utilization: float
    unit_tokens: int
    kv_bytes_per_token: int
    dynamic_units: int
    page_classes: tuple[int, ...]
    reserved_frac: float = 0.05

    @property
    def unit_bytes(self) -> int:
        return self.unit_tokens * self.kv_bytes_per_token

    @property
    def dynamic_bytes(self) -> int:
        return self.dynamic_units * self.unit_bytes

    def to_dict(self) -> dict:
        return {
            "total_bytes": self.total_bytes,
            "weights_bytes": self.weights_bytes,
            "context_bytes": self.context_bytes,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "unit_tokens": self.unit_tokens,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "dynamic_units": self.dynamic_units,
            "page_classes": list(self.page_classes),
            "reserved_frac": self.reserved_frac,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Geometry":
        return cls(
            total_bytes=int(d["total_bytes"]),
            weights_bytes=int(d["weights_bytes"]),
            context_bytes=int(d["context_bytes"]),
            gpu_memory_utilization=float(d["gpu_memory_utilization"]),
            unit_tokens=int(d["unit_tokens"]),
            kv_bytes_per_token=int(d["kv_bytes_per_token"]),
            dynamic_units=int(d["dynamic_units"]),
            page_classes=tuple(int(c) for c in d["page_classes"]),
            reserved_frac=float(d.get("reserved_frac", 0.05)),
        )


class RegionState(IntEnum):
    """State of an occupied run in ``PoolState``."""

    LIVE = 0
    CACHED = 1
    RETAINED = 2
    WORKSPACE = 3


@dataclass(slots=True)
class PoolState:
    """A full dump of a pool's occupied runs, sent with SNAPSHOT so a mirror can resynchronise.

    Parallel int64 arrays, one row per occupied run, sorted by offset. ``refs`` lists the requests
    holding each live page (a tuple per row; empty for cached/retained/workspace runs).
    ``tokens_stored`` is the total of tokens held in live pages.
    """

    offset: np.ndarray
    size: np.ndarray
    state: np.ndarray
    cls: np.ndarray
    tokens: np.ndarray
    refs: list[tuple[int, ...]]
    tokens_stored: int = 0

    def to_dict(self) -> dict:
        return {
            "offset": self.offset.tolist(),
            "size": self.size.tolist(),
            "state": self.state.tolist(),
            "cls": self.cls.tolist(),
            "tokens": self.tokens.tolist(),
            "refs": [list(r) for r in self.refs],
            "tokens_stored": int(self.tokens_stored),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "PoolState":
        return cls(
            offset=np.asarray(d["offset"], dtype=np.int64),
            size=np.asarray(d["size"], dtype=np.int64),
            state=np.asarray(d["state"], dtype=np.int64),
            cls=np.asarray(d["cls"], dtype=np.int64),
            tokens=np.asarray(d["tokens"], dtype=np.int64),
            refs=[tuple(int(x) for x in r) for r in d["refs"]],
            tokens_stored=int(d.get("tokens_stored", 0)),
        )


@dataclass(slots=True)
class EventBatch:
    """Events of one node, in order. ``seq`` counts batches per node and producer ``epoch``;
    a gap in ``seq`` (or a new ``epoch``: a producer restart) tells the consumer it missed events.

    ``geometry`` rides on the first batch of an epoch and on every batch that has a SNAPSHOT;
    ``state`` rides on batches with a SNAPSHOT (the state right after that SNAPSHOT's row).
    """

    node: str
    seq: int
    events: np.ndarray  # EVENT_DTYPE
    epoch: int = 0
    geometry: Geometry | None = None
    state: PoolState | None = None
    extra: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.events)


def empty_events(n: int = 0) -> np.ndarray:
    return np.zeros(n, dtype=EVENT_DTYPE)


def free_runs_checksum(offsets: np.ndarray, sizes: np.ndarray) -> int:
    """Order-independent 63-bit checksum of a set of free runs (offset, size), in units.

    Pool and mirror both call this on their free runs; equal sets give equal checksums.
    """
    o = np.asarray(offsets, dtype=np.uint64)
    s = np.asarray(sizes, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = (o * np.uint64(0x9E3779B97F4A7C15)) ^ (s * np.uint64(0xC2B2AE3D27D4EB4F) + np.uint64(1))
        h ^= h >> np.uint64(29)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        total = int(h.sum(dtype=np.uint64)) if len(h) else 0
    return total & 0x7FFF_FFFF_FFFF_FFFF
