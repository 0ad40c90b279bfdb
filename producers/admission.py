"""Memory-aware, SLO-aware admission at the node: admit, hold or refuse each arriving request from the
node's predicted state (issue 29; docs/ADMISSION.md).

Pure (stdlib only): the shadow engine (``producers.sim.vllm.engine``) and the vLLM plugin
(``producers.vllm.admission``) hand it a ``NodeView`` of the scheduler and act on its ``Verdict``.

Why a new gate: vLLM 0.33's own caps (``AsyncLLM.check_admission``: ``--max-num-queued-reqs``,
``--max-num-queued-tokens``, answering ``QueueOverflowError`` / ``MaxQueuedTokensError``, HTTP 503)
count requests and prompt tokens, never memory nor the time a request will wait; its waiting queue is
unbounded by default. This gate predicts, for a request of priority ``p``:

- **KV demand** in blocks: every running and waiting request at its expected final length (prompt +
  expected output, the output from the lengths observed per priority class, ``LengthModel``) — the
  blocks the node will need as its requests grow, not the blocks they hold now. ``saturation`` is that
  demand over the KV cache (capped at 1): predictive where llm-d-router's utilization detector reads
  ``vllm:kv_cache_usage_perc`` (reactive, its own README says so).
- **Queueing delay**: the wait for KV room and a seat (``max_num_seqs``) — the time until enough
  running requests finish, from their remaining tokens and the decode step time — plus the prefill of
  the prompt tokens served before it (waiting requests of priority >= ``p`` under vLLM's ``priority``
  policy, all of them under ``fcfs``) and its own, at the step budget.

and compares the delay with the request's TTFT target (``vllm bench serve --goodput ttft:…``):
admit when it fits; hold (keep it out of the scheduler, re-decided as the node drains) while holding
can still pay; refuse otherwise, retryable, with ``Retry-After`` = the predicted time until it would
fit. A node with no work always admits (an idle GPU is the best any node can do). Nothing is dropped:
a held request is released or refused, and a refusal is an answer (``Outcome.REFUSED``).

Priorities: kvguard's 0-10, higher more important (the seeds' convention; missing -> 5 and a warning
counter). vLLM's ``priority`` field runs the other way (lower is served first, ``SchedulerConfig.policy``
"priority"): ``vllm_priority(p) = 10 - p``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import IntEnum

from kvguard.contracts.units import DEFAULT_PRIORITY

MIN_PRIORITY, MAX_PRIORITY = 0, 10


def vllm_priority(priority: int) -> int:
    """kvguard's 0-10 (higher more important) as vLLM's ``priority`` (lower served first): ``10 - p``.
    Out-of-range values are clamped to 0-10 first."""
    return MAX_PRIORITY - min(MAX_PRIORITY, max(MIN_PRIORITY, int(priority)))


def kvguard_priority(vllm_value: int) -> int:
    """The inverse of ``vllm_priority`` on 0-10 (vLLM values outside 0-10 are clamped)."""
    return MAX_PRIORITY - min(MAX_PRIORITY, max(MIN_PRIORITY, int(vllm_value)))


class Decision(IntEnum):
    """ADMISSION ``cls``: what the gate did (ADMIT is not written: the ARRIVE row says it)."""

    ADMIT = 0
    HOLD = 1
    REFUSE = 2
    RELEASE = 3  # a held request went into the scheduler


@dataclass(slots=True, frozen=True)
class AdmissionConfig:
    """``ttft_s``: the TTFT target (the SLO's, ``--goodput ttft:``); ``ttft_by_priority`` overrides it
    per class. A request is admitted while its predicted delay <= ``admit_frac`` x its target; held
    while the delay <= ``hold_frac`` x the target and for at most ``hold_max_s`` (default the target);
    refused otherwise. ``min_retry_after_s`` floors the Retry-After. ``kv_limit``: predicted KV demand
    (with the request) over the cache above which a request below ``protect_priority`` is not admitted
    (a preemption storm is what the excess turns into). ``protect_priority``: at or above it a request
    is only refused when even holding cannot get it served (never shed for saturation alone)."""

    ttft_s: float = 2.0
    ttft_by_priority: tuple[tuple[int, float], ...] = ()
    admit_frac: float = 1.0
    hold_frac: float = 2.0
    hold_max_s: float | None = None
    min_retry_after_s: float = 1.0
    kv_limit: float = 1.0
    protect_priority: int = 8

    def __post_init__(self):
        if not self.ttft_s > 0:
            raise ValueError(f"admission.ttft_s: expected > 0, got {self.ttft_s}")
        if not 0 < self.admit_frac <= self.hold_frac:
            raise ValueError(f"admission: expected 0 < admit_frac <= hold_frac, got {self.admit_frac}, {self.hold_frac}")
        if not self.kv_limit > 0:
            raise ValueError(f"admission.kv_limit: expected > 0, got {self.kv_limit}")

    def ttft_for(self, priority: int) -> float:
        for p, t in self.ttft_by_priority:
            if p == priority:
                return t
        return self.ttft_s

    @property
    def hold_limit_s(self) -> float:
        return self.ttft_s if self.hold_max_s is None else self.hold_max_s


class LengthModel:
    """Output lengths observed per priority class (the last ``window`` completions of each), so the
    expected output of a request is what its class really generates, capped by its ``max_tokens``.
    Before ``min_samples`` of a class, all classes together; before that, ``max_tokens`` (what vLLM's
    GUARANTEED-style reservation assumes)."""

    def __init__(self, window: int = 512, min_samples: int = 16):
        self.window, self.min_samples = window, min_samples
        self._by_class: dict[int, deque[int]] = {}
        self._all: deque[int] = deque(maxlen=window)
        self._mean: dict[int | None, float] = {}

    def observe(self, priority: int, output_tokens: int) -> None:
        q = self._by_class.setdefault(priority, deque(maxlen=self.window))
        q.append(int(output_tokens))
        self._all.append(int(output_tokens))
        self._mean.pop(priority, None)
        self._mean.pop(None, None)

    def _class_mean(self, key: int | None) -> float | None:
        if key in self._mean:
            return self._mean[key]
        q = self._all if key is None else self._by_class.get(key)
        if q is None or len(q) < self.min_samples:
            return None
        self._mean[key] = sum(q) / len(q)
        return self._mean[key]

    def expected_output(self, priority: int, max_tokens: int, generated: int = 0) -> int:
        mean = self._class_mean(priority)
        if mean is None:
            mean = self._class_mean(None)
        expected = max_tokens if mean is None else min(max_tokens, math.ceil(mean))
        return max(expected, generated + 1)


@dataclass(slots=True, frozen=True)
class Seq:
    """One request the scheduler holds, as the gate sees it."""

    priority: int  # kvguard's 0-10
    prompt_tokens: int
    max_tokens: int
    generated: int = 0
    blocks: int = 0  # KV blocks it holds now


@dataclass(slots=True)
class NodeView:
    """The node at one moment: its KV cache, seats, step-time model and queues.
    ``step_s(prefill_tokens, decode_seqs)``: one engine step's time (the profile's model on the shadow
    engine; the plugin's measured step times on vLLM)."""

    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_batched_tokens: int
    step_s: Callable[[int, int], float]
    running: list[Seq] = field(default_factory=list)
    waiting: list[Seq] = field(default_factory=list)
    policy: str = "fcfs"
    watermark_blocks: int = 0


@dataclass(slots=True, frozen=True)
class Verdict:
    decision: Decision
    delay_s: float  # predicted queueing delay before the first token's prefill ends
    saturation: float  # predicted KV demand with the request, over the cache (capped at 1)
    retry_after_s: float = 0.0  # REFUSE: when to try again (HTTP Retry-After, whole seconds up)


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class AdmissionModel:
    """The predictions and the decision; stateless but for the ``LengthModel`` it reads."""

    def __init__(self, config: AdmissionConfig | None = None, lengths: LengthModel | None = None):
        self.config = config or AdmissionConfig()
        self.lengths = lengths or LengthModel()

    def final_blocks(self, s: Seq, bs: int) -> int:
        return _blocks(s.prompt_tokens + self.lengths.expected_output(s.priority, s.max_tokens, s.generated), bs)

    def demand_blocks(self, view: NodeView) -> int:
        """KV blocks the node's requests will hold at their expected final lengths."""
        bs = view.block_size
        return sum(max(s.blocks, self.final_blocks(s, bs)) for s in view.running) + \
            sum(self.final_blocks(s, bs) for s in view.waiting)

    def saturation(self, view: NodeView, extra_blocks: int = 0) -> float:
        """Predicted KV demand (plus ``extra_blocks``) over the usable cache, in [0, 1]."""
        usable = max(1, view.num_blocks - view.watermark_blocks)
        return min(1.0, (self.demand_blocks(view) + extra_blocks) / usable)

    def _ahead(self, view: NodeView, priority: int) -> list[Seq]:
        if view.policy == "priority":
            return [s for s in view.waiting if s.priority >= priority]
        return list(view.waiting)

    def delay_s(self, view: NodeView, new: Seq) -> float:
        """Predicted time until ``new``'s prefill ends if admitted now (see the module docstring)."""
        bs = view.block_size
        ahead = self._ahead(view, new.priority)
        need = sum(self.final_blocks(s, bs) for s in ahead) + _blocks(new.prompt_tokens + 1, bs)
        held = sum(max(s.blocks, self.final_blocks(s, bs)) for s in view.running)
        excess_blocks = held + need - (view.num_blocks - view.watermark_blocks)
        excess_seats = len(view.running) + len(ahead) + 1 - view.max_num_seqs
        wait = self._drain_time(view, excess_blocks, excess_seats)
        prefill_tokens = sum(s.prompt_tokens for s in ahead) + new.prompt_tokens
        n_decode = min(len(view.running), view.max_num_seqs)
        per_step = max(1, view.max_batched_tokens - n_decode)
        steps = math.ceil(prefill_tokens / per_step)
        return wait + steps * view.step_s(min(per_step, prefill_tokens), n_decode)

    def _drain_time(self, view: NodeView, excess_blocks: int, excess_seats: int) -> float:
        """Time until the running requests that finish first free ``excess_blocks`` blocks and
        ``excess_seats`` seats (inf when all of them finishing is not enough)."""
        if excess_blocks <= 0 and excess_seats <= 0:
            return 0.0
        bs = view.block_size
        finishing = sorted((max(1, self.lengths.expected_output(s.priority, s.max_tokens, s.generated) - s.generated),
                            max(s.blocks, self.final_blocks(s, bs))) for s in view.running)
        step = view.step_s(0, max(1, len(view.running)))
        freed_blocks = freed_seats = 0
        for remaining, blocks in finishing:
            freed_blocks += blocks
            freed_seats += 1
            if freed_blocks >= excess_blocks and freed_seats >= excess_seats:
                return remaining * step
        return math.inf

    def decide(self, view: NodeView, new: Seq, *, held_s: float = 0.0) -> Verdict:
        """Admit, hold or refuse ``new`` (already held for ``held_s``); see the module docstring."""
        cfg = self.config
        sat = self.saturation(view, self.final_blocks(new, view.block_size))
        if not view.running and not view.waiting:
            return Verdict(Decision.ADMIT, self.delay_s(view, new), sat)
        delay = self.delay_s(view, new)
        budget = cfg.ttft_for(new.priority) - held_s
        over_kv = sat >= cfg.kv_limit and new.priority < cfg.protect_priority
        if delay <= cfg.admit_frac * budget and not over_kv:
            return Verdict(Decision.ADMIT, delay, sat)
        if held_s < cfg.hold_limit_s and delay <= cfg.hold_frac * max(budget, 0.0) + cfg.hold_limit_s - held_s:
            return Verdict(Decision.HOLD, delay, sat)
        retry = delay - budget if math.isfinite(delay) else cfg.hold_limit_s + cfg.ttft_for(new.priority)
        return Verdict(Decision.REFUSE, delay, sat, max(cfg.min_retry_after_s, float(math.ceil(retry))))


@dataclass(slots=True)
class Held:
    """A request the gate keeps out of the scheduler; ``payload`` is the caller's."""

    req_id: int
    seq: Seq
    since_ns: int
    payload: object = None


class HoldQueue:
    """Held requests, highest priority first then oldest: the order in which they are re-decided."""

    def __init__(self):
        self._items: list[Held] = []

    def add(self, held: Held) -> None:
        self._items.append(held)
        self._items.sort(key=lambda h: (-h.seq.priority, h.since_ns, h.req_id))

    def remove(self, held: Held) -> None:
        self._items.remove(held)

    def __iter__(self):
        return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)


@dataclass(slots=True)
class AdmissionStats:
    """Counts per decision and per priority class (the summary's ``refused`` etc.)."""

    held: int = 0
    released: int = 0
    refused: int = 0
    refused_by_priority: dict[int, int] = field(default_factory=dict)
    retry_after_s: list[float] = field(default_factory=list)

    def count_refused(self, priority: int, retry_after_s: float) -> None:
        self.refused += 1
        self.refused_by_priority[priority] = self.refused_by_priority.get(priority, 0) + 1
        if len(self.retry_after_s) < 100_000:
            self.retry_after_s.append(retry_after_s)

    def to_dict(self) -> dict:
        ra = sorted(self.retry_after_s)
        return {"held": self.held, "released": self.released, "refused": self.refused,
                "refused_by_priority": {str(k): v for k, v in sorted(self.refused_by_priority.items())},
                "retry_after_p50_s": ra[len(ra) // 2] if ra else None}


def parse_priority_mix(spec: str) -> tuple[tuple[int, float], ...]:
    """``"9:0.1,5:0.6,1:0.3"`` -> ((9, 0.1), (5, 0.6), (1, 0.3)); shares must be > 0 and sum to 1
    (within 1e-6); priorities 0-10, each once. Raises ``ValueError`` naming the bad part."""
    out: list[tuple[int, float]] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        prio, sep, share = part.partition(":")
        try:
            p, s = int(prio), float(share)
        except ValueError:
            raise ValueError(f"--priority-mix: expected PRIORITY:SHARE (e.g. 9:0.1), got {part!r}") from None
        if not sep or not MIN_PRIORITY <= p <= MAX_PRIORITY or not s > 0:
            raise ValueError(f"--priority-mix: expected a priority in 0-10 and a share > 0, got {part!r}")
        if any(p == q for q, _ in out):
            raise ValueError(f"--priority-mix: priority {p} given twice")
        out.append((p, s))
    if not out:
        raise ValueError("--priority-mix: expected at least one PRIORITY:SHARE")
    total = sum(s for _, s in out)
    if abs(total - 1.0) > 1e-6:
        raise ValueError(f"--priority-mix: shares must sum to 1, got {total:g}")
    return tuple(out)


def priority_for(key: int, mix: Iterable[tuple[int, float]]) -> int:
    """The priority a mix gives the request with integer ``key`` (a deterministic draw in [0, 1))."""
    u = ((key * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & 0xFFFF_FFFF_FFFF_FFFF) / 2.0 ** 64
    acc = 0.0
    last = DEFAULT_PRIORITY
    for p, s in mix:
        acc += s
        last = p
        if u < acc:
            return p
    return last
