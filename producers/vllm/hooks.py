"""The vLLM plugin's hooks: instance-level wrappers on one live ``Scheduler``, its ``KVCacheManager``
and its ``BlockPool`` (vLLM 0.33's v1 core), feeding ``VllmEventTranslator``.

Each wrapper calls vLLM's own method and then reports what changed; none changes an argument, a
return value or a decision. They are set as attributes of the instances (``setattr(pool,
"free_blocks", wrapper)``), so vLLM's internal calls (``self.free_blocks(...)``) reach them, other
instances of the classes are untouched, and ``detach()`` restores the class methods by deleting
the attributes. vLLM is not imported here: the hooks read attributes of the objects they are given.

Hooked methods (vllm/v1/core/...), and what each reports:

- ``BlockPool.get_new_blocks`` (ALLOC, after a RECLAIM for a cached block handed out again: vLLM's
  lazy eviction), ``touch`` (SHARE), ``free_blocks`` and ``unpin_blocks`` (FREE, ``F_TO_CACHE`` when
  the block keeps its hash), ``evict_blocks`` and ``reset_prefix_cache`` (RECLAIM of cached blocks
  that lost their hash). vLLM removes the hash of a block with no reference nowhere else; the
  periodic SNAPSHOT would resynchronise the mirror if a later vLLM did;
- ``KVCacheManager.allocate_slots``, ``free``, ``remove_skipped_blocks``: which request the pool
  calls inside them belong to, and (``free``) each block's computed tokens;
- ``Scheduler.add_request`` (ARRIVE), ``schedule`` (ADMIT of new and resumed requests, FILL; the
  plugin's admission hold and batch-token cap around it), ``_preempt_request`` (PREEMPT),
  ``_free_request`` (FINISH), ``update_from_output`` (STEP, the batch flush, the periodic SNAPSHOT,
  the CUDA memory sample), ``finish_requests`` (a flush when an abort arrives between steps).

The async scheduler (``AsyncScheduler``, a ``Scheduler`` subclass) schedules step N+1 before step N's
``update_from_output``; the rows stay in call order, and a batch is flushed per ``update_from_output``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvguard.contracts.events import Outcome
from kvguard.producers.vllm.translator import BlockTruth, VllmEventTranslator

_OUTCOMES = {
    "FINISHED_STOPPED": Outcome.COMPLETED,
    "FINISHED_LENGTH_CAPPED": Outcome.COMPLETED,
    "FINISHED_REPETITION": Outcome.COMPLETED,
    "FINISHED_ABORTED": Outcome.ABORTED,
    "FINISHED_ERROR": Outcome.ABORTED,  # an engine-side error (kvguard's abort uses this channel)
    "FINISHED_IGNORED": Outcome.REJECTED,
}


def outcome_of(status: Any) -> Outcome:
    return _OUTCOMES.get(getattr(status, "name", str(status)), Outcome.COMPLETED)


class Attachment:
    """The hooks on one scheduler. ``actions`` (``VllmActions``) and ``memory``
    (``CudaMemoryObserver``) are optional; both are called on the engine thread only."""

    def __init__(self, scheduler: Any, translator: VllmEventTranslator, *, actions: Any = None, memory: Any = None,
                 snapshots: bool = True, admission: Any = None) -> None:
        self.scheduler = scheduler
        self.kv = scheduler.kv_cache_manager
        self.pool = self.kv.block_pool
        self.translator = translator
        self.actions = actions
        self.memory = memory
        self.snapshots = snapshots
        self.admission = admission  # producers.vllm.admission.VllmAdmission: fed step times and finished lengths
        self._step_started = 0.0
        self.caching = bool(self.pool.enable_caching)
        self.block_size = translator.block_size
        self._owner: str | None = None
        self._free_tokens: dict[int, int] | None = None
        self._in_step = 0
        self._patched: list[tuple[Any, str]] = []
        self.attached = False

    # ---------------------------------------------------------------- install / remove
    def attach(self) -> Attachment:
        if self.attached:
            return self
        pool, kv, sched = self.pool, self.kv, self.scheduler
        for obj, name, make in (
            (pool, "get_new_blocks", self._get_new_blocks), (pool, "touch", self._touch),
            (pool, "free_blocks", self._free_blocks), (pool, "unpin_blocks", self._unpin_blocks),
            (pool, "evict_blocks", self._evict_blocks), (pool, "reset_prefix_cache", self._reset_prefix_cache),
            (kv, "allocate_slots", self._allocate_slots), (kv, "free", self._kv_free),
            (kv, "remove_skipped_blocks", self._remove_skipped_blocks),
            (sched, "add_request", self._add_request), (sched, "schedule", self._schedule),
            (sched, "update_from_output", self._update_from_output),
            (sched, "_preempt_request", self._preempt_request), (sched, "_free_request", self._free_request),
            (sched, "finish_requests", self._finish_requests),
        ):
            if not hasattr(obj, name):
                raise AttributeError(f"vLLM {type(obj).__name__} has no {name}(): not the vLLM 0.33 v1 core this "
                                     "plugin hooks")
            setattr(obj, name, make(getattr(obj, name)))
            self._patched.append((obj, name))
        self.attached = True
        return self

    def detach(self) -> None:
        for obj, name in reversed(self._patched):
            if name in vars(obj):
                delattr(obj, name)
        self._patched.clear()
        self.attached = False

    # ---------------------------------------------------------------- block pool
    def _get_new_blocks(self, orig: Callable) -> Callable:
        tr = self.translator

        def get_new_blocks(num_blocks):
            blocks = orig(num_blocks)
            tr.on_alloc([b.block_id for b in blocks], self._owner)
            return blocks
        return get_new_blocks

    def _touch(self, orig: Callable) -> Callable:
        tr = self.translator

        def touch(blocks):
            orig(blocks)
            seen: set[int] = set()
            pairs = []
            for b in blocks:
                if b.is_null or b.block_id in seen:
                    continue
                seen.add(b.block_id)
                pairs.append((b.block_id, b.ref_cnt))
            if pairs:
                tr.on_touch(pairs, self._owner)
        return touch

    def _releasing(self, orig: Callable) -> Callable:
        """``free_blocks`` / ``unpin_blocks``: report each distinct block's count before and after."""
        tr, pool, caching, bs = self.translator, self.pool, self.caching, self.block_size

        def release(ordered_blocks, *args, **kwargs):
            blocks = list(ordered_blocks)
            before: dict[int, Any] = {}
            counts: dict[int, int] = {}
            for b in blocks:
                if b.is_null or (b.pool is not None and b.pool is not pool) or b.block_id in before:
                    continue
                before[b.block_id] = b
                counts[b.block_id] = b.ref_cnt
            result = orig(blocks, *args, **kwargs)
            if before:
                tokens = self._free_tokens or {}
                tr.on_free([(i, counts[i], b.ref_cnt, caching and b.block_hash is not None, tokens.get(i, bs))
                            for i, b in before.items()], self._owner)
            return result
        return release

    def _free_blocks(self, orig: Callable) -> Callable:
        return self._releasing(orig)

    def _unpin_blocks(self, orig: Callable) -> Callable:
        return self._releasing(orig)

    def _evict_blocks(self, orig: Callable) -> Callable:
        """``evict_blocks`` (a KV connector drops blocks from the prefix cache): a cached block that
        lost its hash is free. (Reuse of a cached block is reported by ``on_alloc``.)"""
        tr, blocks = self.translator, self.pool.blocks

        def evict_blocks(block_ids):
            orig(block_ids)
            cached = tr.cached
            for block_id in block_ids:
                if block_id in cached and blocks[block_id].block_hash is None:
                    tr.on_reclaim(block_id)
        return evict_blocks

    def _reset_prefix_cache(self, orig: Callable) -> Callable:
        tr = self.translator

        def reset_prefix_cache(*args, **kwargs):
            ok = orig(*args, **kwargs)
            if ok:
                tr.on_reclaim_all()
            return ok
        return reset_prefix_cache

    # ---------------------------------------------------------------- KV cache manager
    def _owned(self, orig: Callable, request_id_of: Callable[[Any], str]) -> Callable:
        def owned(first, *args, **kwargs):
            previous = self._owner
            self._owner = request_id_of(first)
            try:
                return orig(first, *args, **kwargs)
            finally:
                self._owner = previous
        return owned

    def _allocate_slots(self, orig: Callable) -> Callable:
        att = self  # called for every scheduled request of every step: no helper call in between

        def allocate_slots(request, *args, **kwargs):
            previous = att._owner
            att._owner = request.request_id
            try:
                return orig(request, *args, **kwargs)
            finally:
                att._owner = previous
        return allocate_slots

    def _remove_skipped_blocks(self, orig: Callable) -> Callable:
        return self._owned(orig, lambda request_id: request_id)

    def _kv_free(self, orig: Callable) -> Callable:
        def free(request, *args, **kwargs):
            previous, previous_tokens = self._owner, self._free_tokens
            self._owner = request.request_id
            self._free_tokens = self.block_tokens(request)
            try:
                return orig(request, *args, **kwargs)
            finally:
                self._owner, self._free_tokens = previous, previous_tokens
        return free

    def block_tokens(self, request: Any) -> dict[int, int]:
        """Computed tokens of each block of ``request``: ``clamp(computed - index * block_size)``."""
        out: dict[int, int] = {}
        computed = request.num_computed_tokens
        coordinator = self.kv.coordinator
        for group, blocks in enumerate(coordinator.get_blocks(request.request_id)):
            bs = coordinator.single_type_managers[group].block_size
            t = computed
            for b in blocks:
                if not b.is_null:
                    out[b.block_id] = bs if t > bs else (max(0, t))
                t -= bs
        return out

    # ---------------------------------------------------------------- scheduler
    def _add_request(self, orig: Callable) -> Callable:
        tr, sched = self.translator, self.scheduler

        def add_request(request):
            new = request.request_id not in sched.requests
            orig(request)
            if new and request.request_id in sched.requests:
                params = getattr(request, "sampling_params", None)
                tr.on_arrive(request.request_id, request.num_prompt_tokens, request.max_tokens, request.priority,
                             prompt_logprobs=getattr(params, "prompt_logprobs", None) is not None)
        return add_request

    def _schedule(self, orig: Callable) -> Callable:
        tr, actions = self.translator, self.actions

        def schedule(*args, **kwargs):
            self._in_step += 1
            try:
                if actions is not None:
                    actions.before_schedule()
                try:
                    out = orig(*args, **kwargs)
                finally:
                    if actions is not None:
                        actions.after_schedule()
                for new in out.scheduled_new_reqs:
                    tr.on_admit(new.req_id)
                for rid in out.scheduled_cached_reqs.resumed_req_ids:
                    tr.on_admit(rid)
                tr.on_fill(out.total_num_scheduled_tokens)
                if actions is not None:
                    actions.count_step(out.total_num_scheduled_tokens)
                    actions.step_started(out)  # the step governor's prediction, the peak statistics reset
                if self.admission is not None:
                    self._step_started = time.perf_counter()
                return out
            finally:
                self._in_step -= 1
        return schedule

    def _update_from_output(self, orig: Callable) -> Callable:
        tr, sched = self.translator, self.scheduler

        def update_from_output(scheduler_output, *args, **kwargs):
            self._in_step += 1
            try:
                decode = 0
                get = sched.requests.get
                for rid, n in scheduler_output.num_scheduled_tokens.items():
                    request = get(rid)
                    if request is not None and request.num_computed_tokens - n >= request.num_prompt_tokens:
                        decode += n
                if self.admission is not None and self._step_started:  # the model ran since schedule() returned
                    total = scheduler_output.total_num_scheduled_tokens
                    self.admission.timer.observe(total - decode, decode, time.perf_counter() - self._step_started)
                    self._step_started = 0.0
                result = orig(scheduler_output, *args, **kwargs)
                tr.on_step(scheduler_output.total_num_scheduled_tokens, decode)
                if self.actions is not None:
                    self.actions.step_finished()  # the step's measured peak into the governor's calibration
                if self.memory is not None:
                    self.memory.sample()
                tr.flush(self.block_truth() if self.snapshots and tr.snapshot_due() else None)
                return result
            finally:
                self._in_step -= 1
        return update_from_output

    def _preempt_request(self, orig: Callable) -> Callable:
        tr = self.translator

        def preempt_request(request, *args, **kwargs):
            tokens = request.num_tokens
            orig(request, *args, **kwargs)
            tr.on_preempt(request.request_id, tokens)
        return preempt_request

    def _free_request(self, orig: Callable) -> Callable:
        tr = self.translator

        def free_request(request, *args, **kwargs):
            result = orig(request, *args, **kwargs)
            outcome = outcome_of(request.status)
            tr.on_finish(request.request_id, outcome, request.num_output_tokens)
            if self.admission is not None and outcome is Outcome.COMPLETED:
                self.admission.observe_finished(request)
            return result
        return free_request

    def _finish_requests(self, orig: Callable) -> Callable:
        tr = self.translator

        def finish_requests(request_ids, finished_status):
            result = orig(request_ids, finished_status)
            if not self._in_step:
                tr.flush()  # an abort between steps (the client went away): publish it now
            return result
        return finish_requests

    # ---------------------------------------------------------------- vLLM's own state
    def block_truth(self) -> BlockTruth:
        """vLLM's blocks as they are now (for SNAPSHOT rows): O(blocks), taken once per snapshot period."""
        blocks = self.pool.blocks[1:]
        ref_cnt = np.fromiter((b.ref_cnt for b in blocks), dtype=np.int64, count=len(blocks))
        hashed = np.fromiter((b.block_hash is not None for b in blocks), dtype=bool, count=len(blocks))
        cached = (ref_cnt == 0) & hashed if self.caching else np.zeros(len(blocks), dtype=bool)
        tokens = np.zeros(len(blocks), dtype=np.int64)
        for request in list(self.scheduler.requests.values()):
            for block_id, t in self.block_tokens(request).items():
                tokens[block_id - 1] = max(tokens[block_id - 1], t)
        return BlockTruth(ref_cnt=ref_cnt, cached=cached, tokens=tokens)
