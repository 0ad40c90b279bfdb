"""The step governor (``producers.vllm.governor``) inside the vLLM-faithful shadow engine.

The engine keeps only hooks (``VllmEngine._step`` / ``_arrive``); this module reads its scheduler into
a ``Candidates`` record, its allocator twin into the headroom (device free + the cached bytes it can
release, what ``CUDACachingAllocator`` can still give one large tensor before it raises), applies the decision (the token
budget ``schedule()`` starts from; the waiting queue deferred for one step when even one token does
not fit) and writes the GOVERN row. The plan the governor sizes a step with is the very plan
``WorkerMemory.run_step`` replays (``WorkerMemory.step_plan``), so in the shadow engine the prediction
is exact up to the allocator's rounding and fragmentation, which the margin covers.

Context and query lengths in the candidates are rounded up to ``LENGTH_QUANTUM`` tokens (the attention
buffers grow with them): conservative, and it lets plan lookups be cached while contexts grow a token
per step.
"""

from __future__ import annotations

from kvguard.contracts.events import EventKind, Outcome
from kvguard.producers.vllm.governor import (
    F_GOV_NO_FIT,
    F_GOV_REFUSED,
    F_GOV_TOKENS,
    Candidates,
    StepGovernor,
    StepShape,
    never_fits_message,
    worst_case,
)
from kvguard.producers.vllm.step_memory import Batch

LENGTH_QUANTUM = 256
REJECTED_NEVER_FITS = "never_fits"
_GOVERN = int(EventKind.GOVERN)


def _up(n: int) -> int:
    return -(-n // LENGTH_QUANTUM) * LENGTH_QUANTUM


def peak_function(memory_of, sampling: str):
    """``peak_fn`` over the engine's current worker (``memory_of()``: its ``WorkerMemory``)."""
    def peak(shape: StepShape) -> int:
        memory = memory_of()
        n, r = shape.num_tokens, shape.num_seqs
        batch = None
        if shape.prompt_logprob_tokens:
            q = max(shape.prompt_logprob_tokens, shape.max_query_len or 1)
            n = max(n, q + r - 1)  # the bound's rows and query together
            others = [1] * (r - 1)
            left = n - q - (r - 1)
            if others:
                others[0] += left
            else:
                q += left
            scheduled = (q, *others)
            ctx = max(shape.max_seq_len, q)
            batch = Batch(scheduled, (ctx, *(max(t, 1) for t in others)), sampling=sampling,
                          prompt_lens=(ctx, *(1 for _ in others)),
                          prompt_logprobs_tokens=(shape.prompt_logprob_tokens, *(0 for _ in others)))
        plan = memory.step_plan(n, r, batch, max_query_len=shape.max_query_len, max_seq_len=shape.max_seq_len,
                                num_logits=shape.num_logits)
        return plan.peak_bytes
    return peak


def headroom(memory) -> int:
    """What one large allocation can still get: device free bytes plus the cached bytes the allocator can
    release (reserved - allocated - inactive split: free blocks inside partly used segments serve only
    what fits them, so they are not counted; PyTorch's ``inactive_split_bytes``)."""
    twin = memory.twin
    stats = twin._stats
    return (memory.driver.memory.free_bytes + stats["reserved_bytes"][0] - stats["allocated_bytes"][0]
            - stats["inactive_split_bytes"][0])


class SimGovernor:
    """One engine's governor and its bookkeeping (rows, counts)."""

    def __init__(self, engine, margin_bytes: int) -> None:
        self.engine = engine
        self.governor = StepGovernor(peak_function(lambda: engine.memory, engine.spec.sampling), margin_bytes=margin_bytes)
        self.k = engine.spec.num_speculative_tokens
        self.fresh_headroom = headroom(engine.memory)
        self.decisions: list[tuple[int, int, int, int]] = []  # (t_ns, flags, budget, tokens removed), for timelines
        self.refusals: list[str] = []
        self._saved_seqs: int | None = None

    # ---------------------------------------------------------------- before schedule()
    def candidates(self, sched, *, with_waiting: bool = True) -> Candidates:
        running, waiting = sched.running, sched.waiting
        k = self.k
        query = seq_len = 0
        for s in running:
            left = s.num_tokens - s.num_computed_tokens
            if left > query:
                query = left
            if s.num_tokens > seq_len:
                seq_len = s.num_tokens
        n_wait = len(waiting) if with_waiting else 0
        if n_wait:
            for s in waiting:
                if s.num_tokens > query:
                    query = s.num_tokens
            seq_len = max(seq_len, query)
        decode_only = not n_wait and query <= 1 + k
        lp = lp2 = 0  # the two largest prompt-logprob remainders (two requests' rows can be live at once)
        requests = sched.requests
        waiting_ids = None
        for rid in self.engine._prompt_logprobs:
            seq = requests.get(rid)
            if seq is None:
                continue
            left = seq.num_prompt_tokens - seq.num_computed_tokens
            if left > 0:
                if not with_waiting:
                    if waiting_ids is None:
                        waiting_ids = {s.request_id for s in waiting}
                    if rid in waiting_ids:
                        continue
                if left > lp:
                    lp, lp2 = left, lp
                elif left > lp2:
                    lp2 = left
        lp += lp2
        seqs = min(self.engine.profile.max_num_seqs, len(running) + n_wait)
        return Candidates(max(1, seqs), decode_only, _up(lp) if lp else 0,
                          1 + k if decode_only else _up(max(1, query)), _up(seq_len + k), k, len(running))

    def before_schedule(self, sched) -> bool:
        """Set this step's budget; True when the waiting queue must be deferred for the step."""
        budget = sched.max_num_scheduled_tokens
        room = headroom(self.engine.memory)
        c = self.candidates(sched)
        d = self.governor.govern(c, budget, room)
        memory = self.engine.memory
        if self.governor.needs_release(c, budget if d is None else d.budget, memory.driver.memory.free_bytes) \
                and memory.twin.reserved_bytes > memory.twin.allocated_bytes:
            self.governor.release_steps += 1
            memory.empty_cache(self.engine.now_ns)
        if d is None:
            return False
        deferred = self.governor.defer_waiting(d, self.candidates(sched, with_waiting=False), budget, room) \
            if d.flags & F_GOV_NO_FIT and len(sched.waiting) and sched.running else None
        defer = deferred is not None
        d = deferred or d
        sched.max_num_scheduled_tokens = d.budget
        if d.max_seqs:
            self._saved_seqs = sched.config.max_num_seqs
            sched.config.max_num_seqs = d.max_seqs
        self.engine._quiet = False
        now = self.engine.now_ns
        held = d.tokens_removed if d.flags & F_GOV_TOKENS else max(0, c.num_seqs - d.max_seqs)
        self.engine.recorder.row(_GOVERN, now, -1, cls=d.cause, flags=d.flags, offset=d.headroom_bytes,
                                 size=d.predicted_bytes, tokens=d.budget, aux=held)
        self.decisions.append((now, d.flags, d.budget, d.tokens_removed))
        return defer

    def after_schedule(self, sched) -> None:
        if self._saved_seqs is not None:
            sched.config.max_num_seqs, self._saved_seqs = self._saved_seqs, None

    # ---------------------------------------------------------------- at arrival
    def refuse(self, req_id: int, prompt_tokens: int, max_output_tokens: int, wants_logprobs: bool, ts: int) -> bool:
        """Whether a request can never fit (refused, with its GOVERN row and the reason kept)."""
        e = self.engine
        ctx = min(prompt_tokens + max(1, max_output_tokens), e.profile.max_model_len)
        alone = Candidates(1, False, 1 if wants_logprobs else 0, 1, _up(ctx + self.k), self.k)
        need = worst_case(alone, 1 + self.k)
        nbytes = self.governor.never_fits(need, self.fresh_headroom)
        if nbytes is None:
            return False
        self.governor.refused += 1
        if len(self.refusals) < 64:
            self.refusals.append(never_fits_message(nbytes, self.fresh_headroom, self.governor.margin_bytes,
                                                    f"1 token at a {ctx}-token context"))
        e.recorder.row(_GOVERN, ts, req_id, cls=self.governor.cause_of(alone, 1 + self.k, 0), flags=F_GOV_REFUSED,
                       offset=self.fresh_headroom - self.governor.margin_bytes, size=nbytes, tokens=0, aux=0)
        return True


NEVER_FITS = int(Outcome.NEVER_FITS)


def governor_summary(engines) -> dict:
    """The governors of a fleet's engines, summed (``kvguard simulate --governor``'s JSON)."""
    out: dict = {"steps_checked": 0, "steps_governed": 0, "steps_no_fit": 0, "steps_deferred": 0, "cache_releases": 0,
                 "tokens_removed": 0, "never_fits": 0, "by_cause": {}}
    refusals: list[str] = []
    for e in engines:
        g = getattr(e, "governor", None)
        if g is None:
            continue
        s = g.governor.summary()
        for k in ("steps_checked", "steps_governed", "steps_no_fit", "steps_deferred", "cache_releases", "tokens_removed",
                  "never_fits"):
            out[k] += s[k]
        for cause, n in s["by_cause"].items():
            out["by_cause"][cause] = out["by_cause"].get(cause, 0) + n
        refusals += g.refusals
    if refusals:
        out["never_fits_examples"] = refusals[:3]
    return out
