"""kvguard's actions on a running SGLang scheduler, and the engine-port adapter the executor calls.

Each action uses a mechanism SGLang 0.5.23 has, on the scheduler's own thread between two steps
(``submit`` queues it from the command consumer's thread; the plugin runs ``run_pending`` at the
top of ``Scheduler.get_next_batch_to_run``):

- ``retract(rid)``: what ``ScheduleBatch.retract_decode`` does to one victim: ``release_req`` (the
  KV freed without caching its output, ``remaining x 20`` tokens evicted from the tree,
  ``reset_for_retract``), the batch filtered, the request re-queued with
  ``Scheduler._add_request_to_queue(req, is_retracted=True)``; it is recomputed from its cached
  prompt. SGLang counts it in its own retraction metrics only when it retracts by itself.
- ``abort(rid)``: ``Scheduler.abort_request(AbortReq(rid=...))``, as the HTTP ``/abort_request`` does;
- ``hold_admission(max_prompt_tokens)``: requests with longer prompts are taken out of
  ``waiting_queue`` while ``_get_new_batch_prefill_raw`` runs and put back in their place after;
- ``set_token_cap(tokens)``: ``Scheduler.chunked_prefill_size`` (and ``max_prefill_tokens``) lowered,
  so a step prefills at most that many tokens; 0 restores them;
- ``set_headroom(tokens)``: the ``PrefillAdder`` the scheduler builds (``get_prefill_adder_class``)
  starts with ``tokens`` already in its budget's offsets, so admission sees that much less room;
- ``reclaim(tokens)``: ``tree_cache.evict(EvictParams(num_tokens=...))``: unlocked radix pages, least
  recently used first (``/flush_cache`` frees all, but only when idle);
- ``empty_cache()``: ``torch.cuda.empty_cache()`` where the process has CUDA (NOOP with the reason
  elsewhere).

``compact`` has no counterpart (pages are uniform), nor do block- or token-granularity evictions
(a row is freed whole). ``SGLANG_CAPABILITY_FIELDS`` says so in the engine port's terms.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from kvguard.contracts.dimensions import Granularity, HandlingChoice
from kvguard.contracts.engine import Capabilities
from kvguard.contracts.events import Handling
from kvguard.contracts.pool_types import EvictResult, PageInfo, UnknownRequest

log = logging.getLogger("kvguard.sglang")

# The engine port's Capabilities for SGLang (kvguard.contracts.engine): the plugin's adapter declares
# these, the SGLang-faithful shadow engine the same less empty_cache. ``caching_allocator``: SGLang's
# activations do live in PyTorch's caching allocator, but neither the plugin (no allocator observer
# wired for SGLang yet) nor the shadow engine (no allocator twin) reports it, so the policy's
# allocator guards must not count on it.
SGLANG_CAPABILITY_FIELDS = {
    "uniform_blocks": True,  # pages of --page-size tokens; a KV shortage retracts
    "caching_allocator": False,
    "prompt_logprobs": False,
    "evict_granularities": frozenset({Granularity.REQUEST}),
    "evict_handlings": frozenset({HandlingChoice.RECOMPUTE}),
    "admission_headroom": True,
    "token_budget": True,
    "admission_hold": True,
    "abort": True,
    "empty_cache": True,
    "compact": False,
    "reclaim_cached": True,
    "notes": (("compact", "SGLang's KV pages are uniform: there are no free runs to coalesce"),
              ("evict_granularities", "SGLang frees a request's row whole: only whole requests are retracted"),
              ("evict_handlings", "SGLang retracts by recompute (its decode-side host backup is PD-only)"),
              ("caching_allocator", "kvguard does not observe SGLang's caching allocator yet"),
              ("prompt_logprobs", "kvguard's logprob guard is vLLM's only")),
}
SGLANG_CAPABILITIES = Capabilities(**SGLANG_CAPABILITY_FIELDS)


@dataclass(slots=True, frozen=True)
class ActionResult:
    action: str
    done: bool
    detail: str = ""
    units: int = 0


class SglangActions:
    """The actions of the module docstring on one SGLang ``Scheduler``."""

    def __init__(self, scheduler: Any, *, torch_module: Any = None) -> None:
        self.scheduler = scheduler
        self.torch = torch_module
        self._pending: deque[Callable[[], Any]] = deque()
        self._lock = threading.Lock()
        self.hold_max_prompt_tokens: int | None = None
        self.headroom_tokens = 0
        self._configured_chunk = getattr(scheduler, "chunked_prefill_size", None)
        self._configured_prefill = getattr(scheduler, "max_prefill_tokens", None)
        self.retracted_by_kvguard: set[str] = set()

    # ---------------------------------------------------------------- threading
    def submit(self, fn: Callable[[], Any]) -> None:
        with self._lock:
            self._pending.append(fn)

    def run_pending(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    return
                fn = self._pending.popleft()
            try:
                fn()
            except Exception:
                log.exception("kvguard: an action on SGLang's scheduler failed")

    # ---------------------------------------------------------------- actions
    @property
    def page_size(self) -> int:
        return int(getattr(self.scheduler.token_to_kv_pool_allocator, "page_size", 1))

    def _running(self) -> list:
        batch = getattr(self.scheduler, "running_batch", None)
        return list(batch.reqs) if batch is not None else []

    def retract(self, rid: str) -> ActionResult:
        """One running request retracted as ``retract_decode`` retracts its victims."""
        batch = self.scheduler.running_batch
        index = next((i for i, r in enumerate(batch.reqs) if r.rid == rid and not r.finished()), None)
        if index is None:
            return ActionResult("retract", False, f"{rid} is not decoding")
        req = batch.reqs[index]
        available = self.scheduler.token_to_kv_pool_allocator.available_size()
        remaining = len(batch.reqs) - 1
        batch.release_req(index, remaining)
        batch.filter_batch(keep_indices=[i for i in range(len(batch.reqs)) if i != index])
        batch.batch_is_full = False
        self.scheduler._add_request_to_queue(req, is_retracted=True)
        self.retracted_by_kvguard.add(rid)
        freed = self.scheduler.token_to_kv_pool_allocator.available_size() - available
        return ActionResult("retract", True, units=freed // self.page_size)

    def abort(self, rid: str) -> ActionResult:
        from sglang.srt.managers.io_struct import AbortReq  # sglang: loaded already inside SGLang

        known = any(r.rid == rid for r in self._running()) or any(
            r.rid == rid for r in getattr(self.scheduler, "waiting_queue", []))
        if not known:
            return ActionResult("abort", False, f"{rid} is not in the scheduler")
        self.scheduler.abort_request(AbortReq(rid=rid))
        return ActionResult("abort", True)

    def hold_admission(self, max_prompt_tokens: int) -> ActionResult:
        self.hold_max_prompt_tokens = int(max_prompt_tokens)
        return ActionResult("hold", True)

    def release(self) -> ActionResult:
        had = self.hold_max_prompt_tokens is not None
        self.hold_max_prompt_tokens = None
        return ActionResult("release", had, "" if had else "no hold in place")

    def set_token_cap(self, tokens: int) -> ActionResult:
        s = self.scheduler
        if tokens <= 0:
            s.chunked_prefill_size, s.max_prefill_tokens = self._configured_chunk, self._configured_prefill
            return ActionResult("batch_cap", True, "released")
        cap = max(int(tokens), self.page_size)
        s.chunked_prefill_size = min(self._configured_chunk, cap) if self._configured_chunk else cap
        s.max_prefill_tokens = min(self._configured_prefill or cap, cap)
        return ActionResult("batch_cap", True)

    def set_headroom(self, tokens: int) -> ActionResult:
        if tokens < 0:
            raise ValueError(f"headroom must be >= 0 tokens, got {tokens}")
        if tokens < self.headroom_tokens:
            # SGLang skips admission while the running batch is marked full (its budget ran out) until a
            # request frees memory; a smaller hold frees budget, so admission must look again
            self.scheduler.running_batch.batch_is_full = False
        self.headroom_tokens = int(tokens)
        return ActionResult("headroom", True)

    def reclaim(self, tokens: int) -> ActionResult:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # sglang: loaded already inside SGLang

        tree = self.scheduler.tree_cache
        alloc = self.scheduler.token_to_kv_pool_allocator
        before = alloc.available_size()
        tree.evict(EvictParams(num_tokens=int(tokens)))
        freed = alloc.available_size() - before
        return ActionResult("reclaim", freed > 0, "" if freed else "no cached prefix pages to drop",
                            units=freed // self.page_size)

    def empty_cache(self) -> ActionResult:
        torch = self.torch
        if torch is None or not torch.cuda.is_available():
            return ActionResult("empty_cache", False, "no CUDA in this process")
        before = torch.cuda.memory_reserved()
        torch.cuda.empty_cache()
        return ActionResult("empty_cache", True, f"{before - torch.cuda.memory_reserved()} bytes returned to the device")

    # ---------------------------------------------------------------- the scheduler's calls
    def waiting_without_held(self) -> list | None:
        """Take the held requests out of ``waiting_queue``; what to put back (None: nothing held)."""
        cap = self.hold_max_prompt_tokens
        s = self.scheduler
        if cap is None:
            return None
        held = [r for r in s.waiting_queue if len(r.origin_input_ids) > cap]
        if not held:
            return None
        order = {id(r): i for i, r in enumerate(s.waiting_queue)}
        s.waiting_queue = [r for r in s.waiting_queue if len(r.origin_input_ids) <= cap]
        return [held, order]

    def put_back(self, held_and_order) -> None:
        held, order = held_and_order
        s = self.scheduler
        known = sorted(held + [r for r in s.waiting_queue if id(r) in order], key=lambda r: order[id(r)])
        s.waiting_queue = known + [r for r in s.waiting_queue if id(r) not in order]

    def adder_class(self, base: type) -> type:
        """``PrefillAdder`` with kvguard's headroom in its budget (``get_prefill_adder_class``)."""
        actions = self

        class HeadroomPrefillAdder(base):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                headroom = actions.headroom_tokens
                if headroom:
                    self.memory_budget.total_offset += headroom
                    self.memory_budget.current_offset += headroom

        return HeadroomPrefillAdder


class SglangExecutorEngine:
    """The engine port over ``SglangActions`` (kvguard's Executor calls it on the scheduler thread).
    Units are pages; request ids are kvguard's integers (the translator interns SGLang's rids).
    ``capabilities``: ``SGLANG_CAPABILITIES``."""

    capabilities: ClassVar[Capabilities] = SGLANG_CAPABILITIES

    def __init__(self, node: str, actions: SglangActions, names: Callable[[int], str | None]) -> None:
        self.node = node
        self.actions = actions
        self._name = names

    @property
    def pool_units(self) -> int:
        alloc = self.actions.scheduler.token_to_kv_pool_allocator
        return int(alloc.size) // self.actions.page_size

    def evict_request(self, req: int, now_ns: int, *, granularity: str = Granularity.REQUEST,
                      handling: Handling = Handling.RECOMPUTE, pages=None) -> EvictResult:
        handling = Handling(handling)
        name = self._name(req)
        if name is None or granularity != Granularity.REQUEST:
            return EvictResult(req=req, handling=handling)
        r = self.actions.retract(name)
        return EvictResult(req=req, handling=Handling.RECOMPUTE, pages=r.units, units_freed=r.units) if r.done \
            else EvictResult(req=req, handling=handling)

    def request_pages(self, req: int) -> list[PageInfo]:
        raise UnknownRequest(req)  # rows are freed whole: no block or token granularity

    def compact(self, now_ns: int, max_moves: int) -> int:
        return 0

    def reclaim_cached(self, units: int, now_ns: int) -> int:
        return self.actions.reclaim(units * self.actions.page_size).units

    def set_admission_headroom(self, units: int) -> None:
        self.actions.set_headroom(units * self.actions.page_size)

    def set_batch_token_cap(self, tokens: int, steps: int = 0) -> None:
        self.actions.set_token_cap(tokens)

    def hold_admissions(self, max_prompt_tokens: int, steps: int = 0) -> None:
        self.actions.hold_admission(max_prompt_tokens)

    def release_admissions(self) -> bool:
        return self.actions.release().done

    def abort_request(self, req: int, now_ns: int) -> int | None:
        name = self._name(req)
        if name is None:
            return None
        return 0 if self.actions.abort(name).done else None

    def empty_cache(self, now_ns: int) -> int | None:
        r = self.actions.empty_cache()
        return int(r.detail.split()[0]) if r.done else None
