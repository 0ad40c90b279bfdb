"""The step governor (``producers.vllm.governor``) inside a live vLLM 0.33 engine, with its calibration.

On by default (``KVGUARD_GOVERNOR=0`` turns it off; the old ``KVGUARD_LOGPROBS_GUARD=0`` too). It runs
on the engine thread around ``Scheduler.schedule()`` (``producers.vllm.actions.VllmActions``) and
``update_from_output`` (``producers.vllm.hooks``):

- **before** ``schedule()``: the queues (``Scheduler.running`` / ``waiting``: ``Request.num_tokens``,
  ``num_computed_tokens``, ``num_prompt_tokens``, ``sampling_params.prompt_logprobs``,
  ``spec_token_ids``) become a ``Candidates`` record; the headroom is ``torch.cuda.mem_get_info()`` free
  bytes + ``memory_reserved() - memory_allocated()`` - ``inactive_split_bytes`` (cached bytes the
  allocator can release for one large tensor); the decision lowers ``Scheduler.max_num_scheduled_tokens``
  for this call and, when even one token does not fit, holds the waiting queue for this call (the
  admission hold's mechanism). Before a step whose step-class tensors count on cached blocks the cache
  is released (``torch.cuda.empty_cache()``).
- **after** ``schedule()``: the scheduled batch's shape and its plan's prediction are kept, and
  ``torch.cuda.reset_peak_memory_stats()`` opens the measurement (vLLM's ``UniProcExecutor`` runs the
  model in this process between ``schedule()`` and ``update_from_output``).
- **after** ``update_from_output``: ``max_memory_allocated() - memory_allocated()`` at the step start is
  the step's measured peak; ``Calibration.observe`` folds the ratio to the prediction into its class's
  correction (a quantile of the ratio), which the governor's later predictions use; a step above its
  prediction is logged with its shape; the relative error goes to the plugin's histogram
  (``error_histogram``).

The plan is ``step_memory``'s (the V1 runner's tensors, from the served model's ``hf_config``); on Model
Runner V2 or with kernels the plan does not model, the calibration is what makes it right: it is why
the correction exists, and why its floor may go below 1 (``KVGUARD_GOVERNOR_FLOOR``). Inert without
CUDA in the process, unless a torch stand-in is given (the tests on vLLM's CPU scheduler).
"""

from __future__ import annotations

import bisect
import itertools
import logging
from typing import Any

from kvguard.producers.vllm.governor import (
    F_GOV_NO_FIT,
    Calibration,
    Candidates,
    Decision,
    StepGovernor,
    StepShape,
)
from kvguard.producers.vllm.step_memory import Batch, ModelShape, RunnerConfig, step_plan, step_plan_for

log = logging.getLogger("kvguard.vllm.governor")

LENGTH_QUANTUM = 256
RESCAN_STEPS = 16  # running requests are read in full every this many steps (bounds in between)
ERROR_BUCKETS = (-0.5, -0.25, -0.1, -0.05, 0.0, 0.05, 0.1, 0.25, 0.5, 1.0)  # (measured - predicted) / predicted


def _up(n: int) -> int:
    return -(-n // LENGTH_QUANTUM) * LENGTH_QUANTUM


def model_shape(scheduler: Any) -> ModelShape | None:
    """The served model's shape from vLLM's config (None when the config does not say)."""
    try:
        model = scheduler.vllm_config.model_config
        hf = model.hf_config
        config = hf.to_dict() if hasattr(hf, "to_dict") else dict(hf)
        text = config.get("text_config") or config
        tp = int(getattr(scheduler.vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
        shape = ModelShape.from_hf_config(text, tensor_parallel_size=tp, dtype="float32"
                                          if int(model.dtype.itemsize) == 4 else "bfloat16")
        return shape
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def runner_config(scheduler: Any) -> RunnerConfig:
    sc = scheduler.scheduler_config
    mode = "FULL_AND_PIECEWISE"
    try:
        cg = scheduler.vllm_config.compilation_config.cudagraph_mode
        name = getattr(cg, "name", str(cg))
        mode = name if name in ("FULL_AND_PIECEWISE", "PIECEWISE", "FULL", "NONE") else mode
        if getattr(scheduler.vllm_config.model_config, "enforce_eager", False):
            mode = "NONE"
    except AttributeError:
        pass
    return RunnerConfig(max_num_batched_tokens=int(sc.max_num_batched_tokens), max_num_seqs=int(sc.max_num_seqs),
                        cudagraph_mode=mode)


def plan_peak_function(shape: ModelShape, runner: RunnerConfig, sampling: str = "top_p"):
    """``peak_fn`` over ``step_memory``'s plans (prompt logprobs as one request's chunk)."""
    def peak(s: StepShape) -> int:
        n, r = s.num_tokens, s.num_seqs
        if not s.prompt_logprob_tokens:
            return step_plan(shape, runner, n, r, n == r, 1, sampling).peak_bytes
        q = max(s.prompt_logprob_tokens, s.max_query_len or 1)
        n = max(n, q + r - 1)
        others = [1] * (r - 1)
        if others:
            others[0] += n - q - (r - 1)
        else:
            q = n
        ctx = max(s.max_seq_len, q)
        batch = Batch((q, *others), (ctx, *others), sampling=sampling, prompt_lens=(ctx, *(1 for _ in others)),
                      prompt_logprobs_tokens=(s.prompt_logprob_tokens, *(0 for _ in others)))
        return step_plan_for(shape, batch, runner).peak_bytes
    return peak


def _cuda(torch: Any) -> bool:
    return torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized()


class PluginGovernor:
    """The governor of one vLLM engine (module docstring)."""

    def __init__(self, scheduler: Any, torch: Any, *, shape: ModelShape | None = None, margin_bytes: int = 256 << 20,
                 calibration: Calibration | None = None, emit=None) -> None:
        self.scheduler = scheduler
        self.torch = torch
        self.shape = shape if shape is not None else model_shape(scheduler)
        self.runner = runner_config(scheduler)
        self.calibration = calibration if calibration is not None else Calibration(floor=0.25)
        self.governor = StepGovernor(plan_peak_function(self.shape, self.runner), margin_bytes=margin_bytes,
                                     calibration=self.calibration) if self.shape is not None else None
        self.emit = emit  # (Decision) -> None: the GOVERN row
        self.k = int(getattr(getattr(scheduler.vllm_config, "speculative_config", None) or object(),
                             "num_speculative_tokens", 0) or 0)
        self.max_num_seqs = self.runner.max_num_seqs
        self.last: Decision | None = None
        self._step: tuple[StepShape, int, int] | None = None  # (shape, raw prediction, allocated at start)
        self.error_counts = [0] * (len(ERROR_BUCKETS) + 1)  # cumulative per bucket upper bound, +Inf last
        self.error_sum = 0.0
        self.error_count = 0
        self._calls = 0
        self._run_scan: list[int] | None = None
        self._seq_bound = 0
        self.lp_ids: list[str] = []

    @property
    def active(self) -> bool:
        return self.governor is not None and _cuda(self.torch)

    # ---------------------------------------------------------------- headroom
    def headroom(self) -> int:
        cuda = self.torch.cuda
        free, _total = cuda.mem_get_info()
        stats = cuda.memory_stats()
        return int(free) + int(stats.get("reserved_bytes.all.current", 0)) - \
            int(stats.get("allocated_bytes.all.current", 0)) - int(stats.get("inactive_split_bytes.all.current", 0))

    # ---------------------------------------------------------------- before schedule()
    def candidates(self, sched: Any, *, with_waiting: bool = True) -> Candidates:
        """The queues as bounds. Running requests are scanned every ``RESCAN_STEPS`` calls; in between
        their longest context grows by ``1 + k`` a step (a bound), their prompt-logprob positions only
        fall; only the waiting requests that could be admitted this step (``max_num_seqs - running``)
        are read: a step costs O(admissible), not O(running)."""
        k = self.k
        running = sched.running
        self._calls += 1
        if self._calls >= RESCAN_STEPS or self._run_scan is None:
            self._calls = 0
            query = seq_len = lp = lp2 = 0
            lp_ids = []
            for r in running:
                n = r.num_tokens
                left = n + len(r.spec_token_ids or ()) - r.num_computed_tokens
                if left > query:
                    query = left
                if n > seq_len:
                    seq_len = n
                positions = _logprob_positions(r)
                if positions:
                    lp_ids.append(r.request_id)
                    lp, lp2 = (positions, lp) if positions > lp else (lp, max(lp2, positions))
            self._run_scan = [query, seq_len, lp + lp2]  # two requests' rows can be live at once
            self.lp_ids = lp_ids
        else:
            self._run_scan[1] += 1 + k
        query, seq_len, lp = self._run_scan
        n_wait = 0
        if with_waiting and len(sched.waiting):
            room = max(0, self.max_num_seqs - len(running))
            for r in itertools.islice(sched.waiting, room):
                n_wait += 1
                left = r.num_tokens - r.num_computed_tokens
                if left > query:
                    query = left
                if r.num_tokens > seq_len:
                    seq_len = r.num_tokens
                positions = _logprob_positions(r)
                if positions:
                    lp += positions  # conservative: each admissible one may add its rows
                    self.lp_ids.append(r.request_id)
        decode_only = not n_wait and query <= 1 + k
        seqs = max(1, min(self.max_num_seqs, len(running) + n_wait))
        self._seq_bound = seq_len
        return Candidates(seqs, decode_only, _up(lp) if lp else 0, 1 + k if decode_only else _up(max(1, query)),
                          _up(seq_len + k), k, len(running))

    def before_schedule(self, sched: Any) -> tuple[int | None, bool]:
        """(the budget to set or None, whether to hold the waiting queue for this call); an admission cap
        is in ``self.last.max_seqs`` (the caller sets ``Scheduler.max_num_active_reqs`` for the call)."""
        if not self.active:
            return None, False
        budget = sched.max_num_scheduled_tokens
        room = self.headroom()
        c = self.candidates(sched)
        d = self.governor.govern(c, budget, room)
        free = int(self.torch.cuda.mem_get_info()[0])
        if self.governor.needs_release(c, budget if d is None else d.budget, free):
            self.governor.release_steps += 1
            self.torch.cuda.empty_cache()
        self.last = d
        if d is None:
            return None, False
        deferred = self.governor.defer_waiting(d, self.candidates(sched, with_waiting=False), budget, room) \
            if d.flags & F_GOV_NO_FIT and len(sched.waiting) and sched.running else None
        defer = deferred is not None
        if deferred is not None:
            d = self.last = deferred
        if self.emit is not None:
            self.emit(d)
        return d.budget, defer

    # ---------------------------------------------------------------- around the step
    def step_started(self, out: Any) -> None:
        """After ``schedule()``: the batch's prediction; the peak statistics reset."""
        if not self.active or not out.total_num_scheduled_tokens:
            self._step = None
            return
        shape = self.batch_shape(out)
        raw = self.governor.raw_peak(shape)
        cuda = self.torch.cuda
        cuda.reset_peak_memory_stats()
        self._step = (shape, raw, int(cuda.memory_allocated()))

    def step_finished(self) -> None:
        """After ``update_from_output``: the measured peak into the calibration."""
        if self._step is None or not self.active:
            return
        shape, raw, start = self._step
        measured = int(self.torch.cuda.max_memory_allocated()) - start
        self._step = None
        corrected = self.calibration.correct(shape, raw)
        self.calibration.observe(shape, raw, measured)
        if corrected > 0:
            err = (measured - corrected) / corrected
            self.error_counts[bisect.bisect_left(ERROR_BUCKETS, err)] += 1
            self.error_sum += err
            self.error_count += 1
            if measured > corrected:
                log.warning("kvguard governor: step peak %d B above the prediction %d B (plan %d B) for "
                            "%d tokens, %d sequences, %d prompt-logprob positions, %d logits rows",
                            measured, corrected, raw, shape.num_tokens, shape.num_seqs, shape.prompt_logprob_tokens,
                            shape.num_logits)

    def batch_shape(self, out: Any) -> StepShape:
        """The scheduled batch as the plan sees it (``SchedulerOutput``); the context is the candidates'
        bound, prompt-logprob positions are read from the requests known to ask for them."""
        tokens = out.num_scheduled_tokens
        n = int(out.total_num_scheduled_tokens)
        r = len(tokens)
        query = max(tokens.values())
        lp = 0
        if self.lp_ids:
            get = self.scheduler.requests.get
            for rid in self.lp_ids:
                t = tokens.get(rid)
                req = get(rid)
                if t and req is not None and req.num_computed_tokens < req.num_prompt_tokens:
                    lp = max(lp, min(t, req.num_prompt_tokens - req.num_computed_tokens))
        spec = getattr(out, "scheduled_spec_decode_tokens", None)
        drafts = sum(len(v) for v in spec.values()) if spec else 0
        return StepShape(n, r, lp, query, max(self._seq_bound, query), r + drafts if drafts else 0)

    def batch_shape_for_budget(self, budget: int) -> StepShape:
        """A plain prefill step of ``budget`` tokens, one sequence (tests, benchmarks)."""
        return StepShape(budget, 1, 0, budget, budget, 0)

    def error_histogram(self) -> dict:
        """Prometheus-style cumulative buckets of (measured - predicted) / predicted."""
        cumulative, total = {}, 0
        for bound, count in zip([*ERROR_BUCKETS, float("inf")], self.error_counts):
            total += count
            cumulative[str(bound) if bound != float("inf") else "+Inf"] = total
        return {"buckets": cumulative, "sum": round(self.error_sum, 6), "count": self.error_count}

    def summary(self) -> dict:
        out = self.governor.summary() if self.governor is not None else {}
        out["prediction_error"] = self.error_histogram()
        return out


def _wants_prompt_logprobs(request: Any) -> bool:
    params = getattr(request, "sampling_params", None)
    return params is not None and getattr(params, "prompt_logprobs", None) is not None


def _logprob_positions(request: Any) -> int:
    if not _wants_prompt_logprobs(request):
        return 0
    return max(0, request.num_prompt_tokens - request.num_computed_tokens)
