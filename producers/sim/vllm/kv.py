"""The vLLM engine's KV blocks as kvguard events, and the pool view the actuators and the fleet read.

``producers.sim.vllm.kv_blocks`` and ``producers.sim.vllm.scheduler`` are vLLM's block pool, cache manager and
scheduler and record nothing; the subclasses here observe their calls and write event rows
(``kvguard.contracts.events``) without changing any decision. The geometry is one unit per usable
block: vLLM's block 0 is the null block (never handed out, not counted in vLLM's usage), so block
``b`` is unit ``b - 1`` and the region has ``num_gpu_blocks - 1`` units; ``u_kv`` of the mirror then
equals ``vllm:kv_cache_usage_perc`` computed over live blocks.

Rows, and the vLLM call that causes each:

- ADMIT, then SHARE per prefix-hit block (``touch``: a cached free block revived, or a live block
  shared) and ALLOC per new block, when ``allocate_slots`` admits a waiting request;
- ALLOC per block a running request gets (``allocate_slots`` -> ``get_new_blocks``);
- RECLAIM before the ALLOC of a popped block that still had a hash (lazy eviction in ``get_new_blocks``);
- FREE per block, last block first, when a request is freed (``KVCacheManager.free``), with
  ``F_TO_CACHE`` when the block keeps its hash (vLLM appends it to the free queue's tail, reusable);
- PREEMPT after its FREE rows (``Scheduler._preempt``).

Tokens: ALLOC and SHARE of a live block carry no tokens; the engine reports every computed token
with one FILL per step (the batch's scheduled tokens), a revived cached block carries its full
``block_size`` tokens, and FREE carries the block's computed tokens as the freeing request sees them
(``clamp(num_computed_tokens - index * block_size, 0, block_size)``; a block shared by several
requests is full, so every holder sees ``block_size``). So the mirror's ``tokens_stored`` equals the
tokens of KV computed in live blocks, exactly, at every snapshot.
"""

from __future__ import annotations

import struct

import numpy as np

from kvguard.contracts.events import (
    EVENT_DTYPE,
    F_TO_CACHE,
    EventKind,
    PoolState,
    RegionState,
    empty_events,
    free_runs_checksum,
)
from kvguard.contracts.pool_types import PageInfo, PageState, UnknownRequest
from kvguard.producers.sim.vllm.kv_blocks import NO_HIT, BlockPool, KVCacheManager
from kvguard.producers.sim.vllm.scheduler import Scheduler, SchedulerConfig

_ROW = struct.Struct("<qBBBqqqqq")
if _ROW.size != EVENT_DTYPE.itemsize:
    raise TypeError(f"EVENT_DTYPE changed ({EVENT_DTYPE}); update producers.sim.vllm.kv._ROW")
_pack = _ROW.pack
_ADMIT, _ALLOC, _SHARE, _FREE = int(EventKind.ADMIT), int(EventKind.ALLOC), int(EventKind.SHARE), int(EventKind.FREE)
_RECLAIM, _PREEMPT, _SNAPSHOT = int(EventKind.RECLAIM), int(EventKind.PREEMPT), int(EventKind.SNAPSHOT)


class EventRecorder:
    """Rows packed little-endian in the layout of EVENT_DTYPE (one bytearray, no tuple per row).
    ``now_ns`` stamps the rows the KV hooks write (the engine sets it before each scheduler call)."""

    def __init__(self):
        self._rows = bytearray()
        self.now_ns = 0
        self.total = 0

    def row(self, kind: int, ts_ns: int, req: int = -1, *, cls: int = 0, flags: int = 0, offset: int = 0,
            size: int = 0, tokens: int = 0, aux: int = 0) -> None:
        self._rows += _pack(ts_ns, kind, cls, flags, req, offset, size, tokens, aux)

    def allocator_row(self, kind: int, ts_ns: int, cls: int, flags: int, offset: int, size: int, tokens: int,
                      aux: int) -> None:
        self._rows += _pack(ts_ns, kind, cls, flags, -1, offset, size, tokens, aux)

    def take(self) -> np.ndarray:
        if not self._rows:
            return empty_events(0)
        out = np.frombuffer(self._rows, dtype=EVENT_DTYPE).copy()
        self._rows = bytearray()
        self.total += len(out)
        return out

    @property
    def pending(self) -> int:
        return len(self._rows) // _ROW.size


class RecordingBlockPool(BlockPool):
    """vLLM's ``BlockPool`` plus a RECLAIM row for each cached block evicted lazily on reuse."""

    recorder: EventRecorder

    def get_new_blocks(self, num_blocks: int):
        if num_blocks <= self.free_queue.num_free_blocks:
            block = self.free_queue.head.next_free
            rec = self.recorder
            for _ in range(num_blocks):
                if block.block_hash is not None:
                    rec._rows += _pack(rec.now_ns, _RECLAIM, 0, 0, -1, block.block_id - 1, 1, 0, 0)
                block = block.next_free
        return BlockPool.get_new_blocks(self, num_blocks)


class RecordingKVCacheManager(KVCacheManager):
    """vLLM's ``KVCacheManager`` plus ADMIT/SHARE/ALLOC/FREE rows (module docstring).

    Made by ``record(manager, recorder)`` from the manager ``Scheduler.__init__`` built: the instance
    and its block pool change class in place (the subclasses add behaviour, no state beyond the
    recorder), so a cache of ~100k blocks is built once, not once per layer of wrapping."""

    recorder: EventRecorder
    admitted: list  # requests admitted since the engine last cleared it

    @classmethod
    def record(cls, manager: KVCacheManager, recorder: EventRecorder) -> RecordingKVCacheManager:
        if type(manager) is not KVCacheManager or type(manager.pool) is not BlockPool:
            raise TypeError("record() wraps a plain KVCacheManager over a plain BlockPool")
        manager.__class__ = cls
        manager.pool.__class__ = RecordingBlockPool
        manager.pool.recorder = recorder
        manager.recorder = recorder
        manager.admitted = []
        return manager

    def allocate_slots(self, seq, num_new_tokens, computed=NO_HIT, *, num_lookahead_tokens=0,
                       full_sequence_must_fit=False, has_scheduled_reqs=True):
        if not computed.blocks and not full_sequence_must_fit and num_new_tokens > 0:
            # a running request (every one, every step): the call KVCacheManager.allocate_slots makes
            held = self.req_to_blocks.get(seq.request_id)
            if held is not None:
                new = self._extend(seq, held, num_new_tokens, num_lookahead_tokens, has_scheduled_reqs)
                if new:
                    rec = self.recorder
                    rows, ts, rid = rec._rows, rec.now_ns, seq.request_id
                    for block_id in new:
                        rows += _pack(ts, _ALLOC, 0, 0, rid, block_id - 1, 1, 0, 0)
                return new
        revive = [b.ref_count == 0 for b in computed.blocks] if computed.blocks else ()
        new = KVCacheManager.allocate_slots(self, seq, num_new_tokens, computed, num_lookahead_tokens=num_lookahead_tokens,
                                            full_sequence_must_fit=full_sequence_must_fit,
                                            has_scheduled_reqs=has_scheduled_reqs)
        if new is None:
            return None
        rec = self.recorder
        rows, ts, rid = rec._rows, rec.now_ns, seq.request_id
        if seq.is_waiting:
            rows += _pack(ts, _ADMIT, 0, 0, rid, 0, 0, 0, 0)
            self.admitted.append(seq)
            bs = self.block_size
            for block, was_free in zip(computed.blocks, revive):
                rows += _pack(ts, _SHARE, 0, 0, rid, block.block_id - 1, 1, bs if was_free else 0, 0)
        for block_id in new:
            rows += _pack(ts, _ALLOC, 0, 0, rid, block_id - 1, 1, 0, 0)
        return new

    def free(self, request_id) -> None:
        blocks = self.req_to_blocks.get(request_id)
        if blocks:
            self._record_free(request_id, blocks, self.computed_tokens(request_id))
        KVCacheManager.free(self, request_id)

    @staticmethod
    def computed_tokens(request_id) -> int:
        """Tokens whose KV is computed for ``request_id`` (the engine's scheduler replaces this)."""
        return 0

    def _record_free(self, rid, blocks, computed: int) -> None:
        rec = self.recorder
        rows, ts, bs = rec._rows, rec.now_ns, self.block_size
        caching = self.enable_caching
        for index in range(len(blocks) - 1, -1, -1):
            block = blocks[index]
            if block.is_null:
                continue
            tokens = computed - index * bs
            tokens = bs if tokens > bs else (max(0, tokens))
            flags = F_TO_CACHE if caching and block.ref_count == 1 and block.block_hash is not None else 0
            rows += _pack(ts, _FREE, 0, flags, rid, block.block_id - 1, 1, tokens, 0)


class EngineScheduler(Scheduler):
    """vLLM's ``Scheduler`` over the recording cache manager, plus PREEMPT rows and counts."""

    def __init__(self, config: SchedulerConfig, recorder: EventRecorder):
        super().__init__(config)
        self.kv = RecordingKVCacheManager.record(self.kv, recorder)
        requests = self.requests
        self.kv.computed_tokens = lambda rid: requests[rid].num_computed_tokens if rid in requests else 0
        self.recorder = recorder
        self.preempted_in_step = 0
        self.num_evictions = 0  # preemptions asked by the policy (``evict``), counted apart

    def evict(self, seq) -> None:
        """Preempt a running request between steps, as the scheduler's own preemption does."""
        self.running.remove(seq)
        self._preempt(seq)
        self.num_evictions += 1

    def _preempt(self, seq) -> None:
        tokens = seq.num_tokens
        Scheduler._preempt(self, seq)
        self.preempted_in_step += 1
        rec = self.recorder
        rec._rows += _pack(rec.now_ns, _PREEMPT, 0, 0, seq.request_id, 0, 0, tokens, 0)


class BlockPoolView:
    """What the fleet and the actuators read of the engine's KV blocks (the seed's ``PagedPool`` names).

    Units are usable blocks (block ``b`` = unit ``b - 1``). ``reclaim_cached`` and ``compact`` have no
    vLLM counterpart (cached blocks already count as free and are reused on demand; blocks are
    uniform, so there is nothing to coalesce): they do nothing and return 0.
    """

    def __init__(self, engine):
        self._engine = engine

    @property
    def _kv(self):
        return self._engine.scheduler.kv

    @property
    def block_tokens(self) -> int:
        return self._engine.block_size

    def take_events(self) -> np.ndarray:
        return self._engine.recorder.take()

    def reclaim_cached(self, units_needed: int, now_ns: int) -> int:
        return 0

    def compact(self, now_ns: int, max_moves: int) -> int:
        return 0

    def has_request(self, req: int) -> bool:
        return bool(self._kv.req_to_blocks.get(req))

    def requests(self) -> list[int]:
        return [r for r, blocks in self._kv.req_to_blocks.items() if blocks]

    def request_pages(self, req: int) -> list[PageInfo]:
        """The block table of ``req``: one page of one unit per block. Raises UnknownRequest."""
        blocks = self._kv.req_to_blocks.get(req)
        if not blocks:
            raise UnknownRequest(req)
        bs, computed = self._kv.block_size, self._kv.computed_tokens(req)
        return [PageInfo(b.block_id - 1, 1, 0, max(0, min(bs, computed - i * bs)), PageState.LIVE, b.ref_count,
                         b.block_hash is not None) for i, b in enumerate(blocks)]

    def request_units(self, req: int) -> int:
        return len(self._kv.req_to_blocks.get(req, ()))

    # ---------------------------------------------------------------- state
    def _states(self):
        """Per usable block: state (0 free, 1 live, 2 cached), tokens and holders."""
        kv = self._kv
        n = kv.pool.num_blocks - 1
        state = np.zeros(n, dtype=np.int8)
        tokens = np.zeros(n, dtype=np.int64)
        holders: dict[int, list] = {}
        bs = kv.block_size
        for rid, blocks in kv.req_to_blocks.items():
            computed = kv.computed_tokens(rid)
            for i, b in enumerate(blocks):
                if b.is_null:
                    continue
                unit = b.block_id - 1
                state[unit] = 1
                tokens[unit] = max(0, min(bs, computed - i * bs))
                holders.setdefault(unit, []).append(rid)
        for b in kv.pool.blocks[1:]:
            if b.ref_count == 0 and b.block_hash is not None:
                state[b.block_id - 1] = 2
        return state, tokens, holders

    def free_runs(self, state: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Maximal runs of free (neither live nor cached) units, sorted by offset."""
        if state is None:
            state = self._states()[0]
        free = np.concatenate(([False], state == 0, [False]))
        edges = np.flatnonzero(free[1:] != free[:-1])
        starts, ends = edges[0::2], edges[1::2]
        return starts.astype(np.int64), (ends - starts).astype(np.int64)

    def counts(self) -> dict:
        state, tokens, _ = self._states()
        return {"live_units": int((state == 1).sum()), "cached_units": int((state == 2).sum()),
                "free_units": int((state == 0).sum()), "tokens_stored": int(tokens.sum())}

    def snapshot(self, now_ns: int) -> PoolState:
        """Record a SNAPSHOT row and return the full state right after it (as ``PagedPool.snapshot``)."""
        state, tokens, holders = self._states()
        offsets, sizes = self.free_runs(state)
        largest = int(sizes.max()) if sizes.size else 0
        stored = int(tokens.sum())
        self._engine.recorder.row(_SNAPSHOT, now_ns, offset=largest, size=int(sizes.size), tokens=stored,
                                  aux=free_runs_checksum(offsets, sizes))
        occupied = np.flatnonzero(state)
        kinds = np.where(state[occupied] == 1, int(RegionState.LIVE), int(RegionState.CACHED)).astype(np.int64)
        refs = [tuple(holders.get(int(u), ())) for u in occupied.tolist()]
        return PoolState(occupied.astype(np.int64), np.ones(occupied.size, dtype=np.int64), kinds,
                         np.zeros(occupied.size, dtype=np.int64), np.where(state[occupied] == 1, tokens[occupied], 0),
                         refs, stored)
