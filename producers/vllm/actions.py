"""Commands executed inside vLLM: what the plugin can do to a live v1 ``Scheduler`` (vLLM 0.33).

Every action runs on the engine thread, between steps, through vLLM's public scheduler interface
or an internal the scheduler itself uses for the same purpose (named per action):

- ``preempt(request_id)``: the request goes back to the waiting queue and is recomputed later, as
  ``Scheduler.reset_prefix_cache(reset_running_requests=True)`` does it: ``running.remove``, then
  ``Scheduler._preempt_request(request, time.monotonic(), drop_stale_output=True)`` (frees its blocks,
  status PREEMPTED, prepended to ``waiting``), and ``prev_step_scheduled_req_ids.discard`` so the
  model runner receives its whole token list when it resumes;
- ``abort(request_id, reason)``: the request ends with an error its client sees (``finish_reason
  "error"``, a retryable ``RequestError``), through the channel vLLM uses for requests it fails
  itself (``Scheduler.grammar_compile_error_reqs``: ``update_from_output`` finishes them with
  ``FINISHED_ERROR`` and emits their ``EngineCoreOutput``). A plain ``finish_requests`` would free
  the request without telling its client. Takes effect at the end of the step in flight;
- ``hold_admission(max_prompt_tokens, steps)``: no waiting (or preempted) request whose prompt is
  longer than the cap is admitted; ``max_prompt_tokens=0`` holds every admission. During each
  ``schedule()`` call the held requests are taken out of ``Scheduler.waiting`` (``RequestQueue.
  remove_requests``) and put back in their order afterwards; a hold of everything sets the
  scheduler's pause state to ``PauseState.PAUSED_NEW`` for that call only (what ``EngineCore.
  pause_scheduler(mode="wait")`` sets for good). Outside ``schedule()`` the queue and the pause state
  are vLLM's own, so the engine keeps counting held requests as unfinished and keeps stepping;
- ``cap_batch_tokens(max_tokens, steps)``: ``Scheduler.max_num_scheduled_tokens`` (the token
  budget ``schedule()`` starts from) is lowered for the next ``steps`` non-empty steps (None: until
  ``release_batch_cap()``), during each ``schedule()`` call;
- ``set_headroom(blocks)``: ``KVCacheManager.watermark_blocks`` (the free blocks vLLM keeps back
  when it admits a waiting or preempted request) is raised by ``blocks`` (0 restores vLLM's own);
- ``empty_cache()``: ``torch.cuda.empty_cache()`` when this process has initialised CUDA (the
  worker runs in the engine process: ``UniProcExecutor``, one GPU); otherwise a no-op that says so;
- ``drain()`` / ``release()``: hold every admission until released; running requests finish;
- the step governor (on unless ``KVGUARD_GOVERNOR=0``; the logprob guard is one of its cases):
  each ``schedule()`` starts from a token budget whose step's non-KV peak fits what the caching
  allocator can still give, calibrated on the measured peaks of earlier steps
  (``producers.vllm.plugin_governor``) — vLLM's own workarounds for these OOMs (vllm#5424: bound the
  tokens per batch), applied only while needed. Inert without CUDA in the process.

``submit(fn)`` is the thread-safe way in (the command consumer's thread); ``before_schedule``
runs what was submitted. ``ExecutorEngine`` is the engine port (``kvguard.contracts.engine``) kvguard's
``Executor`` (actuators.executor) calls, mapped onto these actions; ``VLLM_CAPABILITIES`` says what it
offers (the vLLM-faithful shadow engine declares the same).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from kvguard.contracts.dimensions import Granularity, HandlingChoice
from kvguard.contracts.engine import Capabilities
from kvguard.contracts.events import Handling
from kvguard.contracts.pool_types import EvictResult, PageInfo, UnknownRequest

log = logging.getLogger(__name__)

# What vLLM's v1 engine offers kvguard (both this plugin and the vLLM-faithful shadow engine)
VLLM_CAPABILITIES = Capabilities(
    uniform_blocks=True,  # paged KV blocks of one size; a KV shortage preempts
    caching_allocator=True,  # activations and logits live in PyTorch's CUDACachingAllocator
    prompt_logprobs=True,
    evict_granularities=frozenset({Granularity.REQUEST}),
    evict_handlings=frozenset({HandlingChoice.RECOMPUTE}),
    admission_headroom=True,  # KVCacheManager.watermark_blocks
    token_budget=True,  # Scheduler.max_num_scheduled_tokens
    admission_hold=True,
    abort=True,
    empty_cache=True,  # torch.cuda.empty_cache(); NOOP with the reason where the process has no CUDA
    compact=False,
    reclaim_cached=False,
    notes=(("compact", "vLLM's KV blocks are uniform: there are no free runs to coalesce"),
           ("reclaim_cached", "vLLM's cached blocks already count as free and are reused on demand"),
           ("evict_granularities", "vLLM's block tables are append-only: only whole requests are freed"),
           ("evict_handlings", "vLLM v1 preempts by recompute only (it has no swap)")),
)


@dataclass(slots=True, frozen=True)
class ActionResult:
    action: str
    outcome: str  # "executed" | "noop" | "queued"
    detail: str = ""
    blocks_freed: int = 0
    bytes_released: int = 0


class VllmActions:
    def __init__(self, scheduler: Any, translator: Any, *, torch_module: Any = None) -> None:
        self.scheduler = scheduler
        self.translator = translator
        self.torch = torch_module
        self.engine_thread = threading.get_ident()
        self._pending: deque[Callable[[], Any]] = deque()
        self.hold_cap: int | None = None  # max prompt tokens admitted; 0 = none; None = no hold
        self.hold_steps: int | None = None
        self.batch_cap: int | None = None
        self.batch_cap_steps = 0
        self.headroom_blocks = 0
        self.base_watermark_blocks = int(getattr(scheduler.kv_cache_manager, "watermark_blocks", 0))
        self.results: deque[ActionResult] = deque(maxlen=256)
        self._held: list = []
        self._order: dict[int, int] | None = None
        self._saved_pause: Any = None
        self._saved_budget: int | None = None
        self._paused_new: Any = None
        self.logprobs_bytes_per_token: int | None = None  # set by the plugin: what one prompt-logprob position costs
        self.logprobs_margin_bytes = 256 << 20
        self.logprobs_guard_steps = 0  # steps whose budget the step governor lowered (the guard's old count)
        self.governor: Any = None  # set by the plugin: producers.vllm.plugin_governor.PluginGovernor
        self._saved_active: int | None = None

    # ---------------------------------------------------------------- threading
    def submit(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the engine thread before the next ``schedule()`` (thread-safe)."""
        self._pending.append(fn)

    def run_pending(self) -> int:
        n = 0
        while self._pending:
            fn = self._pending.popleft()
            try:
                fn()
            except Exception:
                log.exception("kvguard: a submitted action raised")
            n += 1
        return n

    def _done(self, action: str, outcome: str, detail: str = "", blocks_freed: int = 0,
              bytes_released: int = 0) -> ActionResult:
        result = ActionResult(action, outcome, detail, blocks_freed, bytes_released)
        self.results.append(result)
        log.info("kvguard action %s: %s %s", action, outcome, detail)
        return result

    # ---------------------------------------------------------------- actions
    def preempt(self, request_id: str) -> ActionResult:
        sched = self.scheduler
        request = sched.requests.get(request_id)
        if request is None or request not in sched.running:
            return self._done("preempt", "noop", f"{request_id} is not running")
        freed = self._private_blocks(request_id)
        sched.running.remove(request)
        sched._preempt_request(request, time.monotonic(), drop_stale_output=True)
        sched.prev_step_scheduled_req_ids.discard(request_id)
        return self._done("preempt", "executed", f"{request_id} back to waiting", freed)

    def abort(self, request_id: str, reason: str = "aborted by kvguard to prevent a GPU out-of-memory") -> ActionResult:
        from vllm.outputs import RequestError  # vllm: optional, heavy, and already loaded inside vLLM

        sched = self.scheduler
        request = sched.requests.get(request_id)
        if request is None or request.is_finished():
            return self._done("abort", "noop", f"{request_id} is not in the scheduler")
        freed = self._private_blocks(request_id)
        self.translator.aborted_by_kvguard.add(request_id)
        sched.grammar_compile_error_reqs[request_id] = RequestError(code="kvguard_abort", message=reason,
                                                                    retryable=True)
        return self._done("abort", "executed", f"{request_id} ends at the end of this step", freed)

    def hold_admission(self, max_prompt_tokens: int = 0, steps: int | None = None) -> ActionResult:
        if max_prompt_tokens < 0 or (steps is not None and steps <= 0):
            raise ValueError(f"hold_admission: max_prompt_tokens >= 0 and steps > 0 or None, got "
                             f"{max_prompt_tokens}, {steps}")
        self.hold_cap, self.hold_steps = int(max_prompt_tokens), steps
        what = "every admission" if max_prompt_tokens == 0 else f"prompts over {max_prompt_tokens} tokens"
        return self._done("hold", "executed", f"{what} held" + (f" for {steps} steps" if steps else " until released"))

    def release(self) -> ActionResult:
        had = self.hold_cap is not None
        self.hold_cap = self.hold_steps = None
        return self._done("release", "executed" if had else "noop", "admissions released" if had else "no hold")

    def drain(self) -> ActionResult:
        self.hold_admission(0)
        return self._done("drain", "executed", f"{len(self.scheduler.running)} running requests finish, "
                                               f"{len(self.scheduler.waiting)} wait")

    def cap_batch_tokens(self, max_tokens: int, steps: int | None) -> ActionResult:
        """At most ``max_tokens`` scheduled tokens per step for ``steps`` non-empty steps (None: until
        ``release_batch_cap``)."""
        if max_tokens <= 0 or (steps is not None and steps <= 0):
            raise ValueError(f"cap_batch_tokens: max_tokens > 0 and steps > 0 or None, got {max_tokens}, {steps}")
        self.batch_cap, self.batch_cap_steps = int(max_tokens), (int(steps) if steps is not None else None)
        return self._done("batch_cap", "executed", f"at most {max_tokens} tokens per step "
                                                   + (f"for {steps} steps" if steps else "until released"))

    def release_batch_cap(self) -> ActionResult:
        had = self.batch_cap is not None
        self.batch_cap = self.batch_cap_steps = None
        return self._done("batch_cap", "executed" if had else "noop", "token budget restored" if had else "no cap")

    def set_headroom(self, blocks: int) -> ActionResult:
        self.headroom_blocks = max(0, int(blocks))
        self.scheduler.kv_cache_manager.watermark_blocks = self.base_watermark_blocks + self.headroom_blocks
        return self._done("headroom", "executed", f"watermark {self.base_watermark_blocks} + {self.headroom_blocks} "
                                                  "blocks")

    def empty_cache(self) -> ActionResult:
        torch = self.torch
        if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return self._done("empty_cache", "noop", "no CUDA in this process (CPU, or the workers run in other "
                                                     "processes): nothing to release")
        before = torch.cuda.memory_reserved()
        torch.cuda.empty_cache()
        released = before - torch.cuda.memory_reserved()
        return self._done("empty_cache", "executed", f"{released} bytes returned to the device",
                          bytes_released=released)

    def _private_blocks(self, request_id: str) -> int:
        """Blocks only ``request_id`` holds: what freeing it gives back."""
        groups = self.scheduler.kv_cache_manager.coordinator.get_blocks(request_id)
        return sum(1 for blocks in groups for b in blocks if not b.is_null and b.ref_cnt == 1)

    # ---------------------------------------------------------------- around schedule()
    def before_schedule(self) -> None:
        if self._pending:
            self.run_pending()
        sched = self.scheduler
        if self.batch_cap is not None:
            self._saved_budget = sched.max_num_scheduled_tokens
            sched.max_num_scheduled_tokens = min(self._saved_budget, self.batch_cap)
        defer = self._govern(sched) if self.governor is not None else False
        if self.hold_cap is None and not defer:
            return
        if self.hold_cap == 0:
            if self._paused_new is None:
                self._paused_new = type(sched._pause_state)(1)  # PauseState.PAUSED_NEW
            self._saved_pause = sched._pause_state
            if int(self._saved_pause) == 0:  # only over UNPAUSED: vLLM's own pauses stay as they are
                sched._pause_state = self._paused_new
            return
        cap = -1 if defer else self.hold_cap  # the governor defers the whole queue for this call
        waiting = sched.waiting
        self._order = {id(r): i for i, r in enumerate(waiting)}
        self._held = [r for r in waiting if r.num_prompt_tokens > cap]
        if self._held:
            waiting.remove_requests(self._held)

    def _govern(self, sched: Any) -> bool:
        """The step governor's budget for this call (producers.vllm.plugin_governor); True: hold the queue."""
        budget, defer = self.governor.before_schedule(sched)
        if budget is not None and budget < sched.max_num_scheduled_tokens:
            if self._saved_budget is None:
                self._saved_budget = sched.max_num_scheduled_tokens
            sched.max_num_scheduled_tokens = int(budget)
        d = self.governor.last
        if d is not None:
            self.logprobs_guard_steps += 1
            if d.max_seqs and hasattr(sched, "max_num_active_reqs"):  # vLLM 0.33's admission limit
                self._saved_active = sched.max_num_active_reqs
                sched.max_num_active_reqs = min(sched.max_num_active_reqs, int(d.max_seqs))
        return defer

    def step_started(self, out: Any) -> None:
        if self.governor is not None:
            self.governor.step_started(out)

    def step_finished(self) -> None:
        if self.governor is not None:
            self.governor.step_finished()

    def cuda_headroom(self) -> int | None:
        """Bytes a new allocation can still get: the device's free memory plus what the caching
        allocator holds unallocated (it frees that and retries before an OOM). None without CUDA."""
        torch = self.torch
        if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return None
        free, _total = torch.cuda.mem_get_info()
        return int(free) + int(torch.cuda.memory_reserved()) - int(torch.cuda.memory_allocated())

    def after_schedule(self) -> None:
        sched = self.scheduler
        if self._saved_budget is not None:
            sched.max_num_scheduled_tokens = self._saved_budget
            self._saved_budget = None
        if self._saved_active is not None:
            sched.max_num_active_reqs, self._saved_active = self._saved_active, None
        if self._saved_pause is not None:
            sched._pause_state = self._saved_pause
            self._saved_pause = None
        if self._held:
            self._restore_held(sched.waiting)
        self._held, self._order = [], None

    def _restore_held(self, waiting: Any) -> None:
        if isinstance(waiting, deque):
            # FCFS: a deque; put every request back at its old position (new ones, preempted during
            # this schedule(), stay in front as vLLM prepended them)
            order = self._order or {}
            merged = sorted([*waiting, *self._held], key=lambda r: order.get(id(r), -1))
            waiting.clear()
            waiting.extend(merged)
        else:
            for r in self._held:  # the priority queue orders by (priority, arrival) itself
                waiting.add_request(r)

    def count_step(self, scheduled_tokens: int) -> None:
        """Count a non-empty step against the hold and the cap."""
        if not scheduled_tokens:
            return
        if self.batch_cap is not None and self.batch_cap_steps is not None:
            self.batch_cap_steps -= 1
            if self.batch_cap_steps <= 0:
                self.batch_cap = self.batch_cap_steps = None
        if self.hold_steps is not None:
            self.hold_steps -= 1
            if self.hold_steps <= 0:
                self.hold_cap = self.hold_steps = None


def _prefills_prompt_logprobs(request: Any) -> bool:
    params = getattr(request, "sampling_params", None)
    return (params is not None and getattr(params, "prompt_logprobs", None) is not None
            and request.num_computed_tokens < request.num_prompt_tokens)


class ExecutorEngine:
    """The engine port (``kvguard.contracts.engine.ActuationPort``) over ``VllmActions`` (run on the engine thread).

    ``evict_request`` at request granularity is a preemption (recompute: vLLM v1 has no swap),
    whatever handling was asked; block and token granularity are no-ops (append-only block tables),
    as are ``compact`` (uniform blocks) and ``reclaim_cached`` (cached blocks count as free): its
    capabilities say so, so the executor does not ask. ``set_admission_headroom`` is ``set_headroom``
    in blocks (the units of this node's geometry). ``hold`` / ``release`` are ``hold_admission`` /
    ``release``, ``abort`` is ``abort`` (the client sees a retryable error) and ``empty_cache`` is
    ``empty_cache``."""

    capabilities: ClassVar[Capabilities] = VLLM_CAPABILITIES

    def __init__(self, node: str, actions: VllmActions) -> None:
        self.node = node
        self.actions = actions

    @property
    def pool_units(self) -> int:
        """Usable KV blocks: ``num_gpu_blocks`` less vLLM's null block."""
        return int(self.actions.scheduler.kv_cache_manager.block_pool.num_gpu_blocks) - 1

    @property
    def now_ns(self) -> int:
        return self.actions.translator.now()

    def evict_request(self, req: int, now_ns: int, *, granularity: str = "request", handling: Handling = Handling.RECOMPUTE,
                      pages: Any = None) -> EvictResult:
        name = self.actions.translator.name_of(req)
        if granularity != "request" or name is None:
            return EvictResult(req=req, handling=Handling.RECOMPUTE)
        result = self.actions.preempt(name)
        if result.outcome != "executed":
            return EvictResult(req=req, handling=Handling.RECOMPUTE)
        return EvictResult(req=req, handling=Handling.RECOMPUTE, pages=max(1, result.blocks_freed),
                           units_freed=result.blocks_freed)

    def compact(self, now_ns: int, max_moves: int) -> int:
        return 0

    def reclaim_cached(self, units: int, now_ns: int) -> int:
        return 0

    def request_pages(self, req: int) -> list[PageInfo]:
        raise UnknownRequest(req)  # block tables are append-only: no block or token granularity

    def set_admission_headroom(self, units: int) -> None:
        self.actions.set_headroom(units)

    def set_batch_token_cap(self, tokens: int, steps: int = 0) -> None:
        """The ``batch_cap`` command: ``tokens`` 0 releases; ``steps`` 0 lasts until released."""
        if tokens <= 0:
            self.actions.release_batch_cap()
        else:
            self.actions.cap_batch_tokens(tokens, steps or None)

    def hold_admissions(self, max_prompt_tokens: int, steps: int = 0) -> None:
        """The ``hold`` command: ``max_prompt_tokens`` 0 holds every admission (``drain``)."""
        self.actions.hold_admission(max_prompt_tokens, steps or None)

    def release_admissions(self) -> bool:
        """The ``release`` command."""
        return self.actions.release().outcome == "executed"

    def abort_request(self, req: int, now_ns: int) -> int | None:
        """The ``abort`` command for one target: blocks only it held, None when vLLM does not have it."""
        name = self.actions.translator.name_of(req)
        if name is None:
            return None
        result = self.actions.abort(name)
        return result.blocks_freed if result.outcome == "executed" else None

    def empty_cache(self, now_ns: int) -> int | None:
        """The ``empty_cache`` command: bytes returned to the device, None without CUDA here."""
        result = self.actions.empty_cache()
        return result.bytes_released if result.outcome == "executed" else None
