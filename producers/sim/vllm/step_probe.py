"""Would one engine step of a given shape OOM on a worker fresh from start-up? The shadow engine's answer.

``StepProbe`` holds a worker's memory (``WorkerMemory``) just after start-up and answers for a ``Batch``
by running that step on a copy of its caching-allocator twin, with the arguments ``VllmEngine._step``
passes to ``WorkerMemory.run_step`` for the same step (``run_step_arguments``). A copy per question keeps
the answers independent: each is the first step of a server that just started, as a single request
arriving at an idle server meets it.

Two ways to a started worker:

- ``worker_for(profile)``: the start-up the shadow engine makes for that profile (``VllmEngine._start_worker``),
  so an answer here is the engine's;
- ``worker_from_budget``: a worker whose budget a real server's log states (consumed memory, KV cache, CUDA
  graphs, free memory at start-up). It starts with ``--kv-cache-memory-bytes`` set to the logged KV cache
  (the profile still runs, the formula is skipped) and with the weights and the CUDA context sized so that
  the twin's own accounting reproduces the logged figures: for the V2 accounting its start-up snapshot's
  free memory and its ``total_consumed`` (one calibration run, since both move one-for-one with those two
  inputs); for the V1 one the logged weights and non-torch memory (the runner's buffers are outside vLLM's
  budget there, as in the real V1 runner).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

from kvguard.producers.sim.profile import Profile, VllmSpec
from kvguard.producers.sim.vllm.memory import StepOOM, WorkerMemory
from kvguard.producers.vllm.step_memory import Batch

DECODE_GRAPH_SEQS = 256  # VllmEngine._step skips the attention extent for small all-decode steps


def run_step_arguments(batch: Batch, *, v2: bool, num_speculative_tokens: int) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of ``WorkerMemory.run_step`` (less ``now_ns``) for ``batch``, as ``VllmEngine._step``
    builds them: the batch itself only when prompt-logprob positions (or, beyond the engine, sample
    logprobs under the V1 runner) need it; under V2 the longest query and context, and the logits rows when
    speculating."""
    total, seqs = batch.num_tokens, batch.num_seqs
    keep = any(batch.prompt_logprobs_tokens) or (not v2 and batch.num_logprobs is not None)
    if not v2:
        return (total, seqs, batch if keep else None), {}
    max_query, max_seq = ((max(batch.num_scheduled_tokens), max(batch.context_lens))
                          if total != seqs or seqs > DECODE_GRAPH_SEQS else (1, 0))
    num_logits = seqs + batch.num_draft_tokens_total if num_speculative_tokens else 0
    return (total, seqs, batch if keep else None), {"max_query_len": max_query, "max_seq_len": max_seq,
                                                     "num_logits": num_logits}


class StepProbe:
    """A started worker asked about single steps (module docstring). ``headroom_bytes``: what its caching
    allocator can still hand out (free device memory plus its cached, unallocated blocks)."""

    def __init__(self, memory: WorkerMemory):
        self.memory = memory
        stats = memory.stats()
        self.headroom_bytes = stats["device_free_bytes"] + stats["reserved_bytes"] - stats["allocated_bytes"]
        self.num_speculative_tokens = getattr(memory.spec, "num_speculative_tokens", 0)

    def _arguments(self, batch: Batch):
        return run_step_arguments(batch, v2=self.memory.v2, num_speculative_tokens=self.num_speculative_tokens)

    def fits(self, batch: Batch) -> bool:
        return self.slack_bytes(batch) is not None

    def slack_bytes(self, batch: Batch) -> int | None:
        """What the device still had at the step's worst moment (free memory plus what the allocator held
        before, less the most it reserved during the step: rounding and fragmentation included), or None when
        the step OOMs."""
        (total, seqs, kept), kwargs = self._arguments(batch)
        memory = copy.deepcopy(self.memory)
        before = memory.stats()
        try:
            memory.run_step(total, seqs, 0, kept, **kwargs)
        except StepOOM:
            return None
        return before["device_free_bytes"] + before["reserved_bytes"] - memory.stats()["peak_reserved_bytes"]

    def peak_bytes(self, batch: Batch) -> int:
        """The step's own tensors at their peak (``StepPlan.peak_bytes``: allocated bytes above the steady
        state; the allocator's segment rounding comes on top)."""
        (total, seqs, kept), kwargs = self._arguments(batch)
        return self.memory.step_plan(total, seqs, kept, **kwargs).peak_bytes


def worker_for(profile: Profile) -> WorkerMemory:
    """The worker ``VllmEngine`` starts for ``profile`` (no neighbour, no leak)."""
    g = profile.geometry
    return WorkerMemory(profile.vllm, total_bytes=g.total_bytes, weights_bytes=g.weights_bytes,
                        context_bytes=g.context_bytes, gpu_memory_utilization=g.gpu_memory_utilization,
                        max_num_batched_tokens=profile.max_batched_tokens, max_num_seqs=profile.max_num_seqs,
                        max_model_len=profile.max_model_len)


@dataclass(frozen=True, slots=True)
class ServerBudget:
    """A real server's start-up budget in bytes (what its log says; ``init_free_bytes`` None when the log's
    format does not print it, then ``context_bytes`` is the CUDA context and NCCL baseline assumed)."""

    total_bytes: int
    gpu_memory_utilization: float
    consumed_bytes: int  # the V2 accounting's total_consumed, or weights + non-torch of the older lines
    non_torch_bytes: int  # inside consumed_bytes (0 when the line does not split it)
    kv_cache_bytes: int
    cudagraph_bytes: int
    init_free_bytes: int | None = None
    context_bytes: int = 0  # without init_free_bytes: the CUDA context and NCCL baseline assumed outside the budget
    buffers_in_consumed: bool = True  # the V2 accounting counts the runner's buffers in consumed; older ones not


def worker_from_budget(spec: VllmSpec, budget: ServerBudget, *, max_num_batched_tokens: int, max_num_seqs: int,
                       max_model_len: int) -> WorkerMemory:
    """A started worker whose budget is ``budget`` (module docstring); raises ``StartupRefused`` as vLLM
    would refuse these numbers (free memory below the requested share, a KV cache too small for one
    request), and ``ValueError`` when the log's consumed memory is smaller than this model's own buffers."""
    v2 = spec.model_runner == "v2"
    total = budget.total_bytes
    non_torch = budget.non_torch_bytes
    if budget.init_free_bytes is not None:
        context = total - budget.init_free_bytes
    elif v2:
        context = budget.context_bytes
    else:  # V0's lines: no free-memory check then; the assumed context is held after profiling, like non-torch
        context, non_torch = 0, non_torch + budget.context_bytes
    fixed = replace(spec, kv_cache_memory_bytes=max(1, budget.kv_cache_bytes),
                    cudagraph_bytes=max(0, budget.cudagraph_bytes), non_torch_increase_bytes=0 if v2 else non_torch)

    def start(weights: int, context_bytes: int) -> WorkerMemory:
        return WorkerMemory(fixed, total_bytes=total, weights_bytes=weights, context_bytes=context_bytes,
                            gpu_memory_utilization=budget.gpu_memory_utilization,
                            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                            max_model_len=max_model_len)

    weights = budget.consumed_bytes - budget.non_torch_bytes
    if not v2:  # 0.11's accounting: weights and non-torch as logged, the runner's buffers on top
        if budget.buffers_in_consumed:  # a 0.33 line read with the V1 runner: its buffers are in consumed
            weights -= start(weights, max(0, context)).ledger.persistent_bytes
        if weights < 0:
            raise ValueError(f"the log's consumed memory ({budget.consumed_bytes} bytes) is less than this model's "
                             f"own runner buffers: the log is not this model's")
        return start(weights, max(0, context))
    slack = 64 << 20  # the trial starts with more free memory than the final start, never less
    trial = start(weights, max(0, context - slack)).ledger
    weights += budget.consumed_bytes - trial.total_consumed_bytes
    if budget.init_free_bytes is not None:
        context = max(0, context - slack) + trial.init_free_bytes - budget.init_free_bytes
    if weights < 0:
        raise ValueError(f"the log's consumed memory ({budget.consumed_bytes} bytes) is less than this model's own "
                         f"runner buffers: the log is not this model's")
    return start(weights, max(0, context))
