"""The shadow engine: continuous batching over a workload on a simulated clock (docs/ARCHITECTURE.md, "Node side").

One ``Engine`` drives one ``PagedPool``. Each step schedules running requests first (one decode
token each, then the next chunk of any unfinished prefill), then admits waiting requests while the
token budget (``max_batched_tokens``), ``max_num_seqs`` and the free-space watermark allow. KV
growth is checked the way vLLM's scheduler checks it, by counting free units (cached prefix pages
count as free, and the workspace of a full step is held back); the pool then has to place the pages
physically, in contiguous runs. The gap between the two is where fragmentation OOMs come from.

Baseline recovery on a KV allocation failure is vLLM's: reclaim cached prefix pages (LRU), then
preempt running requests (lowest priority first, then newest) until the count fits, and recompute
them later. An allocation that still fails, or a step's workspace buffer that does not fit after
reclaiming cached pages, crashes the engine the way a real server process dies of CUDA OOM: an OOM
row, every request it holds (running, swapped and waiting: the whole in-memory queue) finishes
FAILED_OOM, the pool resets, and the GPU is down for ``restart_s``. While it is down it refuses
work: a request that arrives then finishes REJECTED at once (a router with a health check sends
new work to the GPUs that are up instead; see ``producers.sim.fleet``), so it restarts empty.

Pure decode phases are fused: when no prefill is pending, up to ``max_fused_steps`` identical decode
steps run as one block (KV slots for the block are allocated at its start, as vLLM's multi-step
scheduling does), ending no later than the next arrival or the first request to finish. One STEP
row then covers the block (size/tokens/aux are the block's totals).

Decode tokens that fit the free room of a request's last page are counted by the engine and
reported to the pool (one FILL) when the next page is needed: pages are allocated exactly when
their first token needs them, the per-token Python work is O(1), and the pool's ``tokens_stored``
lags by less than one small page per request. A step's decode growth goes to the pool in one
``grow_many`` call whenever the free count shows that no request would be preempted
(``_decode_batch``); otherwise request by request, with vLLM's recovery.

Events: the pool records the memory rows; the engine adds ARRIVE, ADMIT, FINISH, PREEMPT, OOM and
STEP rows in order. Time only comes from the workload and the step-time model, never a clock.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from kvguard.contracts.dimensions import Granularity, HandlingChoice
from kvguard.contracts.engine import Capabilities, KnobUnavailable
from kvguard.contracts.events import F_PRIORITY_DEFAULTED, EventKind, Handling, Outcome
from kvguard.contracts.pool_types import EvictResult, PageInfo, PageState, PoolError, PoolExhausted
from kvguard.contracts.units import DEFAULT_PRIORITY, NS_PER_S
from kvguard.producers.sim.profile import Profile
from kvguard.producers.sim.run import (
    GRANULARITIES,
    RunningView,
    RunSummary,
    SeqState,
    slo_fields,
)
from kvguard.producers.sim.workloads import HASH_BLOCK_TOKENS, Request, mix_hash


@dataclass(slots=True)
class SeedEngineConfig:
    watermark_frac: float = 0.01  # admission keeps this share of D free (vLLM's watermark)
    restart_s: float = 60.0  # downtime after an OOM crash
    max_fused_steps: int = 16  # decode steps fused into one block
    max_prompt_tokens: int | None = None  # None: the profile's max_model_len


class _Seq:
    """Engine-side state of one request."""

    __slots__ = ("req", "rid", "priority", "arrival_ns", "prompt", "max_out", "generated", "kv_tokens",
                 "target", "state", "first_token_ns", "last_step_ns", "retained", "hashes", "order", "room",
                 "pending")

    def __init__(self, req: Request, priority: int, order: int):
        self.req = req
        self.rid = req.req_id
        self.priority = priority
        self.arrival_ns = req.arrival_ns
        self.prompt = req.prompt_tokens
        self.max_out = max(1, req.max_output_tokens)
        self.generated = 0
        self.kv_tokens = 0  # tokens whose KV the pool holds for this request
        self.target = req.prompt_tokens  # tokens to prefill before decoding (prompt + generated on recompute)
        self.state = SeqState.WAITING
        self.first_token_ns = -1
        self.last_step_ns = -1
        self.retained = False
        self.hashes = req.block_hashes
        self.order = order  # admission order: "newest" for preemption
        self.room = 0  # free token slots left in the request's last page
        self.pending = 0  # decode tokens written into that room, not yet reported to the pool


SEED_CAPABILITIES = Capabilities(
    uniform_blocks=False,  # two page classes, placed in contiguous runs shared with the step workspace
    caching_allocator=False,
    prompt_logprobs=False,
    evict_granularities=frozenset(Granularity),
    evict_handlings=frozenset(HandlingChoice),
    admission_headroom=True,
    token_budget=False,
    admission_hold=False,
    abort=False,
    empty_cache=False,
    compact=True,
    reclaim_cached=True,
    notes=(("token_budget", "this engine has no per-step token budget to cap"),
           ("admission_hold", "this engine has no admission hold"),
           ("abort", "this engine cannot abort a request"),
           ("empty_cache", "this engine has no caching allocator")),
)


class Engine:
    capabilities: ClassVar[Capabilities] = SEED_CAPABILITIES

    def __init__(self, pool, profile: Profile, *, node: str = "sim-0/gpu0", seed: int = 0,
                 config: SeedEngineConfig | None = None):
        self.pool = pool
        self.profile = profile
        self.node = node
        self.seed = seed
        self.config = config or SeedEngineConfig()
        geometry = profile.geometry
        self.unit_tokens = geometry.unit_tokens
        self.dynamic_units = geometry.dynamic_units
        self.base_watermark_units = int(self.config.watermark_frac * geometry.dynamic_units)
        # admission keeps watermark_units free: the engine's own watermark plus any headroom an
        # actuator holds back (set_admission_headroom)
        self.watermark_units = self.base_watermark_units
        self.ws_reserve_units = profile.workspace_units(profile.max_batched_tokens)
        self.max_prompt = self.config.max_prompt_tokens or profile.max_model_len
        self.small_page_tokens = geometry.page_classes[0] * geometry.unit_tokens
        self.now_ns = 0
        self.down_until_ns = 0
        self._arrivals: list[tuple[int, int, Request]] = []  # heap (arrival_ns, req_id, request)
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._swapped: deque[_Seq] = deque()
        self._seqs: dict[int, _Seq] = {}
        self._order = 0
        self._stash: list[np.ndarray] = []
        self._outstanding = 0
        self._events_total = 0
        # outcomes
        self.requests = 0
        self.completed = 0
        self.failed = 0
        self.rejected = 0
        self.ooms = 0
        self.preemptions = 0
        self.priority_defaulted = 0
        self.downtime_ns = 0
        self.goodput_tokens = 0
        self.steps = 0
        self._ttft_ns: list[int] = []
        self._tpot_ns: list[float] = []
        self.served: list[tuple[int, float, int]] = []  # (ttft_ns, mean tpot_ns, output tokens) per completion
        self.oom_log: list[dict] = []

    # ------------------------------------------------------------------ events

    def _emit(self, ts_ns: int, kind: EventKind, req: int = -1, *, cls: int = 0, flags: int = 0,
              offset: int = 0, size: int = 0, tokens: int = 0, aux: int = 0) -> None:
        self.pool.record_event(kind, ts_ns, req=req, cls=cls, flags=flags, offset=offset, size=size,
                               tokens=tokens, aux=aux)

    def take_events(self) -> np.ndarray:
        """Every row recorded since the last call (pool and engine rows, one ordered stream)."""
        rows = self.pool.take_events()
        if self._stash:
            rows = np.concatenate(self._stash + [rows])
            self._stash = []
        self._events_total += len(rows)
        return rows

    @property
    def events_recorded(self) -> int:
        rows = self.pool.take_events()
        if len(rows):
            self._stash.append(rows)
        return self._events_total + sum(len(c) for c in self._stash)

    # ------------------------------------------------------------------ input

    def submit(self, request: Request) -> None:
        """Queue a request; it arrives at ``request.arrival_ns`` on the simulated clock."""
        heapq.heappush(self._arrivals, (request.arrival_ns, request.req_id, request))
        self._outstanding += request.prompt_tokens + request.max_output_tokens

    def is_up(self, at_ns: int) -> bool:
        """Whether a request arriving at ``at_ns`` would be accepted (the engine is not restarting
        after a crash then): the router's health check."""
        return max(at_ns, self.now_ns) >= self.down_until_ns

    def outstanding_tokens(self) -> int:
        """Prompt + output tokens of every request submitted here and not yet finished: the
        router's load measure (O(1), kept as requests come and go)."""
        return self._outstanding

    def _arrive(self, until_ns: int) -> None:
        while self._arrivals and self._arrivals[0][0] <= until_ns:
            arrival_ns, _, r = heapq.heappop(self._arrivals)
            # rows of one node stay in time order: a request routed here after this engine's step
            # passed its arrival time is recorded when the engine sees it
            arrival_ns = max(arrival_ns, self.now_ns)
            flags = 0
            priority = r.priority
            if priority is None:
                priority, flags = DEFAULT_PRIORITY, F_PRIORITY_DEFAULTED
                self.priority_defaulted += 1
            priority = min(10, max(0, int(priority)))
            seq = _Seq(r, priority, 0)
            seq.hashes = self._pool_hashes(r.block_hashes, r.prompt_tokens)
            self.requests += 1
            self._emit(arrival_ns, EventKind.ARRIVE, r.req_id, cls=priority, flags=flags,
                       tokens=r.prompt_tokens, aux=r.max_output_tokens)
            if (arrival_ns < self.down_until_ns or r.prompt_tokens + 1 > self.max_prompt
                    or self._units_for(r.prompt_tokens + 1) + self.ws_reserve_units > self.dynamic_units):
                # down (restarting after a crash) or a prompt that could never fit: refused
                self.rejected += 1
                self._outstanding -= r.prompt_tokens + r.max_output_tokens
                self._emit(arrival_ns, EventKind.FINISH, r.req_id, flags=int(Outcome.REJECTED))
                continue
            self._seqs[r.req_id] = seq
            self._waiting.append(seq)

    # ------------------------------------------------------------------ stepping

    def advance(self, until_ns: int) -> None:
        """Run engine steps until the simulated clock reaches ``until_ns`` (a step that starts
        before ``until_ns`` runs to its end, so ``now_ns`` may pass it slightly)."""
        while self.now_ns < until_ns:
            if self.now_ns < self.down_until_ns:
                # crashed: requests that arrive while the GPU restarts are refused
                resume = min(self.down_until_ns, until_ns)
                self._arrive(resume)
                self.downtime_ns += resume - self.now_ns
                self.now_ns = resume
                continue
            self._arrive(self.now_ns)
            if not self._running and not self._waiting and not self._swapped:
                nxt = self._arrivals[0][0] if self._arrivals else until_ns
                self.now_ns = max(self.now_ns, min(nxt, until_ns))
                continue
            if not self._step(until_ns):
                # nothing schedulable (all blocked): idle until the next arrival
                nxt = self._arrivals[0][0] if self._arrivals else until_ns
                self.now_ns = max(self.now_ns + 1, min(nxt, until_ns))

    def _units_for(self, tokens: int) -> int:
        return -(-tokens // self.unit_tokens)

    def _free_count(self) -> int:
        """Units vLLM's scheduler would call free: free runs plus reclaimable cached pages."""
        return self.pool.free_units + self.pool.cached_units

    def _step(self, until_ns: int) -> bool:
        now = self.now_ns
        self._swap_in_ready(now)
        budget = self.profile.max_batched_tokens
        decode = [s for s in self._running if s.kv_tokens >= s.target]
        prefilling = [s for s in self._running if s.kv_tokens < s.target]
        if not prefilling and not self._admissible(now, budget - len(decode)):
            return self._fused_decode(decode, until_ns) if decode else False
        done = self._decode_batch(decode, 1, now)
        scheduled_decode: list[_Seq] = decode[:done]
        for s in decode[done:]:
            if s.state is not SeqState.RUNNING or self.down_until_ns > now:
                continue  # preempted by an earlier allocation in this step, or crashed
            if self._decode_tokens(s, 1, now):
                scheduled_decode.append(s)
        budget -= len(scheduled_decode)
        chunks: list[tuple[_Seq, int]] = []
        for s in prefilling:
            if budget <= 0 or self.down_until_ns > now:
                break
            if s.state is not SeqState.RUNNING:
                continue
            n = min(budget, s.target - s.kv_tokens)
            if self._grow(s, n, now):
                chunks.append((s, n))
                budget -= n
        while (budget > 0 and self._waiting and len(self._running) < self.profile.max_num_seqs
               and self.down_until_ns <= now):
            s = self._waiting[0]
            if not self._admit(s, now, budget):
                break
            n = min(budget, s.target - s.kv_tokens)
            if n <= 0:
                continue
            if self._grow(s, n, now):
                chunks.append((s, n))
                budget -= n
        if self.now_ns != now:
            return True  # crashed during scheduling
        scheduled_decode = [s for s in scheduled_decode if s.state is SeqState.RUNNING]
        chunks = [(s, n) for s, n in chunks if s.state is SeqState.RUNNING]
        prefill_tokens = sum(n for _, n in chunks)
        batched = prefill_tokens + len(scheduled_decode)
        if batched == 0:
            return False
        duration = int(self.profile.step_seconds(prefill_tokens, len(scheduled_decode)) * NS_PER_S)
        if not self._run_step(now, batched, len(scheduled_decode), duration):
            return True
        end = now + duration
        for s in scheduled_decode:
            s.generated += 1
            s.last_step_ns = end
        for s, n in chunks:
            s.last_step_ns = end
            if s.kv_tokens >= s.target:  # prefill done: this step sampled a token
                if s.first_token_ns < 0:
                    s.first_token_ns = end
                    self._ttft_ns.append(end - s.arrival_ns)
                s.generated += 1 if s.generated < s.max_out else 0
        self.now_ns = end
        self._finish_done(end)
        return True

    def _fused_decode(self, decode: list[_Seq], until_ns: int) -> bool:
        now = self.now_ns
        n = len(decode)
        per_step = int(self.profile.step_seconds(0, n) * NS_PER_S)
        k = min(self.config.max_fused_steps, min(s.max_out - s.generated for s in decode))
        horizon = self._arrivals[0][0] if self._arrivals else until_ns
        horizon = min(horizon, until_ns)
        if horizon > now:
            k = min(k, max(1, -(-(horizon - now) // per_step)))
        else:
            k = 1
        k = max(1, k)
        done = self._decode_batch(decode, k, now)
        grown = decode[:done]
        for s in decode[done:]:
            if s.state is not SeqState.RUNNING or self.down_until_ns > now:
                continue
            if self._decode_tokens(s, k, now):
                grown.append(s)
        if self.now_ns != now:
            return True
        grown = [s for s in grown if s.state is SeqState.RUNNING]
        if not grown:
            return False
        if len(grown) != n:
            per_step = int(self.profile.step_seconds(0, len(grown)) * NS_PER_S)
        duration = per_step * k
        if not self._run_step(now, len(grown), len(grown), duration, steps=k):
            return True
        end = now + duration
        done = []
        for s in grown:
            s.generated += k
            s.last_step_ns = end
            if s.generated >= s.max_out and s.kv_tokens >= s.target:
                done.append(s)
        self.now_ns = end
        # every running request is in ``grown`` (no prefill was pending), in running order
        self._finish_done(end, done)
        return True

    def _run_step(self, now: int, batched: int, decode_seqs: int, duration: int, steps: int = 1) -> bool:
        """Allocate the step's workspace, record the STEP, free it. False if the engine crashed."""
        units = self.profile.workspace_units(batched)
        try:
            offset = self.pool.alloc_workspace(units, now, batched)
        except PoolExhausted:
            self.pool.reclaim_cached(units, now)
            try:
                offset = self.pool.alloc_workspace(units, now, batched)
            except PoolExhausted as e:
                self._crash(now, -1, units, e.largest_free_run, "workspace", e.free_units)
                return False
        self._emit(now, EventKind.STEP, size=batched * steps, tokens=decode_seqs * steps, aux=duration)
        self.pool.free_workspace(offset, now + duration)
        self.steps += steps
        return True

    def _finish_done(self, now: int, done: list[_Seq] | None = None) -> None:
        """Release and record the running requests that are done (``done``: those, in running
        order, when the caller already knows them)."""
        if done is None:
            done = [s for s in self._running if s.generated >= s.max_out and s.kv_tokens >= s.target]
        if not done:
            return
        for s in done:
            self.pool.release(s.rid, now, cache_prefix=True)
            s.state = SeqState.FINISHED
            self.completed += 1
            self._outstanding -= s.prompt + s.req.max_output_tokens
            self.goodput_tokens += s.generated
            tpot = (now - s.first_token_ns) / (s.generated - 1) if s.generated > 1 else 0.0
            if s.generated > 1:
                self._tpot_ns.append(tpot)
            self.served.append((s.first_token_ns - s.arrival_ns, tpot, s.generated))
            self._emit(now, EventKind.FINISH, s.rid, flags=int(Outcome.COMPLETED), tokens=s.generated)
            del self._seqs[s.rid]
        self._running = [s for s in self._running if s.state is SeqState.RUNNING]

    # ------------------------------------------------------------------ admission and growth

    def _admissible(self, now: int, budget: int) -> bool:
        if budget <= 0 or not self._waiting or len(self._running) >= self.profile.max_num_seqs:
            return False
        s = self._waiting[0]
        n = min(budget, s.target - s.kv_tokens)
        return self._free_count() - self.pool.units_needed(s.rid, n, s.hashes) >= self.watermark_units + self.ws_reserve_units

    def _admit(self, s: _Seq, now: int, budget: int) -> bool:
        if s.retained:
            s.retained = False
            try:
                self.pool.remap(s.rid, now)
            except PoolError:
                pass
            self._resync_tokens(s, now)
        n = min(budget, s.target - s.kv_tokens)
        if self._free_count() - self.pool.units_needed(s.rid, n, s.hashes) < self.watermark_units + self.ws_reserve_units:
            return False
        self._waiting.popleft()
        s.state = SeqState.RUNNING
        self._order += 1
        s.order = self._order
        self._running.append(s)
        self._emit(now, EventKind.ADMIT, s.rid)
        return True

    def _pool_hashes(self, hashes: tuple[int, ...], prompt_tokens: int) -> tuple[int, ...]:
        """The workload's chained hashes per HASH_BLOCK_TOKENS, re-cut to the pool's block size.
        Each workload hash names its whole prefix, so a coarser block takes the hash at its end and
        a finer block mixes the covering hash with its index inside it."""
        block = self.pool.block_tokens
        if not hashes or block == HASH_BLOCK_TOKENS:
            return hashes
        if block > HASH_BLOCK_TOKENS:
            step = block // HASH_BLOCK_TOKENS
            return hashes[step - 1::step]
        per = HASH_BLOCK_TOKENS // block
        return tuple(mix_hash(h, j) for h in hashes for j in range(per))

    def _decode_batch(self, decode: list[_Seq], n: int, now: int) -> int:
        """``_decode_tokens(s, n, now)`` for the leading requests of ``decode`` (all running), with
        their page growth in one ``pool.grow_many`` call. Exact only where the one-by-one path
        would neither preempt nor fail: so it runs when the free count covers every grow's upper
        bound plus the workspace reserve, and stops where the pool stops (a grow that may share,
        revive or fail). Returns how many of ``decode`` it handled; the caller does the rest one
        by one, as before."""
        growers, rids, tokens, hashes = [], [], [], []
        unit = self.unit_tokens
        need = 0
        for s in decode:
            if s.room < n:
                m = s.pending + n
                need += -(-m // unit) + 1
                growers.append(s)
                rids.append(s.rid)
                tokens.append(m)
                hashes.append(s.hashes)
        if growers:
            if self._free_count() - need < self.ws_reserve_units:
                return 0
            grown = self.pool.grow_many(rids, tokens, now, hashes)
            stop = len(decode) if grown == len(growers) else decode.index(growers[grown])
        else:
            stop = len(decode)
        small = self.small_page_tokens
        for s in decode[:stop] if stop < len(decode) else decode:
            if s.room >= n:
                s.room -= n
                s.pending += n
                s.kv_tokens += n
            else:
                s.kv_tokens += n
                s.pending = 0
                s.room = -s.kv_tokens % small
        return stop

    def _decode_tokens(self, s: _Seq, n: int, now: int) -> bool:
        """Decode tokens go into the room of the last page without a pool call; the pool hears of
        them (one FILL) when the next page is needed, so pages are still allocated exactly when the
        first token needs them and the per-token Python work stays O(1)."""
        if s.room >= n:
            s.room -= n
            s.pending += n
            s.kv_tokens += n
            return True
        return self._grow(s, n, now)

    def _grow(self, s: _Seq, n: int, now: int) -> bool:
        """Append ``n`` tokens of KV for ``s``, with vLLM's recovery; False if ``s`` was preempted
        (or the engine crashed) instead."""
        free = self._free_count()
        # n tokens never need more than ceil(n / unit) + 1 new units: skip the exact count when clear
        n_pool = s.pending + n
        need = self._units_for(n_pool) + 1
        if free - need < self.ws_reserve_units:
            need = self.pool.units_needed(s.rid, n_pool, s.hashes)
        while need and self._free_count() - need < self.ws_reserve_units:
            victim = self._pick_victim()
            if victim is None:
                break
            self._preempt(victim, now)
            if victim is s:
                return False
        try:
            self.pool.grow(s.rid, n_pool, now, s.hashes)
        except PoolExhausted:
            self.pool.reclaim_cached(need, now)
            try:
                self.pool.grow(s.rid, n_pool, now, s.hashes)
            except PoolExhausted as e:
                self._crash(now, s.rid, e.requested_units, e.largest_free_run, "kv", e.free_units)
                return False
        s.kv_tokens += n
        s.pending = 0
        s.room = -s.kv_tokens % self.small_page_tokens
        return True

    def _pick_victim(self) -> _Seq | None:
        if not self._running:
            return None
        return min(self._running, key=lambda s: (s.priority, -s.order))

    def _preempt(self, s: _Seq, now: int) -> None:
        self.pool.release(s.rid, now, cache_prefix=True)
        self.preemptions += 1
        recompute = s.prompt + s.generated
        self._emit(now, EventKind.PREEMPT, s.rid, tokens=recompute)
        self._requeue(s, recompute)

    def _requeue(self, s: _Seq, target: int) -> None:
        s.state = SeqState.WAITING
        s.kv_tokens = s.pending = s.room = 0
        s.target = max(target, 1)
        self._running.remove(s)
        self._waiting.appendleft(s)

    def _crash(self, now: int, req: int, units: int, largest: int, what: str, free_units: int) -> None:
        self.ooms += 1
        # fragmentation: the total free space would have sufficed, only a contiguous run was missing
        self.oom_log.append({"t_s": round(now / NS_PER_S, 3), "what": what, "requested_units": units,
                             "largest_free_run": largest, "free_units": free_units,
                             "fragmentation": free_units >= units, "running": len(self._running),
                             "waiting": len(self._waiting), "swapped": len(self._swapped)})
        self._emit(now, EventKind.OOM, req, size=units, aux=largest)
        # the process dies with its whole in-memory queue: running, then swapped, then waiting
        for s in list(self._running) + list(self._swapped) + list(self._waiting):
            s.state = SeqState.FINISHED
            self.failed += 1
            self._outstanding -= s.prompt + s.req.max_output_tokens
            self._emit(now, EventKind.FINISH, s.rid, flags=int(Outcome.FAILED_OOM), tokens=s.generated)
            del self._seqs[s.rid]
        self._running = []
        self._swapped.clear()
        self._waiting.clear()
        self.pool.reset(now)
        self.down_until_ns = now + int(self.config.restart_s * NS_PER_S)
        self.now_ns = now + 1

    # ------------------------------------------------------------------ swapped requests

    def _swap_in_ready(self, now: int) -> None:
        while self._swapped and len(self._running) < self.profile.max_num_seqs:
            s = self._swapped[0]
            need = self._units_for(s.kv_tokens) + 1
            if self._free_count() - need < self.watermark_units + self.ws_reserve_units:
                return
            try:
                self.pool.swap_in(s.rid, now)
            except PoolExhausted:
                return
            except PoolError:
                s.kv_tokens = 0  # contents lost (checkpoint gone): recompute
                self._swapped.popleft()
                s.state = SeqState.WAITING
                s.target = s.prompt + s.generated
                self._waiting.appendleft(s)
                continue
            self._swapped.popleft()
            s.state = SeqState.RUNNING
            self._order += 1
            s.order = self._order
            self._running.append(s)

    # ------------------------------------------------------------------ actuator entry points

    def evict_request(self, req: int, now_ns: int, *, granularity: str = Granularity.REQUEST,
                      handling: Handling = Handling.RECOMPUTE, pages=None) -> EvictResult:
        """Execute a policy eviction between steps. ``request`` granularity takes every page;
        ``block`` the ``pages`` tail pages (default 1); ``token`` the page offsets in ``pages``.
        The request leaves the running set: RECOMPUTE/RETAIN -> waiting (RETAIN re-maps its pages on
        re-admission), SWAP/CHECKPOINT -> swapped (brought back when there is room). A finished or
        unknown request returns a no-op result."""
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity: expected one of {GRANULARITIES}, got {granularity!r}")
        handling = Handling(handling)
        s = self._seqs.get(req)
        if s is None or s.state is not SeqState.RUNNING:
            return EvictResult(req=req, handling=handling)
        if granularity == Granularity.REQUEST:
            sel = None
        elif granularity == Granularity.BLOCK:
            sel = 1 if pages is None else int(pages)
        else:
            sel = list(pages or [])
            if not sel:
                return EvictResult(req=req, handling=handling)
        result = self.pool.evict(req, now_ns, pages=sel, handling=handling)
        self._running.remove(s)
        if handling in (Handling.SWAP, Handling.CHECKPOINT):
            s.state = SeqState.SWAPPED
            self._swapped.append(s)
        else:
            s.state = SeqState.WAITING
            s.retained = handling is Handling.RETAIN
            s.target = max(s.prompt + s.generated, 1)
            if not s.retained:
                self._resync_tokens(s, now_ns)
            self._waiting.appendleft(s)
        return result

    def _resync_tokens(self, s: _Seq, now_ns: int) -> None:
        """After an eviction: continue from the live pages when only the tail was lost; a request
        missing pages in the middle recomputes from scratch (its KV must be contiguous in order)."""
        s.pending = s.room = 0
        if not self.pool.has_request(s.rid):
            s.kv_tokens = 0
            return
        pages = self.pool.request_pages(s.rid)
        if any(p.state != PageState.LIVE for p in pages):
            self.pool.release(s.rid, now_ns, cache_prefix=True)
            s.kv_tokens = 0
        else:
            s.kv_tokens = sum(p.tokens for p in pages)
            s.room = -s.kv_tokens % self.small_page_tokens

    def set_admission_headroom(self, units: int) -> None:
        """Hold ``units`` back from admission on top of the engine's own watermark (0 releases
        the hold). Running requests keep growing; only new admissions and swap-ins see it."""
        if units < 0:
            raise ValueError(f"admission headroom must be >= 0 units, got {units}")
        self.watermark_units = self.base_watermark_units + int(units)

    def compact(self, now_ns: int, max_moves: int) -> int:
        """Move up to ``max_moves`` pages to coalesce free runs; returns the units moved."""
        return self.pool.compact(now_ns, max_moves)

    def reclaim_cached(self, units: int, now_ns: int) -> int:
        """Drop up to ``units`` units of cached prefix pages (LRU); returns the units freed."""
        return self.pool.reclaim_cached(units, now_ns)

    def request_pages(self, req: int) -> list[PageInfo]:
        return self.pool.request_pages(req)

    @property
    def pool_units(self) -> int:
        return self.dynamic_units

    @property
    def ooms_by_cause(self) -> Counter[str]:
        """OOMs by ``layer:cause``: KV-arena runs, ``fragmentation`` when the free units would have
        sufficed, ``peak`` otherwise (the vLLM engine's keys name the allocator's causes)."""
        return Counter("kv_arena:fragmentation" if o["fragmentation"] else "kv_arena:peak" for o in self.oom_log)

    @property
    def rejected_by_reason(self) -> Counter[str]:
        """Rejections by reason: this engine records none (its ``rejected`` count has them all)."""
        return Counter()

    # the knobs this engine does not have (SEED_CAPABILITIES): the executor never calls them

    def set_batch_token_cap(self, tokens: int, steps: int = 0) -> None:
        raise KnobUnavailable("the seed engine", "token_budget")

    def hold_admissions(self, max_prompt_tokens: int, steps: int = 0) -> None:
        raise KnobUnavailable("the seed engine", "admission_hold")

    def release_admissions(self) -> bool:
        raise KnobUnavailable("the seed engine", "admission_hold")

    def abort_request(self, req: int, now_ns: int) -> int | None:
        raise KnobUnavailable("the seed engine", "abort")

    def empty_cache(self, now_ns: int) -> int | None:
        raise KnobUnavailable("the seed engine", "empty_cache")

    # ------------------------------------------------------------------ queries

    def running_requests(self) -> list[RunningView]:
        out = []
        for s in self._running:
            try:
                units = sum(p.size for p in self.pool.request_pages(s.rid) if p.offset >= 0)
            except PoolError:
                units = 0
            out.append(RunningView(s.rid, s.priority, s.prompt, s.generated, units, s.last_step_ns, s.state))
        return out

    def queue_lengths(self) -> dict:
        return {"pending": len(self._arrivals), "waiting": len(self._waiting), "running": len(self._running),
                "swapped": len(self._swapped)}

    def summary(self) -> RunSummary:
        def pct(values, q):
            return round(float(np.percentile(np.asarray(values, dtype=np.float64), q)) / NS_PER_S, 6) if values else None

        sim_s = self.now_ns / NS_PER_S
        return RunSummary(
            requests=self.requests, completed=self.completed, failed=self.failed, rejected=self.rejected,
            unfinished=len(self._seqs), ooms=self.ooms,
            preemptions=self.preemptions, ttft_p50_s=pct(self._ttft_ns, 50), ttft_p99_s=pct(self._ttft_ns, 99),
            tpot_p50_s=pct(self._tpot_ns, 50), tpot_p99_s=pct(self._tpot_ns, 99),
            goodput_tokens_per_s=round(self.goodput_tokens / sim_s, 3) if sim_s > 0 else 0.0,
            downtime_s=round(self.downtime_ns / NS_PER_S, 3), sim_seconds=round(sim_s, 3),
            events=self.events_recorded, **slo_fields(self.served, self.requests, sim_s),
        )
