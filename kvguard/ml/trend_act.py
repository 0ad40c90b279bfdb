"""A shadow-engine run with the drain-and-restart guard acting on the trend model's alarms.

The fleet of the run, the stream core with the trend predictor (as the deployed worker runs it), and
``policy.drain_guard.DrainRestartGuard`` over every tick; its actions go to the simulated engines
(``VllmEngine.draining``: out of the router; ``VllmEngine.planned_restart``: the restart, refused
unless drained). The same run without the guard is the baseline: the crash it replaces. The
summary holds the fleet's (OOMs, failed and rejected requests, SLO attainment) and the guard's
counters, so ``prevents the growth OOMs with no failed request`` is read off it.
"""

from __future__ import annotations

import time

from kvguard.contracts.events import EventKind
from kvguard.contracts.units import NS_PER_S
from kvguard.ml.dataset import RunSpec
from kvguard.ml.trend import external_config, trend_workload
from kvguard.policy.drain_guard import DRAIN, RESTART, UNDRAIN, DrainRestartConfig, DrainRestartGuard
from kvguard.producers.sim.fleet import Fleet
from kvguard.producers.sim.profiles import EngineKnobs, load_profile, prompt_cap_tokens
from kvguard.producers.sim.registry import engine_kind
from kvguard.streams.core import StreamConfig, StreamCore
from kvguard.streams.loader import with_model_threshold


def run_acting(spec: RunSpec, predictor, *, guard: bool = True, tick_s: float = 10.0, flush_every_s: float = 1.0,
               config: DrainRestartConfig | None = None) -> dict:
    """Run ``spec`` with (``guard``) or without the drain-and-restart guard; the fleet's summary plus
    ``guard`` counters, ``actions`` (time, kind, node, reason) and ``ooms_by_cause``."""
    started = time.monotonic()
    runner = "v1" if engine_kind(load_profile(spec.profile)).takes_knobs else None
    profile = load_profile(spec.profile, knobs=EngineKnobs(gpu_memory_utilization=spec.gpu_memory_utilization,
                                                           model_runner=runner))
    workload = trend_workload(spec, max_prompt_tokens=prompt_cap_tokens(profile))
    kind = engine_kind(profile)
    engine_config = kind.node_config(prompt_logprobs_frac=spec.prompt_logprobs_frac, **external_config(spec))
    fleet = Fleet(spec.n_gpus, profile, seed=spec.seed, config=engine_config)
    fleet.submit_workload(workload)
    core = StreamCore(with_model_threshold(StreamConfig(tick_s=tick_s), predictor), predictor=predictor)
    g = DrainRestartGuard(config or DrainRestartConfig(p_threshold=float(predictor.threshold)))
    engine_of = {e.node: e for e in fleet.engines}
    actions: list[dict] = []
    oom_times: dict[str, list[float]] = {n: [] for n in fleet.nodes}
    end_ns = int(spec.duration_s * NS_PER_S)
    for now_ns, batches in fleet.steps(end_ns, step_ns=int(flush_every_s * NS_PER_S)):
        for b in batches:
            rows = b.events["kind"] == EventKind.OOM
            oom_times[b.node].extend((b.events["ts_ns"][rows] / NS_PER_S).round(1).tolist())
        ticks, _ = core.process_many(batches)
        if not guard:
            continue
        for tick in ticks:
            for act in g.observe(tick):
                e = engine_of[act.node]
                ok = True
                if act.kind == DRAIN:
                    e.draining = True
                elif act.kind == UNDRAIN:
                    e.draining = False
                elif act.kind == RESTART:
                    ok = e.planned_restart(now_ns)
                    g.restarted(act.node, now_ns, ok)
                actions.append({"t_s": round(now_ns / NS_PER_S, 1), "kind": act.kind, "node": act.node,
                                "ok": ok, "reason": act.reason})
    core.flush(end_ns)
    out = fleet.summary().to_dict()
    out.update({"run": spec.key(), "guard": g.counters.as_dict() if guard else None,
                "planned_restarts": sum(getattr(e, "planned_restarts", 0) for e in fleet.engines),
                "ooms_by_cause": fleet.ooms_by_cause(), "oom_times_s": oom_times,
                "actions": [a for a in actions if a["kind"] != RESTART or a["ok"]][:50],
                "restart_attempts_refused": sum(1 for a in actions if a["kind"] == RESTART and not a["ok"]),
                "wall_s": round(time.monotonic() - started, 1)})
    return out


def compare(spec: RunSpec, predictor, **kw) -> dict:
    """The run without and with the guard, and what the guard changed."""
    base = run_acting(spec, predictor, guard=False, **kw)
    acted = run_acting(spec, predictor, guard=True, **kw)
    keys = ("ooms", "failed", "rejected", "completed", "slo_met", "slo_attainment", "downtime_s",
            "goodput_tokens_per_s", "slo_goodput_tokens_per_s")
    return {"run": spec.key(), "without_guard": {k: base.get(k) for k in keys} | {"ooms_by_cause": base["ooms_by_cause"]},
            "with_guard": {k: acted.get(k) for k in keys} | {"ooms_by_cause": acted["ooms_by_cause"],
                                                            "planned_restarts": acted["planned_restarts"],
                                                            "guard": acted["guard"]},
            "actions": acted["actions"], "oom_times_s": {"without": base["oom_times_s"], "with": acted["oom_times_s"]},
            "slo_attainment_gain": (None if base.get("slo_attainment") is None or acted.get("slo_attainment") is None
                                    else round(acted["slo_attainment"] - base["slo_attainment"], 4))}
