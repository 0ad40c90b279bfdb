"""Replay a recorded event log through the stream core, the predictor and the policy.

A dry run: the ticks, alerts and the commands the policy *would* have issued, per node, with
nothing executed — what an SRE reads after an incident (`kvguard replay LOG --report DIR`). With
another policy (a settings file), a what-if: the log's own requests (its ARRIVE rows: arrival
time, prompt and output lengths, priority) re-run on the shadow engine with that policy closing
the loop, beside the same requests without it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvguard.contracts.events import F_PRIORITY_DEFAULTED, EventBatch, EventKind
from kvguard.contracts.units import NS_PER_S
from kvguard.producers.sim.workloads import Request, Workload
from kvguard.runtime.embedded import run_embedded


@dataclass(slots=True)
class NodeTimeline:
    """One node's replay, in seconds of event time."""

    node: str
    ts_s: list[float] = field(default_factory=list)
    u_kv: list[float] = field(default_factory=list)
    f_ext: list[float] = field(default_factory=list)
    psi: list[float] = field(default_factory=list)
    p_oom: list[float | None] = field(default_factory=list)
    alloc_reserved_bytes: list[int] = field(default_factory=list)
    alloc_allocated_bytes: list[int] = field(default_factory=list)
    alloc_f_ext: list[float] = field(default_factory=list)
    ooms: list[float] = field(default_factory=list)
    alerts: list[tuple[float, str, str]] = field(default_factory=list)  # (ts_s, rule, firing|resolved)
    commands: list[tuple[float, str]] = field(default_factory=list)  # (ts_s, action)


@dataclass(slots=True)
class ReplayResult:
    nodes: dict[str, NodeTimeline]
    batches: int = 0
    events: int = 0
    ticks: int = 0
    alerts: int = 0
    commands: int = 0
    ooms: int = 0  # OOMs the ticks counted (what the policy saw)
    oom_rows: int = 0  # OOM rows of the log: more when a producer restart dropped an unfinished interval's tick
    skipped: list[dict] = field(default_factory=list)  # batches left out: {line, node, epoch, seq, reason}

    def summary(self) -> dict:
        return {"nodes": len(self.nodes), "batches": self.batches, "events": self.events, "ticks": self.ticks,
                "alerts": self.alerts, "commands": self.commands, "ooms": self.ooms, "oom_rows": self.oom_rows,
                "skipped_batches": list(self.skipped),
                "commands_by_action": _count(a for t in self.nodes.values() for _, a in t.commands),
                "ooms_by_node": {n: len(t.ooms) for n, t in sorted(self.nodes.items()) if t.ooms}}


def _count(items: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return dict(sorted(out.items()))


def dry_run(graph: Any, batches: Iterable[EventBatch], *, chunk_batches: int = 64,
            progress: Callable[[int], None] | None = None) -> ReplayResult:
    """Streams, predictor and policy over ``batches``; commands are collected, never executed. A batch
    the core rejects is listed in ``skipped``; the end of the input is the core's ``finish()`` (each
    node's last, partial interval gets its tick, so an OOM there is counted)."""
    core, engine = graph.stream_core(), graph.policy_engine()
    result = ReplayResult({})

    def take(ticks, alerts) -> None:
        for tick in ticks:
            t = result.nodes.setdefault(tick.node, NodeTimeline(tick.node))
            ts = tick.ts_ns / NS_PER_S
            t.ts_s.append(ts)
            t.u_kv.append(tick.u_kv)
            t.f_ext.append(tick.f_ext)
            t.psi.append(tick.psi)
            t.p_oom.append(tick.p_oom)
            t.alloc_reserved_bytes.append(tick.alloc_reserved_bytes)
            t.alloc_allocated_bytes.append(tick.alloc_allocated_bytes)
            t.alloc_f_ext.append(tick.alloc_f_ext)
            if tick.ooms:
                t.ooms.append(ts)
                result.ooms += tick.ooms
            decision = engine.decide(tick)
            t.commands.extend((ts, str(c.action)) for c in decision.commands)
            result.commands += len(decision.commands)
        for alert in alerts:
            result.nodes.setdefault(alert.node, NodeTimeline(alert.node)).alerts.append(
                (alert.ts_ns / NS_PER_S, alert.rule, alert.state))
        result.ticks += len(ticks)
        result.alerts += len(alerts)

    def note_rejected() -> None:
        result.skipped.extend({"line": None, "node": r.batch.node, "epoch": int(r.batch.epoch),
                               "seq": int(r.batch.seq), "reason": f"{r.reason}: {r.detail}"} for r in core.rejected)

    chunk: list[EventBatch] = []
    for batch in batches:
        chunk.append(batch)
        result.batches += 1
        result.events += len(batch)
        if len(batch):
            result.oom_rows += int(np.count_nonzero(batch.events["kind"] == EventKind.OOM))
        if len(chunk) >= chunk_batches:
            take(*core.process_many(chunk))
            note_rejected()
            chunk = []
            if progress is not None:
                progress(result.batches)
    if chunk:
        take(*core.process_many(chunk))
        note_rejected()
    take(*core.finish())
    if progress is not None:
        progress(result.batches)
    return result


def workload_from_log(batches: Iterable[EventBatch], name: str = "recorded") -> Workload:
    """The requests a log's ARRIVE rows describe (KV prefix hashes are not in the log: none)."""
    requests = []
    for batch in batches:
        rows = batch.events[batch.events["kind"] == int(EventKind.ARRIVE)]
        for row in rows.tolist():
            ts_ns, _, cls, flags, req, _, _, tokens, aux = row
            priority = None if flags & F_PRIORITY_DEFAULTED else int(cls)
            requests.append(Request(int(req), int(ts_ns), int(tokens), int(aux), priority))
    requests.sort(key=lambda r: (r.arrival_ns, r.req_id))
    return Workload(name, requests, notes=["rebuilt from the log's ARRIVE rows (no prefix hashes)"])


async def what_if(graph: Any, workload: Workload, *, n_gpus: int, seed: int = 0,
                  progress: Callable[[float, float], None] | None = None) -> dict:
    """The recorded requests on ``n_gpus`` shadow GPUs, without and with ``graph``'s policy."""
    end_s = (workload.requests[-1].arrival_ns / NS_PER_S + 60.0) if workload.requests else 60.0
    duration_s = float(np.ceil(end_s / graph.settings.streams.tick_s) * graph.settings.streams.tick_s)
    runs = {}
    for label, guarded in (("without_policy", False), ("with_policy", True)):
        run = await run_embedded(graph, workload, n_gpus=n_gpus, duration_s=duration_s, seed=seed, guarded=guarded,
                                 progress=progress)
        runs[label] = run.summary
    return {"duration_s": duration_s, "requests": len(workload.requests), **runs}
