"""The SGLang-faithful shadow engine: one SGLang scheduler process on a simulated clock.

``SglangEngine`` has the entry points, counters and event stream of the vLLM-faithful engine
(``producers.sim.vllm.engine``) and of the engine port (``kvguard.contracts.engine``), over parts
checked against SGLang 0.5.23's own code:

- start-up: ``producers.sim.sglang.memory`` (``--mem-fraction-static`` sizes the token pool);
- scheduling, the pool, the radix cache and retraction: ``producers.sim.sglang.scheduler``, compared
  step by step with SGLang's classes by ``producers.sim.sglang.conformance`` (``kvguard
  conformance sglang``).

One step is one pass of ``Scheduler.event_loop_normal``: a prefill batch or a decode step, its time
from the profile's model ``a + b x prefill_tokens + c x decode_seqs``. A KV shortage retracts decode
requests (SGLang's preemption: their KV is freed and they are re-queued to be recomputed); a
request SGLang cannot keep even alone is aborted ("Out of memory even after retracting all other
requests") and counted as failed. Retractions are counted as this engine's preemptions.

Divergences from SGLang (besides those of the scheduler module):

- No CUDA OOM: the non-KV memory (activations, CUDA graphs, the sampler) is the start-up slack,
  not modelled step by step (no caching-allocator twin here, unlike the vLLM engine); so this
  engine never crashes, and its capabilities say it has no caching allocator.
- No model runs: sampled tokens are a function of the request and position; requests finish at
  ``max_new_tokens`` (clipped at arrival as SGLang clips it).
- Workload prefix blocks become token ids (``conformance.prompt_tokens``), so requests that share a
  workload prefix share a radix-tree path.
- Actuator actions map onto SGLang's own mechanisms (``producers.sglang.actions`` does the same on
  a real SGLang): ``evict_request`` at request granularity is a retraction; ``abort_request`` an
  abort; ``reclaim_cached`` evicts unlocked radix pages (``/flush_cache`` frees all of them);
  ``hold_admissions`` keeps long prompts in the queue; ``set_batch_token_cap`` caps the chunked
  prefill budget; ``set_admission_headroom`` lowers what admission sees as free. ``compact`` and
  ``empty_cache`` have no counterpart here (uniform pages; no allocator twin).
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from kvguard.contracts.dimensions import Granularity
from kvguard.contracts.engine import Capabilities
from kvguard.contracts.events import F_PRIORITY_DEFAULTED, EventKind, Handling, Outcome
from kvguard.contracts.pool_types import EvictResult, PageInfo
from kvguard.contracts.units import DEFAULT_PRIORITY, NS_PER_S
from kvguard.producers.sglang.actions import SGLANG_CAPABILITY_FIELDS
from kvguard.producers.sim.run import GRANULARITIES, RunningView, RunSummary, SeqState, slo_fields
from kvguard.producers.sim.sglang.conformance import prompt_tokens
from kvguard.producers.sim.sglang.kv import PagePoolView, RecordingListener
from kvguard.producers.sim.sglang.scheduler import SGLANG_VERSION_FOLLOWED, Scheduler
from kvguard.producers.sim.vllm.kv import EventRecorder
from kvguard.producers.sim.workloads import Request

# The engine port's Capabilities of this engine (kvguard.contracts.engine): the plugin's
# (producers.sglang.actions.SGLANG_CAPABILITY_FIELDS) less empty_cache, which needs an allocator twin.
SGLANG_SHADOW_CAPABILITY_FIELDS = {
    **SGLANG_CAPABILITY_FIELDS, "empty_cache": False,
    "notes": (*SGLANG_CAPABILITY_FIELDS["notes"],
              ("empty_cache", "the SGLang shadow engine has no caching-allocator twin: nothing to return")),
}
SGLANG_SHADOW_CAPABILITIES = Capabilities(**SGLANG_SHADOW_CAPABILITY_FIELDS)

_ARRIVE, _FINISH, _FILL, _STEP = int(EventKind.ARRIVE), int(EventKind.FINISH), int(EventKind.FILL), int(EventKind.STEP)
_COMPLETED, _FAILED, _REJECTED, _ABORTED = (int(Outcome.COMPLETED), int(Outcome.FAILED_OOM), int(Outcome.REJECTED),
                                            int(Outcome.ABORTED))


@dataclass(slots=True)
class SglangEngineConfig:
    restart_s: float = 60.0  # kept for the fleet's configs; this engine never crashes


@dataclass(slots=True)
class _Info:
    arrival_ns: int
    prompt_tokens: int
    max_output_tokens: int
    priority: int
    first_token_ns: int = -1


def _percentile_s(values, q: float) -> float | None:
    if not values:
        return None
    return round(float(np.percentile(np.asarray(values, dtype=np.float64), q)) / NS_PER_S, 6)


class SglangEngine:
    """One GPU's SGLang server; see the module docstring. The profile must have an ``sglang`` section."""

    capabilities: ClassVar[Capabilities] = SGLANG_SHADOW_CAPABILITIES

    def __init__(self, profile, *, node: str = "sim-0/gpu0", seed: int = 0, config: SglangEngineConfig | None = None):
        if getattr(profile, "sglang", None) is None:
            raise ValueError(f"profile {profile.name!r} has no sglang section: it is for the {profile.engine!r} engine")
        self.profile = profile
        self.node = node
        self.seed = seed
        self.config = config or SglangEngineConfig()
        self.spec = profile.sglang
        self.recorder = EventRecorder()
        self.listener = RecordingListener(self.recorder, self.spec.page_size)
        self.scheduler = Scheduler(self.spec.scheduler_config(), self.listener)
        self.pool = PagePoolView(self)
        self.now_ns = 0
        self.last_step_ns = -1
        self._arrivals: list[tuple[int, int, Request]] = []
        self._info: dict[int, _Info] = {}
        self._outstanding = 0
        self._hold_cap: int | None = None
        self._hold_steps = 0
        self._cap_steps = 0
        self.requests = self.completed = self.failed = self.rejected = self.aborted = 0
        self.ooms = self.evictions = self.priority_defaulted = self.steps = 0
        self.goodput_tokens = 0
        self._ttft_ns: list[int] = []
        self._tpot_ns: list[float] = []
        self.served: list[tuple[int, float, int]] = []
        self.oom_log: list[dict] = []
        self.ooms_by_cause: Counter[str] = Counter()
        self.rejected_by_reason: Counter[str] = Counter()

    # ------------------------------------------------------------------ input
    def submit(self, request: Request) -> None:
        heapq.heappush(self._arrivals, (request.arrival_ns, request.req_id, request))
        self._outstanding += request.prompt_tokens + request.max_output_tokens

    def is_up(self, at_ns: int) -> bool:
        return self._hold_cap != 0

    def outstanding_tokens(self) -> int:
        return self._outstanding

    def take_events(self):
        return self.recorder.take()

    def _arrive(self, until_ns: int) -> None:
        rec = self.recorder
        while self._arrivals and self._arrivals[0][0] <= until_ns:
            arrival_ns, _, r = heapq.heappop(self._arrivals)
            ts = max(arrival_ns, self.now_ns)
            flags, priority = 0, r.priority
            if priority is None:
                priority, flags = DEFAULT_PRIORITY, F_PRIORITY_DEFAULTED
                self.priority_defaulted += 1
            self.requests += 1
            rec.row(_ARRIVE, ts, r.req_id, cls=min(10, max(0, int(priority))), flags=flags, tokens=r.prompt_tokens,
                    aux=r.max_output_tokens)
            refused = None
            if r.prompt_tokens <= 0:
                refused = "empty_prompt"
            else:
                reason = self.scheduler.add_request(r.req_id, prompt_tokens(r), max(1, r.max_output_tokens))
                refused = reason.value if reason is not None else None
            if refused is not None:
                self.rejected += 1
                self.rejected_by_reason[refused] += 1
                self._outstanding -= r.prompt_tokens + r.max_output_tokens
                rec.row(_FINISH, ts, r.req_id, flags=_REJECTED)
                continue
            self._info[r.req_id] = _Info(ts, r.prompt_tokens, r.max_output_tokens, priority)

    # ------------------------------------------------------------------ stepping
    def advance(self, until_ns: int) -> None:
        while self.now_ns < until_ns:
            self._arrive(self.now_ns)
            if not self.scheduler.requests:
                nxt = self._arrivals[0][0] if self._arrivals else until_ns
                self.now_ns = max(self.now_ns, min(until_ns, nxt))
                if not self._arrivals or nxt > until_ns:
                    self.now_ns = max(self.now_ns, until_ns)
                continue
            if not self._step():
                nxt = self._arrivals[0][0] if self._arrivals else until_ns
                self.now_ns = max(self.now_ns + 1, min(until_ns, nxt))

    def _step(self) -> bool:
        s, rec = self.scheduler, self.recorder
        now = self.now_ns
        rec.now_ns = now
        held = self._take_held()
        try:
            out = s.step()
        finally:
            if held is not None:
                self._put_back(*held)
        if out.kind == "idle":
            return False
        prefill_tokens = sum(n for _, _, n in out.prefill)
        decode = len(out.decode)
        duration = int(self.profile.step_seconds(prefill_tokens, decode) * NS_PER_S)
        rec.row(_FILL, now, tokens=out.tokens)
        rec.row(_STEP, now, size=out.tokens, tokens=decode, aux=duration)
        end = now + duration
        rec.now_ns = end
        first = [rid for rid, _, _ in out.prefill if rid in self._info and self._info[rid].first_token_ns < 0
                 and (s.chunked is None or rid != s.chunked.rid)]
        for rid in first:
            self._info[rid].first_token_ns = end
            self._ttft_ns.append(end - self._info[rid].arrival_ns)
        for rid in out.finished:
            self._complete(rid, end)
        for rid in out.aborted:
            self._fail(rid, end, _FAILED)
        self.steps += 1
        self._count_steps()
        self.now_ns = self.last_step_ns = end
        return True

    def _take_held(self):
        """Take the held requests out of the queue for one step (``hold_admissions``)."""
        cap = self._hold_cap
        s = self.scheduler
        if cap is None:
            return None
        held = [r for r in s.waiting if len(r.origin) > cap]
        if not held:
            return None
        order = {id(r): i for i, r in enumerate(s.waiting)}
        s.waiting = [r for r in s.waiting if len(r.origin) <= cap]
        return held, order

    def _put_back(self, held, order) -> None:
        """The held requests back in their places; requests queued during the step stay behind them."""
        s = self.scheduler
        known = sorted(held + [r for r in s.waiting if id(r) in order], key=lambda r: order[id(r)])
        s.waiting = known + [r for r in s.waiting if id(r) not in order]

    def _complete(self, rid: int, end: int) -> None:
        info = self._info.pop(rid)
        generated = max(1, info.max_output_tokens)
        self.completed += 1
        self._outstanding -= info.prompt_tokens + info.max_output_tokens
        self.goodput_tokens += generated
        tpot = (end - info.first_token_ns) / (generated - 1) if generated > 1 and info.first_token_ns >= 0 else 0.0
        if generated > 1 and info.first_token_ns >= 0:
            self._tpot_ns.append(tpot)
        ttft = info.first_token_ns - info.arrival_ns if info.first_token_ns >= 0 else end - info.arrival_ns
        self.served.append((ttft, tpot, generated))
        self.recorder.row(_FINISH, end, rid, flags=_COMPLETED, tokens=generated)

    def _fail(self, rid: int, end: int, outcome: int) -> None:
        info = self._info.pop(rid, None)
        if info is None:
            return
        self.failed += 1
        self._outstanding -= info.prompt_tokens + info.max_output_tokens
        self.recorder.row(_FINISH, end, rid, flags=outcome)

    def _count_steps(self) -> None:
        if self._cap_steps:
            self._cap_steps -= 1
            if self._cap_steps <= 0:
                self.set_batch_token_cap(0)
        if self._hold_steps:
            self._hold_steps -= 1
            if self._hold_steps <= 0:
                self.release_admissions()

    # ------------------------------------------------------------------ the engine port: actions
    @property
    def pool_units(self) -> int:
        return self.scheduler.pool.num_pages

    def evict_request(self, req: int, now_ns: int, *, granularity: str = Granularity.REQUEST,
                      handling: Handling = Handling.RECOMPUTE, pages=None) -> EvictResult:
        """A retraction between steps at request granularity (SGLang frees the KV and re-queues the
        request for recompute, whatever handling was asked); block and token granularity have no
        SGLang counterpart and do nothing."""
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity: expected one of {GRANULARITIES}, got {granularity!r}")
        handling = Handling(handling)
        s = self.scheduler
        r = next((x for x in s.running if x.rid == req), None)
        if r is None or granularity != Granularity.REQUEST:
            return EvictResult(req=req, handling=handling)
        holders = self.listener.holders
        pages = list(r.pages)
        shared = sum(1 for p in pages if holders[p] > 1)
        private = sum(1 for i, p in enumerate(pages) if holders[p] <= 1 and i * s.page_size >= r.protected)
        computed = r.committed
        self.recorder.now_ns = max(now_ns, self.now_ns)
        s.retract(req)
        self.evictions += 1
        return EvictResult(req=req, handling=Handling.RECOMPUTE, pages=len(pages),
                           units_freed=private, tokens=computed, shared_pages=shared)

    def request_pages(self, req: int) -> list[PageInfo]:
        return self.pool.request_pages(req)

    def compact(self, now_ns: int, max_moves: int) -> int:
        """No SGLang counterpart: pages are uniform. Moves nothing."""
        return 0

    def reclaim_cached(self, units: int, now_ns: int) -> int:
        """Evict up to ``units`` pages of unlocked radix-tree prefixes, LRU first; the pages freed."""
        s = self.scheduler
        self.recorder.now_ns = max(now_ns, self.now_ns)
        before = s.pool.available_size()
        s._evict_for(before + units * s.page_size)
        return (s.pool.available_size() - before) // s.page_size

    def set_admission_headroom(self, units: int) -> None:
        """Hold ``units`` pages back from what admission sees as free (0 releases them)."""
        if units < 0:
            raise ValueError(f"admission headroom must be >= 0 units, got {units}")
        s = self.scheduler
        tokens = int(units) * s.page_size
        if tokens < s.admission_headroom_tokens:
            # SGLang skips admission while ``batch_is_full`` (set when the budget ran out) until memory
            # frees; a smaller hold frees budget, so admission must look again, as after a finish
            s.batch_is_full = False
        s.admission_headroom_tokens = tokens

    def set_batch_token_cap(self, tokens: int, steps: int = 0) -> None:
        """Cap the prefill tokens of a step at ``tokens`` (the chunked-prefill budget) for ``steps``
        steps (0: until released); 0 releases."""
        s = self.scheduler
        configured = s.config.chunked_prefill_size
        if tokens > 0:
            cap = max(int(tokens), s.page_size)
            s.chunked_prefill_size = min(configured, cap) if configured is not None else cap
        else:
            s.chunked_prefill_size = configured
        self._cap_steps = int(steps) if tokens > 0 and steps > 0 else 0

    def hold_admissions(self, max_prompt_tokens: int, steps: int = 0) -> None:
        if max_prompt_tokens < 0 or steps < 0:
            raise ValueError(f"hold: max_prompt_tokens and steps must be >= 0, got {max_prompt_tokens}, {steps}")
        self._hold_cap, self._hold_steps = int(max_prompt_tokens), int(steps)

    def release_admissions(self) -> bool:
        had = self._hold_cap is not None
        self._hold_cap, self._hold_steps = None, 0
        return had

    def abort_request(self, req: int, now_ns: int) -> int | None:
        s = self.scheduler
        r = s.requests.get(req)
        if r is None:
            return None
        holders = self.listener.holders
        private = sum(1 for p in r.pages if holders[p] <= 1) if r.holds_row else 0
        now = max(now_ns, self.now_ns)
        self.recorder.now_ns = now
        s.abort(req)
        self.aborted += 1
        self._fail(req, now, _ABORTED)
        return private

    def empty_cache(self, now_ns: int) -> int | None:
        """No caching-allocator twin in this engine: nothing to return (None)."""
        return None

    # ------------------------------------------------------------------ queries
    @property
    def preemptions(self) -> int:
        """Retractions SGLang made for lack of KV (the policy's evictions not counted)."""
        return self.scheduler.num_retracted - self.evictions

    def running_requests(self) -> list[RunningView]:
        out = []
        for r in self.scheduler.running:
            info = self._info.get(r.rid)
            if info is None or r.finished:
                continue
            out.append(RunningView(r.rid, info.priority, len(r.origin), len(r.output), len(r.pages), self.last_step_ns,
                                   SeqState.RUNNING))
        return out

    def queue_lengths(self) -> dict:
        s = self.scheduler
        return {"pending": len(self._arrivals), "waiting": len(s.waiting) + (s.chunked is not None),
                "running": len([r for r in s.running + s.last_prefill if not r.finished]), "swapped": 0}

    def memory_summary(self) -> dict:
        return self.profile.memory.to_dict()

    def summary(self) -> RunSummary:
        sim_s = self.now_ns / NS_PER_S
        return RunSummary(
            requests=self.requests, completed=self.completed, failed=self.failed, rejected=self.rejected,
            unfinished=len(self._info), ooms=0, preemptions=self.preemptions,
            ttft_p50_s=_percentile_s(self._ttft_ns, 50), ttft_p99_s=_percentile_s(self._ttft_ns, 99),
            tpot_p50_s=_percentile_s(self._tpot_ns, 50), tpot_p99_s=_percentile_s(self._tpot_ns, 99),
            goodput_tokens_per_s=round(self.goodput_tokens / sim_s, 3) if sim_s > 0 else 0.0,
            downtime_s=0.0, sim_seconds=round(sim_s, 3), events=self.recorder.total + self.recorder.pending,
            **slo_fields(self.served, self.requests, sim_s),
        )


VERSIONS = {"sglang": SGLANG_VERSION_FOLLOWED}
