"""SGLang's scheduler: admission by the prefill budget and ``new_token_ratio``, chunked prefill,
decode, and retraction of decode requests when the KV pool runs short.

Follows SGLang 0.5.23 (``SGLANG_VERSION_FOLLOWED``), one engine step as ``Scheduler.event_loop_normal``
runs it (the synchronous loop, no overlap), with ``--schedule-policy fcfs`` (the default) over the
radix cache (``producers.sim.sglang.radix``) and the token pool (``producers.sim.sglang.token_pool``):

- ``get_next_batch_to_run`` (``managers/scheduler.py``): the chunked request is checkpointed into the
  tree (``stash_chunked_request``); the last prefill batch, less finished and chunked requests, joins
  the running batch; a prefill batch is tried first and, when there is none, the running batch
  decodes (``update_running_batch``); a step with no batch while nothing is queued or running resets
  ``new_token_ratio`` (``on_idle``);
- prefill (``_get_new_batch_prefill_raw`` and ``PrefillAdder``, ``managers/schedule_policy.py``,
  ``mem_cache/prefill_budget.py``): skipped while ``batch_is_full``; the chunked request continues
  first (``add_chunked_req``); every 32nd attempt first touches the prefixes of the first 128
  waiting requests, the head last (``_touch_waiting_prefixes``); then waiting requests in queue order, each matched against the tree
  (``init_next_round_input``: at most ``len - 1`` tokens), locked while it is checked, and admitted
  iff ``extend + min(max_new - output, 4096) + page_size < available + evictable - total_offset``,
  where ``total_offset`` starts at ``sum(min(max_new - output, 4096) * new_token_ratio)`` over the
  running requests and grows by ``ceil_page(extend) + page_size + min(max_new, 4096)`` per admitted
  one (a chunk's ``max_new`` is 0); a request longer than what is left of ``chunked_prefill_size``
  is cut at a page boundary and becomes the chunked request. The scan stops at the first refusal;
  a refusal for tokens (``NO_TOKEN``) sets ``batch_is_full`` when anything runs or was admitted;
  the request-slot gate (``max_running_requests``, the rows of ``ReqToTokenPool``) sets it too;
- allocation (``mem_cache/allocation.py``): before a prefill batch the tree is evicted for
  ``extend_tokens (+ batch size x page_size when pages are larger than one token)`` less what is
  free, before a decode step for ``batch size x page_size``; each request gets the pages its new
  positions start (a page per ``page_size`` positions);
- decode and retraction (``ScheduleBatch.check_decode_mem`` / ``retract_decode``): the step needs a
  page for every request whose committed length is a page multiple; the tree is evicted for it;
  if that is still short, requests are retracted, fewest output tokens first, then the longest
  prompt (a stable sort, so of equal keys the later one), each freeing its KV without caching its
  output and evicting ``remaining x 20`` tokens more, until the rest fits or one is left; the last
  one is aborted if even it does not fit. ``new_token_ratio`` becomes
  ``min(1, (sum output + 20 x remaining) / (sum max_new + 1))``; a step without retraction decays
  it by ``(init - min) / 600`` down to ``min = 0.14 x init``, ``init = min(0.7 x
  schedule_conservativeness, 1)`` (``scheduler_components/new_token_ratio_tracker.py``, ``environ.py``);
- the tree (``mem_cache/radix_cache.py`` ``checkpoint``, ``mem_cache/common.py``
  ``release_kv_cache``): after each prefill (and each middle chunk) the computed prompt is inserted,
  the request's pages that duplicate cached ones are freed and its row points at the tree's; a
  finished request is inserted with its output, a retracted one is not; the tokens past the last
  whole page go back to the pool;
- arrival (``Scheduler.init_req_max_new_tokens``, ``managers/utils.py`` ``validate_input_length``):
  ``max_new`` is clipped to ``max_req_len - prompt - 1`` and to the empty pool; a prompt of at least
  ``max_req_input_len = min(context_len - 1, pool - 1) - 5`` tokens is refused.

Not modelled (named so nothing hides): the overlap scheduler, mixed chunked prefill, the
cache-aware policies (``lpm``, ``dfs-weight``, in-batch prefix caching), priority scheduling and
priority preemption, hierarchical cache / HiCache, speculative decoding, sliding-window and Mamba
pools, prefill/decode disaggregation, EOS and stop strings (requests end at ``max_new_tokens``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from kvguard.producers.sim.sglang.radix import Node, RadixTree
from kvguard.producers.sim.sglang.token_pool import TokenPool

SGLANG_VERSION_FOLLOWED = "0.5.23"
CLIP_MAX_NEW_TOKENS = 4096  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
INIT_NEW_TOKEN_RATIO = 0.7  # SGLANG_INIT_NEW_TOKEN_RATIO
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14  # SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
NEW_TOKEN_RATIO_DECAY_STEPS = 600  # SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS
RETRACT_DECODE_STEPS = 20  # SGLANG_RETRACT_DECODE_STEPS
WAITING_PREFIX_REFRESH_INTERVAL = 32  # managers/schedule_policy.py
WAITING_QUEUE_PREFIX_MATCH_MAX = 128


class Refused(str, Enum):
    PROMPT_TOO_LONG = "prompt_too_long"  # validate_input_length: prompt >= max_req_input_len


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    """What ``sglang.launch_server`` is given (its flag in each comment) and what it derived."""

    max_total_num_tokens: int  # the KV pool in tokens (producers.sim.sglang.memory)
    page_size: int = 1  # --page-size
    max_running_requests: int = 256  # --max-running-requests (or the derived default)
    max_prefill_tokens: int = 16384  # --max-prefill-tokens
    chunked_prefill_size: int | None = 8192  # --chunked-prefill-size (None: -1, chunking off)
    schedule_conservativeness: float = 1.0  # --schedule-conservativeness
    context_len: int = 32768  # --context-length (or the model's)

    def __post_init__(self):
        if self.page_size <= 0 or self.max_total_num_tokens < self.page_size:
            raise ValueError(f"page_size {self.page_size} and a pool of {self.max_total_num_tokens} tokens: "
                             "the pool must hold at least one page")
        if self.max_total_num_tokens % self.page_size:
            raise ValueError(f"max_total_num_tokens {self.max_total_num_tokens} is not a whole number of pages of "
                             f"{self.page_size} (SGLang sizes the pool in whole pages)")
        if self.max_running_requests <= 0 or self.max_prefill_tokens <= 0:
            raise ValueError("max_running_requests and max_prefill_tokens must be positive")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < self.page_size:
            raise ValueError(f"chunked_prefill_size {self.chunked_prefill_size} is below one page")
        if self.schedule_conservativeness <= 0:
            raise ValueError("schedule_conservativeness must be positive")

    @property
    def max_req_len(self) -> int:
        return min(self.context_len - 1, self.max_total_num_tokens - 1)

    @property
    def max_req_input_len(self) -> int:
        return self.max_req_len - 5


@dataclass(slots=True)
class NewTokenRatio:
    init: float
    min: float
    decay: float
    current: float

    @classmethod
    def from_conservativeness(cls, conservativeness: float) -> NewTokenRatio:
        init = min(INIT_NEW_TOKEN_RATIO * conservativeness, 1.0)
        low = min(init * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        return cls(init=init, min=low, decay=(init - low) / NEW_TOKEN_RATIO_DECAY_STEPS, current=init)

    def decay_step(self) -> None:
        self.current = max(self.current - self.decay, self.min)


@dataclass(slots=True, eq=False)
class Req:
    """One request: its tokens, its row of KV pages and its place in the tree."""

    rid: int
    origin: tuple[int, ...]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)  # the row: page of position p is pages[p // page_size]
    committed: int = 0  # kv_committed_len: positions whose KV is (being) computed
    protected: int = 0  # cache_protected_len: the leading positions the tree owns
    prefix_len: int = 0
    extend_end: int = 0
    last_node: Node | None = None
    lock: Node | None = None
    holds_row: bool = False
    retractions: int = 0
    finished: bool = False

    @property
    def fill(self) -> tuple[int, ...]:
        return self.origin + tuple(self.output)

    @property
    def extend_len(self) -> int:
        return self.extend_end - self.prefix_len


class KvListener:
    """What the scheduler's KV decisions look like from outside (the engine's event rows). Each
    method is called after the change it names; the default does nothing."""

    def admitted(self, req: Req, shared: Sequence[int], new: Sequence[int]) -> None: ...
    def allocated(self, req: Req, pages: Sequence[int]) -> None: ...
    def swapped(self, req: Req, dropped: Sequence[int], shared: Sequence[int]) -> None: ...
    def released(self, req: Req, pages: Sequence[int], cached: Sequence[bool]) -> None: ...
    def reclaimed(self, pages: Sequence[int]) -> None: ...
    def retracted(self, req: Req) -> None: ...


@dataclass(slots=True)
class StepOutcome:
    """One step: a prefill batch ``(rid, prefix_len, extend_len)`` or the decoding rids, and what it did."""

    kind: str  # "prefill" | "decode" | "idle"
    prefill: list[tuple[int, int, int]] = field(default_factory=list)
    decode: list[int] = field(default_factory=list)
    retracted: list[int] = field(default_factory=list)
    aborted: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(n for _, _, n in self.prefill) + len(self.decode)


class Scheduler:
    """SGLang's scheduler over one KV pool; see the module docstring."""

    def __init__(self, config: SchedulerConfig, listener: KvListener | None = None):
        self.config = config
        self.page_size = config.page_size
        self.pool = TokenPool(config.max_total_num_tokens, config.page_size)
        self.tree = RadixTree(config.page_size, self._tree_frees)
        self.listener = listener or KvListener()
        self.ratio = NewTokenRatio.from_conservativeness(config.schedule_conservativeness)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.last_prefill: list[Req] = []
        self.chunked: Req | None = None
        self.batch_is_full = False
        self.rows_in_use = 0
        self.requests: dict[int, Req] = {}
        self.num_retracted = self.num_aborted = 0
        self._refresh_calls = 0
        self.chunked_prefill_size = config.chunked_prefill_size  # Scheduler.chunked_prefill_size (a cap may lower it)
        self.admission_headroom_tokens = 0  # kvguard's headroom: tokens admission sees as taken

    # ------------------------------------------------------------------ input
    def add_request(self, rid: int, tokens: Sequence[int], max_new_tokens: int) -> Refused | None:
        """Queue a request (``init_req_max_new_tokens``, ``validate_input_length``); the refusal, if any."""
        c = self.config
        n = len(tokens)
        max_new = max(0, min(max_new_tokens, c.max_req_len - n - 1))
        paged_input = -(-n // self.page_size) * self.page_size
        max_new = max(0, min(max_new, c.max_total_num_tokens - paged_input - self.page_size - 1))
        if n >= c.max_req_input_len:
            return Refused.PROMPT_TOO_LONG
        req = Req(rid, tuple(tokens), max_new)
        self.requests[rid] = req
        self.waiting.append(req)
        return None

    def usage(self) -> float:
        """``sglang:token_usage`` before rounding: what is neither free nor evictable, over the pool."""
        size = self.config.max_total_num_tokens
        return (size - self.pool.available_size() - self.tree.evictable_size()) / size

    # ------------------------------------------------------------------ the step
    def step(self) -> StepOutcome:
        if self.chunked is not None and self.chunked.extend_end > self.chunked.prefix_len:
            self._checkpoint(self.chunked)
        if self.last_prefill:
            kept = [r for r in self.last_prefill if not r.finished and r is not self.chunked]
            if len(kept) < len(self.last_prefill) or (kept and not self.running):
                # an empty running batch is replaced by the last prefill batch, whose flag is clear
                self.batch_is_full = False
            self.running.extend(kept)
            self.last_prefill = []
        alive = [r for r in self.running if not r.finished]
        if len(alive) < len(self.running):
            self.batch_is_full = False
        self.running = alive
        batch = self._prefill_batch()
        if batch is not None:
            out = self._run_prefill(batch)
            self.last_prefill = batch
            return out
        if self.running:
            return self._decode()
        if not self.waiting and self.chunked is None:
            self.ratio.current = self.ratio.init
        return StepOutcome("idle")

    # ------------------------------------------------------------------ prefill
    def _allocatable(self, running_bs: int, held_rows: int = 0) -> int:
        rows = self.config.max_running_requests - self.rows_in_use + held_rows
        return min(self.config.max_running_requests - running_bs, max(rows, 0))

    def _prefill_batch(self) -> list[Req] | None:
        if not self.running:
            self.batch_is_full = False
        if (self.batch_is_full or not self.waiting) and self.chunked is None:
            return None
        running_bs = len(self.running)
        if self._allocatable(running_bs) <= 0 and self.chunked is None:
            self.batch_is_full = True
            return None
        self._touch_waiting_prefixes()
        adder = _Adder(self)
        if self.chunked is not None:
            self.chunked = adder.add_chunked(self.chunked)
        for req in self.waiting:
            if adder.state() == "other":
                break
            held = sum(r.holds_row for r in adder.can_run)
            if len(adder.can_run) >= self._allocatable(running_bs, held):
                self.batch_is_full = True
            if self.batch_is_full:
                break
            self._match(req)
            result = adder.add(req)
            if result != "continue":
                if result == "no_token":
                    self.batch_is_full = bool(adder.can_run) or bool(self.running)
                break
        if not adder.can_run:
            return None
        chosen = set(map(id, adder.can_run))
        self.waiting = [r for r in self.waiting if id(r) not in chosen]
        if adder.new_chunked is not None:
            self.chunked = adder.new_chunked
        return adder.can_run

    def _touch_waiting_prefixes(self) -> None:
        """``SchedulePolicy._touch_waiting_prefixes`` (``SGLANG_ENABLE_WAITING_PREFIX_REFRESH``, on by
        default): on every 32nd prefill attempt with a queue, the cached prefixes of the first 128 waiting
        requests are touched, the head last, so LRU evicts in reverse queue order."""
        if not self.waiting:
            return
        refresh = self._refresh_calls % WAITING_PREFIX_REFRESH_INTERVAL == 0
        self._refresh_calls += 1
        if refresh:
            for req in reversed(self.waiting[:WAITING_QUEUE_PREFIX_MATCH_MAX]):
                self.tree.match_prefix(req.fill)

    def _match(self, req: Req) -> None:
        """``init_next_round_input``: the cached prefix, at most ``len - 1`` tokens."""
        fill = req.fill
        limit = max(len(fill) - 1, 0)
        req.prefix_len, req.last_node = self.tree.match_prefix(fill[:limit])
        req.protected = req.prefix_len

    def _run_prefill(self, batch: list[Req]) -> StepOutcome:
        ps = self.page_size
        extend_tokens = sum(r.extend_len for r in batch)
        self._evict_for(extend_tokens + (len(batch) * ps if ps > 1 else 0))
        out = StepOutcome("prefill")
        for req in batch:
            new = -(-req.extend_end // ps) - -(-req.prefix_len // ps)
            pages = self.pool.alloc_pages(new)
            if pages is None:
                raise RuntimeError(f"Prefill out of memory: request {req.rid} needs {new} pages, "
                                   f"{len(self.pool.free_pages)} free (the admission budget should prevent this)")
            first = not req.holds_row
            if first:
                req.holds_row = True
                self.rows_in_use += 1
                req.pages = self.tree.path_pages(req.last_node)[:req.prefix_len // ps] if req.last_node else []
                self.listener.admitted(req, list(req.pages), pages)
            else:
                self.listener.allocated(req, pages)
            req.pages.extend(pages)
            req.committed = req.extend_end
            out.prefill.append((req.rid, req.prefix_len, req.extend_len))
        for req in batch:
            if req is self.chunked:
                continue
            req.output.append(_sampled(req))
            if len(req.output) >= req.max_new_tokens:
                self._finish(req, out)
            else:
                self._checkpoint(req)
        return out

    # ------------------------------------------------------------------ decode
    def _pages_needed(self, reqs: list[Req]) -> int:
        ps = self.page_size
        return sum(ps for r in reqs if r.committed % ps == 0)

    def _fits_decode(self, reqs: list[Req]) -> bool:
        needed = self._pages_needed(reqs)
        self._evict_for(needed)
        return self.pool.available_size() >= needed

    def _decode(self) -> StepOutcome:
        out = StepOutcome("decode")
        initial = len(self.running)
        if not self._fits_decode(self.running):
            self._retract(out)
        else:
            self.ratio.decay_step()
        if len(self.running) < initial:
            self.batch_is_full = False
        if not self.running:
            return out
        ps = self.page_size
        self._evict_for(len(self.running) * ps)
        for req in self.running:
            if req.committed % ps == 0:
                page = self.pool.alloc_pages(1)
                if page is None:
                    raise RuntimeError(f"Decode out of memory: request {req.rid} (check_decode_mem should prevent this)")
                req.pages.extend(page)
                self.listener.allocated(req, page)
            req.committed += 1
        for req in self.running:
            out.decode.append(req.rid)
            req.output.append(_sampled(req))
            if len(req.output) >= req.max_new_tokens:
                self._finish(req, out)
        return out

    def _retract(self, out: StepOutcome) -> None:
        reqs = self.running
        order = sorted(range(len(reqs)), key=lambda i: (len(reqs[i].output), -len(reqs[i].origin)), reverse=True)
        first = True
        while first or not self._fits_decode([reqs[i] for i in order]):
            if len(order) == 1:
                break
            first = False
            req = reqs[order.pop()]
            self._release(req, checkpoint=False)
            self._evict_for(len(order) * RETRACT_DECODE_STEPS)
            self._reset_for_retract(req)
            self.listener.retracted(req)
            out.retracted.append(req.rid)
            self.num_retracted += 1
        if len(order) <= 1 and not self._fits_decode([reqs[i] for i in order]):
            req = reqs[order.pop()]
            self._release(req, checkpoint=False)
            req.finished = True
            self.requests.pop(req.rid, None)
            out.aborted.append(req.rid)
            self.num_aborted += 1
        self.running = [reqs[i] for i in order]
        decoded = sum(len(r.output) for r in self.running)
        budget = sum(r.max_new_tokens for r in self.running)
        self.ratio.current = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(self.running)) / (budget + 1))
        for rid in out.retracted:
            self.waiting.append(self.requests[rid])

    def _reset_for_retract(self, req: Req) -> None:
        req.retractions += 1
        req.prefix_len = req.protected = req.committed = req.extend_end = 0
        req.last_node = None
        req.pages = []

    # ------------------------------------------------------------------ the tree
    def _tree_frees(self, pages: list[int]) -> None:
        self.pool.free_pages_of(pages)

    def _evict_for(self, num_tokens: int) -> None:
        """``evict_to_free_tokens``: evict the tree for what ``num_tokens`` lacks of free space."""
        shortfall = num_tokens - self.pool.available_size()
        if shortfall > 0:
            before = len(self.tree.evicted_pages)
            self.tree.evict(shortfall)
            evicted = self.tree.evicted_pages[before:]
            if evicted:
                self.listener.reclaimed(evicted)
            self.tree.evicted_pages.clear()

    def _checkpoint(self, req: Req, up_to: int | None = None) -> None:
        """``RadixCache.checkpoint``: insert the computed tokens, free duplicates, re-point the row."""
        ps = self.page_size
        up_to = req.extend_end if up_to is None else up_to
        tokens = req.fill[:up_to]
        key_len = len(tokens) // ps * ps
        key_pages = req.pages[:key_len // ps]
        present, _ = self.tree.insert(tokens, key_pages)
        prompt_len = len(req.origin) // ps * ps
        if 0 < prompt_len < key_len:
            self.tree.insert(tokens[:prompt_len], key_pages[:prompt_len // ps])
        dup_lo, dup_hi = req.protected // ps, -(-present // ps) if present > req.protected else req.protected // ps
        dropped = req.pages[dup_lo:dup_hi]
        self.pool.free_pages_of(dropped)
        _, node = self.tree.match_prefix(tokens[:key_len])
        path = self.tree.path_pages(node)
        shared = path[dup_lo:dup_hi]
        req.pages[req.protected // ps:len(path)] = path[req.protected // ps:]
        if dropped:
            self.listener.swapped(req, dropped, shared)
        req.protected = len(path) * ps
        if req.lock is not None:
            self.tree.dec_lock_ref(req.lock)
        self.tree.inc_lock_ref(node)
        req.lock = req.last_node = node
        if up_to == req.extend_end:
            req.prefix_len = req.extend_end

    def _release(self, req: Req, *, checkpoint: bool) -> None:
        """``release_kv_cache``: optionally insert into the tree, then give the row back."""
        ps = self.page_size
        if checkpoint:
            self._checkpoint(req, up_to=req.committed)
        tree_pages = req.protected // ps
        tail = req.pages[tree_pages:-(-req.committed // ps)]
        self.pool.free_pages_of(tail)
        held = req.pages[:-(-req.committed // ps)]
        self.listener.released(req, held, [i < tree_pages for i in range(len(held))])
        if req.lock is not None:
            self.tree.dec_lock_ref(req.lock)
        req.lock = None
        if req.holds_row:
            req.holds_row = False
            self.rows_in_use -= 1

    def _finish(self, req: Req, out: StepOutcome) -> None:
        self._release(req, checkpoint=True)
        req.finished = True
        self.requests.pop(req.rid, None)
        out.finished.append(req.rid)

    # ------------------------------------------------------------------ actuator entry points
    def abort(self, rid: int) -> bool:
        """End a request now, running or waiting, as SGLang's ``abort_request`` does between steps:
        a queued one leaves the queue, a running one frees its KV without caching it."""
        req = self.requests.get(rid)
        if req is None:
            return False
        if req in self.waiting:
            self.waiting.remove(req)
        if req.holds_row:
            self._release(req, checkpoint=False)
        if req is self.chunked:
            self.chunked = None
        self.running = [r for r in self.running if r is not req]
        self.last_prefill = [r for r in self.last_prefill if r is not req]
        req.finished = True
        self.requests.pop(rid, None)
        return True

    def retract(self, rid: int) -> bool:
        """Retract one decoding request, as ``retract_decode`` does to its victim (back to the queue)."""
        req = next((r for r in self.running if r.rid == rid), None)
        if req is None:
            return False
        self._release(req, checkpoint=False)
        self._reset_for_retract(req)
        self.running = [r for r in self.running if r is not req]
        self.batch_is_full = False
        self.listener.retracted(req)
        self.waiting.append(req)
        self.num_retracted += 1
        return True

    def flush_cache(self) -> int:
        """Evict every unlocked tree node (what ``/flush_cache`` frees while requests run); the tokens freed."""
        before = len(self.tree.evicted_pages)
        freed = self.tree.evict(self.tree.evictable_size())
        evicted = self.tree.evicted_pages[before:]
        if evicted:
            self.listener.reclaimed(evicted)
        self.tree.evicted_pages.clear()
        return freed


class _Adder:
    """``PrefillAdder`` with ``PrefillBudget``: the token budgets of one prefill batch."""

    def __init__(self, s: Scheduler):
        self.s = s
        c = s.config
        self.page_size = c.page_size
        self.rem_input = c.max_prefill_tokens
        self.rem_chunk = s.chunked_prefill_size
        self.can_run: list[Req] = []
        self.new_chunked: Req | None = None
        ratio = s.ratio.current
        self.total_offset = s.admission_headroom_tokens + sum(
            min(r.max_new_tokens - len(r.output), CLIP_MAX_NEW_TOKENS) * ratio for r in s.running)
        self.current_offset = s.admission_headroom_tokens

    def ceil_page(self, tokens: int) -> int:
        return -(-tokens // self.page_size) * self.page_size

    def free_and_evictable(self) -> int:
        return self.s.pool.available_size() + self.s.tree.evictable_size()

    @property
    def remaining_total(self) -> float:
        return self.free_and_evictable() - self.total_offset

    @property
    def remaining_current(self) -> float:
        return self.free_and_evictable() - self.current_offset

    def state(self) -> str:
        if not (self.remaining_total > 0 and self.remaining_current > 0):
            return "no_token"
        if self.rem_input <= 0 or (self.rem_chunk is not None and self.rem_chunk <= 0):
            return "other"
        return "continue"

    def _charge(self, extend_len: int, max_new: int) -> None:
        paged = self.ceil_page(extend_len)
        self.total_offset += paged + self.page_size + max_new
        self.current_offset += paged + self.page_size
        self.rem_input -= paged
        if self.rem_chunk is not None:
            self.rem_chunk -= paged

    def add_chunked(self, req: Req) -> Req | None:
        """``add_chunked_req``: the next chunk of the chunked request; it, while more chunks remain."""
        rem = min(self.rem_chunk, int(self.remaining_total))
        if rem <= 0:
            rem = self.rem_chunk
        cand = len(req.fill) - req.prefix_len
        truncated = cand > rem
        req.extend_end = req.prefix_len + min(cand, rem)
        self.can_run.append(req)
        self._charge(req.extend_len, 0 if truncated else min(req.max_new_tokens, CLIP_MAX_NEW_TOKENS))
        return req if truncated else None

    def add(self, req: Req) -> str:
        """``add_one_req``: "continue", "no_token" or "other" (the scan goes on only on "continue")."""
        tree = self.s.tree
        max_new = min(max(req.max_new_tokens - len(req.output), 0), CLIP_MAX_NEW_TOKENS)
        extend_len = len(req.fill) - req.prefix_len
        total = extend_len + max_new + self.page_size
        tree.inc_lock_ref(req.last_node)
        try:
            if not total < self.remaining_total:
                return "no_token"
            input_tokens = self.ceil_page(extend_len)
            if self.rem_chunk is None and self.can_run and input_tokens >= self.rem_input:
                return "other"
            chunked = False
            admitted_max_new = min(req.max_new_tokens, CLIP_MAX_NEW_TOKENS)
            if self.rem_chunk is not None and input_tokens > self.rem_chunk:
                end = (req.prefix_len + self.rem_chunk // self.page_size * self.page_size) // self.page_size \
                    * self.page_size
                extend_len = end - req.prefix_len
                if extend_len <= 0:
                    return "other"
                chunked, admitted_max_new = True, 0
            req.extend_end = req.prefix_len + extend_len
            tree.inc_lock_ref(req.last_node)
            req.lock = req.last_node
            self.can_run.append(req)
            if chunked:
                self.new_chunked = req
            self._charge(extend_len, admitted_max_new)
        finally:
            tree.dec_lock_ref(req.last_node)
        return self.state()


def _sampled(req: Req) -> int:
    """The token the fake model step samples for ``req`` (its KV is computed at the next step)."""
    return output_token(req.rid, len(req.origin) + len(req.output))


def output_token(rid: int, position: int) -> int:
    """A token id that depends on the request and the position only (both sides of the conformance
    sample it), never SGLang's default EOS id 2 (ids are 3 or more)."""
    return 3 + (rid * 1_000_003 + position * 7919) % 30000
