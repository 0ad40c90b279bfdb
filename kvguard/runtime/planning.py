"""``kvguard plan``'s composition: servers for ``ops.plan`` from the shadow engine's start-up, or from a real
server's logged budget, and the plan they give.

- **model**: a setting (``gpu_memory_utilization``, ``max_num_batched_tokens``) is the profile those flags
  describe (``EngineArgs`` for your model, or a bundled profile with ``EngineKnobs``), measured as the
  shadow engine measures it; its steps run on the worker the engine would start (``sim.vllm.step_probe``),
  so a limit here is where the engine's own first step would OOM.
- **log** (``--from-log``): the budget the log states (``ops.startup_log``) on a worker built to reproduce
  it (``step_probe.worker_from_budget``); the steps are the model config's. Another utilization moves the
  KV cache by the change of the requested share (vLLM's non-KV figures do not depend on it); another token
  budget moves it by the change the model's own start-up shows between the two settings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from kvguard.ops import plan as ops_plan
from kvguard.ops.plan import Plan, ServerConfig, Startup
from kvguard.ops.startup_log import LogBudget, parse_startup_log
from kvguard.ops.traffic import CLASSES, TrafficClass
from kvguard.producers.sim.engine_args import BaselineEstimates, EngineArgs
from kvguard.producers.sim.model_config import ModelConfigError, UnsupportedArchitecture
from kvguard.producers.sim.profile import EngineKnobs, Profile, ProfileError
from kvguard.producers.sim.profiles import profile_from_dict, profile_object
from kvguard.producers.sim.vllm.memory import StartupRefused
from kvguard.producers.sim.vllm.profile import vllm_spec_of
from kvguard.producers.sim.vllm.scheduler import VLLM_VERSION_FOLLOWED
from kvguard.producers.sim.vllm.step_probe import ServerBudget, StepProbe, worker_for, worker_from_budget
from kvguard.producers.vllm.step_memory import Batch

GiB = 1 << 30
# StartupRefused fields (sim.vllm.memory): the worker would not start with these numbers
_MEMORY_FIELDS = ("gpu_memory_utilization", "max_model_len", "weights_bytes", "total_bytes", "kv_cache_memory_bytes")
# vLLM's refusals for too small a KV cache (kv_cache_planning.py): the low side of the utilization range
_KV_REFUSALS = ("No available memory for the cache blocks", "To serve at least one request",
                "Cannot auto-fit max_model_len")


class PlanError(ValueError):
    """Inputs ``kvguard plan`` cannot plan from; the message says which and why."""


@dataclass(frozen=True)
class ModelSettings:
    """The flags of the server to plan: your model (``engine_args``) or a bundled profile with knobs."""

    engine_args: EngineArgs | None = None
    profile_name: str | None = None
    knobs: EngineKnobs = field(default_factory=EngineKnobs)
    total_bytes: int | None = None  # the GPU as a log states it (overrides the flags' GPU)
    max_model_len: int | None = None  # as a log states it, when the flags leave it unset

    def profile_dict(self, utilization: float | None = None, batched_tokens: int | None = None) -> tuple[str, dict]:
        if self.engine_args is not None:
            args = self.engine_args
            if self.total_bytes is not None:
                args = replace(args, gpu=None, gpu_memory_gib=self.total_bytes / GiB)
            if self.max_model_len is not None and args.max_model_len is None:
                args = replace(args, max_model_len=self.max_model_len)
            if utilization is not None:
                args = replace(args, gpu_memory_utilization=utilization)
            if batched_tokens is not None:
                args = replace(args, max_num_batched_tokens=batched_tokens)
            d = args.profile_dict()
            if self.total_bytes is not None:
                d["total_bytes"] = self.total_bytes
            return args.name, d
        knobs = self.knobs
        if self.max_model_len is not None and knobs.max_model_len is None:
            knobs = replace(knobs, max_model_len=self.max_model_len)
        if utilization is not None:
            knobs = replace(knobs, gpu_memory_utilization=utilization)
        if batched_tokens is not None:
            knobs = replace(knobs, max_num_batched_tokens=batched_tokens)
        d = dict(profile_object(self.profile_name, knobs=knobs))
        if self.total_bytes is not None:
            d["total_bytes"] = self.total_bytes
        name = self.profile_name or "default"
        return (f"{name}@{knobs.label()}" if not knobs.is_default() else name), d

    def profile(self, utilization: float | None = None, batched_tokens: int | None = None) -> Profile:
        name, d = self.profile_dict(utilization, batched_tokens)
        return profile_from_dict(name, d)


@dataclass
class ShadowServer:
    """An ``ops.plan.Server`` over a worker fresh from start-up."""

    startup: Startup
    config: ServerConfig
    probe: StepProbe

    def fits(self, batch: Batch) -> bool:
        return self.probe.fits(batch)

    def slack_bytes(self, batch: Batch) -> int | None:
        return self.probe.slack_bytes(batch)

    def peak_bytes(self, batch: Batch) -> int:
        return self.probe.peak_bytes(batch)


def _is_refusal(e: ProfileError) -> bool:
    return bool(e.vllm_message) or e.field in _MEMORY_FIELDS


def _refused(u: float, m: int | None, message: str) -> Startup:
    return Startup(gpu_memory_utilization=u, max_num_batched_tokens=m or 0, refused=message,
                   refused_for_kv=message.startswith(_KV_REFUSALS))


def _config(profile: Profile) -> ServerConfig:
    spec = profile.vllm
    return ServerConfig(max_num_batched_tokens=profile.max_batched_tokens, max_num_seqs=profile.max_num_seqs,
                        max_model_len=profile.max_model_len, block_size=spec.block_size, sampling=spec.sampling,
                        model_runner=spec.model_runner, num_speculative_tokens=spec.num_speculative_tokens)


def _ledger_startup(ledger, config: ServerConfig, headroom: int, **overrides) -> Startup:
    values = dict(gpu_memory_utilization=ledger.gpu_memory_utilization,
                  max_num_batched_tokens=config.max_num_batched_tokens, total_bytes=ledger.total_bytes,
                  init_free_bytes=ledger.init_free_bytes, requested_bytes=ledger.requested_bytes,
                  consumed_bytes=ledger.total_consumed_bytes, peak_activation_bytes=ledger.peak_activation_bytes,
                  cudagraph_bytes=ledger.cudagraph_bytes, kv_cache_bytes=ledger.kv_cache_bytes,
                  num_gpu_blocks=ledger.num_gpu_blocks, kv_cache_tokens=ledger.kv_token_capacity,
                  max_concurrency=ledger.max_concurrency, max_model_len=ledger.max_model_len,
                  headroom_bytes=headroom, log_lines=tuple(ledger.log_lines()))
    return Startup(**(values | overrides))


def model_start(settings: ModelSettings):
    """``ops.plan.Start`` over the shadow engine's start-up (module docstring)."""
    default_u = settings.profile_dict()[1]["gpu_memory_utilization"]
    memo: dict = {}

    def start(u: float | None, m: int | None):
        if (u, m) in memo:
            return memo[u, m]
        try:
            profile = settings.profile(u, m)
        except ProfileError as e:
            if not _is_refusal(e):
                raise
            memo[u, m] = _refused(u if u is not None else default_u, m, e.vllm_message or e.expected)
            return memo[u, m]
        config = _config(profile)
        probe = StepProbe(worker_for(profile))
        memo[u, m] = ShadowServer(_ledger_startup(profile.memory, config, probe.headroom_bytes), config, probe)
        return memo[u, m]

    return start


def _requested(total: int, u: float, log_format: str) -> float:
    """vLLM's requested share: ``ceil(total * u)`` since the V2-era worker, ``total * u`` before."""
    return math.ceil(total * u) if log_format == "vllm-0.33" else total * u


def log_start(settings: ModelSettings, log: LogBudget, model_runner: str, baseline: BaselineEstimates,
              enforce_eager: bool = False):
    """``ops.plan.Start`` over a logged budget (module docstring)."""
    if log.total_bytes is None or log.requested_bytes is None or log.consumed_bytes is None:
        raise PlanError("the log's budget line lacks the GPU's total, the requested share or the consumed memory")
    name, base = settings.profile_dict()
    section = dict(base["vllm"], model_runner=model_runner)
    spec = vllm_spec_of(name, dict(base, vllm=section))
    kv = log.kv_cache_bytes
    if kv is None:  # the line's own closure: consumed + peak + KV = requested
        kv = log.requested_bytes - log.consumed_bytes - (log.peak_activation_bytes or 0)
    graphs = log.cudagraph_bytes
    if graphs is None:
        graphs = 0 if enforce_eager else int(baseline.cudagraph_gib * GiB)
    tp = spec.shape.tensor_parallel_size
    log_m, seqs, max_model_len = base["max_batched_tokens"], base["max_num_seqs"], base["max_model_len"]
    config = ServerConfig(max_num_batched_tokens=log_m, max_num_seqs=seqs, max_model_len=max_model_len,
                          block_size=spec.block_size, sampling=spec.sampling, model_runner=spec.model_runner,
                          num_speculative_tokens=spec.num_speculative_tokens)
    u_log = log.gpu_memory_utilization
    memo: dict = {}

    def logged(ledger, headroom: int | None) -> Startup:
        """The start-up at the log's own setting: the log's figures where it prints them."""
        pick = lambda printed, computed: printed if printed is not None else computed  # noqa: E731
        return Startup(
            gpu_memory_utilization=u_log, max_num_batched_tokens=log_m, total_bytes=log.total_bytes,
            init_free_bytes=log.init_free_bytes, requested_bytes=log.requested_bytes,
            consumed_bytes=log.consumed_bytes, peak_activation_bytes=log.peak_activation_bytes or 0,
            cudagraph_bytes=graphs, kv_cache_bytes=kv,
            num_gpu_blocks=pick(log.num_gpu_blocks, ledger.num_gpu_blocks if ledger else 0),
            kv_cache_tokens=pick(log.kv_cache_tokens, ledger.kv_token_capacity if ledger else 0),
            max_concurrency=pick(log.max_concurrency, ledger.max_concurrency if ledger else 0.0),
            max_model_len=max_model_len, headroom_bytes=headroom or 0, log_lines=log.lines)
    reference: dict[int, object] = {}

    def model_ledger(m: int):
        if m not in reference:
            reference[m] = settings.profile(u_log, m).memory
        return reference[m]

    def start(u: float | None, m: int | None):
        u = u if u is not None else u_log
        m = m if m is not None else log_m
        if (u, m) in memo:
            return memo[u, m]
        d_consumed = d_nonkv = d_peak = 0
        if m != log_m:
            try:
                here, there = model_ledger(log_m), model_ledger(m)
            except ProfileError as e:
                memo[u, m] = _refused(u, m, f"the model does not start at max_num_batched_tokens={m}, so the log's "
                                            f"budget cannot be moved there ({e.vllm_message or e.expected})")
                return memo[u, m]
            d_consumed = there.total_consumed_bytes - here.total_consumed_bytes
            d_peak = there.peak_activation_bytes - here.peak_activation_bytes
            d_nonkv = (there.requested_bytes - there.kv_cache_bytes) - (here.requested_bytes - here.kv_cache_bytes)
        shift = round(_requested(log.total_bytes, u, log.format) - _requested(log.total_bytes, u_log, log.format))
        budget = ServerBudget(total_bytes=log.total_bytes, gpu_memory_utilization=u,
                              consumed_bytes=log.consumed_bytes + d_consumed,
                              non_torch_bytes=log.non_torch_bytes or 0, kv_cache_bytes=kv + shift - d_nonkv,
                              cudagraph_bytes=graphs, init_free_bytes=log.init_free_bytes,
                              context_bytes=baseline.context_bytes(tp),
                              buffers_in_consumed=log.format == "vllm-0.33")
        cfg = replace(config, max_num_batched_tokens=m)
        own = (u, m) == (u_log, log_m)
        try:
            worker = worker_from_budget(spec, budget, max_num_batched_tokens=m, max_num_seqs=seqs,
                                        max_model_len=max_model_len)
        except StartupRefused as e:
            message = e.vllm_message or e.expected
            if not own:
                memo[u, m] = _refused(u, m, message)
            elif log.refused:  # the server itself refused: its own words
                memo[u, m] = replace(logged(None, None), refused=log.refused,
                                     refused_for_kv=log.refused.startswith(_KV_REFUSALS))
            else:
                memo[u, m] = replace(logged(None, None), refused=(
                    f"{message} (kvguard's rebuild of the log's budget does not start; the log itself shows no "
                    f"refusal, so the assumptions below may not hold for this server)"),
                    refused_for_kv=message.startswith(_KV_REFUSALS))
            return memo[u, m]
        except ValueError as e:
            raise PlanError(str(e)) from None
        probe = StepProbe(worker)
        ledger = worker.ledger
        if own:  # the log's own figures, as it prints them
            startup = logged(ledger, probe.headroom_bytes)
        else:
            startup = _ledger_startup(
                ledger, cfg, probe.headroom_bytes, gpu_memory_utilization=u,
                requested_bytes=round(_requested(log.total_bytes, u, log.format)),
                init_free_bytes=log.init_free_bytes, consumed_bytes=budget.consumed_bytes,
                peak_activation_bytes=(log.peak_activation_bytes or 0) + d_peak, cudagraph_bytes=graphs,
                log_lines=())
        memo[u, m] = ShadowServer(startup, cfg, probe)
        return memo[u, m]

    return start


def _default_classes(traffic: tuple[TrafficClass, ...]) -> tuple[TrafficClass, ...]:
    """The server's busiest ordinary step, the declared classes, then every other class (reported, not
    required)."""
    named = {c.name for c in traffic}
    return (TrafficClass(ops_plan.BASELINE),) + traffic + tuple(TrafficClass(n) for n in CLASSES if n not in named)


def build_plan(start, *, source: str, traffic: tuple[TrafficClass, ...], what_if: tuple[float, ...] | None,
               search: bool = True, assumptions: tuple[str, ...] = ()) -> Plan:
    """The report: the configured start-up, every class on it, the boundaries, the what-if table. A refused
    start still gets the utilization range vLLM starts in and the what-if table."""
    configured = start(None, None)
    started = not isinstance(configured, Startup)
    startup = configured.startup if started else configured
    config = configured.config if started else None
    everything = _default_classes(traffic)
    classes = ()
    if started:
        declared = {c.name for c in traffic} | {ops_plan.BASELINE}
        classes = tuple(ops_plan.class_limit(configured, c, declared=c.name in declared) for c in everything)
    boundary = None
    if search:
        lowest, highest, fitting = ops_plan.utilization_boundary(start, traffic)
        at = start(fitting, None) if fitting is not None else None
        batched = grid = batched_startup = None
        if started:  # the largest token budget at the configured utilization (the baseline bounds it too)
            grid = (config.max_num_seqs, max(config.max_num_batched_tokens, config.max_model_len))
            batched = ops_plan.batched_tokens_boundary(start, traffic, *grid)
            if batched is not None:
                found = start(None, batched)
                batched_startup = None if isinstance(found, Startup) else found.startup
        boundary = ops_plan.Boundary(lowest, highest, fitting,
                                     None if at is None or isinstance(at, Startup) else at.startup,
                                     batched, batched_startup, grid)
    rows = ()
    if what_if is not None:
        points = set(what_if) | {startup.gpu_memory_utilization}
        if boundary is not None and boundary.largest_fitting is not None:
            points.add(boundary.largest_fitting)
        rows = tuple(ops_plan.what_if(start, everything, tuple(sorted(points))))
    return Plan(source, startup, config, classes, traffic, boundary, rows, assumptions)


def model_assumptions(settings: ModelSettings, profile: Profile | None) -> tuple[str, ...]:
    runner = profile.vllm.model_runner if profile is not None else "v2"
    out = [f"vLLM followed: {VLLM_VERSION_FOLLOWED}; start-up accounting of "
           + ("vLLM 0.33's Worker with Model Runner V2 (gpu_worker.py determine_available_memory, utils/mem_utils.py)"
              if runner == "v2" else
              "the V1 GPUModelRunner and vLLM 0.11's worker as the shadow engine models them (VLLM_USE_V2_MODEL_RUNNER=0"
              "; checked against llm-d's vLLM 0.11 measurements)"),
           "budget: the shadow engine's start-up, measured through the caching-allocator twin (PyTorch "
           "c10/cuda/CUDACachingAllocator.cpp); class limits: the step run on a copy of that worker, as the shadow "
           "engine runs it (docs/PLAN.md)"]
    if settings.engine_args is not None:
        b = settings.engine_args.baseline
        out.append(f"not in any config, kvguard's cited defaults: CUDA context + NCCL {b.context_bytes(1) / GiB:.2f} "
                   f"GiB at TP 1 ({b.context_bytes(2) / GiB:.2f} above), non-torch growth {b.non_torch_bytes(1) / GiB:.2f}"
                   f" ({b.non_torch_bytes(2) / GiB:.2f}), CUDA-graph pool {b.cudagraph_gib:.2f} GiB (llm-d/llm-d-benchmark "
                   "config_explorer/empirical-vllm-memory-results.md, vLLM 0.11 on H100)")
    else:
        out.append(f"bundled profile {settings.profile_name or 'default'} (producers/sim/profiles.json, its sources "
                   "there)")
    out += _class_assumptions(runner)
    return tuple(out)


def log_assumptions(log: LogBudget, runner: str, graphs_assumed: bool) -> tuple[str, ...]:
    out = [f"budget: the log's own lines ({log.format} format, {len(log.lines)} lines read; when a figure appears "
           "more than once the last is taken), on a caching-allocator twin built to reproduce it; the steps: the "
           "model config's",
           f"runner: {'Model Runner V2' if runner == 'v2' else 'the V1 GPUModelRunner'}"
           + (" (the log's format predates Model Runner V2)" if log.format != "vllm-0.33" else ""),
           "other utilizations move the logged KV cache by the change of the requested share; another "
           "max_num_batched_tokens by the change the model's own start-up shows"]
    if log.init_free_bytes is None:
        out.append("the log does not print the free memory at start-up: the CUDA context and NCCL baseline is "
                   "kvguard's default estimate (llm-d: 0.61 GiB at TP 1, 1.54 above)")
    if graphs_assumed:
        out.append("the log does not print the CUDA-graph pool: 0.39 GiB assumed (llm-d), 0 with --enforce-eager")
    out += _class_assumptions(runner)
    return tuple(out)


def _class_assumptions(runner: str) -> list[str]:
    out = ["class steps: full_step = the whole token budget over that many sampling sequences (ordinary traffic, "
           "always required); prompt_logprobs = one prompt prefilled alone (chunked at max_num_batched_tokens); "
           "logprobs / spec_decode = a decode step of that many sequences; long_context = a request at that context "
           "in its busiest steps (its last prefill chunk as large as the budget allows beside decodes of the other "
           "seats, and its decode among max_num_seqs); each limit is for one such step on a server fresh from "
           "start-up: several such requests in one step, or the allocator's fragmentation after hours of "
           "traffic, can lower it",
           "margin: what the device still had at the step's worst moment (the allocator's rounding and "
           "fragmentation included); tensors: the step's own peak"]
    if runner == "v2":
        out.append("Model Runner V2 computes prompt logprobs in 1,024-position chunks (sample/prompt_logprob.py) and "
                   "sample logprobs without a [rows, vocab] copy: those classes rarely OOM; --model-runner v1 "
                   "(VLLM_USE_V2_MODEL_RUNNER=0) shows the V1 runner's limits")
    return out


def plan_server(*, engine_args: EngineArgs | None = None, profile_name: str | None = None,
                knobs: EngineKnobs | None = None, flags: dict | None = None, traffic: tuple[TrafficClass, ...] = (),
                log_text: str | None = None, what_if: tuple[float, ...] | None = None, search: bool = True) -> dict:
    """``kvguard plan``'s core, callable from Python: the report as a dict (``Plan.to_dict`` plus a title).
    ``flags``: the engine flags as given (None: not given), to tell a flag the operator set from a default."""
    flags = flags or {}
    settings = ModelSettings(engine_args=engine_args, profile_name=profile_name, knobs=knobs or EngineKnobs())
    if log_text is None:
        start = model_start(settings)
        configured = start(None, None)
        profile = None if isinstance(configured, Startup) else settings.profile()
        report = build_plan(start, source="model", traffic=traffic, what_if=what_if, search=search,
                            assumptions=model_assumptions(settings, profile))
        out = report.to_dict()
        out["log_format"] = None
    else:
        log = load_log_budget(log_text)
        out = _plan_from_log(settings, log, flags, traffic, what_if, search)
        settings = replace(settings, total_bytes=log.total_bytes)
    out["title"] = _title(settings)
    return out


def _plan_from_log(settings: ModelSettings, log: LogBudget, flags: dict, traffic, what_if, search) -> dict:
    given_runner = flags.get("model_runner")
    if log.format != "vllm-0.33" and given_runner == "v2":
        raise PlanError(f"a {log.format} log comes from before Model Runner V2: drop --model-runner v2")
    runner = (given_runner or "v2") if log.format == "vllm-0.33" else "v1"
    if flags.get("kv_cache_memory_bytes"):
        raise PlanError("--kv-cache-memory-bytes with --from-log: the log says the server's KV cache")
    given_u = flags.get("gpu_memory_utilization")
    if given_u is not None and abs(given_u - (log.gpu_memory_utilization or 0.0)) > 1e-9:
        raise PlanError(f"the log's server ran at gpu_memory_utilization {log.gpu_memory_utilization}; "
                        f"--what-if {given_u} shows it at {given_u}")
    if settings.engine_args is not None and (settings.engine_args.gpu or settings.engine_args.gpu_memory_gib):
        flagged = settings.engine_args.resolve_gpu().total_bytes
        if abs(flagged - log.total_bytes) > 0.011 * GiB:
            raise PlanError(f"--gpu says {flagged / GiB:.2f} GiB but the log's device has {log.total_bytes / GiB:.2f} "
                            f"GiB: drop --gpu/--gpu-memory-gib (the log says the device)")
    log_len = log.max_model_len if flags.get("max_model_len") is None else None
    settings = replace(settings, total_bytes=log.total_bytes, max_model_len=log_len)
    baseline = settings.engine_args.baseline if settings.engine_args is not None else BaselineEstimates()
    try:
        start = log_start(settings, log, runner, baseline, enforce_eager=bool(flags.get("enforce_eager")))
        report = build_plan(start, source="log", traffic=traffic, what_if=what_if, search=search,
                            assumptions=log_assumptions(log, runner, graphs_assumed=log.cudagraph_bytes is None))
    except ProfileError as e:
        raise PlanError(f"the model config does not describe this server ({e})") from None
    out = report.to_dict()
    out["log_format"] = log.format
    out["log_budget"] = log.to_dict()
    return out


def _title(settings: ModelSettings) -> str:
    try:
        _, d = settings.profile_dict()
    except (ProfileError, ModelConfigError, UnsupportedArchitecture):
        return settings.profile_name or "?"
    return str(d.get("description") or d.get("model") or settings.profile_name)


def load_log_budget(text: str) -> LogBudget:
    return parse_startup_log(text)


__all__ = ["ModelSettings", "PlanError", "build_plan", "load_log_budget", "log_assumptions", "log_start",
           "model_assumptions", "model_start", "plan_server"]
