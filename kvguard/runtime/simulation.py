"""The shadow fleet on its own (``kvguard simulate``): a workload through N simulated GPUs, no kvguard.

The fleet comes from the composition root (``bootstrap(...).fleet``, the same engines the demo and a
node process run) and steps through the fleet's one run loop (``Fleet.steps``); its event batches go
to an event log when one is asked for. Nothing here reads the clock but the wall-time figures of the
summary (``wall_seconds``, ``sim_speed_x``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from kvguard.config.settings import Settings
from kvguard.contracts.units import NS_PER_S
from kvguard.producers.admission import AdmissionConfig
from kvguard.producers.sim.bench_serve import ClosedLoopClient
from kvguard.producers.sim.profiles import EngineKnobs, ProfileError, prompt_cap_tokens
from kvguard.producers.sim.registry import engine_kind
from kvguard.producers.sim.run import DEFAULT_SLO
from kvguard.producers.sim.vllm.admission_gate import admission_totals
from kvguard.producers.sim.vllm.engine import RETRYABLE_REASONS
from kvguard.producers.sim.vllm.governed import governor_summary
from kvguard.producers.sim.workloads import load_workload, with_long_context, with_priority_mix
from kvguard.runtime.bootstrap import bootstrap
from kvguard.wire.eventlog import EventLogWriter

DRAIN_CAP_S = 1800  # at most 30 simulated minutes to finish what is in flight


class EventLogFailed(OSError):
    """The event log could not be written; the run itself finished (``summary`` holds its result)."""

    def __init__(self, path: Path, error: OSError, summary: dict):
        self.path, self.error, self.summary = path, error, summary
        super().__init__(f"could not write the event log {path}: {error.strerror or error}")


class _LogSink:
    """The run's event batches into an event log; a write error closes it and is kept, so the run
    finishes and the caller says what could not be written."""

    def __init__(self, path: Path | None, meta: dict) -> None:
        self.writer: EventLogWriter | None = None
        self.error: OSError | None = None
        if path is not None:
            try:
                self.writer = EventLogWriter(path, meta).__enter__()
            except OSError as err:
                self.error = err

    def write(self, batches: list) -> None:
        if self.writer is None:
            return
        try:
            for batch in batches:
                self.writer.write(batch)
        except OSError as err:  # the disk filled up or went away: finish the run, then say so
            self.error = err
            self._close(quiet=True)

    def close(self) -> None:
        self._close(quiet=False)

    def _close(self, *, quiet: bool) -> None:
        writer, self.writer = self.writer, None
        if writer is None:
            return
        try:
            writer.__exit__(None, None, None)
        except OSError as err:
            if not quiet:
                self.error = self.error or err


def run_simulation(workload: str, *, gpus: int = 1, duration_s: float | None = None, rate_scale: float = 1.0,
                   profile_name: str | None = None, seed: int = 0, events_out: Path | None = None,
                   drain: bool = True, flush_s: float = 10.0, progress: Callable[[float, float], None] | None = None,
                   knobs: EngineKnobs | None = None, prompt_logprobs_frac: float = 0.0, logprobs_guard: bool = False,
                   settings: Settings | None = None, engine_args: Any = None, bench: Any = None,
                   max_concurrency: int | None = None, neighbour: Any = None, leak: Any = None,
                   long_context_frac: float = 0.0, long_context_len: int = 0, priority_mix: Any = None,
                   slo: Any = None, admission: bool = False, router: str = "least_loaded") -> dict:
    """The command's core, callable from Python: returns the JSON summary as a dict. ``knobs``: an
    ``EngineKnobs`` over the (vLLM) profile; ``prompt_logprobs_frac``: the share of requests asking
    for prompt logprobs (``echo`` + ``logprobs``, as lm-eval-harness's loglikelihood tasks do);
    ``logprobs_guard``: kvguard's node-side logprob guard on (vLLM profiles). ``settings``: the
    graph's (default: the defaults; the bare fleet reads none of them). ``engine_args``: an
    ``EngineArgs`` (your model config, GPU and ``vllm serve`` flags) instead of a bundled profile;
    ``bench``: a ``BenchRun`` (``vllm bench serve``'s random dataset and client) for ``--workload random``;
    ``max_concurrency``: a closed-loop client over any workload; ``neighbour``/``leak``: memory outside
    vLLM (``sim.vllm.external``); ``long_context_*``: a share of prompts made that long (class C3);
    ``priority_mix``: ((priority, share), ...) for requests the trace gave none; ``slo``: the ``SloTargets``
    counted against (default ``ttft:2000 tpot:100``); ``admission``: kvguard's admission gate on each
    (vLLM) node, its TTFT target the SLO's; ``router``: the fleet's (``producers.sim.fleet.ROUTERS``)."""
    slo = slo if slo is not None else DEFAULT_SLO
    graph = bootstrap(settings if settings is not None else Settings(), profile=profile_name, knobs=knobs,
                      predictor=None)
    profile = engine_args.profile() if engine_args is not None else graph.profile
    kind = engine_kind(profile)
    sampler = kind.capabilities.prompt_logprobs
    if prompt_logprobs_frac and not sampler:
        raise ProfileError(profile.name, "engine", f"an engine with a sampler for --prompt-logprobs-frac (the "
                                                   f"{kind.name!r} engine has none)")
    # the seed engine caps prompts that could never fit one GPU's KV region (said in the notes); the
    # vLLM engine takes them as they are and rejects those over max_model_len, as vLLM does
    if bench is not None:
        wl = bench.workload()
    else:
        wl = load_workload(workload, rate_scale=rate_scale, window=duration_s, seed=seed,
                           max_prompt_tokens=prompt_cap_tokens(profile))
    if long_context_frac:
        wl = with_long_context(wl, long_context_frac, long_context_len, seed)
    if priority_mix:
        wl = with_priority_mix(wl, priority_mix, seed)
    if logprobs_guard and not sampler:
        raise ProfileError(profile.name, "engine", f"an engine with a sampler for --logprobs-guard (the "
                                                   f"{kind.name!r} engine has none)")
    external = {k: v for k, v in (("neighbour", neighbour), ("leak", leak)) if v is not None}
    if external and not kind.capabilities.caching_allocator:
        raise ProfileError(profile.name, "engine", f"an engine with a device for --neighbour / --leak (the "
                                                   f"{kind.name!r} engine has none)")
    config = kind.node_config(prompt_logprobs_frac=prompt_logprobs_frac, logprobs_guard=logprobs_guard,
                              **external) if sampler else None
    if admission:
        if "admission" not in {f.name for f in fields(kind.config)}:
            raise ProfileError(profile.name, "engine", f"an engine with kvguard's admission gate for --admission (the "
                                                       f"{kind.name!r} engine has none)")
        config = kind.node_config(config, admission=AdmissionConfig(ttft_s=slo.ttft_s))
    fleet = graph.with_node(profile, config).fleet(gpus, seed=seed, router=router)
    if bench is not None or max_concurrency is not None:
        return _run_closed_loop(fleet, wl, profile, bench, max_concurrency, duration_s, events_out, progress,
                                knobs, seed, gpus, prompt_logprobs_frac, logprobs_guard, flush_s)
    fleet.submit_workload(wl)
    last_arrival_ns = wl.requests[-1].arrival_ns if wl.requests else 0
    end_ns = int(duration_s * NS_PER_S) if duration_s is not None else last_arrival_ns + int(flush_s * NS_PER_S)
    meta = {"workload": workload, "profile": profile.name, "gpus": gpus, "rate_scale": rate_scale, "seed": seed,
            "duration_s": duration_s, "nodes": fleet.nodes, "workload_notes": wl.notes}
    sink = _LogSink(events_out, meta)
    wall0 = time.perf_counter()
    try:
        for now_ns, batches in fleet.steps(end_ns, step_ns=int(flush_s * NS_PER_S), drain=drain,
                                           drain_cap_ns=end_ns + DRAIN_CAP_S * NS_PER_S):
            sink.write(batches)
            if progress is not None:
                progress(min(now_ns, end_ns) / NS_PER_S, end_ns / NS_PER_S)
    finally:
        sink.close()
    wall = time.perf_counter() - wall0
    out = _summary(fleet, profile, wl, wall, gpus, rate_scale, seed, events_out, knobs, prompt_logprobs_frac,
                   logprobs_guard, slo)
    if sink.error is not None:
        raise EventLogFailed(events_out, sink.error, out)
    return out


def _run_closed_loop(fleet, wl, profile, bench, max_concurrency, duration_s, events_out, progress, knobs, seed,
                     gpus, prompt_logprobs_frac, logprobs_guard, flush_s) -> dict:
    """``vllm bench serve``'s client over the fleet (``producers.sim.bench_serve``)."""
    limit = bench.max_concurrency if bench is not None else max_concurrency
    client = ClosedLoopClient(fleet, wl, limit)
    sink = _LogSink(events_out, {"workload": wl.name, "profile": profile.name, "gpus": gpus, "seed": seed,
                                 "nodes": fleet.nodes, "workload_notes": wl.notes})
    cap_s = duration_s if duration_s is not None else 7 * 86400.0
    wall0 = time.perf_counter()
    try:
        client.run(cap_ns=int(cap_s * NS_PER_S), on_batches=sink.write, flush_ns=int(flush_s * NS_PER_S))
    finally:
        sink.close()
    wall = time.perf_counter() - wall0
    if progress is not None:
        progress(1.0, 1.0)
    out = _summary(fleet, profile, wl, wall, gpus, 1.0, seed, events_out, knobs, prompt_logprobs_frac,
                   logprobs_guard)
    out["bench"] = client.metrics()
    out["bench"]["preemptions"] = out["preemptions"]
    out["bench"]["kv_token_capacity"] = out.get("kv_token_capacity")
    out["bench"]["max_concurrency"] = limit
    if bench is not None:
        out["bench"].update(bench.describe())
    if sink.error is not None:
        raise EventLogFailed(events_out, sink.error, out)
    return out


def _summary(fleet, profile, wl, wall, gpus, rate_scale, seed, events_out, knobs, prompt_logprobs_frac,
             logprobs_guard, slo=None) -> dict:
    out = fleet.summary(slo if slo is not None else DEFAULT_SLO).to_dict()
    gates = [e.gate for e in fleet.engines if getattr(e, "gate", None) is not None]
    if gates:
        out["admission"] = admission_totals(gates, fleet.shed)
    out["wall_seconds"] = round(wall, 3)
    out["sim_speed_x"] = round(out["sim_seconds"] * gpus / wall, 1) if wall > 0 else None
    out.update({"gpus": gpus, "profile": profile.name, "workload": wl.describe(), "rate_scale": rate_scale,
                "seed": seed, "events_out": str(events_out) if events_out else None,
                "knobs": knobs.to_dict() if knobs is not None else {}, "prompt_logprobs_frac": prompt_logprobs_frac,
                "logprobs_guard": logprobs_guard})
    if logprobs_guard:
        out["logprobs_guard_steps"] = sum(e.logprobs_guard_steps for e in fleet.engines)
        out["governor"] = governor_summary(fleet.engines)
    _per_gpu(out, fleet, profile)
    return out


def _per_gpu(out: dict, fleet: Any, profile: Any) -> None:
    if profile.memory is not None:
        out["kv_blocks"] = profile.memory.num_gpu_blocks
        out["kv_token_capacity"] = profile.memory.kv_token_capacity
        out["max_model_len"] = profile.max_model_len
        out["startup_log"] = profile.memory.log_lines()
    engines = fleet.engines
    if any(getattr(e, "num_spec", 0) for e in engines):
        drafts = sum(e.spec_drafts for e in engines)
        accepted = sum(e.spec_accepted for e in engines)
        out["spec_decode"] = {"num_speculative_tokens": engines[0].num_spec, "draft_tokens": drafts,
                              "accepted_tokens": accepted,
                              "acceptance_rate": round(accepted / drafts, 4) if drafts else None}
    out["startups_refused"] = sum(getattr(e, "startups_refused", 0) for e in engines)
    per_gpu = fleet.per_gpu()
    for d, e in zip(per_gpu, fleet.engines):
        d["oom_fragmentation"] = sum(o["fragmentation"] for o in e.oom_log)
        d["oom_log"] = e.oom_log[:20]
    out["priority_defaulted"] = sum(d["priority_defaulted"] for d in per_gpu)
    out["ooms_from_fragmentation"] = sum(d["oom_fragmentation"] for d in per_gpu)
    out["ooms_by_cause"] = fleet.ooms_by_cause()
    out["rejected_by_reason"] = fleet.rejected_by_reason()
    out["rejected_retryable"] = sum(n for reason, n in out["rejected_by_reason"].items() if reason in RETRYABLE_REASONS)
    out["engine"] = profile.engine
    out["per_gpu"] = per_gpu
