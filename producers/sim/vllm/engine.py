"""The vLLM-faithful shadow engine: one vLLM v1 worker on a simulated clock (docs/ARCHITECTURE.md, "Node side").

``VllmEngine`` is a drop-in for ``producers.sim.seed.engine.Engine`` (same entry points, counters and event
stream) whose parts are checked against the real things:

- scheduling and KV blocks: ``producers.sim.vllm.scheduler`` / ``producers.sim.vllm.kv_blocks``, vLLM 0.33.0's v1
  ``Scheduler``, ``KVCacheManager`` and ``BlockPool`` (compared step by step with vLLM's own classes by
  ``producers.sim.vllm.conformance``): 16-token blocks, token budget and chunked prefill, ``max_num_seqs``,
  the full-sequence admission gate, prefix caching with the LRU free queue and lazy eviction,
  preemption by recompute;
- every other byte of GPU memory: ``producers.sim.vllm.memory`` (the start-up ledger as vLLM's
  ``Worker`` measures it and each step's allocations, ``producers.vllm.step_memory``, replayed through
  ``producers.sim.torch_allocator.caching_allocator``, the twin of PyTorch's ``CUDACachingAllocator`` at commit
  ``001074d2``, about PyTorch 2.4/2.5, with the 2.9/2.10 rules named in its docstring).

One step is what ``EngineCore.step`` does with a synchronous scheduler: ``Scheduler.schedule()`` ->
the batch's non-KV allocations through the twin (malloc/free in order) -> the step time from the
profile's model ``a + b * prefill_tokens + c * decode_seqs`` -> ``update_from_output`` with one token
per sampling request. A KV shortage preempts (the scheduler does it) and never crashes. An
``OutOfMemoryError`` of the twin is a CUDA OOM: the engine process dies (every running and waiting
request finishes FAILED_OOM, the GPU is down for ``restart_s`` and refuses arrivals meanwhile), and a
fresh worker (new twin, new scheduler, the same start-up) comes up after the restart, so a restart
heals an allocator that fragmented. The OOM row has ``cls=OomLayer.ALLOCATOR``, ``size`` the bytes
requested, ``aux`` the bytes reserved but unallocated at that moment, ``flags`` the ``OomCause``.

Decode-only stretches are fused (``producers.sim.vllm.fused``): the same block assignments, hashes,
finishes and allocator calls as step-by-step scheduling, in the same order (a test compares them).

Divergences from vLLM 0.33 / PyTorch (besides those of the modules named above):

- No model runs: sampled token ids are a per-request constant (the request id); they only feed the
  output blocks' hashes. Requests finish at ``max_tokens`` or ``max_model_len`` (no EOS, no stop).
- Time: the step time comes from the profile's linear model, not from kernels; the scheduler is
  synchronous (no async scheduling, so no step overlaps the next one's scheduling).
- Every request samples the same way (the profile's ``sampling``, from the model's generation config);
  no logprobs unless ``prompt_logprobs_frac`` marks requests as asking for prompt logprobs (then their
  prefill chunks allocate what ``_get_prompt_logprobs_dict`` does; vLLM also stops such requests from
  reading the prefix cache, which is not modelled).
- Weights, the KV cache tensor and the CUDA-graph pool are held outside the twin
  (``reserve_external``); in vLLM they are allocations of the same caching allocator, made once.
- Actuator actions without a vLLM counterpart are explicit no-ops: ``compact`` (uniform blocks),
  ``pool.reclaim_cached`` (cached blocks already count as free), and evictions at block or token
  granularity (block tables are append-only). A request-granularity eviction is vLLM's preemption
  (recompute: v1 has no swap), whatever handling was asked; ``set_admission_headroom`` raises
  vLLM's watermark (blocks kept free when a waiting request is admitted).
- Priorities: kvguard's 0-10 (higher is more important) become vLLM's ``10 - p`` (lower is served
  first, ``producers.admission.vllm_priority``); they matter only with the ``priority`` policy (vLLM's
  default is ``fcfs``).
- Not vLLM: with ``VllmEngineConfig.admission`` kvguard's admission gate (``sim.vllm.admission_gate``)
  decides each arrival vLLM would take, before ``add_request``: admitted, held outside the scheduler,
  or refused (FINISH ``Outcome.REFUSED``, retryable, counted in ``refused``).
- Prompts longer than ``max_model_len`` (or equal to it, or empty) are rejected at arrival and counted
  by reason, as vLLM's input processor does; nothing is truncated.
- Events (``producers.sim.vllm.kv``): one unit per usable block (block ``b`` is offset ``b - 1``:
  vLLM's null block 0 is never handed out); tokens are reported by one FILL per step rather than on
  the ALLOC rows; a policy eviction writes the FREE and PREEMPT rows a preemption writes (not EVICT);
  a fused stretch writes one STEP row. ``RunningView.last_step_ns`` is the end of the engine's last
  step for every running request.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from kvguard.contracts.dimensions import Granularity
from kvguard.contracts.engine import Capabilities
from kvguard.contracts.events import (
    F_PRIORITY_DEFAULTED,
    F_PROMPT_LOGPROBS,
    EventKind,
    Handling,
    OomCause,
    OomLayer,
    Outcome,
)
from kvguard.contracts.pool_types import EvictResult, PageInfo
from kvguard.contracts.units import DEFAULT_PRIORITY, NS_PER_S
from kvguard.producers.sim.profile import Profile
from kvguard.producers.sim.run import (
    DEFAULT_SLO,
    GRANULARITIES,
    RunningView,
    RunSummary,
    SeqState,
    SloTargets,
    slo_fields,
)
from kvguard.producers.admission import AdmissionConfig, vllm_priority
from kvguard.producers.sim.vllm.admission_gate import ShadowGate
from kvguard.producers.sim.vllm.external import Leak, Neighbour
from kvguard.producers.sim.vllm.fused import fused_decode
from kvguard.producers.sim.vllm.governed import REJECTED_NEVER_FITS, SimGovernor
from kvguard.producers.sim.vllm.kv import BlockPoolView, EngineScheduler, EventRecorder
from kvguard.producers.sim.vllm.kv_blocks import prompt_block_keys
from kvguard.producers.sim.vllm.memory import StartupRefused, StepOOM, WorkerMemory
from kvguard.producers.sim.vllm.oom_step import headroom_bytes, refusal_code, write_crashing_step
from kvguard.producers.sim.vllm.scheduler import VLLM_VERSION_FOLLOWED, SchedulerConfig, SeqStatus
from kvguard.producers.sim.workloads import HASH_BLOCK_TOKENS, Request, mix_hash
from kvguard.producers.vllm.actions import VLLM_CAPABILITIES
from kvguard.producers.vllm.step_memory import Batch

PYTORCH_ALLOCATOR_FOLLOWED = "c10/cuda/CUDACachingAllocator.cpp @ 001074d2 (PyTorch 2.4/2.5; 2.9/2.10 rules)"
REJECTED_RESTARTING = "engine_restarting"
# vLLM's 503s (vllm/exceptions.py QueueOverflowError / MaxQueuedTokensError, raised by AsyncLLM.check_admission
# before the request reaches the engine core): retryable, counted by reason as vLLM's rejection counter is
REJECTED_QUEUE_REQS = "max_num_queued_reqs"
REJECTED_QUEUE_TOKENS = "max_num_queued_tokens"
RETRYABLE_REASONS = (REJECTED_RESTARTING, REJECTED_QUEUE_REQS, REJECTED_QUEUE_TOKENS)
_ARRIVE, _FINISH, _OOM, _RESET = int(EventKind.ARRIVE), int(EventKind.FINISH), int(EventKind.OOM), int(EventKind.RESET)
_FILL, _STEP = int(EventKind.FILL), int(EventKind.STEP)
_COMPLETED, _FAILED, _REJECTED = int(Outcome.COMPLETED), int(Outcome.FAILED_OOM), int(Outcome.REJECTED)
_ABORTED, _REFUSED, _NEVER_FITS = int(Outcome.ABORTED), int(Outcome.REFUSED), int(Outcome.NEVER_FITS)


@dataclass(slots=True)
class VllmEngineConfig:
    restart_s: float = 60.0  # downtime after a CUDA OOM
    fuse_decode: bool = True  # fuse decode-only stretches (exact; off: one scheduler call per step)
    max_fused_steps: int = 256
    fast_memory: bool = True  # skip allocator replays that provably repeat (vllm_engine_memory)
    prompt_logprobs_frac: float = 0.0  # share of requests asking for prompt logprobs (echo + logprobs)
    # kvguard's node-side logprob guard: while a request asking for prompt logprobs still has prompt
    # tokens to compute, each step's token budget is capped so that its logits fit the allocator's
    # headroom (device free + cached-but-unallocated bytes, less ``logprobs_guard_margin_bytes``)
    logprobs_guard: bool = False  # an alias of ``governor`` (the logprob guard is one case of it)
    logprobs_guard_margin_bytes: int = 256 << 20
    # kvguard's step governor (producers.vllm.governor, sim.vllm.governed): every step sized so its non-KV
    # peak fits the allocator's headroom less ``governor_margin_bytes``; never-fit requests refused at arrival
    governor: bool = False
    governor_margin_bytes: int = 256 << 20
    neighbour: Neighbour | None = None  # C4: another process on the GPU (external.Neighbour)
    leak: Leak | None = None  # C7: memory that is never returned (external.Leak)
    admission: AdmissionConfig | None = None  # kvguard's admission gate (sim.vllm.admission_gate; issue 29)


@dataclass(slots=True)
class _Req:
    """Engine-side facts about one request the scheduler holds."""

    req_id: int
    arrival_ns: int
    prompt_tokens: int
    max_output_tokens: int
    priority: int
    first_token_ns: int = -1
    last_token_ns: int = -1

    @property
    def outstanding(self) -> int:
        return self.prompt_tokens + self.max_output_tokens


def percentile_s(values, q: float) -> float | None:
    """The q-th percentile of nanosecond ``values`` in seconds (None when empty), as the seed engine."""
    if not values:
        return None
    return round(float(np.percentile(np.asarray(values, dtype=np.float64), q)) / NS_PER_S, 6)


def oom_cause_name(cls: int, flags: int) -> str:
    """``layer:cause`` of an OOM row, e.g. ``allocator:fragmentation`` (the ``ooms_by_cause`` keys)."""
    layer = "allocator" if cls == OomLayer.ALLOCATOR else "kv_arena"
    return f"{layer}:{OomCause(flags).name.lower()}"


class VllmEngine:
    """One GPU's vLLM worker; see the module docstring. The profile must have a ``vllm`` section.
    Its capabilities are the plugin's on a real vLLM (``producers.vllm.actions.VLLM_CAPABILITIES``):
    the same knobs, the same things lacking, checked by the same contract suite."""

    capabilities: ClassVar[Capabilities] = VLLM_CAPABILITIES

    def __init__(self, profile: Profile, *, node: str = "sim-0/gpu0", seed: int = 0,
                 config: VllmEngineConfig | None = None):
        if profile.vllm is None:
            raise ValueError(f"profile {profile.name!r} has no vllm section: it is for the {profile.engine!r} engine")
        self.profile = profile
        self.node = node
        self.seed = seed
        self.config = config or VllmEngineConfig()
        if not 0.0 <= self.config.prompt_logprobs_frac <= 1.0:
            raise ValueError(f"prompt_logprobs_frac: expected a fraction in [0, 1], got {self.config.prompt_logprobs_frac}")
        self.spec = profile.vllm
        self.block_size = self.spec.block_size
        self.recorder = EventRecorder()
        self.pool = BlockPoolView(self)
        self.now_ns = 0
        self.down_until_ns = 0
        self._arrivals: list[tuple[int, int, Request]] = []
        self._reqs: dict[int, _Req] = {}
        self._awaiting_first: set[int] = set()
        self._prompt_logprobs: set[int] = set()
        self._outstanding = 0
        self._headroom_blocks = 0
        self._batch_cap = 0  # per-step token budget an actuator set (0: the profile's max_batched_tokens)
        self._batch_cap_steps = 0  # non-empty steps the cap still lasts (0: until released)
        self._hold_cap: int | None = None  # admission hold an actuator set: prompts over this many tokens (0: all)
        self._hold_steps = 0  # non-empty steps the hold still lasts (0: until released)
        self._quiet = False
        self.last_step_ns = -1
        # outcomes (the seed engine's names and meanings)
        self.requests = self.completed = self.failed = self.rejected = self.aborted = 0
        self.ooms = self.evictions = self.priority_defaulted = 0
        self._preemptions_done = 0  # preemptions of workers that died
        self.downtime_ns = self.goodput_tokens = self.steps = 0
        self._ttft_ns: list[int] = []
        self._tpot_ns: list[float] = []
        self.served: list[tuple[int, float, int]] = []  # (ttft_ns, mean tpot_ns, output tokens) per completion
        self.oom_log: list[dict] = []
        self.ooms_by_cause: Counter[str] = Counter()
        self.rejected_by_reason: Counter[str] = Counter()
        self.restarts = 0
        self.draining = False  # kvguard's drain-and-restart guard took it out of the router (planned_restart)
        self.planned_restarts = 0
        self.startups_refused = 0  # restarts vLLM refused (a neighbour holds what the budget needs)
        self.startup_refusals: list[str] = []
        self._allocator_totals = {"peak_reserved_bytes": 0, "peak_allocated_bytes": 0, "num_alloc_retries": 0}
        self.num_spec = self.spec.num_speculative_tokens
        self.spec_drafts = self.spec_accepted = 0
        # per completed request, as ``vllm bench serve`` sees it: (id, arrival, first token, end, prompt, output)
        self.records: list[tuple[int, int, int, int, int, int]] = []
        self._itl_values: list[int] = []  # inter-token gaps: (value, how many requests saw it)
        self._itl_counts: list[int] = []
        self.finish_listeners: list = []  # called with (request id, end ns, completed) (closed-loop clients)
        self.refused = 0  # refused by the admission gate (Outcome.REFUSED, retryable)
        self.served_priority: list[int] = []  # the priority of each ``served`` entry
        self.requests_by_priority: Counter[int] = Counter()
        self.gate = ShadowGate(self, self.config.admission) if self.config.admission is not None else None
        self.scheduler = self._new_scheduler()
        self.memory: WorkerMemory | None = None
        self._start_worker(0)
        self.governor = SimGovernor(self, self.config.governor_margin_bytes) \
            if self.config.governor or self.config.logprobs_guard else None

    # ------------------------------------------------------------------ worker lifecycle
    def _new_scheduler(self) -> EngineScheduler:
        p, spec = self.profile, self.spec
        config = SchedulerConfig(num_gpu_blocks=p.memory.num_gpu_blocks, max_model_len=p.max_model_len,
                                 block_size=spec.block_size, max_num_seqs=p.max_num_seqs,
                                 max_num_batched_tokens=p.max_batched_tokens,
                                 long_prefill_token_threshold=spec.long_prefill_token_threshold, policy=spec.policy,
                                 scheduler_reserve_full_isl=spec.scheduler_reserve_full_isl, watermark=spec.watermark,
                                 enable_prefix_caching=spec.enable_prefix_caching,
                                 num_lookahead_tokens=spec.num_speculative_tokens,
                                 draft_slots=1 if spec.num_speculative_tokens else 0)
        scheduler = EngineScheduler(config, self.recorder)
        self._base_watermark = scheduler.kv.watermark_blocks
        scheduler.kv.watermark_blocks = self._base_watermark + self._headroom_blocks
        if self._batch_cap:
            scheduler.max_num_scheduled_tokens = min(p.max_batched_tokens, self._batch_cap)
        return scheduler

    def _start_worker(self, now_ns: int) -> bool:
        """Start the worker process; False when vLLM refuses (a neighbour now holds memory its budget
        needs): the GPU stays down another ``restart_s`` and the start is tried again."""
        p = self.profile
        g = p.geometry
        self.recorder.now_ns = now_ns
        neighbour = self.config.neighbour
        if neighbour is not None:  # what the other process holds now is already there at this start
            neighbour = Neighbour(neighbour.bytes_at(now_ns / NS_PER_S), 0.0) if now_ns else neighbour
        try:
            memory = WorkerMemory(self.spec, total_bytes=g.total_bytes, weights_bytes=g.weights_bytes,
                                  context_bytes=g.context_bytes, gpu_memory_utilization=g.gpu_memory_utilization,
                                  max_num_batched_tokens=p.max_batched_tokens, max_num_seqs=p.max_num_seqs,
                                  max_model_len=p.max_model_len, emit=self.recorder.allocator_row, now_ns=now_ns,
                                  fast=self.config.fast_memory, neighbour=neighbour, leak=self.config.leak)
        except StartupRefused as e:
            if not now_ns:
                raise
            self.startups_refused += 1
            self.startup_refusals.append(str(e))
            self.down_until_ns = now_ns + int(self.config.restart_s * NS_PER_S)
            return False
        if neighbour is not None and self.config.neighbour is not None:
            memory.neighbour = self.config.neighbour  # keeps following the schedule from here
        # a neighbour changes the free memory seen at the snapshot, never the KV cache (requested is
        # total * utilization, and what it holds is outside total_consumed)
        same = memory.ledger == p.memory if neighbour is None else \
            (memory.ledger.num_gpu_blocks, memory.ledger.kv_cache_bytes) == (p.memory.num_gpu_blocks,
                                                                             p.memory.kv_cache_bytes)
        if now_ns == 0 and not same:
            raise AssertionError("the worker measured a different start-up ledger than its profile")
        self.memory = memory
        self.startup_headroom_bytes = headroom_bytes(memory.stats())  # for the OOM_STEP rows of a crash
        return True

    # ------------------------------------------------------------------ events
    def take_events(self):
        """Every row recorded since the last call (KV, allocator and lifecycle rows, one ordered stream)."""
        return self.recorder.take()

    @property
    def events_recorded(self) -> int:
        return self.recorder.total + self.recorder.pending

    # ------------------------------------------------------------------ input
    def submit(self, request: Request) -> None:
        """Queue a request; it arrives at ``request.arrival_ns`` on the simulated clock."""
        heapq.heappush(self._arrivals, (request.arrival_ns, request.req_id, request))
        self._outstanding += request.prompt_tokens + request.max_output_tokens

    def is_up(self, at_ns: int) -> bool:
        """Whether the router should send a request arriving at ``at_ns`` here (its health check): the
        worker is up and not drained (a hold of every admission fails the check, as a drained pod fails
        its readiness probe; a request that still arrives waits for the release)."""
        return max(at_ns, self.now_ns) >= self.down_until_ns and self._hold_cap != 0 and not self.draining

    def outstanding_tokens(self) -> int:
        return self._outstanding

    def _next_arrival_ns(self) -> int | None:
        return self._arrivals[0][0] if self._arrivals else None

    def _arrive(self, until_ns: int) -> None:
        rec = self.recorder
        if self.gate is not None:
            self.gate.release(self.now_ns, down=self.now_ns < self.down_until_ns)
        while self._arrivals and self._arrivals[0][0] <= until_ns:
            arrival_ns, _, r = heapq.heappop(self._arrivals)
            ts = max(arrival_ns, self.now_ns)
            flags, priority = 0, r.priority
            if priority is None:
                priority, flags = DEFAULT_PRIORITY, F_PRIORITY_DEFAULTED
                self.priority_defaulted += 1
            priority = min(10, max(0, int(priority)))
            self.requests += 1
            self.requests_by_priority[priority] += 1
            frac = self.config.prompt_logprobs_frac
            wants_logprobs = bool(frac) and mix_hash(r.req_id, self.seed) % 1_000_000 < frac * 1_000_000
            if wants_logprobs:
                flags |= F_PROMPT_LOGPROBS
            rec.row(_ARRIVE, ts, r.req_id, cls=priority, flags=flags, tokens=r.prompt_tokens, aux=r.max_output_tokens)
            reason = REJECTED_RESTARTING if ts < self.down_until_ns else self._queue_full()
            if reason is None and self.governor is not None and \
                    self.governor.refuse(r.req_id, r.prompt_tokens, r.max_output_tokens, wants_logprobs, ts):
                reason = REJECTED_NEVER_FITS  # the governor refuses never-fit first, then the admission gate
            if reason is None and self.gate is not None and not self.scheduler._reject_reason(r.prompt_tokens):
                self.gate.offer(r, ts, priority, wants_logprobs)
                self._quiet = False
                continue
            if reason is None:
                self._take_in(r, ts, priority, wants_logprobs)
                continue
            self._reject(r, ts, reason)

    def _take_in(self, r: Request, ts: int, priority: int, wants_logprobs: bool) -> None:
        """vLLM's ``add_request`` (kvguard's 0-10 priority as vLLM's, ``vllm_priority``), or its rejection."""
        keys = prompt_block_keys(r.block_hashes, HASH_BLOCK_TOKENS, self.block_size) if r.block_hashes else ()
        refused = self.scheduler.add_request(r.req_id, num_prompt_tokens=r.prompt_tokens,
                                             max_tokens=max(1, r.max_output_tokens), arrival_ns=ts,
                                             priority=vllm_priority(priority), prompt_block_keys=keys)
        if refused is not None:
            self._reject(r, ts, refused.value)
            return
        self._reqs[r.req_id] = _Req(r.req_id, ts, r.prompt_tokens, r.max_output_tokens, priority)
        if wants_logprobs:
            self._prompt_logprobs.add(r.req_id)
        self._quiet = False

    def _reject(self, r: Request, ts: int, reason: str) -> None:
        self.rejected += 1
        self.rejected_by_reason[reason] += 1
        self._outstanding -= r.prompt_tokens + r.max_output_tokens
        self.recorder.row(_FINISH, ts, r.req_id, flags=_NEVER_FITS if reason == REJECTED_NEVER_FITS else _REJECTED,
                          aux=refusal_code(reason))
        self._notify(r.req_id, ts, False)

    def _refuse(self, r: Request, ts: int) -> None:
        """The admission gate refused ``r`` (retryable; its ADMISSION row carries the Retry-After)."""
        self.refused += 1
        self._outstanding -= r.prompt_tokens + r.max_output_tokens
        self.recorder.row(_FINISH, ts, r.req_id, flags=_REFUSED)
        self._notify(r.req_id, ts, False)

    def _queue_full(self) -> str | None:
        """vLLM's admission caps (``AsyncLLM.check_admission``): unfinished requests + 1 over
        ``max_num_queued_reqs``, or a prefill backlog (prompt tokens of requests that have not produced
        their first token) at or over ``max_num_queued_tokens``; a 503 either way."""
        spec = self.spec
        if spec.max_num_queued_reqs and len(self.scheduler.requests) + 1 > spec.max_num_queued_reqs:
            return REJECTED_QUEUE_REQS
        if spec.max_num_queued_tokens:
            backlog = sum(seq.num_prompt_tokens for seq in self.scheduler.requests.values() if not seq.output_token_ids)
            if backlog >= spec.max_num_queued_tokens:
                return REJECTED_QUEUE_TOKENS
        return None

    # ------------------------------------------------------------------ stepping
    def advance(self, until_ns: int) -> None:
        """Run engine steps until the simulated clock reaches ``until_ns`` (a step that starts before
        ``until_ns`` runs to its end, so ``now_ns`` may pass it)."""
        while self.now_ns < until_ns:
            if self.now_ns < self.down_until_ns:
                resume = min(self.down_until_ns, until_ns)
                self._arrive(resume)
                self.downtime_ns += resume - self.now_ns
                self.now_ns = resume
                continue
            if self.memory is None and not self._start_worker(self.now_ns):
                continue
            self._arrive(self.now_ns)
            if not self.scheduler.requests:
                nxt = self._next_arrival_ns()
                self.now_ns = max(self.now_ns, min(until_ns, nxt if nxt is not None else until_ns))
                continue
            if self._quiet and self.config.fuse_decode and fused_decode(self, until_ns):
                continue
            if not self._step():
                nxt = self._next_arrival_ns()
                self.now_ns = max(self.now_ns + 1, min(until_ns, nxt if nxt is not None else until_ns))

    def step_ns(self, prefill_tokens: int, decode_seqs: int) -> int:
        return int(self.profile.step_seconds(prefill_tokens, decode_seqs) * NS_PER_S)

    def _step(self) -> bool:
        """One engine step; False when the scheduler scheduled nothing."""
        now = self.now_ns
        sched, rec = self.scheduler, self.recorder
        kv = sched.kv
        rec.now_ns = now
        sched.preempted_in_step = 0
        kv.admitted = []
        running_before = len(sched.running)
        budget = sched.max_num_scheduled_tokens
        defer = self.governor is not None and self.governor.before_schedule(sched)
        try:
            out = sched.schedule() if self._hold_cap is None and not defer else self._schedule_holding(sched, defer)
        finally:
            sched.max_num_scheduled_tokens = budget
            if self.governor is not None:
                self.governor.after_schedule(sched)
        tokens = out.num_scheduled_tokens
        if not tokens:
            self._quiet = False
            return False
        total = sum(tokens.values())
        seqs = len(tokens)
        drafts = sum(out.spec_tokens.values()) if out.spec_tokens else 0
        decode = seqs if total == seqs else sum(1 for rid, n in tokens.items() if n == 1 + out.spec_tokens.get(rid, 0))
        duration = self.step_ns(total - decode - drafts, decode) + self._draft_ns(decode)
        batch = self._prompt_logprobs_batch(out) if self._prompt_logprobs else None
        try:
            if self.memory.v2:
                max_query, max_seq = self._batch_extent(out) if total != seqs or seqs > 256 else (1, 0)
                self.memory.run_step(total, seqs, now, batch, max_query_len=max_query, max_seq_len=max_seq,
                                     num_logits=seqs + drafts if self.num_spec else 0)
            else:
                self.memory.run_step(total, seqs, now, batch)
        except StepOOM as e:
            m = self.memory
            write_crashing_step(rec, now, out, sched.requests, self._prompt_logprobs, e.error,
                                startup_headroom=self.startup_headroom_bytes, neighbour_bytes=m.neighbour_bytes,
                                neighbour_start_bytes=m.neighbour_start_bytes, leaked_bytes=m.leaked_bytes)
            self._crash(now, e)
            return True
        rec.row(_FILL, now, tokens=total)
        rec.row(_STEP, now, size=total, tokens=decode, aux=duration)
        end = now + duration
        rec.now_ns = end
        for seq in kv.admitted:
            if self._reqs[seq.request_id].first_token_ns < 0:
                self._awaiting_first.add(seq.request_id)
        if self.num_spec:
            sampled = self._verify(out)
        else:
            sampled = {rid: rid for rid in out.sampling_ids}
        finished = sched.update_from_output(out, sampled)
        self._note_tokens(out.sampling_ids, end)
        if self._awaiting_first:
            self._note_first_tokens(end)
        for rid in finished:
            self._complete(rid, end)
        if self.num_spec:  # the drafter proposes k tokens for every request that sampled
            sched.update_draft_token_ids({rid: self.num_spec for rid in out.sampling_ids if rid not in finished})
        self.steps += 1
        self._count_capped_steps(1)
        self.now_ns = self.last_step_ns = end
        # fusable next: every running request sampled (so each has exactly one token to compute), and the
        # waiting queue cannot move before a finish or an arrival (it is empty, or this step was
        # decode-only with the same budget and seats as the next one and refused its head)
        waiting = len(sched.waiting)
        self._quiet = (not self.num_spec and not self.finish_listeners_waiting() and not sched.preempted_in_step
                       and seqs == len(out.sampling_ids) == running_before + len(kv.admitted)
                       and (not waiting or (not kv.admitted and total == seqs and not finished)))
        return True

    def finish_listeners_waiting(self) -> bool:
        """Whether a closed-loop client waits for a finish to send its next request: a fused stretch must
        then end at the first finish (``fused._timeline`` treats it as a waiting request)."""
        return any(getattr(listener, "waiting", False) for listener in self.finish_listeners) or \
            (self.gate is not None and len(self.gate.held) > 0)

    def _batch_extent(self, out) -> tuple[int, int]:
        """The step's longest query and longest sequence (its context after this step's tokens)."""
        requests = self.scheduler.requests
        max_query = max(out.num_scheduled_tokens.values())
        max_seq = max(requests[rid].num_computed_tokens for rid in out.num_scheduled_tokens)
        return max_query, max_seq

    def _draft_ns(self, decode_seqs: int) -> int:
        """The drafter's time: k passes of the draft model, each costing the step's base time scaled by
        the draft's share of the weights (the profile's step-time model; an estimate)."""
        if not self.num_spec or not decode_seqs:
            return 0
        share = self.spec.draft_weights_bytes / max(1, self.profile.geometry.weights_bytes)
        return int(self.num_spec * self.profile.step_base_s * share * NS_PER_S)

    def _verify(self, out) -> dict:
        """Tokens each sampling request gets from verification: the bonus token plus the leading drafts
        accepted, each accepted with ``spec_acceptance_rate`` (a deterministic draw per request, step and
        position: the acceptance is the workload's, not vLLM's)."""
        rate, step = self.spec.spec_acceptance_rate, self.scheduler.step
        sampled = {}
        for rid in out.sampling_ids:
            drafts = out.spec_tokens.get(rid, 0)
            accepted = 0
            while accepted < drafts and mix_hash(mix_hash(rid, step), accepted + self.seed) % 1_000_000 < rate * 1e6:
                accepted += 1
            self.spec_drafts += drafts
            self.spec_accepted += accepted
            sampled[rid] = (rid,) * (1 + accepted)
        return sampled

    def _note_tokens(self, sampling_ids, end: int) -> None:
        """Inter-token latencies as ``vllm bench serve`` measures them: the gap between a request's
        streamed chunks (one chunk per step that gives it tokens)."""
        values, counts, reqs = self._itl_values, self._itl_counts, self._reqs
        for rid in sampling_ids:
            info = reqs.get(rid)
            if info is None:
                continue
            if info.last_token_ns >= 0:
                values.append(end - info.last_token_ns)
                counts.append(1)
            info.last_token_ns = end

    def _notify(self, rid: int, end: int, completed: bool) -> None:
        for listener in self.finish_listeners:
            listener(rid, end, completed)

    @property
    def logprobs_guard_steps(self) -> int:
        """Steps whose budget the step governor lowered (the logprob guard's count, kept as its alias)."""
        return self.governor.governor.governed_steps if self.governor is not None else 0

    def _schedule_holding(self, sched, defer: bool = False):
        """``schedule()`` with the held requests out of the waiting queue, put back in their order
        afterwards (what the plugin does to vLLM's queue, producers.vllm.actions); ``defer``: the step
        governor holds the whole queue for this step."""
        cap = -1 if defer or self._hold_cap is None else self._hold_cap
        waiting = sched.waiting
        order = {id(seq): i for i, seq in enumerate(waiting)}
        held = [seq for seq in waiting if seq.num_prompt_tokens > cap]
        if held:
            waiting.remove(held)
        try:
            return sched.schedule()
        finally:
            if held:
                sched.waiting.restore(held, order)
            self._quiet = False  # no fused stretch while a hold lasts: it may end in the middle of one

    def _note_first_tokens(self, end: int) -> None:
        requests = self.scheduler.requests
        for rid in list(self._awaiting_first):
            seq = requests.get(rid)
            if seq is None or seq.output_token_ids:
                self._awaiting_first.discard(rid)
                info = self._reqs[rid]
                info.first_token_ns = end
                self._ttft_ns.append(end - info.arrival_ns)

    def _complete(self, rid: int, end: int) -> None:
        """A request the scheduler finished (its blocks were freed by ``update_from_output``)."""
        info = self._reqs.pop(rid)
        generated = min(max(1, info.max_output_tokens), self.profile.max_model_len - info.prompt_tokens)
        self.completed += 1
        self._outstanding -= info.outstanding
        self.goodput_tokens += generated
        tpot = (end - info.first_token_ns) / (generated - 1) if generated > 1 and info.first_token_ns >= 0 else 0.0
        if generated > 1 and info.first_token_ns >= 0:
            self._tpot_ns.append(tpot)
        self.served.append((info.first_token_ns - info.arrival_ns if info.first_token_ns >= 0 else end - info.arrival_ns,
                            tpot, generated))
        self.served_priority.append(info.priority)
        if self.gate is not None:
            self.gate.observe_output(info.priority, generated)
        self._prompt_logprobs.discard(rid)
        self.records.append((rid, info.arrival_ns, info.first_token_ns, end, info.prompt_tokens, generated))
        self.recorder.row(_FINISH, end, rid, flags=_COMPLETED, tokens=generated)
        if self.memory is not None:
            self.memory.leak_request()
        self._notify(rid, end, True)

    def _prompt_logprobs_batch(self, out) -> Batch | None:
        """The step as a ``Batch`` when a request asking for prompt logprobs computes prompt positions."""
        requests = self.scheduler.requests
        counts = []
        for rid, n in out.num_scheduled_tokens.items():
            seq = requests[rid]
            start = seq.num_computed_tokens - n
            counts.append(max(0, min(n, seq.num_prompt_tokens - start)) if rid in self._prompt_logprobs else 0)
        if not any(counts):
            return None
        scheduled = tuple(out.num_scheduled_tokens.values())
        contexts = tuple(requests[rid].num_computed_tokens for rid in out.num_scheduled_tokens)
        prompts = tuple(requests[rid].num_prompt_tokens for rid in out.num_scheduled_tokens)
        return Batch(scheduled, contexts, sampling=self.spec.sampling, prompt_lens=prompts,
                     prompt_logprobs_tokens=tuple(counts))

    def _crash(self, now: int, oom: StepOOM) -> None:
        """A CUDA OOM: the worker process dies with its whole queue; back after ``restart_s``."""
        e, rec, sched = oom.error, self.recorder, self.scheduler
        self.ooms += 1
        cause = oom_cause_name(int(OomLayer.ALLOCATOR), int(oom.cause))
        self.ooms_by_cause[cause] += 1
        self.oom_log.append({"t_s": round(now / NS_PER_S, 3), "what": "allocator", "cause": cause,
                             "requested_bytes": e.requested_bytes, "tried_to_allocate_bytes": e.tried_to_allocate_bytes,
                             "reserved_bytes": e.reserved_bytes, "allocated_bytes": e.allocated_bytes,
                             "reserved_unallocated_bytes": e.reserved_unallocated_bytes,
                             "device_free_bytes": e.device_free_bytes, "fragmentation": e.cause == "fragmentation",
                             "allocation": oom.allocation, "running": len(sched.running), "waiting": len(sched.waiting),
                             "neighbour_bytes": self.memory.neighbour_bytes if self.memory else 0,
                             "leaked_bytes": self.memory.leaked_bytes if self.memory else 0})
        rec.row(_OOM, now, cls=int(OomLayer.ALLOCATOR), flags=int(oom.cause), size=e.requested_bytes,
                aux=e.reserved_unallocated_bytes)
        running = [s.request_id for s in sched.running]
        lost = running + [rid for rid in sched.requests if rid not in set(running)]
        for rid in lost:
            seq = sched.requests[rid]
            info = self._reqs.pop(rid)
            self.failed += 1
            self._outstanding -= info.outstanding
            rec.row(_FINISH, now, rid, flags=_FAILED, tokens=len(seq.output_token_ids))
            self._notify(rid, now, False)
        self._retire_worker(now)  # the dead process's allocator rows (blocks and segments released) first,
        rec.row(_RESET, now)  # then the reset: a mirror that resets first meets frees of blocks it dropped
        self._awaiting_first.clear()
        self._prompt_logprobs.clear()
        self.scheduler = self._new_scheduler()
        self.down_until_ns = now + int(self.config.restart_s * NS_PER_S)
        self.now_ns = now + 1
        self.restarts += 1
        self._quiet = False

    def _retire_worker(self, now: int) -> None:
        stats = self.memory.stats()
        totals = self._allocator_totals
        totals["peak_reserved_bytes"] = max(totals["peak_reserved_bytes"], stats["peak_reserved_bytes"])
        totals["peak_allocated_bytes"] = max(totals["peak_allocated_bytes"], stats["peak_allocated_bytes"])
        totals["num_alloc_retries"] += stats["num_alloc_retries"]
        self._preemptions_done += self.scheduler.num_preemptions - self.scheduler.num_evictions
        self.memory.shutdown(now)
        self.memory = None

    # ------------------------------------------------------------------ actuator entry points
    def planned_restart(self, now_ns: int) -> bool:
        """Restart the worker process now, as an operator does after a leak (C7): only once it is drained
        (nothing running, waiting or arriving), so no request is lost; the process and everything it
        leaked go, and the GPU is back after ``restart_s`` as after a crash. False when not drained."""
        if self.memory is None or self.scheduler.requests or self._arrivals:
            return False
        now = max(int(now_ns), self.now_ns)
        self.recorder.now_ns = now
        self._retire_worker(now)
        self.recorder.row(_RESET, now)
        self._awaiting_first.clear()
        self._prompt_logprobs.clear()
        self.scheduler = self._new_scheduler()
        self.down_until_ns = now + int(self.config.restart_s * NS_PER_S)
        self.now_ns = now + 1
        self.planned_restarts += 1
        self.draining = False
        self._quiet = False
        return True

    def evict_request(self, req: int, now_ns: int, *, granularity: str = Granularity.REQUEST,
                      handling: Handling = Handling.RECOMPUTE, pages=None) -> EvictResult:
        """A policy eviction between steps. Request granularity is vLLM's preemption (recompute, the
        only kind v1 has: the result says RECOMPUTE whatever was asked); block and token granularity
        have no vLLM counterpart (block tables are append-only) and do nothing. A finished, waiting
        or unknown request is a no-op."""
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity: expected one of {GRANULARITIES}, got {granularity!r}")
        handling = Handling(handling)
        sched = self.scheduler
        seq = sched.requests.get(req)
        if seq is None or seq.status is not SeqStatus.RUNNING or granularity != Granularity.REQUEST:
            return EvictResult(req=req, handling=handling)
        blocks = sched.kv.req_to_blocks.get(req, [])
        shared = sum(1 for b in blocks if b.ref_count > 1)
        computed = seq.num_computed_tokens
        self.recorder.now_ns = max(now_ns, self.now_ns)
        sched.evict(seq)
        self.evictions += 1
        self._quiet = False
        return EvictResult(req=req, handling=Handling.RECOMPUTE, pages=len(blocks), units_freed=len(blocks) - shared,
                           tokens=computed, shared_pages=shared)

    def set_batch_token_cap(self, tokens: int, steps: int = 0) -> None:
        """Cap the per-step token budget at ``tokens`` (at least ``max_num_seqs``, as vLLM requires of
        the budget) for ``steps`` non-empty steps (0: until released); ``tokens`` 0 releases. The plugin
        does the same to vLLM's ``Scheduler.max_num_scheduled_tokens`` (producers.vllm.actions)."""
        configured = self.profile.max_batched_tokens
        self._batch_cap = min(configured, max(int(tokens), self.profile.max_num_seqs)) if tokens > 0 else 0
        self._batch_cap_steps = int(steps) if tokens > 0 and steps > 0 else 0
        if self.scheduler is not None:
            self.scheduler.max_num_scheduled_tokens = self._batch_cap or configured
        self._quiet = False

    def _count_capped_steps(self, n: int) -> None:
        if self._batch_cap_steps:
            self._batch_cap_steps -= n
            if self._batch_cap_steps <= 0:
                self.set_batch_token_cap(0)
        if self._hold_steps:
            self._hold_steps -= n
            if self._hold_steps <= 0:
                self.release_admissions()

    def hold_admissions(self, max_prompt_tokens: int, steps: int = 0) -> None:
        """Admit no waiting or preempted request whose prompt is longer than ``max_prompt_tokens``
        (0: none at all, a drain) for ``steps`` non-empty steps (0: until released). Held requests
        stay queued and count as waiting."""
        if max_prompt_tokens < 0 or steps < 0:
            raise ValueError(f"hold: max_prompt_tokens and steps must be >= 0, got {max_prompt_tokens}, {steps}")
        self._hold_cap, self._hold_steps = int(max_prompt_tokens), int(steps)
        self._quiet = False

    def release_admissions(self) -> bool:
        """End the admission hold; False when there was none."""
        had = self._hold_cap is not None
        self._hold_cap, self._hold_steps = None, 0
        self._quiet = False
        return had

    def abort_request(self, req: int, now_ns: int) -> int | None:
        """End a request now, running or waiting (vLLM: the client gets a retryable error); its blocks
        are freed. Returns the blocks only it held (what aborting gives back), None when it is not in
        the scheduler (finished, rejected, not arrived yet). Counted as failed."""
        sched = self.scheduler
        seq = sched.requests.get(req)
        if seq is None:
            return None
        blocks = sched.kv.req_to_blocks.get(req, [])
        private = sum(1 for b in blocks if b.ref_count <= 1)
        now = max(now_ns, self.now_ns)
        self.recorder.now_ns = now
        sched.finish_requests([req])
        info = self._reqs.pop(req)
        self.failed += 1
        self.aborted += 1
        self._outstanding -= info.outstanding
        self._awaiting_first.discard(req)
        self._prompt_logprobs.discard(req)
        self.recorder.row(_FINISH, now, req, flags=_ABORTED, tokens=len(seq.output_token_ids))
        self._notify(req, now, False)
        self._quiet = False
        return private

    def empty_cache(self, now_ns: int) -> int | None:
        """``torch.cuda.empty_cache()`` on the worker's caching allocator: bytes returned to the device
        (None while the worker is down)."""
        if self.memory is None:
            return None
        return self.memory.empty_cache(max(now_ns, self.now_ns))

    def set_admission_headroom(self, units: int) -> None:
        """Hold ``units`` blocks back from admission on top of vLLM's watermark (0 releases them)."""
        if units < 0:
            raise ValueError(f"admission headroom must be >= 0 units, got {units}")
        self._headroom_blocks = int(units)
        self.scheduler.kv.watermark_blocks = self._base_watermark + self._headroom_blocks
        self._quiet = False

    def compact(self, now_ns: int, max_moves: int) -> int:
        """No vLLM counterpart: blocks are uniform, nothing to coalesce. Moves nothing."""
        return 0

    def reclaim_cached(self, units: int, now_ns: int) -> int:
        """No vLLM counterpart: cached blocks already count as free. Frees nothing."""
        return self.pool.reclaim_cached(units, now_ns)

    def request_pages(self, req: int) -> list[PageInfo]:
        """The request's block table, one unit per block (raises ``UnknownRequest``)."""
        return self.pool.request_pages(req)

    @property
    def pool_units(self) -> int:
        """Usable KV blocks (vLLM's null block 0 is never handed out)."""
        return self.profile.geometry.dynamic_units

    # ------------------------------------------------------------------ queries
    @property
    def preemptions(self) -> int:
        """Preemptions the scheduler made for lack of KV blocks (policy evictions not counted)."""
        return self._preemptions_done + self.scheduler.num_preemptions - self.scheduler.num_evictions

    def running_requests(self) -> list[RunningView]:
        sched = self.scheduler
        out = []
        for seq in sched.running:
            info = self._reqs[seq.request_id]
            out.append(RunningView(seq.request_id, info.priority, seq.num_prompt_tokens, len(seq.output_token_ids),
                                   len(sched.kv.req_to_blocks.get(seq.request_id, ())), self.last_step_ns,
                                   SeqState.RUNNING))
        return out

    def queue_lengths(self) -> dict:
        return {"pending": len(self._arrivals), "waiting": len(self.scheduler.waiting),
                "running": len(self.scheduler.running), "swapped": 0}

    def allocator_summary(self) -> dict:
        """The caching allocator over the run (every worker incarnation): the ``simulate`` JSON block."""
        totals = dict(self._allocator_totals)
        current = self.memory.stats() if self.memory is not None else None
        if current is not None:
            totals["peak_reserved_bytes"] = max(totals["peak_reserved_bytes"], current["peak_reserved_bytes"])
            totals["peak_allocated_bytes"] = max(totals["peak_allocated_bytes"], current["peak_allocated_bytes"])
            totals["num_alloc_retries"] += current["num_alloc_retries"]
        totals["inactive_split_bytes"] = current["inactive_split_bytes"] if current else 0
        totals["reserved_bytes"] = current["reserved_bytes"] if current else 0
        ledger = self.profile.memory
        totals.update(profile_peak_bytes=ledger.profile_peak_bytes, kv_cache_bytes=ledger.kv_cache_bytes,
                      num_gpu_blocks=ledger.num_gpu_blocks, restarts=self.restarts)
        return totals

    def summary(self, slo: SloTargets = DEFAULT_SLO) -> RunSummary:
        sim_s = self.now_ns / NS_PER_S
        return RunSummary(
            requests=self.requests, completed=self.completed, failed=self.failed, rejected=self.rejected,
            unfinished=len(self._reqs) + (len(self.gate.held) if self.gate is not None else 0), ooms=self.ooms,
            preemptions=self.preemptions, refused=self.refused,
            ttft_p50_s=percentile_s(self._ttft_ns, 50), ttft_p99_s=percentile_s(self._ttft_ns, 99),
            tpot_p50_s=percentile_s(self._tpot_ns, 50), tpot_p99_s=percentile_s(self._tpot_ns, 99),
            goodput_tokens_per_s=round(self.goodput_tokens / sim_s, 3) if sim_s > 0 else 0.0,
            downtime_s=round(self.downtime_ns / NS_PER_S, 3), sim_seconds=round(sim_s, 3),
            events=self.events_recorded, **slo_fields(self.served, self.requests, sim_s, slo,
                                                      priorities=(self.served_priority, self.requests_by_priority)),
        )


VERSIONS = {"vllm": VLLM_VERSION_FOLLOWED, "pytorch_caching_allocator": PYTORCH_ALLOCATOR_FOLLOWED}
