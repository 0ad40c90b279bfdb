"""The crashing step, written as OOM_STEP rows right before the shadow engine's allocator OOM row.

An OOM row carries the requested bytes, the reserved-but-unallocated bytes and the failure class
(``kvguard.contracts.events``); what an SRE asks next is in PyTorch's OOM message and the engine's
scheduler output, not in the log: how much the device had free, what was reserved and allocated,
which step asked (its tokens, its sequences) and the requests in it with their shapes (prompt
length, prompt logprobs, speculative tokens, context length), and the headroom start-up left.
vLLM's own report of the same crash is the ``torch.OutOfMemoryError`` text ("Tried to allocate …
GPU 0 has a total capacity of … of which … is free … reserved by PyTorch but unallocated",
``c10/cuda/CUDACachingAllocator.cpp``) and its scheduler's ``SchedulerOutput.num_scheduled_tokens``
(``vllm/v1/core/sched/output.py``); these rows are that, in the event table's columns, so
``kvguard rca`` can explain the OOM from the log alone (``kvguard.ops.rca_explain``).
"""

from __future__ import annotations

from kvguard.contracts.events import F_PROMPT_LOGPROBS, EventKind, OomStepRow, Refusal

_OOM_STEP = int(EventKind.OOM_STEP)
_REFUSALS = {"engine_restarting": Refusal.RESTARTING, "max_num_queued_reqs": Refusal.QUEUE_REQS,
             "max_num_queued_tokens": Refusal.QUEUE_TOKENS, "prompt_longer_than_max_model_len": Refusal.PROMPT_TOO_LONG,
             "prompt_equals_max_model_len": Refusal.PROMPT_TOO_LONG, "empty_prompt": Refusal.PROMPT_TOO_LONG}


def refusal_code(reason: str) -> int:
    """The FINISH REJECTED row's ``aux`` for the engine's rejection reason (``rejected_by_reason`` keys)."""
    return int(_REFUSALS.get(reason, Refusal.OTHER))


def headroom_bytes(stats: dict) -> int:
    """What a step can still get from the allocator: device free plus reserved-but-unallocated bytes
    (``WorkerMemory.stats()`` names)."""
    return int(stats["device_free_bytes"] + stats["reserved_bytes"] - stats["allocated_bytes"])


def write_crashing_step(rec, now_ns: int, out, requests, prompt_logprobs, error, *, startup_headroom: int,
                        neighbour_bytes: int = 0, neighbour_start_bytes: int = 0, leaked_bytes: int = 0) -> None:
    """OOM_STEP rows for the step ``out`` (the scheduler's output) whose allocation raised ``error``
    (the twin's ``OutOfMemoryError``). ``requests``: the scheduler's requests by id (``num_prompt_tokens``,
    ``num_computed_tokens`` already advanced by this step, as vLLM's scheduler does at schedule time);
    ``prompt_logprobs``: the ids asking for prompt logprobs."""
    rows = []
    spec = getattr(out, "spec_tokens", None) or {}
    for rid, n in out.num_scheduled_tokens.items():
        seq = requests[rid]
        asks = rid in prompt_logprobs
        # prompt positions this step computes: their logits are what prompt logprobs need
        positions = max(0, min(n, seq.num_prompt_tokens - (seq.num_computed_tokens - n))) if asks else 0
        rows.append((int(rid), int(n), int(seq.num_prompt_tokens), int(seq.num_computed_tokens),
                     int(spec.get(rid, 0)), F_PROMPT_LOGPROBS if asks else 0, positions))
    _write(rec, now_ns, error, rows, startup_headroom, neighbour_bytes, neighbour_start_bytes, leaked_bytes)


def write_crashing_decode(rec, now_ns: int, seqs, prompt_logprobs, error, *, startup_headroom: int,
                          neighbour_bytes: int = 0, neighbour_start_bytes: int = 0, leaked_bytes: int = 0) -> None:
    """The same for a decode-only step of a fused stretch (``fused.fused_decode``): one token per
    sequence in ``seqs``, whose ``num_computed_tokens`` is still before the step."""
    rows = [(int(s.request_id), 1, int(s.num_prompt_tokens), int(s.num_computed_tokens) + 1, 0,
             F_PROMPT_LOGPROBS if s.request_id in prompt_logprobs else 0, 0) for s in seqs]
    _write(rec, now_ns, error, rows, startup_headroom, neighbour_bytes, neighbour_start_bytes, leaked_bytes)


def _write(rec, now_ns, error, rows, startup_headroom, neighbour_bytes, neighbour_start_bytes, leaked_bytes) -> None:
    rec.row(_OOM_STEP, now_ns, cls=int(OomStepRow.DEVICE), size=int(error.device_free_bytes),
            offset=int(error.reserved_bytes), tokens=int(error.allocated_bytes),
            aux=int(error.tried_to_allocate_bytes))
    rec.row(_OOM_STEP, now_ns, cls=int(OomStepRow.STEP), size=sum(r[1] for r in rows), tokens=len(rows),
            offset=sum(r[6] for r in rows), aux=max(0, int(startup_headroom)))
    for rid, n, prompt, context, drafts, flags, _ in rows:
        rec.row(_OOM_STEP, now_ns, rid, cls=int(OomStepRow.REQUEST), tokens=n, offset=prompt, size=context,
                aux=drafts, flags=flags)
    if neighbour_bytes or neighbour_start_bytes or leaked_bytes:
        rec.row(_OOM_STEP, now_ns, cls=int(OomStepRow.EXTERNAL), size=int(neighbour_bytes),
                offset=int(neighbour_start_bytes), tokens=int(leaked_bytes))
