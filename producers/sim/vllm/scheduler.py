"""The vLLM v1 scheduler (vLLM 0.33.0 ``vllm/v1/core/sched/scheduler.py``, synchronous ``Scheduler``).

One ``schedule()`` call is one engine step; the model step is outside: the caller runs the batch and
hands one sampled token per sampling request to ``update_from_output``. A request finishes after
``max_tokens`` output tokens or at ``max_model_len`` tokens (EOS is ignored). The rules, each from
``Scheduler.schedule`` unless named otherwise:

- Running requests first, in order, each getting ``num_tokens - num_computed_tokens`` tokens (one for
  a decode, the rest of the prompt for a prefill) capped by ``long_prefill_token_threshold`` (only
  while more than one request is running or waiting), by the token budget
  ``max_num_batched_tokens`` (chunked prefill) and by ``max_model_len - num_computed_tokens - 1``.
- When a running request's slots do not fit, preempt by recompute until they do: policy "fcfs"
  takes the last running request; "priority" the running request with the largest
  ``(priority, arrival)`` (the first such in running order), returning the budget it was given this
  step. A preempted request frees its blocks, restarts from 0 computed tokens and goes to the front
  of the waiting queue (``_preempt_request``). If the request preempts itself, the running pass
  stops ("fcfs") or moves on to the next request ("priority").
- Waiting requests next, only if nothing was preempted this step, while the budget lasts and fewer
  than ``max_num_seqs`` run: prefix-cache hit (``get_computed_blocks``), then ``allocate_slots`` with
  the full-sequence gate (``scheduler_reserve_full_isl``, default True) and the watermark; the first
  refusal ends admission for the step (FCFS head-of-line blocking, as in vLLM).
- Waiting order: "fcfs" a deque (arrival order, preempted requests in front); "priority" a heap on
  ``(priority, arrival_ns, request_id)`` (``request_queue.py``, ``Request.__lt__``).
- At arrival, a prompt longer than ``max_model_len``, or exactly that long (no room for one output
  token), or empty, is rejected and counted by reason (``vllm/v1/engine/input_processor.py``
  ``_validate_prompt_len``).

Differences from vLLM 0.33.0 (everything else is meant to match step for step):
- this is the synchronous ``Scheduler``. vLLM 0.33's engine resolves ``async_scheduling=None`` to
  True where the executor supports it and then runs ``AsyncScheduler``: step N+1 is scheduled
  before step N's output is processed, with one output placeholder token per decoding request, so
  blocks are taken one token earlier and a finished request frees its blocks one step later;
- speculative decoding as the draft-model method schedules it: ``num_spec_tokens`` drafts per running
  request, ``num_lookahead_tokens`` slots in ``allocate_slots``, one input slot per scheduled request
  for the drafter (``draft_slots``), rejected drafts rolling back ``num_computed_tokens``; the drafts'
  token ids are not modelled (only their count), and this path is not in the differential test;
- not modelled: pipeline parallelism, KV connectors
  (P/D, offloading), encoder/multimodal inputs, LoRA, structured output, streaming sessions,
  pooling models, prompt logprobs, Mamba/sliding-window/hybrid groups, the DP prefill cadence
  (``prefill_schedule_interval`` stays 1), ``max_num_active_seqs`` (= ``max_num_seqs``),
  ``long_prefill_token_threshold_adaptive``, stop tokens and EOS;
- vLLM compares ``arrival_time`` in float seconds; kvguard keeps integer ``arrival_ns``;
- ``max_num_scheduled_tokens`` is ``max_num_batched_tokens`` (vLLM lowers it only for drafts);
- ``update_from_output`` raises on a token for a request in the middle of its prefill, or a
  missing one for a sampling request (vLLM trusts its model runner for both).

Requests carry kvguard's block hashes (``producers.sim.vllm.kv_blocks``): from prompt token ids when given,
else from ``prompt_block_keys`` (a workload's prefix hashes) and a per-request ``salt``.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import Counter, abc, deque
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from enum import Enum

from kvguard.producers.sim.vllm.kv_blocks import ROOT_HASH, KVCacheManager, chain_hash, token_block_key
from kvguard.producers.sim.workloads import mix_hash

VLLM_VERSION_FOLLOWED = "0.33.0"


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_LENGTH = "finished_length_capped"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "finished_aborted"  # ended from outside (vLLM: finish_requests(..., FINISHED_ABORTED))


class RejectReason(Enum):
    EMPTY_PROMPT = "empty_prompt"
    PROMPT_TOO_LONG = "prompt_longer_than_max_model_len"
    NO_ROOM_FOR_OUTPUT = "prompt_equals_max_model_len"


class DuplicateRequest(ValueError):
    def __init__(self, request_id: Hashable):
        self.request_id = request_id
        super().__init__(f"request {request_id!r} is already in the scheduler; request ids must be unique")


class BadModelOutput(ValueError):
    """``update_from_output`` got tokens that do not match what the step scheduled."""


@dataclass(slots=True)
class SchedulerConfig:
    """The knobs of ``vllm/config/scheduler.py`` and ``vllm/config/cache.py`` that this scheduler
    honours, with vLLM 0.33.0's defaults where vLLM has one."""

    num_gpu_blocks: int
    max_model_len: int
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    scheduler_reserve_full_isl: bool = True
    watermark: float = 0.0
    enable_prefix_caching: bool = True
    num_lookahead_tokens: int = 0
    # speculative decoding (draft_model method): input slots each scheduled request reserves for the
    # drafter (SpeculativeConfig.max_num_new_slots_for_drafting: 1 for a draft model, 0 without one)
    draft_slots: int = 0

    def __post_init__(self):
        if self.policy not in QUEUES:
            raise ValueError(f"policy: expected one of {sorted(QUEUES)}, got {self.policy!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs})")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                             f">= max_model_len ({self.max_model_len})")
        blocks_for_longest = -(-self.max_model_len // self.block_size)
        if self.num_gpu_blocks - 1 < blocks_for_longest:
            raise ValueError(f"KV cache of {self.num_gpu_blocks} blocks ({self.num_gpu_blocks - 1} usable) cannot hold one "
                             f"request of max_model_len={self.max_model_len} ({blocks_for_longest} blocks of "
                             f"{self.block_size}); vLLM refuses to start so (kv_cache_planning.check_enough_kv_cache_memory): "
                             "add blocks or lower max_model_len")
        if self.long_prefill_token_threshold > self.max_model_len:
            raise ValueError(f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) cannot exceed "
                             f"max_model_len ({self.max_model_len})")


def default_salt(request_id: Hashable) -> int:
    """A deterministic per-request key (``hash`` of a str is salted per process, so not that)."""
    if isinstance(request_id, int):
        return mix_hash(request_id, 0x5EED)
    digest = hashlib.blake2b(repr(request_id).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


@dataclass(slots=True, eq=False)
class Sequence:
    """One request's scheduling state (``vllm/v1/request.py`` ``Request``).

    ``block_hashes[k]`` is the chain hash of full block k, kept for every full block of prompt and
    output (``Request.update_block_hashes``). A block's content key is ``token_block_key`` of its
    token ids when the prompt's ids are known; otherwise ``prompt_block_keys[k]`` for a keyed prompt
    block, ``mix_hash(salt, k)`` for an unkeyed one, and that mixed with the output tokens' key for
    blocks that hold output tokens.
    """

    request_id: Hashable
    arrival_ns: int
    num_prompt_tokens: int
    max_tokens: int
    block_size: int
    priority: int = 0
    prompt_token_ids: list[int] | None = None
    prompt_block_keys: abc.Sequence[int] = ()
    salt: int = 0
    status: SeqStatus = SeqStatus.WAITING
    num_tokens: int = 0  # prompt + output tokens; kept as a field, it is read on every step
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    is_prefill_chunk: bool = False
    num_spec_tokens: int = 0  # draft tokens proposed for the next step (vLLM: len(spec_token_ids))
    output_token_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.num_tokens = self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_waiting(self) -> bool:
        return self.status is SeqStatus.WAITING or self.status is SeqStatus.PREEMPTED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.num_tokens += 1
        if self.num_tokens % self.block_size == 0:
            self.update_block_hashes()

    def update_block_hashes(self) -> None:
        bs = self.block_size
        parent = self.block_hashes[-1] if self.block_hashes else ROOT_HASH
        for k in range(len(self.block_hashes), self.num_tokens // bs):
            parent = chain_hash(parent, self._content_key(k))
            self.block_hashes.append(parent)

    def _content_key(self, k: int) -> int:
        bs, num_prompt = self.block_size, self.num_prompt_tokens
        start, end = k * bs, k * bs + bs
        if self.prompt_token_ids is not None:
            if end <= num_prompt:
                return token_block_key(self.prompt_token_ids[start:end])
            tokens = self.prompt_token_ids[start:] if start < num_prompt else []
            return token_block_key(tokens + self.output_token_ids[max(start - num_prompt, 0):end - num_prompt])
        if end <= num_prompt:
            return self.prompt_block_keys[k] if k < len(self.prompt_block_keys) else mix_hash(self.salt, k)
        outputs = token_block_key(self.output_token_ids[max(start - num_prompt, 0):end - num_prompt])
        return mix_hash(mix_hash(self.salt, k), outputs) if start < num_prompt else outputs


class FCFSQueue:
    """Arrival order; a preempted request goes back to the front (``FCFSRequestQueue``)."""

    def __init__(self):
        self._items: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        self._items.append(seq)

    def prepend(self, seq: Sequence) -> None:
        self._items.appendleft(seq)

    def peek(self) -> Sequence:
        return self._items[0]

    def pop(self) -> Sequence:
        return self._items.popleft()

    def remove(self, seqs: list[Sequence]) -> None:
        """Take ``seqs`` out, the others keeping their order (``RequestQueue.remove_requests``)."""
        gone = {id(s) for s in seqs}
        self._items = deque(s for s in self._items if id(s) not in gone)

    def restore(self, seqs: list[Sequence], order: dict[int, int]) -> None:
        """Put ``seqs`` back at their old positions (``order``: id -> index before ``remove``); requests
        that joined in between at the front (a preemption prepends) stay in front."""
        self._items = deque(sorted([*self._items, *seqs], key=lambda s: order.get(id(s), -1)))

    def __iter__(self):
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


class PriorityQueue:
    """Smallest ``(priority, arrival_ns, request_id)`` first; "prepend" is a push (``PriorityRequestQueue``)."""

    def __init__(self):
        self._heap: list[tuple[int, int, Hashable, Sequence]] = []

    def add(self, seq: Sequence) -> None:
        heapq.heappush(self._heap, (seq.priority, seq.arrival_ns, seq.request_id, seq))

    prepend = add

    def peek(self) -> Sequence:
        return self._heap[0][3]

    def pop(self) -> Sequence:
        return heapq.heappop(self._heap)[3]

    def remove(self, seqs: list[Sequence]) -> None:
        gone = {id(s) for s in seqs}
        self._heap = [entry for entry in self._heap if id(entry[3]) not in gone]
        heapq.heapify(self._heap)

    def restore(self, seqs: list[Sequence], order: dict[int, int]) -> None:
        for seq in seqs:  # the heap orders by (priority, arrival) itself
            self.add(seq)

    def __iter__(self):
        return (entry[3] for entry in self._heap)

    def __len__(self) -> int:
        return len(self._heap)


QUEUES = {"fcfs": FCFSQueue, "priority": PriorityQueue}


@dataclass(slots=True, frozen=True)
class ScheduleOutput:
    """One step's batch (``SchedulerOutput``).

    ``num_scheduled_tokens``: request id → tokens this step, running requests first, then admitted
    ones, in scheduling order. ``block_ids``: for an admitted request its whole block table, for a
    running one the blocks allocated this step. ``preempted_ids``: preempted during this step.
    ``finished_ids``: finished since the previous ``schedule()`` (vLLM's ``finished_req_ids``).
    ``sampling_ids``: requests that sample a token this step (all but partial prefill chunks).
    """

    step: int
    num_scheduled_tokens: dict[Hashable, int]
    block_ids: dict[Hashable, tuple[int, ...]]
    preempted_ids: tuple[Hashable, ...]
    finished_ids: tuple[Hashable, ...]
    sampling_ids: tuple[Hashable, ...]
    spec_tokens: dict[Hashable, int] = field(default_factory=dict)  # draft tokens scheduled per request

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


class Scheduler:
    """Running, waiting and the KV cache manager; see the module docstring for the rules."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        # the budget schedule() starts from (vLLM's ``Scheduler.max_num_scheduled_tokens``); an actuator's
        # batch-token cap lowers it between steps, as kvguard's vLLM plugin does
        self.max_num_scheduled_tokens = config.max_num_batched_tokens
        self.kv = KVCacheManager(config.num_gpu_blocks, block_size=config.block_size,
                                 max_model_len=config.max_model_len, enable_caching=config.enable_prefix_caching,
                                 watermark=config.watermark)
        self.requests: dict[Hashable, Sequence] = {}
        self.waiting = QUEUES[config.policy]()
        self.running: list[Sequence] = []
        self.step = 0
        self.num_preemptions = 0
        self.num_finished = 0
        self.rejected: Counter[RejectReason] = Counter()
        self._finished_since_schedule: list[Hashable] = []

    # ---- arrival ---------------------------------------------------------------------------
    def add_request(self, request_id: Hashable, *, num_prompt_tokens: int, max_tokens: int, arrival_ns: int = 0,
                    priority: int = 0, prompt_token_ids: list[int] | None = None,
                    prompt_block_keys: abc.Sequence[int] = (), salt: int | None = None) -> RejectReason | None:
        """Queue a request, or reject it (counted in ``rejected``) and return the reason."""
        if request_id in self.requests:
            raise DuplicateRequest(request_id)
        if max_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_tokens must be >= 1, got {max_tokens}")
        if prompt_token_ids is not None and len(prompt_token_ids) != num_prompt_tokens:
            raise ValueError(f"request {request_id!r}: {len(prompt_token_ids)} prompt token ids for "
                             f"num_prompt_tokens={num_prompt_tokens}")
        reason = self._reject_reason(num_prompt_tokens)
        if reason is not None:
            self.rejected[reason] += 1
            return reason
        seq = Sequence(request_id, arrival_ns, num_prompt_tokens, max_tokens, self.config.block_size, priority,
                        prompt_token_ids, prompt_block_keys, default_salt(request_id) if salt is None else salt)
        seq.update_block_hashes()
        self.requests[request_id] = seq
        self.waiting.add(seq)
        return None

    def _reject_reason(self, num_prompt_tokens: int) -> RejectReason | None:
        if num_prompt_tokens <= 0:
            return RejectReason.EMPTY_PROMPT
        if num_prompt_tokens > self.config.max_model_len:
            return RejectReason.PROMPT_TOO_LONG
        if num_prompt_tokens == self.config.max_model_len:
            return RejectReason.NO_ROOM_FOR_OUTPUT
        return None

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> ScheduleOutput:
        self.step += 1
        cfg = self.config
        budget = self.max_num_scheduled_tokens
        scheduled: dict[Hashable, int] = {}
        block_ids: dict[Hashable, tuple[int, ...]] = {}
        preempted: list[Sequence] = []
        threshold = cfg.long_prefill_token_threshold if len(self.running) + len(self.waiting) > 1 else 0
        spec: dict[Hashable, int] = {}
        budget, inputs = self._schedule_running(budget, threshold, scheduled, block_ids, preempted, spec)
        if not preempted:
            self._schedule_waiting(budget, threshold, scheduled, block_ids, inputs)
        sampling = []
        requests = self.requests
        for rid, n in scheduled.items():
            seq = requests[rid]
            seq.num_computed_tokens += n
            seq.is_prefill_chunk = seq.num_computed_tokens < seq.num_tokens
            if not seq.is_prefill_chunk:
                sampling.append(rid)
        out = ScheduleOutput(self.step, scheduled, block_ids, tuple(s.request_id for s in preempted),
                             tuple(self._finished_since_schedule), tuple(sampling), spec)
        self._finished_since_schedule = []
        return out

    def _schedule_running(self, budget: int, threshold: int, scheduled: dict, block_ids: dict,
                          preempted: list, spec: dict) -> tuple[int, int]:
        """Returns the token budget and the input budget left (vLLM's ``input_budget``: every scheduled
        request also takes ``draft_slots`` input slots, so with a draft model fewer tokens fit)."""
        cfg, running = self.config, self.running
        allocate, lookahead, max_model_len = self.kv.allocate_slots, cfg.num_lookahead_tokens, cfg.max_model_len
        slots = cfg.draft_slots
        inputs = cfg.max_num_batched_tokens
        i = 0
        while i < len(running) and budget > 0:
            if inputs <= slots:
                break
            seq = running[i]
            n = seq.num_tokens + seq.num_spec_tokens - seq.num_computed_tokens
            if 0 < threshold < n:
                n = threshold
            n = min(n, budget, inputs - slots, max_model_len - seq.num_computed_tokens - 1)
            if n <= 0:
                i += 1
                continue
            while True:
                new = allocate(seq, n, num_lookahead_tokens=lookahead)
                if new is not None:
                    break
                victim, index = self._pick_victim()
                del running[index]
                if index < i:
                    i -= 1
                if victim.request_id in scheduled:
                    restored = scheduled.pop(victim.request_id)
                    budget += restored
                    inputs += restored + slots
                    del block_ids[victim.request_id]
                    spec.pop(victim.request_id, None)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if new is None:
                if cfg.policy == "priority":
                    continue  # seq preempted itself; running[i] is now the next request
                break
            scheduled[seq.request_id] = n
            block_ids[seq.request_id] = tuple(new)
            if seq.num_spec_tokens:
                drafts = n + seq.num_computed_tokens - seq.num_tokens
                if drafts > 0:
                    spec[seq.request_id] = min(drafts, seq.num_spec_tokens)
                seq.num_spec_tokens = 0  # new ones come with update_draft_token_ids
            budget -= n
            inputs -= n + slots
            i += 1
        return budget, inputs

    def _pick_victim(self) -> tuple[Sequence, int]:
        """fcfs: the last running request; priority: the first with the largest (priority, arrival)."""
        if self.config.policy == "priority":
            index = max(range(len(self.running)),
                        key=lambda j: (self.running[j].priority, self.running[j].arrival_ns))
            return self.running[index], index
        return self.running[-1], len(self.running) - 1

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq.request_id)
        seq.num_spec_tokens = 0
        seq.status = SeqStatus.PREEMPTED
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(seq)

    def _schedule_waiting(self, budget: int, threshold: int, scheduled: dict, block_ids: dict,
                          inputs: int | None = None) -> None:
        cfg, kv = self.config, self.kv
        slots = cfg.draft_slots
        inputs = cfg.max_num_batched_tokens if inputs is None else inputs
        while budget > 0 and len(self.waiting) and len(self.running) < cfg.max_num_seqs and inputs > slots:
            seq = self.waiting.peek()
            computed = kv.get_computed_blocks(seq)
            n = seq.num_tokens - computed.num_tokens
            if 0 < threshold < n:
                n = threshold
            if not cfg.enable_chunked_prefill and n > budget:
                break
            n = min(n, budget, inputs - slots)
            new = kv.allocate_slots(seq, n, computed, num_lookahead_tokens=cfg.num_lookahead_tokens,
                                    full_sequence_must_fit=cfg.scheduler_reserve_full_isl,
                                    has_scheduled_reqs=bool(self.running))
            if new is None:
                break
            kv.record_prefix_lookup(seq, computed.num_tokens)
            self.waiting.pop()
            self.running.append(seq)
            seq.status = SeqStatus.RUNNING
            seq.num_computed_tokens = computed.num_tokens
            scheduled[seq.request_id] = n
            block_ids[seq.request_id] = kv.block_ids(seq.request_id)
            budget -= n
            inputs -= n + slots

    # ---- after the model step --------------------------------------------------------------
    def update_from_output(self, output: ScheduleOutput, sampled_token_ids: Mapping[Hashable, int]) -> list[Hashable]:
        """Append each sampling request's token; finish (and free) those at ``max_tokens`` or
        ``max_model_len``, in scheduling order. Returns the ids finished by this call."""
        if len(sampled_token_ids) != len(output.sampling_ids) or not sampled_token_ids.keys() >= set(
                output.sampling_ids):
            raise BadModelOutput(f"step {output.step}: expected one token for each of {len(output.sampling_ids)} "
                                 f"sampling requests (partial prefill chunks sample none), got "
                                 f"{len(sampled_token_ids)}")
        finished = []
        max_model_len = self.config.max_model_len
        requests = self.requests
        spec = output.spec_tokens
        for rid in output.sampling_ids:
            seq = requests.get(rid)
            if seq is None or seq.status is not SeqStatus.RUNNING:
                continue
            tokens = sampled_token_ids[rid]
            if isinstance(tokens, int):
                tokens = (tokens,)
            drafts = spec.get(rid, 0)
            if drafts:  # rejected drafts roll back the computed tokens (update_from_output)
                rejected = drafts - (len(tokens) - 1)
                if rejected < 0:
                    raise BadModelOutput(f"step {output.step}: request {rid!r} got {len(tokens)} tokens for "
                                         f"{drafts} draft tokens")
                seq.num_computed_tokens -= rejected
            for token in tokens:  # _update_request_with_output: stop checks after each token
                seq.append_output_token(token)
                if seq.num_tokens >= max_model_len or len(seq.output_token_ids) >= seq.max_tokens:
                    break
            if seq.num_tokens >= max_model_len or len(seq.output_token_ids) >= seq.max_tokens:
                seq.status = SeqStatus.FINISHED_LENGTH
                self.kv.free(rid)
                del self.requests[rid]
                finished.append(rid)
        if finished:
            self.running = [s for s in self.running if s.status is SeqStatus.RUNNING]
            self.num_finished += len(finished)
            self._finished_since_schedule.extend(finished)
        return finished

    def update_draft_token_ids(self, num_draft_tokens: Mapping[Hashable, int]) -> None:
        """The drafter's proposals for the next step (``Scheduler.update_draft_token_ids``): ignored for a
        finished request or one in the middle of its prefill."""
        for rid, count in num_draft_tokens.items():
            seq = self.requests.get(rid)
            if seq is None or seq.status is not SeqStatus.RUNNING:
                continue
            seq.num_spec_tokens = 0 if seq.is_prefill_chunk else count

    def finish_requests(self, request_ids, status: SeqStatus = SeqStatus.FINISHED_ABORTED) -> list[Hashable]:
        """End requests from outside, wherever they are (vLLM ``Scheduler.finish_requests``): out of
        running or waiting, blocks freed. Unknown ids are skipped. Returns the ids ended."""
        ended, waiting = [], []
        for rid in request_ids:
            seq = self.requests.get(rid)
            if seq is None:
                continue
            if seq.status is SeqStatus.RUNNING:
                self.running.remove(seq)
            else:
                waiting.append(seq)
            seq.status = status
            self.kv.free(rid)
            del self.requests[rid]
            ended.append(rid)
        if waiting:
            self.waiting.remove(waiting)
        self._finished_since_schedule.extend(ended)
        return ended

    # ---- queries ---------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def usage(self) -> float:
        return self.kv.usage
