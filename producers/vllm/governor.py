"""The step governor: no engine step asks the caching allocator for more than it can still give.

One pure mechanism shared by the vLLM-faithful shadow engine (``producers.sim.vllm.engine``) and the
vLLM plugin (``producers.vllm.actions``); each side only reads its scheduler's queues into a
``Candidates`` record, its memory state into a headroom figure, and applies the ``Decision``.

Before each ``schedule()`` call:

1. **What the step could need.** ``worst_case(candidates, budget)`` is the largest step the scheduler
   could form from the requests it may schedule (running, then waiting) within ``budget`` tokens:
   every token scheduled, as many sequences as the candidates and the budget allow (a decode row
   takes ``1 + k`` tokens with ``k`` speculative tokens), the longest prompt remainder as one query
   (the one chunk that carries prompt logprobs, when a candidate asks for them), the longest context a
   candidate reaches. Its non-KV peak is the step plan's (``producers.vllm.step_memory`` /
   ``model_runner_v2``: the same plan the shadow engine replays through its allocator twin), given by
   the caller as ``peak_fn(StepShape) -> bytes``, corrected by the calibration (``Calibration``) when
   one is attached, and cached per shape.
2. **What the allocator can give.** ``headroom`` = device free bytes + reserved-but-unallocated bytes
   (what ``CUDACachingAllocator`` frees and retries with before it raises), less ``margin_bytes``
   (segment rounding, splits it cannot reuse).
3. **Shrink, never drop.** If the budget's worst case fits, nothing changes (the fast path: one cached
   lookup). Otherwise, when capping admissions alone makes it fit (the sampler's rows), fewer sequences
   are admitted this step (``max_seqs``: vLLM's ``--max-num-seqs`` lowered, never below those running);
   else the budget is lowered to the most tokens whose worst case fits (bisection over
   cached plans) — the prefill is chunked, and decode rows beyond the budget wait a step (vLLM's own
   workarounds: ``--max-num-batched-tokens`` / ``--max-num-seqs`` lower, vllm#5424, vllm#5907
   comments, lm-eval-harness#2698). If even one token does not fit, the waiting queue is deferred for
   the step (``defer_waiting``: its requests stay queued, nothing is dropped) and only running
   requests are considered; if that still does not fit, the step runs at the floor and the decision
   says so (``F_GOV_NO_FIT``: the headroom is gone for a reason no step shape controls — a neighbour,
   a leak — which the governor does not claim).

A request that cannot fit even alone, one token at a time, on a worker fresh from start-up
(``never_fits``) is refused at arrival (``Outcome.NEVER_FITS``, not retryable on this node) with an
error naming its need and the headroom, as a 400 would (the ask of vllm#52871), instead of entering
the queue and killing the engine later.

Decisions are published as GOVERN rows (``kvguard.contracts.events``): ``cls`` the class that made
the step not fit (``OomCause``: PROMPT_LOGPROBS, LONG_CONTEXT, SPEC_DECODE, else PEAK), ``flags`` what
was done (``F_GOV_*``), ``size`` the predicted peak of the step as vLLM would have scheduled it,
``tokens`` the budget set, ``aux`` the tokens taken off, ``offset`` the headroom less the margin.

Invariant (tested with hypothesis): whenever ``govern`` returns a budget without ``F_GOV_NO_FIT``,
the corrected peak of ``worst_case(candidates, budget)`` is at most the headroom less the margin,
and the budget is the largest such (bisection over a monotone plan).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

from kvguard.contracts.events import OomCause

DEFAULT_MARGIN_BYTES = 256 << 20  # the logprob guard's margin, kept
F_GOV_TOKENS = 1  # the token budget was lowered: prefill chunked finer
F_GOV_SEQS = 2  # fewer sequences than the candidates offered (decode rows wait a step)
F_GOV_DEFER = 4  # the waiting queue was deferred this step (requests stay queued)
F_GOV_NO_FIT = 8  # even the smallest step does not fit: it ran at the floor
F_GOV_REFUSED = 16  # a request refused at arrival: it can never fit (Outcome.NEVER_FITS)


@dataclass(frozen=True, slots=True)
class StepShape:
    """What the step plan needs to size one step's non-KV allocations."""

    num_tokens: int
    num_seqs: int
    prompt_logprob_tokens: int = 0  # prompt positions computing logprobs this step (one request's chunk)
    max_query_len: int = 0  # longest query (0: not needed by the plan)
    max_seq_len: int = 0  # longest context after this step (0: not needed)
    num_logits: int = 0  # logits rows when speculating (0: one per sequence)

    @property
    def shape_class(self) -> tuple:
        """The calibration's class: token-count octave, decode-only, prompt logprobs, speculation."""
        return (self.num_tokens.bit_length(), self.num_tokens == self.num_seqs, self.prompt_logprob_tokens > 0,
                self.num_logits > self.num_seqs)


@dataclass(frozen=True, slots=True)
class Candidates:
    """What ``schedule()`` may put in the next step, read from the queues (bounds, not the batch)."""

    num_seqs: int  # requests it may schedule: running + admissible waiting (at most max_num_seqs)
    decode_only: bool = False  # every candidate is decoding (no prompt left, nobody waiting)
    # most prompt-logprob positions live at once: the two largest remainders (vLLM's loop rebinds its
    # tensors only after the next request's exist, so two requests' rows can be live together)
    prompt_logprob_tokens: int = 0
    max_query_len: int = 0  # longest prompt remainder among candidates (1 when all decode)
    max_seq_len: int = 0  # longest context a candidate reaches this step
    spec_tokens: int = 0  # speculative tokens per decode row (k)
    running: int = 0  # of those, already running (an admission cap cannot go below them)


def worst_case(c: Candidates, budget: int) -> StepShape:
    """The largest step ``schedule()`` can form from ``c`` within ``budget`` tokens (module docstring)."""
    per_row = 1 + c.spec_tokens
    if c.decode_only:
        seqs = max(1, min(c.num_seqs, budget // per_row))
        tokens = seqs * per_row
        query = per_row
    else:
        tokens = budget
        seqs = max(1, min(c.num_seqs, budget))
        # the longest query and the most rows at once: a bound (their sum may pass the budget by seqs - 1)
        query = max(1, min(budget, c.max_query_len or budget))
    logprobs = min(tokens, c.prompt_logprob_tokens) if c.prompt_logprob_tokens else 0
    logits = min(tokens, seqs * per_row) if c.spec_tokens else 0
    return StepShape(tokens, seqs, logprobs, query, max(c.max_seq_len, query), logits)


class Decision(NamedTuple):
    budget: int  # the token budget schedule() starts from
    flags: int  # F_GOV_*
    cause: int  # OomCause of the class that made the step not fit
    predicted_bytes: int  # the corrected peak of the step vLLM's own budget could form
    headroom_bytes: int  # what the allocator can still give, less the margin
    tokens_removed: int  # vLLM's budget - the governor's
    max_seqs: int = 0  # an admission cap for this step (vLLM's max_num_seqs lowered); 0: unchanged


class Calibration:
    """An online correction of the plan per step-shape class (the plugin measures each step's allocator
    peak: ``observe(shape, predicted, measured)``). The factor is the ``quantile`` of the ratio measured /
    predicted over the class's last ``window`` steps (once ``min_samples`` are in), clamped to
    ``[floor, ceiling]``; ``correct`` multiplies a prediction by it (a class not yet learned takes the
largest factor learned, at least 1). Steps whose measured peak exceeds
    the raw prediction are kept in ``exceeded`` with their shape (the plugin logs them)."""

    def __init__(self, *, quantile: float = 0.99, window: int = 256, min_samples: int = 8, floor: float = 1.0,
                 ceiling: float = 8.0, refresh_every: int = 8) -> None:
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"quantile: expected a fraction in (0, 1], got {quantile}")
        if not 0.0 < floor <= ceiling:
            raise ValueError(f"floor/ceiling: expected 0 < floor <= ceiling, got {floor}, {ceiling}")
        self.quantile, self.window, self.min_samples = quantile, window, min_samples
        self.floor, self.ceiling, self.refresh_every = floor, ceiling, max(1, refresh_every)
        self._ratios: dict[tuple, deque] = {}
        self._factor: dict[tuple, float] = {}
        self._since: dict[tuple, int] = {}
        self.errors: list[float] = []  # (measured - corrected) / corrected per step, for the histogram
        self.exceeded: deque = deque(maxlen=64)  # (shape, predicted, measured) of steps above the prediction
        self.steps = 0
        self._default = 1.0

    def factor(self, shape_class: tuple) -> float:
        """The class's factor; a class not yet learned takes the largest learned one (conservative)."""
        return self._factor.get(shape_class, self._default)

    def correct(self, shape: StepShape, predicted: int) -> int:
        f = self._factor.get(shape.shape_class, self._default)
        return predicted if f == 1.0 else int(math.ceil(predicted * f))

    def observe(self, shape: StepShape, predicted: int, measured: int) -> None:
        if predicted <= 0:
            return
        self.steps += 1
        key = shape.shape_class
        corrected = self.correct(shape, predicted)
        self.errors.append((measured - corrected) / corrected)
        if len(self.errors) > 4096:
            del self.errors[:2048]
        if measured > predicted:
            self.exceeded.append((shape, predicted, measured))
        ratios = self._ratios.get(key)
        if ratios is None:
            ratios = self._ratios[key] = deque(maxlen=self.window)
        ratios.append(measured / predicted)
        self._since[key] = self._since.get(key, 0) + 1
        if len(ratios) >= self.min_samples and (key not in self._factor or self._since[key] >= self.refresh_every):
            ordered = sorted(ratios)
            q = ordered[min(len(ordered) - 1, int(math.ceil(self.quantile * len(ordered))) - 1)]
            self._factor[key] = min(self.ceiling, max(self.floor, q))
            self._default = max(1.0, max(self._factor.values()))
            self._since[key] = 0
            self.on_refresh()

    def on_refresh(self) -> None:
        """Called when a factor changes (the governor drops its cached decisions)."""

    def factors(self) -> dict[str, float]:
        return {"/".join(str(x) for x in k): round(v, 4) for k, v in self._factor.items()}


class StepGovernor:
    """The governor of one engine (module docstring). ``peak_fn(StepShape)``: the plan's non-KV peak in
    bytes above the step's start; ``max_tokens``: vLLM's ``max_num_batched_tokens``."""

    def __init__(self, peak_fn: Callable[[StepShape], int], *, margin_bytes: int = DEFAULT_MARGIN_BYTES,
                 calibration: Calibration | None = None, cache_size: int = 1 << 14) -> None:
        if margin_bytes < 0:
            raise ValueError(f"margin_bytes: expected >= 0, got {margin_bytes}")
        self.peak_fn = peak_fn
        self.margin_bytes = margin_bytes
        self.calibration = calibration
        if calibration is not None:
            calibration.on_refresh = self._drop_decisions
        self._peaks: dict[StepShape, int] = {}
        self._decisions: dict[tuple, Decision | None] = {}
        self.cache_size = cache_size
        # counters
        self.steps = self.governed_steps = self.deferred_steps = self.no_fit_steps = self.refused = 0
        self.release_steps = 0  # steps before which the cache was released (needs_release)
        self.tokens_removed = 0
        self.by_cause: dict[str, int] = {}

    # ---------------------------------------------------------------- plan lookups
    def raw_peak(self, shape: StepShape) -> int:
        peak = self._peaks.get(shape)
        if peak is None:
            if len(self._peaks) >= self.cache_size:
                self._peaks.clear()
            peak = self._peaks[shape] = int(self.peak_fn(shape))
        return peak

    def peak(self, shape: StepShape) -> int:
        raw = self.raw_peak(shape)
        return raw if self.calibration is None else self.calibration.correct(shape, raw)

    def _drop_decisions(self) -> None:
        self._decisions.clear()

    # ---------------------------------------------------------------- the decision
    def govern(self, c: Candidates, budget: int, headroom_bytes: int, *, bucket_bytes: int = 8 << 20) -> Decision | None:
        """The budget for this step, or None when vLLM's ``budget`` already fits. ``headroom_bytes`` is
        rounded down to ``bucket_bytes`` (conservative) so that decisions can be cached."""
        self.steps += 1
        avail = (headroom_bytes - self.margin_bytes) // bucket_bytes * bucket_bytes
        key = (c, budget, avail)
        if key in self._decisions:
            d = self._decisions[key]
        else:
            d = self._decide(c, budget, avail)
            if len(self._decisions) >= self.cache_size:
                self._decisions.clear()
            self._decisions[key] = d
        if d is not None:
            self._count(d)
        return d

    def defer_waiting(self, d: Decision, running_only: Candidates, budget: int, headroom_bytes: int) -> Decision | None:
        """When even the smallest step with the waiting queue does not fit (``F_GOV_NO_FIT``) but the
        running requests alone do, the decision for a step that defers the queue (``F_GOV_DEFER``:
        requests stay queued, nothing is dropped); None when deferring would not help. ``running_only``:
        the step's candidates without the waiting queue."""
        if not d.flags & F_GOV_NO_FIT:
            return None
        alone = self.govern(running_only, budget, headroom_bytes)
        if alone is not None and alone.flags & F_GOV_NO_FIT:
            return None
        self.deferred_steps += 1
        new = alone.budget if alone is not None else budget
        return d._replace(budget=new, flags=(alone.flags if alone is not None else 0) | F_GOV_DEFER,
                          tokens_removed=budget - new)

    def needs_release(self, c: Candidates, budget: int, device_free_bytes: int) -> bool:
        """Whether the step at ``budget`` counts on cached blocks for a step-class tensor (prompt logprobs,
        long-context buffers, speculative rows): its worst case is over the device's free bytes less the
        margin. The caller then releases the cache first (``torch.cuda.empty_cache()``) so those tensors get
        segments of their own size instead of splitting cached ones (a split leaves the rest of a segment
        unusable to the next large tensor: the fragmentation OOM of a step that "fit")."""
        if not (c.prompt_logprob_tokens or c.spec_tokens or c.max_seq_len > c.max_query_len):
            return False
        return self.peak(worst_case(c, budget)) > device_free_bytes - self.margin_bytes

    def _count(self, d: Decision) -> None:
        self.governed_steps += 1
        self.tokens_removed += d.tokens_removed
        if d.flags & F_GOV_NO_FIT:
            self.no_fit_steps += 1
        name = OomCause(d.cause).name.lower()
        self.by_cause[name] = self.by_cause.get(name, 0) + 1

    def _decide(self, c: Candidates, budget: int, avail: int) -> Decision | None:
        full = self.peak(worst_case(c, budget))
        if full <= avail:
            return None
        cause = self.cause_of(c, budget, avail)
        seqs = self._largest_seq_cap(c, budget, avail)
        if seqs:  # fewer sequences admitted, the token budget kept (vLLM's --max-num-seqs workaround)
            return Decision(budget, F_GOV_SEQS, cause, full, avail, 0, seqs)
        fits = self._largest_fitting(c, budget, avail)
        flags = 0
        if fits:
            flags |= F_GOV_TOKENS
            if worst_case(c, fits).num_seqs < min(c.num_seqs, worst_case(c, budget).num_seqs):
                flags |= F_GOV_SEQS
            return Decision(fits, flags, cause, full, avail, budget - fits)
        return Decision(1, F_GOV_TOKENS | F_GOV_NO_FIT, cause, full, avail, budget - 1)

    def _largest_seq_cap(self, c: Candidates, budget: int, avail: int) -> int:
        """The most sequences (from the running ones up, below the candidates) whose worst case at the
        full budget fits; 0 when an admission cap alone cannot make the step fit."""
        lo = max(1, c.running)
        if lo >= c.num_seqs or self.peak(worst_case(replace(c, num_seqs=lo), budget)) > avail:
            return 0
        hi = c.num_seqs  # fits at lo, not at hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.peak(worst_case(replace(c, num_seqs=mid), budget)) <= avail:
                lo = mid
            else:
                hi = mid
        return lo

    def _largest_fitting(self, c: Candidates, budget: int, avail: int) -> int:
        """The most tokens (<= budget) whose worst case fits ``avail``; 0 when not even one does."""
        floor = 1 + c.spec_tokens if c.decode_only else 1
        if self.peak(worst_case(c, floor)) > avail:
            return 0
        lo, hi = floor, budget  # peak(lo) fits, peak(hi) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.peak(worst_case(c, mid)) <= avail:
                lo = mid
            else:
                hi = mid
        return lo

    def cause_of(self, c: Candidates, budget: int, avail: int) -> int:
        """The class whose part of the step, removed, saves the most bytes (PEAK when none would)."""
        full = self.peak(worst_case(c, budget))
        best, cause = 0, int(OomCause.PEAK)
        for name, stripped in (("PROMPT_LOGPROBS", replace(c, prompt_logprob_tokens=0)),
                               ("SPEC_DECODE", replace(c, spec_tokens=0)),
                               ("LONG_CONTEXT", replace(c, max_seq_len=0))):
            if stripped == c:
                continue
            saved = full - self.peak(worst_case(stripped, budget))
            if saved > best:
                best, cause = saved, int(OomCause[name])
        return cause

    # ---------------------------------------------------------------- arrival
    def never_fits(self, need: StepShape, fresh_headroom_bytes: int) -> int | None:
        """The bytes ``need`` (a request alone, at its smallest step) asks for when that exceeds what a
        fresh worker's allocator can give less the margin; None when it fits."""
        nbytes = self.peak(need)
        return nbytes if nbytes > fresh_headroom_bytes - self.margin_bytes else None

    def summary(self) -> dict:
        out = {"steps_checked": self.steps, "steps_governed": self.governed_steps, "steps_no_fit": self.no_fit_steps,
               "steps_deferred": self.deferred_steps, "cache_releases": self.release_steps, "tokens_removed": self.tokens_removed,
               "never_fits": self.refused, "by_cause": dict(sorted(self.by_cause.items()))}
        if self.calibration is not None:
            out["calibration"] = {"steps": self.calibration.steps, "factors": self.calibration.factors(),
                                  "exceeded": len(self.calibration.exceeded)}
        return out


def never_fits_message(need_bytes: int, headroom_bytes: int, margin_bytes: int, what: str) -> str:
    """The refusal's text: the request's need and the node's headroom, as a 400 would say it."""
    gib = 1 << 30
    return (f"request can never fit this node: its smallest engine step ({what}) needs {need_bytes / gib:.2f} GiB "
            f"of GPU memory outside the KV cache, and a freshly started worker can give "
            f"{max(0, headroom_bytes - margin_bytes) / gib:.2f} GiB ({headroom_bytes / gib:.2f} GiB free and cached, "
            f"less a {margin_bytes / gib:.2f} GiB margin); not retryable here")
