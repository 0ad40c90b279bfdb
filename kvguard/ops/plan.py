"""``kvguard plan``'s reasoning: per request class, the largest step that fits what start-up left, and the
settings at which every declared class fits (docs/PLAN.md).

Pure: a server is a port (``Server``) that says what start-up measured (``Startup``) and whether one step
(a ``step_memory.Batch``) fits; the runtime builds it from the shadow engine (``runtime.planning``). Each
class of ``ops.traffic.CLASSES`` has a step shape parameterised by one size (``REQUEST_CLASSES``):

- ``prompt_logprobs``: one prompt of ``n`` tokens asking for prompt logprobs, prefilled alone in one step
  (``n`` at most ``max_num_batched_tokens``: a longer prompt is chunked, and its first chunk is that long);
- ``logprobs``: a decode step of ``n`` sequences each asking for ``logprobs=N``;
- ``spec_decode``: a decode step of ``n`` sequences each verifying the server's ``k`` draft tokens;
- ``long_context``: a request at a context of ``n`` tokens in the busiest steps it takes part in: its last
  prefill chunk as large as the token budget allows with every other seat decoding, and its decode among
  ``max_num_seqs`` decodes (``_long_context_step``).

``full_step`` (``BASELINE``) is no traffic class but every server's busiest ordinary step (the whole token budget
over ``n`` sampling sequences); every setting search requires it besides the declared classes.

A class's limit is the largest ``n`` whose steps fit (bisection; each class's peak grows with ``n``); its
margin is what the device still had at the worst moment of the step at that size, as the server's allocator
saw it (``Server.slack_bytes``). The setting searches bisect too: as ``gpu_memory_utilization`` rises vLLM
first refuses for too small a KV cache, then starts, then some class stops fitting, then it refuses or
crashes for too little beyond the KV cache (``Outcome``); as ``max_num_batched_tokens`` rises a class's
step only grows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol

from kvguard.ops.traffic import CLASSES, TrafficClass
from kvguard.producers.vllm.step_memory import Batch

GiB = 1 << 30
MAX_LOGPROBS = 20  # vllm/config/model.py max_logprobs default
UTILIZATION_STEP = 0.001  # the utilization search's resolution (vLLM takes any float in (0, 1])
BATCHED_TOKENS_STEP = 256  # the token-budget search's grid


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The settings a class's step shape depends on."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    block_size: int
    sampling: str
    model_runner: str
    num_speculative_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Startup:
    """What vLLM would log at start-up (bytes), or its refusal (``refused``: vLLM's message)."""

    gpu_memory_utilization: float
    max_num_batched_tokens: int
    refused: str | None = None
    refused_for_kv: bool = False  # refused for too small a KV cache (the low side of the utilization range)
    total_bytes: int = 0
    init_free_bytes: int | None = None
    requested_bytes: int = 0
    consumed_bytes: int = 0  # weights + non-torch (+ the runner's buffers under the V2 accounting)
    peak_activation_bytes: int = 0  # as vLLM logs it
    cudagraph_bytes: int = 0
    kv_cache_bytes: int = 0
    num_gpu_blocks: int = 0
    kv_cache_tokens: int = 0
    max_concurrency: float = 0.0
    max_model_len: int = 0
    headroom_bytes: int = 0  # what a step can still get from the caching allocator after start-up
    log_lines: tuple[str, ...] = ()

    @property
    def started(self) -> bool:
        return self.refused is None

    def to_dict(self) -> dict:
        return {"gpu_memory_utilization": self.gpu_memory_utilization,
                "max_num_batched_tokens": self.max_num_batched_tokens, "refused": self.refused,
                "refused_for_kv_cache": self.refused_for_kv,
                "total_bytes": self.total_bytes, "init_free_bytes": self.init_free_bytes,
                "requested_bytes": self.requested_bytes, "consumed_bytes": self.consumed_bytes,
                "peak_activation_bytes": self.peak_activation_bytes, "cudagraph_bytes": self.cudagraph_bytes,
                "kv_cache_bytes": self.kv_cache_bytes, "num_gpu_blocks": self.num_gpu_blocks,
                "kv_cache_tokens": self.kv_cache_tokens, "max_concurrency": round(self.max_concurrency, 2),
                "max_model_len": self.max_model_len, "headroom_bytes": self.headroom_bytes}


class Server(Protocol):
    """A server just started with some settings."""

    startup: Startup
    config: ServerConfig

    def fits(self, batch: Batch) -> bool: ...

    def slack_bytes(self, batch: Batch) -> int | None:
        """What memory is left at the step's worst moment, as the allocator sees it; None: it OOMs."""

    def peak_bytes(self, batch: Batch) -> int:
        """The step's own tensors at their peak."""


# a server for (gpu_memory_utilization, max_num_batched_tokens); a refused start is a Startup
Start = Callable[[float | None, int | None], "Server | Startup"]


# -- request classes ----------------------------------------------------------------------------------

def _decode_context(cfg: ServerConfig, startup: Startup, seqs: int) -> int:
    """The longest context ``seqs`` decoding sequences can each have in this KV cache."""
    return max(1, min(cfg.max_model_len - 1, startup.kv_cache_tokens // max(1, seqs)))


def _prompt_logprobs_step(n: int, cfg: ServerConfig, startup: Startup, cls: TrafficClass) -> tuple[Batch, ...]:
    return (Batch((n,), (n,), sampling=cfg.sampling, prompt_lens=(n,), prompt_logprobs_tokens=(n,)),)


def _logprobs_step(n: int, cfg: ServerConfig, startup: Startup, cls: TrafficClass) -> tuple[Batch, ...]:
    return (Batch.uniform(n, 1, _decode_context(cfg, startup, n), sampling=cfg.sampling,
                          num_logprobs=cls.shape if cls.shape is not None else MAX_LOGPROBS),)


def _spec_step(n: int, cfg: ServerConfig, startup: Startup, cls: TrafficClass) -> tuple[Batch, ...]:
    k = cfg.num_speculative_tokens
    return (Batch((1 + k,) * n, (_decode_context(cfg, startup, n),) * n, sampling=cfg.sampling,
                  num_draft_tokens=(k,) * n),)


def _full_step(n: int, cfg: ServerConfig, startup: Startup, cls: TrafficClass) -> tuple[Batch, ...]:
    """Ordinary traffic at its busiest: the whole token budget over ``n`` sequences that all sample (one
    prompt's last chunk takes the tokens the ``n - 1`` decodes leave)."""
    chunk = max(1, cfg.max_num_batched_tokens - (n - 1))
    context = _decode_context(cfg, startup, n)
    return (Batch((chunk,) + (1,) * (n - 1), (max(chunk, min(context, cfg.max_model_len - 1)),) + (context,) * (n - 1),
                  sampling=cfg.sampling),)


def _long_context_step(n: int, cfg: ServerConfig, startup: Startup, cls: TrafficClass) -> tuple[Batch, ...]:
    """A request at context ``n`` in the busiest steps it takes part in: its last prefill chunk at the size
    that still leaves every other seat decoding (the most tokens with the most sequences), and its decode
    beside ``max_num_seqs - 1`` others. Both sizes are fixed by the server, not by ``n``, so each step's
    peak only grows with ``n`` (the prompt's own remainder modulo the token budget would make the
    limit jump up and down with it)."""
    spare_blocks = max(0, startup.kv_cache_tokens - n) // cfg.block_size
    seats = max(0, min(cfg.max_num_seqs - 1, spare_blocks))
    steps = []
    for chunk in sorted({min(n, max(1, cfg.max_num_batched_tokens - seats)), 1}):
        others = max(0, min(seats, cfg.max_num_batched_tokens - chunk))
        context = max(1, min(n, (startup.kv_cache_tokens - n) // others)) if others else 1
        steps.append(Batch((chunk,) + (1,) * others, (n,) + (context,) * others, sampling=cfg.sampling))
    return tuple(steps)


@dataclass(frozen=True, slots=True)
class RequestClass:
    """A class's step, the sizes a server can schedule of it, and what vLLM refuses outright."""

    name: str
    unit: str
    steps: Callable[[int, ServerConfig, Startup, TrafficClass], tuple[Batch, ...]]  # all must fit
    largest: Callable[[ServerConfig, Startup], int]  # the largest size one step of this server holds
    declared: Callable[[ServerConfig, TrafficClass], int]  # the size the traffic asks for
    refusal: Callable[[ServerConfig, TrafficClass], str | None] = lambda cfg, cls: None
    per_step: Callable[[int, ServerConfig], int] = lambda n, cfg: n  # the size one step sees of a request

    @property
    def summary(self) -> str:
        return CLASSES[self.name].summary if self.name in CLASSES else BASELINE_SUMMARY


def _no_spec(cfg: ServerConfig, cls: TrafficClass) -> str | None:
    if not cfg.num_speculative_tokens:
        return "needs --num-speculative-tokens with --speculative-model-config (the server does not speculate)"
    if cfg.model_runner != "v2":
        return "not modelled under the V1 runner (the shadow engine speculates with Model Runner V2 only)"
    return None


def _too_many_logprobs(cfg: ServerConfig, cls: TrafficClass) -> str | None:
    n = cls.shape if cls.shape is not None else MAX_LOGPROBS
    if n > MAX_LOGPROBS:  # sampling_params.py: a VLLMValidationError, HTTP 400
        return f"Requested sample logprobs of {n}, which is greater than max allowed: {MAX_LOGPROBS}"
    return None


BASELINE = "full_step"  # not a traffic class: every server's own busiest ordinary step, always required
BASELINE_SUMMARY = "ordinary traffic at its busiest: the whole token budget, every sequence sampling"

REQUEST_CLASSES: dict[str, RequestClass] = {c.name: c for c in (
    RequestClass(BASELINE, "sequences", _full_step,
                 largest=lambda cfg, s: min(cfg.max_num_seqs, cfg.max_num_batched_tokens),
                 declared=lambda cfg, cls: min(cfg.max_num_seqs, cfg.max_num_batched_tokens)),
    RequestClass("prompt_logprobs", "tokens", _prompt_logprobs_step,
                 largest=lambda cfg, s: min(cfg.max_num_batched_tokens, cfg.max_model_len - 1),
                 declared=lambda cfg, cls: cls.shape if cls.shape is not None else cfg.max_model_len - 1,
                 per_step=lambda n, cfg: min(n, cfg.max_num_batched_tokens)),
    RequestClass("logprobs", "sequences", _logprobs_step,
                 largest=lambda cfg, s: min(cfg.max_num_seqs, cfg.max_num_batched_tokens),
                 declared=lambda cfg, cls: min(cfg.max_num_seqs, cfg.max_num_batched_tokens),
                 refusal=_too_many_logprobs),
    RequestClass("spec_decode", "sequences", _spec_step,
                 largest=lambda cfg, s: min(cfg.max_num_seqs,
                                            cfg.max_num_batched_tokens // (1 + cfg.num_speculative_tokens)),
                 declared=lambda cfg, cls: cls.shape if cls.shape is not None else cfg.max_num_seqs,
                 refusal=_no_spec,
                 per_step=lambda n, cfg: min(n, cfg.max_num_seqs,
                                             cfg.max_num_batched_tokens // (1 + cfg.num_speculative_tokens))),
    RequestClass("long_context", "tokens", _long_context_step,
                 largest=lambda cfg, s: cfg.max_model_len - 1,
                 declared=lambda cfg, cls: cls.shape if cls.shape is not None else cfg.max_model_len - 1),
)}


# -- searches -----------------------------------------------------------------------------------------

def largest_fitting(fits: Callable[[int], bool], lo: int, hi: int) -> int | None:
    """The largest ``n`` in ``[lo, hi]`` with ``fits(n)``, for a ``fits`` that holds up to some size and not
    beyond; None when ``fits(lo)`` does not hold."""
    if lo > hi or not fits(lo):
        return None
    if fits(hi):
        return hi
    while hi - lo > 1:  # fits(lo) and not fits(hi)
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True, slots=True)
class ClassLimit:
    """One class on one server: the largest size that fits, with the peak and the margin there."""

    name: str
    unit: str
    share: float | None
    declared: int | None  # the size the traffic asks for (None: the class was not declared)
    largest: int  # the largest size one step of this server holds
    limit: int | None = None  # the largest size that fits (None: not even the smallest)
    peak_bytes: int = 0  # the step's own tensors at their peak at ``limit`` (the smallest size when none fits)
    next_peak_bytes: int | None = None  # at ``limit + 1``, the first size that does not fit
    headroom_bytes: int = 0
    margin_bytes: int | None = None  # the allocator's slack at the step's worst moment, at ``limit``
    declared_fits: bool | None = None  # whether the declared size fits (None: not declared, or refused)
    refused: str | None = None  # vLLM refuses such requests, or the class does not apply here

    @property
    def unlimited(self) -> bool:
        return self.limit is not None and self.limit >= self.largest

    def to_dict(self) -> dict:
        return {"name": self.name, "unit": self.unit, "share": self.share, "declared": self.declared,
                "largest_schedulable": self.largest, "limit": self.limit, "unlimited": self.unlimited,
                "peak_bytes": self.peak_bytes, "next_peak_bytes": self.next_peak_bytes,
                "headroom_bytes": self.headroom_bytes, "margin_bytes": self.margin_bytes,
                "declared_fits": self.declared_fits, "refused": self.refused}


def class_limit(server: Server, cls: TrafficClass, declared: bool = True) -> ClassLimit:
    """``cls`` on ``server`` (module docstring): its limit by bisection over the sizes one step holds."""
    spec = REQUEST_CLASSES[cls.name]
    cfg, startup = server.config, server.startup
    largest = spec.largest(cfg, startup)
    base = dict(name=cls.name, unit=spec.unit, share=cls.share,
                declared=spec.declared(cfg, cls) if declared else None, largest=largest,
                headroom_bytes=startup.headroom_bytes)
    refused = spec.refusal(cfg, cls)
    if refused is not None or largest < 1:
        return ClassLimit(**base, refused=refused or "no step of this server holds one")
    steps = lambda n: spec.steps(n, cfg, startup, cls)  # noqa: E731
    peak = lambda n: max(server.peak_bytes(b) for b in steps(n))  # noqa: E731
    limit = largest_fitting(lambda n: all(server.fits(b) for b in steps(n)), 1, largest)
    at = limit if limit is not None else 1
    following = at + 1 if limit is not None and limit < largest else None
    fits_declared = margin = None
    if declared:
        fits_declared = limit is not None and limit >= min(spec.per_step(base["declared"], cfg), largest)
    if limit is not None:
        margin = min(server.slack_bytes(b) for b in steps(limit))
    return ClassLimit(**base, limit=limit, peak_bytes=peak(at), next_peak_bytes=peak(following) if following else None,
                      margin_bytes=margin, declared_fits=fits_declared)


def declared_fit(server: Server, classes: tuple[TrafficClass, ...]) -> bool:
    """Whether the server's busiest ordinary step (``BASELINE``) and every declared class fit at their declared
    sizes (one step each, no search)."""
    for cls in (TrafficClass(BASELINE),) + tuple(classes):
        spec = REQUEST_CLASSES[cls.name]
        cfg = server.config
        if spec.refusal(cfg, cls) is not None:
            continue  # a class vLLM refuses (or that does not apply) costs no memory
        size = min(spec.per_step(spec.declared(cfg, cls), cfg), spec.largest(cfg, server.startup))
        if size >= 1 and not all(server.fits(b) for b in spec.steps(size, cfg, server.startup, cls)):
            return False
    return True


class Outcome(IntEnum):
    """What a start at one setting gives, in the order they come as gpu_memory_utilization rises."""

    REFUSED_KV = 0  # vLLM refuses: too little memory for the KV cache (raise the utilization)
    FITS = 1  # starts, and every declared class fits
    OOMS = 2  # starts, and some declared class's step does not fit
    REFUSED_HIGH = 3  # vLLM refuses or crashes at start with too little beyond the KV cache: free memory below
    # the requested share, the warm-up or the CUDA-graph capture out of memory (lower the utilization)


def outcome(started: Server | Startup, classes: tuple[TrafficClass, ...]) -> Outcome:
    if isinstance(started, Startup):
        return Outcome.REFUSED_KV if started.refused_for_kv else Outcome.REFUSED_HIGH
    return Outcome.FITS if declared_fit(started, classes) else Outcome.OOMS


@dataclass(frozen=True, slots=True)
class Boundary:
    """The utilization range vLLM starts in and the largest setting at which every declared class fits."""

    lowest_start: float | None  # below it: vLLM refuses for the KV cache ("No available memory ...")
    highest_start: float | None  # above it: vLLM refuses for free memory
    largest_fitting: float | None  # the largest utilization that starts with every declared class fitting
    startup: Startup | None = None  # at ``largest_fitting``
    largest_batched_tokens: int | None = None  # at the configured utilization
    batched_tokens_startup: Startup | None = None
    batched_tokens_searched: tuple[int, int] | None = None  # the grid's ends

    def to_dict(self) -> dict:
        kv = lambda s: s.kv_cache_tokens if s is not None else None  # noqa: E731
        return {"lowest_starting_utilization": self.lowest_start, "highest_starting_utilization": self.highest_start,
                "largest_utilization": self.largest_fitting, "kv_cache_tokens_at_largest_utilization": kv(self.startup),
                "kv_cache_bytes_at_largest_utilization": self.startup.kv_cache_bytes if self.startup else None,
                "largest_max_num_batched_tokens": self.largest_batched_tokens,
                "kv_cache_tokens_at_largest_max_num_batched_tokens": kv(self.batched_tokens_startup),
                "max_num_batched_tokens_searched": list(self.batched_tokens_searched)
                if self.batched_tokens_searched else None}


def utilization_boundary(start: Start, classes: tuple[TrafficClass, ...], *,
                         step: float = UTILIZATION_STEP) -> tuple[float | None, float | None, float | None]:
    """(lowest utilization vLLM starts at, highest, largest at which every declared class fits), each to
    ``step``; None where there is none. Relies on ``Outcome``'s order as the utilization rises."""
    top = round(1.0 / step)
    memo: dict[int, Outcome] = {}

    def at(k: int) -> Outcome:
        if k not in memo:
            memo[k] = outcome(start(round(k * step, 6), None), classes)
        return memo[k]

    highest = largest_fitting(lambda k: at(k) != Outcome.REFUSED_HIGH, 1, top)
    lowest = None
    if highest is not None:  # the first k that is not refused for the KV cache
        below = largest_fitting(lambda k: at(k) == Outcome.REFUSED_KV, 1, highest)
        lowest = (below + 1 if below is not None else 1) if at(highest) != Outcome.REFUSED_KV else None
    fitting = None
    if lowest is not None:
        k = largest_fitting(lambda k: at(k) <= Outcome.FITS, lowest, highest)
        fitting = k if k is not None and at(k) == Outcome.FITS else None
    as_u = lambda k: round(k * step, 6) if k is not None else None  # noqa: E731
    return as_u(lowest), as_u(highest), as_u(fitting)


def batched_tokens_boundary(start: Start, classes: tuple[TrafficClass, ...], lo: int, hi: int, *,
                            step: int = BATCHED_TOKENS_STEP) -> int | None:
    """The largest ``max_num_batched_tokens`` on the grid ``lo, k * step ... hi`` at which vLLM starts and
    every declared class fits (at the configured utilization); None when not even ``lo`` does."""
    grid = [lo] + [k * step for k in range(lo // step + 1, hi // step + 1)]
    memo: dict[int, bool] = {}

    def good(i: int) -> bool:
        if i not in memo:
            memo[i] = outcome(start(None, grid[i]), classes) == Outcome.FITS
        return memo[i]

    i = largest_fitting(good, 0, len(grid) - 1)
    return grid[i] if i is not None else None


@dataclass(frozen=True, slots=True)
class WhatIfRow:
    startup: Startup
    classes: tuple[ClassLimit, ...] = ()

    def to_dict(self) -> dict:
        return {"startup": self.startup.to_dict(), "classes": [c.to_dict() for c in self.classes]}


def what_if(start: Start, classes: tuple[TrafficClass, ...], utilizations: tuple[float, ...]) -> list[WhatIfRow]:
    """Each utilization's start-up and, where vLLM starts, each class's limit."""
    rows = []
    for u in utilizations:
        started = start(u, None)
        if isinstance(started, Startup):
            rows.append(WhatIfRow(started))
        else:
            rows.append(WhatIfRow(started.startup, tuple(class_limit(started, c) for c in classes)))
    return rows


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything ``kvguard plan`` reports (``to_dict``: its ``--json``)."""

    source: str  # "model" (the shadow engine's start-up) or "log" (a real server's budget)
    startup: Startup
    config: ServerConfig | None
    classes: tuple[ClassLimit, ...]
    traffic: tuple[TrafficClass, ...]
    boundary: Boundary | None
    what_if: tuple[WhatIfRow, ...]
    assumptions: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict:
        s = self.startup
        out = {"source": self.source, **{k: v for k, v in s.to_dict().items()},
               "log_lines": list(s.log_lines),
               "config": None if self.config is None else {
                   "max_num_batched_tokens": self.config.max_num_batched_tokens,
                   "max_num_seqs": self.config.max_num_seqs, "max_model_len": self.config.max_model_len,
                   "block_size": self.config.block_size, "model_runner": self.config.model_runner,
                   "num_speculative_tokens": self.config.num_speculative_tokens, "sampling": self.config.sampling},
               "traffic": [c.spelled() for c in self.traffic],
               "classes": [c.to_dict() for c in self.classes],
               "boundary": self.boundary.to_dict() if self.boundary else None,
               "what_if": [r.to_dict() for r in self.what_if],
               "assumptions": list(self.assumptions)}
        return out


def class_sentence(limit: ClassLimit, utilization: float) -> str:
    """The operator's sentence for one class, e.g. "prompts over 11,800 tokens with prompt_logprobs will OOM
    at 0.95"."""
    u = f"{utilization:g}"
    if limit.refused is not None:
        return f"{limit.name}: {limit.refused}"
    if limit.limit is None:
        return f"{limit.name}: every such request OOMs at {u} (even the smallest step does not fit)"
    if limit.unlimited:
        return {BASELINE: f"full_step: a full step of {limit.largest:,} sequences fits at {u}","prompt_logprobs": f"prompt_logprobs: no prompt OOMs at {u} (each step computes at most "
                                   f"{limit.largest:,} prompt positions)",
                "logprobs": f"logprobs: a full batch of {limit.largest:,} sequences fits at {u}",
                "spec_decode": f"spec_decode: a full batch of {limit.largest:,} verifying sequences fits at {u}",
                "long_context": f"long_context: every context up to {limit.largest:,} tokens fits at {u}"}[limit.name]
    return {BASELINE: f"full steps of more than {limit.limit:,} sampling sequences will OOM at {u}: ordinary "
                      f"traffic, before any class",
            "prompt_logprobs": f"prompts over {limit.limit:,} tokens with prompt_logprobs will OOM at {u}",
            "logprobs": f"more than {limit.limit:,} sequences with logprobs in one step will OOM at {u}",
            "spec_decode": f"more than {limit.limit:,} sequences verifying drafts in one step will OOM at {u}",
            "long_context": f"contexts over {limit.limit:,} tokens will OOM at {u} in a full step (the last prefill "
                            f"chunk, or a decode, beside the other seats)"}[limit.name]
