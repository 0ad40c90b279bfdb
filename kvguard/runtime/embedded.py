"""The embedded closed loop: the whole of kvguard in one process, deterministic for a seed.

Per tick of simulated time the fleet advances, its event batches go through the stream core
(ticks, alerts, P(OOM)), each tick through the policy (commands), each command through its node's
actuator (verify, apply once, execute, ack), and only then the next tick. The in-process bus
carries ticks, alerts, commands and acks with Kafka's topic/key/partition semantics. Without the
policy (``guarded=False``) the same loop is the baseline: the bare engine on the same workload.

``kvguard demo`` and the benchmarks drive it; ``compare`` gives the demo's headline ratios.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

from kvguard.bus.inproc import InprocBus
from kvguard.contracts.commands import AckOutcome
from kvguard.contracts.units import NS_PER_S
from kvguard.ops.static_sweep import tuned_knobs
from kvguard.policy.budget import fragmented_f_ext
from kvguard.producers.sim.profiles import load_profile, prompt_cap_tokens
from kvguard.producers.sim.registry import engine_kind
from kvguard.producers.sim.vllm.governed import governor_summary
from kvguard.producers.sim.workloads import load_workload, with_priority_mix
from kvguard.runtime.bootstrap import make_ledger, make_slo_ledger
from kvguard.streams.outputs import output_records
from kvguard.wire.schemas import make_headers

# The bundled stress: the `mixed` scenario (long and short prompts) at twice its base rate on the
# default profile, 4 GPUs. With seed 0 the baseline crashes 9 times: the first fragmentation OOM
# at ~615 s on gpu0, and the load it sheds onto the other GPUs cascades through all four until
# ~780 s (the arrival mix varies by seed: seeds 3 and 4 give 35 and 15 baseline OOMs, seed 2
# none). --quick packs the arrivals denser (×2.25 for 15 minutes): 8 baseline OOMs with seed 0.
# Measured with this policy (`kvguard demo --json`, seed 0): guarded 0 OOMs in both.
DEMO_WORKLOAD = "mixed"
DEMO_RATE_SCALE = 2.0
DEMO_DURATION_S = 1800.0
QUICK_RATE_SCALE = 2.25
QUICK_DURATION_S = 900.0


@dataclass(slots=True)
class RunResult:
    """One run's outcomes (the `kvguard simulate` summary fields) and its time series."""

    label: str
    summary: dict
    series: dict[str, list[tuple]] = field(default_factory=dict)  # node -> ``series_point``s
    oom_times: dict[str, list[float]] = field(default_factory=dict)
    actions: dict[str, Counter] = field(default_factory=dict)
    commands: dict[str, list[tuple[float, str]]] = field(default_factory=dict)  # node -> (ts_s, action) executed
    governed: dict[str, list[float]] = field(default_factory=dict)  # node -> times (s) the step governor shrank a step
    wall_seconds: float = 0.0


# a RunResult's series point: the tick's time and levels, both layers' fragmentation (the caching
# allocator's F_ext and its reserved-but-unallocated bytes: on uniform-block engines the KV layer's
# F_ext is 0 by construction, the fragmentation is the allocator's) and the prediction
SERIES_FIELDS = ("ts_s", "u_kv", "f_ext", "psi", "p_oom", "alloc_f_ext", "alloc_unallocated_bytes",
                 "alloc_reserved_bytes")


def series_point(tick: Any) -> tuple:
    """One tick as a ``RunResult.series`` point, in ``SERIES_FIELDS`` order."""
    return (tick.ts_ns / NS_PER_S, tick.u_kv, tick.f_ext, tick.psi, tick.p_oom, tick.alloc_f_ext,
            max(0, tick.alloc_reserved_bytes - tick.alloc_allocated_bytes), tick.alloc_reserved_bytes)


def budget_f_ext(point: tuple) -> float:
    """The F_ext a series point debits from the fragmentation budget (``policy.budget.fragmented_f_ext``)."""
    return fragmented_f_ext(point[2], *point[5:6], *point[7:8])


def static_arms(graph: Any, profile_name: str | None, node_config: Any = None) -> dict[str, Any]:
    """The static arms beside an operator's graph (issue 12), each the same graph over another node
    configuration: ``vllm_default`` (the profile as shipped) and ``tuned_static`` (the static sweep's
    winner, ``kvguard/ops/tuned_static.json``); run them unguarded."""
    return {"vllm_default": graph.with_node(load_profile(profile_name), node_config),
            "tuned_static": graph.with_node(load_profile(profile_name, knobs=tuned_knobs()), node_config)}


def with_node_guard(graph: Any, governor: bool = True) -> Any:
    """The graph with kvguard's node-side guard on, as a guarded node runs it: on engines that serve
    prompt logprobs the step governor (``VllmEngineConfig.logprobs_guard``, an alias of ``governor``:
    every step sized so its non-KV peak fits the allocator's headroom). Other engines have no node-side
    guard, and ``governor=False`` (the policy's commands alone) leaves the graph as it is."""
    kind = engine_kind(graph.profile)
    if not governor or not kind.capabilities.prompt_logprobs:
        return graph
    return replace(graph, node_config=kind.node_config(graph.node_config, logprobs_guard=True))


def demo_workload(profile: Any, *, workload: str, rate_scale: float, duration_s: float, seed: int,
                  priority_mix: Any = None):
    """``priority_mix``: ((priority, share), ...) for requests the trace gives none (issue 29)."""
    wl = load_workload(workload, rate_scale=rate_scale, window=duration_s, seed=seed,
                       max_prompt_tokens=prompt_cap_tokens(profile))
    return with_priority_mix(wl, priority_mix, seed) if priority_mix else wl


async def run_embedded(graph: Any, workload: Any, *, n_gpus: int, duration_s: float, seed: int, guarded: bool,
                       view: Any = None, progress: Any = None, host: str = "sim-0", bus: InprocBus | None = None,
                       on_batches: Any = None) -> RunResult:
    """One deterministic run; ``guarded`` closes the loop (policy + actuators). Node ids are
    ``<host>/gpu<i>``; the guarded run records in the graph's budget and SLO ledgers (in memory
    when the graph has none). ``bus``: the in-process bus to carry the records (a new one by
    default); ``on_batches(batches)`` sees each tick's event batches."""

    settings = graph.settings
    topics = settings.topics
    bus = bus if bus is not None else InprocBus.from_settings(settings)
    fleet = (with_node_guard(graph) if guarded else graph).fleet(n_gpus, seed=seed, host=host)
    fleet.submit_workload(workload)
    engines = {e.node: e for e in fleet.engines}
    core = graph.stream_core()
    ledger = graph.ledger if graph.ledger is not None else make_ledger(settings)
    slo = None
    if guarded:
        slo = graph.slo_recorder(graph.slo_ledger if graph.slo_ledger is not None else make_slo_ledger(settings),
                                 confirm_with_acks=True)
    service = graph.policy_service(bus=bus, ledger=ledger, slo=slo) if guarded else None
    actuators = graph.actuators(fleet.engines) if guarded else {}
    commands_sub = bus.subscribe([topics.name("commands")], "kvguard-actuators")
    result = RunResult("guarded" if guarded else "baseline", {})
    alerts_firing: dict[str, set[str]] = defaultdict(set)
    actions: dict[str, Counter] = {n: Counter() for n in engines}
    tick_ns = int(settings.streams.tick_s * NS_PER_S)
    end_ns = int(duration_s * NS_PER_S)
    wall0 = time.perf_counter()
    for t, batches in fleet.steps(end_ns, step_ns=tick_ns, clamp=True):
        if on_batches is not None:
            on_batches(batches)
        if slo is not None:
            slo.observe_batches(batches)
        ticks, alerts = core.process_many(batches)
        more_ticks, more_alerts = core.flush(t)
        ticks += more_ticks
        alerts += more_alerts
        for record in output_records(ticks, alerts):
            bus.append(topics.name(record.kind), record.key, record.value, record.headers)
        for alert in alerts:
            (alerts_firing[alert.node].add if alert.state == "firing" else alerts_firing[alert.node].discard)(alert.rule)
        for tick in ticks:
            result.series.setdefault(tick.node, []).append(series_point(tick))
            if tick.ooms:
                result.oom_times.setdefault(tick.node, []).append(tick.ts_ns / NS_PER_S)
            if service is not None:
                await service.publish(service.handle_tick(tick))
        if actuators:
            for record in await commands_sub.getmany(max_records=10_000, timeout_s=0):
                node = record.key.decode()
                ack = actuators[node].handle_record(record.value, engines[node].now_ns)
                if ack is not None:
                    if slo is not None:
                        slo.observe_ack(ack)
                    actions[node][f"{ack.action}:{ack.outcome.value}"] += 1
                    if ack.outcome is AckOutcome.EXECUTED:
                        result.commands.setdefault(node, []).append((engines[node].now_ns / NS_PER_S, ack.action))
                    bus.append(topics.name("acks"), node, ack.to_bytes(), make_headers("acks", node))
                await record.commit()
        if view is not None:
            for tick in ticks:
                e = engines[tick.node]
                view.update(tick.node, tick.ts_ns / NS_PER_S, u_kv=tick.u_kv, f_ext=tick.f_ext, psi=tick.psi,
                            p_oom=tick.p_oom, alerts=len(alerts_firing[tick.node]),
                            actions=sum(v for k, v in actions[tick.node].items() if k.endswith(":executed")),
                            ooms=e.ooms, preemptions=e.preemptions)
        if progress is not None:
            progress(t / NS_PER_S, end_ns / NS_PER_S)
    await commands_sub.close()
    if slo is not None:
        slo.observe_batches(fleet.take_batches(end_ns))
        slo.finish(end_ns)
    result.wall_seconds = round(time.perf_counter() - wall0, 3)
    result.actions = actions
    result.governed = governed_times(fleet.engines)
    result.summary = run_summary(fleet, result, service, actuators, graph)
    if result.governed or any(getattr(e, "governor", None) is not None for e in fleet.engines):
        result.summary["governor"] = governor_summary(fleet.engines)
    if slo is not None:
        result.summary["kvguard"]["slo"] = slo.counters.as_dict()
    return result


def governed_times(engines) -> dict[str, list[float]]:
    """Per node, when the step governor shrank a step (its decisions; refusals are FINISH rows)."""
    out = {}
    for e in engines:
        g = getattr(e, "governor", None)
        if g is not None and g.decisions:
            out[e.node] = [t / NS_PER_S for t, *_ in g.decisions]
    return out


def run_summary(fleet: Any, result: RunResult, service: Any, actuators: dict, graph: Any) -> dict:
    out = fleet.summary().to_dict()
    out["gpus"] = len(fleet.engines)
    out["wall_seconds"] = result.wall_seconds
    out["priority_defaulted"] = sum(e.priority_defaulted for e in fleet.engines)
    total = Counter()
    for c in result.actions.values():
        total.update(c)
    out["kvguard"] = None
    if service is not None:
        counters = {name: 0 for name in ("received", "executed", "noop", "failed", "duplicate",
                                         "rejected_signature", "rejected_expired", "rejected_node",
                                         "malformed", "units_freed", "units_moved")}
        for a in actuators.values():
            for k, v in a.counters.as_dict().items():
                counters[k] = counters.get(k, 0) + v
        out["kvguard"] = {
            "policy": service.engine.counters.as_dict(),
            "budget_unavailable_ticks": service.budget_errors,
            "actuators": counters,
            "acks": dict(sorted(total.items())),
            "mode_changes": [c.to_dict() for c in service.mode_changes],
            "predictor": graph.predictor_note,
        }
    return out


def compare(baseline: dict, guarded: dict) -> dict:
    """The headline ratios of the closed loop against the baseline on the same workload."""

    def reduction(key: str) -> float | None:
        b, g = baseline.get(key) or 0, guarded.get(key) or 0
        return None if b == 0 else round(1.0 - g / b, 4)

    def ratio(key: str) -> float | None:
        b, g = baseline.get(key), guarded.get(key)
        return None if not b or g is None else round(g / b, 4)

    return {"baseline": baseline, "guarded": guarded, "oom_reduction": reduction("ooms"),
            "preemption_reduction": reduction("preemptions"), "goodput_ratio": ratio("goodput_tokens_per_s"),
            "ttft_p99_ratio": ratio("ttft_p99_s")}


def ledger_summary(ledger: Any, slo_ledger: Any, redis: str | None) -> tuple[dict, str | None]:
    """Both ledgers' stats after a last flush and a read (is Redis reachable now?); the second
    value says what could not be stored (None: everything was)."""
    out: dict[str, Any] = {"backend": "redis" if redis else "memory"}
    problems, lost = [], []
    for name, led in (("budget", ledger), ("slo", slo_ledger)):
        flushed = led.flush() if hasattr(led, "flush") else True
        reachable_error = None
        if redis:
            try:
                led.ping()
            except Exception as err:  # noqa: BLE001 - LedgerUnavailable names the (masked) URL
                reachable_error = str(err)
        stats = led.stats().to_dict() if hasattr(led, "stats") else {}
        out[name] = stats
        if stats.get("outages"):
            problems.append(f"{name} ledger: {stats['outages']} Redis outage(s) during the run")
        if not flushed or stats.get("buffered") or stats.get("dropped") or reachable_error:
            lost.append(f"{reachable_error or name + ' ledger: Redis unreachable at the end of the run'} "
                        f"({stats.get('buffered', 0)} write(s) still buffered, {stats.get('dropped', 0)} dropped)")
    out["problems"] = problems + lost  # outages the run recovered from are listed, not fatal
    return out, ("; ".join(lost) or None)
