"""vLLM's KV cache and scheduler, as kvguard event rows: the translator behind the vLLM plugin.

The plugin's hooks (``producers.vllm.hooks``) see vLLM's own calls and hand the translator
plain values: request ids, block ids, reference counts before and after a call. The translator
turns them into rows of ``kvguard.contracts.events`` and, at the end of each engine step, into one
``EventBatch`` for its sink. It imports no vLLM and reads no clock of its own (``clock_ns`` is an
argument), so a test drives it with a list sink and plain integers.

Geometry: one unit per usable block. vLLM's block 0 is the null block (never handed out, not in
``BlockPool.get_usage``), so block ``b`` is unit ``b - 1`` and the region has ``num_gpu_blocks - 1``
units; the mirror's ``u_kv`` is then vLLM's ``kv_cache_manager.usage``, and vLLM's free-block count
(its free queue, cached blocks included) is the mirror's ``free_units + cached_units``.

Reference counts are the contract. For every block a hook touches, the translator first brings the
count it has reported up (SHARE) or down (FREE) to the count vLLM had before the call, then writes
the call's own rows. vLLM changes ``ref_cnt`` outside ``BlockPool`` in one place (the copy-on-write
of partial prefix hits, Mamba "align" mode only), and this reconciliation absorbs it. Rows a hook
cannot attribute to a request (those syncs, blocks a KV connector retains) name ``SYSTEM_REQ``
(request 0; vLLM's requests are interned from 1), never -1: the mirror files a reference under its
request.

Rows per vLLM call:

- ARRIVE (``Scheduler.add_request``): tokens = prompt tokens, aux = max_tokens, cls = priority
  (kvguard's 0-10 is ``10 - vLLM priority`` with the priority policy; with FCFS vLLM ignores
  priorities and the row carries the default with ``F_PRIORITY_DEFAULTED``);
- ADMIT: a waiting or preempted request scheduled by ``Scheduler.schedule`` (new or resumed);
- ALLOC per block ``BlockPool.get_new_blocks`` hands out, after a RECLAIM when the block was a
  cached one (vLLM's lazy eviction: ``_maybe_evict_cached_block`` drops its hash on reuse);
- SHARE per reference ``BlockPool.touch`` adds (a prefix hit), reviving a cached block with its
  ``block_size`` tokens;
- FREE per reference ``BlockPool.free_blocks``/``unpin_blocks`` drops, with ``F_TO_CACHE`` when the
  last reference leaves a block that keeps its hash (vLLM appends it to the free queue's tail, where
  a prefix hit can still revive it); tokens = the block's computed tokens as the freeing request
  sees them (``clamp(num_computed_tokens - index * block_size, 0, block_size)``);
- RECLAIM: a cached block lost its hash (reused, ``evict_blocks``, ``reset_prefix_cache``);
- PREEMPT after its FREE rows (``Scheduler._preempt_request``), tokens = tokens to recompute;
- FINISH (``Scheduler._free_request``): tokens = output tokens, flags = ``Outcome``;
- FILL per step (end of ``schedule``): the step's scheduled tokens (the KV the step writes), so
  ``tokens_stored`` is the computed KV of live blocks; STEP per step (``update_from_output``): size = scheduled tokens, tokens = decode tokens,
  aux = ns since the previous step ended.

Tokens are exact for one KV-cache group without speculative decoding. With several groups (hybrid
models) or rejected draft tokens the mirror's ``tokens_stored`` (F_int) drifts; the periodic
SNAPSHOT, built from vLLM's own block pool, resynchronises it. U_kv and free counts stay exact.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvguard.contracts.events import (
    EVENT_DTYPE,
    F_PRIORITY_DEFAULTED,
    F_PROMPT_LOGPROBS,
    F_TO_CACHE,
    EventBatch,
    EventKind,
    Geometry,
    OomStepRow,
    Outcome,
    PoolState,
    RegionState,
    empty_events,
    free_runs_checksum,
)
from kvguard.contracts.units import DEFAULT_PRIORITY, NS_PER_S

SYSTEM_REQ = 0  # references vLLM holds for no request (syncs, connector retentions)

_ROW = struct.Struct("<qBBBqqqqq")
if _ROW.size != EVENT_DTYPE.itemsize:
    raise TypeError(f"EVENT_DTYPE changed ({EVENT_DTYPE}); update producers.vllm.translator._ROW")
_pack = _ROW.pack
_ARRIVE, _ADMIT, _FINISH, _PREEMPT = (int(EventKind.ARRIVE), int(EventKind.ADMIT), int(EventKind.FINISH),
                                      int(EventKind.PREEMPT))
_ALLOC, _SHARE, _FREE, _RECLAIM = int(EventKind.ALLOC), int(EventKind.SHARE), int(EventKind.FREE), int(EventKind.RECLAIM)
_FILL, _STEP, _SNAPSHOT, _OOM = int(EventKind.FILL), int(EventKind.STEP), int(EventKind.SNAPSHOT), int(EventKind.OOM)
_OOM_STEP = int(EventKind.OOM_STEP)


class BatchSink(Protocol):
    """Where the translator's batches go: a list in tests, the node publisher's queue in vLLM."""

    def publish(self, batch: EventBatch) -> None: ...


class ListSink:
    """Keeps every batch (tests, the GPU check, the benchmark)."""

    def __init__(self) -> None:
        self.batches: list[EventBatch] = []

    def publish(self, batch: EventBatch) -> None:
        self.batches.append(batch)

    def events(self) -> np.ndarray:
        return np.concatenate([b.events for b in self.batches]) if self.batches else empty_events(0)


@dataclass(slots=True, frozen=True)
class BlockTruth:
    """vLLM's own view of its blocks (``vllm.hooks.block_truth``), for SNAPSHOT rows.
    Parallel arrays over usable blocks (unit = block id - 1)."""

    ref_cnt: np.ndarray  # int64
    cached: np.ndarray  # bool: ref_cnt == 0 and the block keeps a hash
    tokens: np.ndarray  # int64: computed tokens of live blocks


def geometry_for_blocks(num_gpu_blocks: int, block_size: int, kv_bytes_per_token: int, *, total_bytes: int = 0,
                        weights_bytes: int = 0, gpu_memory_utilization: float = 0.9) -> Geometry:
    """The geometry of a vLLM block pool: one unit per usable block (the null block excluded)."""
    units = int(num_gpu_blocks) - 1
    if units <= 0:
        raise ValueError(f"num_gpu_blocks: expected >= 2 (block 0 is vLLM's null block), got {num_gpu_blocks}")
    kv_bytes_per_token = max(1, int(kv_bytes_per_token))
    dynamic_bytes = units * int(block_size) * kv_bytes_per_token
    total = max(int(total_bytes), dynamic_bytes + int(weights_bytes))
    return Geometry(total_bytes=total, weights_bytes=int(weights_bytes), context_bytes=0,
                    gpu_memory_utilization=float(gpu_memory_utilization), unit_tokens=int(block_size),
                    kv_bytes_per_token=kv_bytes_per_token, dynamic_units=units, page_classes=(1,))


class VllmEventTranslator:
    """Turns the hooks' observations into rows and per-step batches (module docstring)."""

    def __init__(self, node: str, geometry: Geometry, sink: BatchSink, *, clock_ns: Callable[[], int],
                 epoch: int, priority_policy: bool = False, snapshot_every_s: float = 60.0) -> None:
        self.node = node
        self.geometry = geometry
        self.sink = sink
        self.clock_ns = clock_ns
        self.epoch = int(epoch)
        self.priority_policy = priority_policy
        self.block_size = geometry.unit_tokens
        self.snapshot_every_ns = int(snapshot_every_s * NS_PER_S)
        self.seq = 0
        self._rows = bytearray()
        self._ts = 0
        self._ids: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._next_id = SYSTEM_REQ + 1
        self.holders: dict[int, list[int]] = {}  # block id -> requests holding it (one entry per reference)
        self.cached: set[int] = set()  # block ids with no reference that keep their hash
        self.aborted_by_kvguard: set[str] = set()
        self.extra: dict = {}  # rides on the next batch (``EventBatch.extra``: CUDA memory stats)
        self._last_step_end_ns: int | None = None
        self._next_snapshot_ns: int | None = None
        self.rows_total = 0
        self.steps = 0

    # ---------------------------------------------------------------- ids and time
    def req(self, name: str) -> int:
        """kvguard's integer id of vLLM request ``name`` (interned from 1, stable for its life)."""
        rid = self._ids.get(name)
        if rid is None:
            rid = self._next_id
            self._next_id += 1
            self._ids[name] = rid
            self._names[rid] = name
        return rid

    def name_of(self, req: int) -> str | None:
        return self._names.get(int(req))

    def known(self, name: str) -> bool:
        return name in self._ids

    def now(self) -> int:
        """Event time for the next rows: the clock, never going back."""
        ts = self.clock_ns()
        self._ts = max(self._ts, ts)
        return self._ts

    def _row(self, kind: int, req: int = -1, *, cls: int = 0, flags: int = 0, offset: int = 0, size: int = 0,
             tokens: int = 0, aux: int = 0) -> None:
        self._rows += _pack(self._ts, kind, cls, flags, req, offset, size, tokens, aux)

    # ---------------------------------------------------------------- lifecycle
    def on_arrive(self, name: str, prompt_tokens: int, max_tokens: int, priority: int,
                  prompt_logprobs: bool = False) -> None:
        self.now()
        if self.priority_policy:
            cls, flags = min(10, max(0, 10 - int(priority))), 0
        else:
            cls, flags = DEFAULT_PRIORITY, F_PRIORITY_DEFAULTED
        if prompt_logprobs:
            flags |= F_PROMPT_LOGPROBS
        self._row(_ARRIVE, self.req(name), cls=cls, flags=flags, tokens=int(prompt_tokens), aux=int(max_tokens))

    def on_admit(self, name: str) -> None:
        self._row(_ADMIT, self.req(name))

    def on_preempt(self, name: str, tokens: int) -> None:
        self.now()
        self._row(_PREEMPT, self.req(name), tokens=int(tokens))

    def on_finish(self, name: str, outcome: Outcome, output_tokens: int) -> None:
        self.now()
        if name in self.aborted_by_kvguard:
            self.aborted_by_kvguard.discard(name)
            outcome = Outcome.ABORTED
        rid = self.req(name)
        self._row(_FINISH, rid, flags=int(outcome), tokens=int(output_tokens))
        # forgotten now; a block it still holds (a connector's delayed free) is freed under the
        # holder the translator recorded, never under a fresh id
        self._ids.pop(name, None)
        self._names.pop(rid, None)

    # ---------------------------------------------------------------- blocks
    def _sync(self, block_id: int, ref_cnt: int, holder: int) -> None:
        """Bring the reported references of ``block_id`` to vLLM's ``ref_cnt`` (module docstring)."""
        held = self.holders.get(block_id)
        have = len(held) if held else 0
        while have < ref_cnt:
            self._share(block_id, holder)
            have += 1
        while have > ref_cnt:
            self._free(block_id, self.holders[block_id][-1], self.block_size, to_cache=False)
            have -= 1

    def _share(self, block_id: int, holder: int) -> None:
        revive = block_id in self.cached
        if revive:
            self.cached.discard(block_id)
        self.holders.setdefault(block_id, []).append(holder)
        self._row(_SHARE, holder, offset=block_id - 1, size=1, tokens=self.block_size if revive else 0)

    def _free(self, block_id: int, holder: int, tokens: int, *, to_cache: bool) -> None:
        held = self.holders.get(block_id)
        if held:
            try:
                held.remove(holder)
            except ValueError:
                holder = held.pop()
            if not held:
                del self.holders[block_id]
                if to_cache:
                    self.cached.add(block_id)
        flags = F_TO_CACHE if to_cache else 0
        self._row(_FREE, holder, flags=flags, offset=block_id - 1, size=1, tokens=tokens)

    def on_alloc(self, block_ids: list[int], owner: str | None) -> None:
        """``get_new_blocks`` handed out ``block_ids`` (each now at ref_cnt 1)."""
        self.now()
        holder = self.req(owner) if owner is not None else SYSTEM_REQ
        holders, cached, rows, ts = self.holders, self.cached, self._rows, self._ts
        for b in block_ids:
            if b in holders:  # a decrement we never saw: the block was in the free queue
                self._sync(b, 0, holder)
            if b in cached:  # a cached block handed out again: vLLM evicted its hash on reuse
                cached.discard(b)
                rows += _pack(ts, _RECLAIM, 0, 0, -1, b - 1, 1, 0, 0)
            holders[b] = [holder]
            rows += _pack(ts, _ALLOC, 0, 0, holder, b - 1, 1, 0, 0)

    def on_touch(self, blocks: list[tuple[int, int]], owner: str | None) -> None:
        """``touch`` raised each block's count to ``ref_cnt_after`` (pairs ``(block id, after)``)."""
        self.now()
        holder = self.req(owner) if owner is not None else SYSTEM_REQ
        for b, after in blocks:
            self._sync(b, after - 1, SYSTEM_REQ)
            self._share(b, holder)

    def on_free(self, blocks: list[tuple[int, int, int, bool, int]], owner: str | None) -> None:
        """``free_blocks``/``unpin_blocks`` dropped references: ``(block id, ref_cnt before, after,
        keeps its hash, tokens)`` per distinct block."""
        self.now()
        holder = self._ids.get(owner) if owner is not None else None
        for b, before, after, hashed, tokens in blocks:
            self._sync(b, before, SYSTEM_REQ)
            for k in range(before - after):
                last = after == 0 and k == before - after - 1
                who = holder if holder is not None else self._holder_of(b)
                self._free(b, who, tokens, to_cache=last and hashed)

    def _holder_of(self, block_id: int) -> int:
        held = self.holders.get(block_id)
        return held[-1] if held else SYSTEM_REQ

    def on_reclaim(self, block_id: int) -> None:
        """A cached block lost its hash: its unit is free."""
        if block_id in self.cached:
            self.now()
            self.cached.discard(block_id)
            self._row(_RECLAIM, offset=block_id - 1, size=1)

    def on_reclaim_all(self) -> None:
        """``reset_prefix_cache`` succeeded: every cached block is plain free."""
        self.now()
        for b in sorted(self.cached):
            self._row(_RECLAIM, offset=b - 1, size=1)
        self.cached.clear()

    def on_oom_device(self, device_free_bytes: int, reserved_bytes: int, allocated_bytes: int,
                      requested_bytes: int) -> None:
        """The device picture of the allocator OOM row that follows: an OOM_STEP DEVICE row (``kvguard rca``)."""
        self.now()
        self._row(_OOM_STEP, cls=int(OomStepRow.DEVICE), size=max(0, int(device_free_bytes)),
                  offset=max(0, int(reserved_bytes)), tokens=max(0, int(allocated_bytes)),
                  aux=max(0, int(requested_bytes)))

    def on_oom(self, requested_bytes: int, reserved_unallocated_bytes: int, cause: int, layer: int) -> None:
        self.now()
        self._row(_OOM, cls=layer, flags=cause, size=int(requested_bytes), aux=int(reserved_unallocated_bytes))

    def add_rows(self, rows: np.ndarray) -> None:
        """Rows made elsewhere (the allocator layer from ``torch_cuda``), appended in order."""
        if len(rows):
            self._rows += np.ascontiguousarray(rows, dtype=EVENT_DTYPE).tobytes()

    # ---------------------------------------------------------------- steps and batches
    def on_fill(self, scheduled_tokens: int) -> None:
        """The KV one step writes (at the end of ``schedule``, when vLLM counts the tokens computed)."""
        if scheduled_tokens:
            self.now()
            self._row(_FILL, tokens=int(scheduled_tokens))

    def on_step(self, scheduled_tokens: int, decode_tokens: int) -> None:
        """The STEP row of one engine step (after ``update_from_output``)."""
        now = self.now()
        last = self._last_step_end_ns
        self._row(_STEP, size=int(scheduled_tokens), tokens=int(decode_tokens), aux=0 if last is None else now - last)
        self._last_step_end_ns = now
        self.steps += 1

    def snapshot_due(self) -> bool:
        if self._next_snapshot_ns is None:
            self._next_snapshot_ns = self._ts + self.snapshot_every_ns
            return False
        return self._ts >= self._next_snapshot_ns

    def flush(self, truth: BlockTruth | None = None) -> EventBatch | None:
        """Publish the rows so far as one batch (with a SNAPSHOT and its state when ``truth`` is given)."""
        state = None
        if truth is not None:
            state = self._snapshot(truth)
            self._next_snapshot_ns = self._ts + self.snapshot_every_ns
        if not self._rows:
            return None
        events = np.frombuffer(self._rows, dtype=EVENT_DTYPE).copy()
        self._rows = bytearray()
        batch = EventBatch(node=self.node, seq=self.seq, events=events, epoch=self.epoch,
                           geometry=self.geometry if (self.seq == 0 or state is not None) else None, state=state,
                           extra=self.extra)
        self.extra = {}
        self.seq += 1
        self.rows_total += len(events)
        self.sink.publish(batch)
        return batch

    def _snapshot(self, truth: BlockTruth) -> PoolState:
        """A SNAPSHOT row and the state right after it, from vLLM's blocks (reported holders as refs)."""
        self.now()
        live = truth.ref_cnt > 0
        occupied = np.flatnonzero(live | truth.cached)
        state = np.where(live[occupied], int(RegionState.LIVE), int(RegionState.CACHED)).astype(np.int64)
        tokens = np.where(live[occupied], truth.tokens[occupied], 0).astype(np.int64)
        refs = []
        for unit, is_live in zip(occupied.tolist(), live[occupied].tolist()):
            if not is_live:
                refs.append(())
                continue
            held = list(self.holders.get(unit + 1, ()))
            count = int(truth.ref_cnt[unit])
            refs.append(tuple((held + [SYSTEM_REQ] * count)[:count]))
        free = np.concatenate(([False], ~(live | truth.cached), [False]))
        edges = np.flatnonzero(free[1:] != free[:-1])
        starts, sizes = edges[0::2], edges[1::2] - edges[0::2]
        stored = int(tokens.sum())
        self._row(_SNAPSHOT, offset=int(sizes.max()) if sizes.size else 0, size=int(sizes.size), tokens=stored,
                  aux=free_runs_checksum(starts, sizes))
        return PoolState(occupied.astype(np.int64), np.ones(occupied.size, dtype=np.int64), state,
                         np.zeros(occupied.size, dtype=np.int64), tokens, refs, stored)

    @property
    def pending_rows(self) -> int:
        return len(self._rows) // _ROW.size
