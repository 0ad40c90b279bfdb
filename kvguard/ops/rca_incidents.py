"""Incidents that are not OOMs, with the same per-cause structure (``kvguard rca``): preemption storms,
refusals and long queueing stretches, from the rows and ticks ``kvguard.ops.rca.replay`` kept.

- **Preemption storm**: PREEMPT rows of one node closer than ``gap_s`` to each other, at least
  ``min_preemptions`` of them. vLLM preempts (recompute: V1 has no swap) when a running request needs
  a KV block and none is free (``vllm/v1/core/sched/scheduler.py``: ``_preempt_request`` in ``schedule``),
  so its cause is KV pressure; the report gives the KV level and the queue over the storm.
- **Refusals**: FINISH rows whose Outcome is not a completion or a crash (REJECTED, and the overload
  gate's REFUSED and the governor's NEVER_FITS where the log has them), grouped the same way, each with its
  reason: the FINISH row's ``Refusal`` (``aux``), else the engine being down after an OOM, else unknown.
- **Queueing stretch**: consecutive ticks with requests waiting, at least ``min_queue_s`` long; its
  cause is the engine's state over the stretch: down after an OOM, the KV cache full (waiting for
  blocks), or the step's budget and seats (the KV cache had room).

Each incident carries the governor's and admission's decisions inside its span (GOVERN = 28 and
ADMISSION = 29 rows, read when present) and the policy's commands (``kvguard rca`` runs the policy over
the ticks, executing nothing). Pure: the standard library.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from kvguard.contracts.events import EventKind, Outcome, Refusal
from kvguard.contracts.units import NS_PER_S

GAP_S = 30.0
MIN_PREEMPTIONS = 5
MIN_QUEUE_S = 60.0
KV_FULL = 0.95  # U_kv at or above this: the KV cache is full for the scheduler's purposes
REFUSED, NEVER_FITS = int(Outcome.REFUSED), int(Outcome.NEVER_FITS)  # admission's and the governor's refusals
GOVERN, ADMISSION = int(EventKind.GOVERN), int(EventKind.ADMISSION)  # the governor's and admission's rows

REFUSAL_TEXT = {
    int(Refusal.RESTARTING): "the engine was restarting after a crash",
    int(Refusal.QUEUE_REQS): "vLLM's 503: unfinished requests over --max-num-queued-reqs",
    int(Refusal.QUEUE_TOKENS): "vLLM's 503: the prefill backlog over --max-num-queued-tokens",
    int(Refusal.PROMPT_TOO_LONG): "the prompt does not fit the model's context (max_model_len)",
    int(Refusal.OTHER): "refused by the engine (another reason)",
}
REFUSAL_FIX = {
    "restarting": "the OOM before it (see its RCA): no crash, no downtime; a router that skips a restarting replica",
    "queue_reqs": "more replicas or a higher --max-num-queued-reqs; the 503s are retryable",
    "queue_tokens": "more replicas or a higher --max-num-queued-tokens; the 503s are retryable",
    "prompt_too_long": "a gateway limit on prompt length, or a longer --max-model-len if the KV cache allows it",
    "admission": "kvguard's admission held or refused them to protect the node (retryable, Retry-After)",
    "never_fits": "the governor refused requests that can never fit this node: route them to a larger one",
    "unknown": "the log does not say why",
}


@dataclass(slots=True)
class Incident:
    node: str
    epoch: int
    kind: str  # preemption_storm | refusals | queueing
    start_ns: int
    end_ns: int
    count: int
    cause: str
    title: str
    details: list[str] = field(default_factory=list)
    prevention: list[str] = field(default_factory=list)
    decisions: dict[str, int] = field(default_factory=dict)  # governor / admission rows and policy commands

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / NS_PER_S

    def to_dict(self) -> dict:
        d = asdict(self)
        d["start_s"], d["end_s"], d["duration_s"] = self.start_ns / NS_PER_S, self.end_ns / NS_PER_S, self.duration_s
        return d


def _clusters(times: list[int], gap_ns: int) -> list[tuple[int, int]]:
    """Index spans [a, b) of sorted ``times`` whose neighbours are at most ``gap_ns`` apart."""
    out, a = [], 0
    for i in range(1, len(times) + 1):
        if i == len(times) or times[i] - times[i - 1] > gap_ns:
            out.append((a, i))
            a = i
    return out if times else []


def find_incidents(rep, *, gap_s: float = GAP_S, min_preemptions: int = MIN_PREEMPTIONS,
                   min_queue_s: float = MIN_QUEUE_S, commands: dict | None = None) -> list[Incident]:
    """Incidents of every node of ``rep`` (a ``kvguard.ops.rca.Replay``), by node, epoch, then time.
    ``commands``: node -> [(ts_ns, action, epoch)] the policy would have issued (``rca.policy_commands``)."""
    out: list[Incident] = []
    gap = int(gap_s * NS_PER_S)
    for name in sorted(rep.nodes):
        nr = rep.nodes[name]
        epochs = sorted({e for *_, e in nr.preempts} | {e for *_, e in nr.finishes} | {t.epoch for t in nr.ticks})
        for epoch in epochs:
            ticks = sorted((t for t in nr.ticks if t.epoch == epoch), key=lambda t: t.ts_ns)
            ooms = sorted(o.ts_ns for o in nr.ooms if o.epoch == epoch)
            down = _down_spans(nr, epoch, ooms)
            rows = [r for r in nr.policy_rows if r[-1] == epoch]
            cmds = [c for c in (commands or {}).get(name, []) if c[2] == epoch]
            found = _storms(nr, epoch, ticks, gap, min_preemptions) + _refusals(nr, epoch, gap, down) + \
                _queueing(nr, epoch, ticks, min_queue_s, down)
            for inc in found:
                inc.decisions = _decisions(inc, rows, cmds)
            out += sorted(found, key=lambda i: (i.start_ns, i.kind))
    return out


def _down_spans(nr, epoch: int, ooms: list[int]) -> list[tuple[int, int]]:
    """(crash, first step after it) per OOM: the engine was down, restarting."""
    steps = sorted(t.ts_ns for t in nr.ticks if t.epoch == epoch and t.requests_running > 0)
    spans = []
    for o in ooms:
        nxt = next((s for s in steps if s > o), None)
        spans.append((o, nxt if nxt is not None else o + 60 * NS_PER_S))
    return spans


def _within(ticks, a: int, b: int):
    return [t for t in ticks if a <= t.ts_ns <= b + 1]


def _storms(nr, epoch, ticks, gap, min_n) -> list[Incident]:
    pre = sorted((ts, req) for ts, req, e in nr.preempts if e == epoch)
    times = [ts for ts, _ in pre]
    out = []
    for a, b in _clusters(times, gap):
        if b - a < min_n:
            continue
        start, end = times[a], times[b - 1]
        span = _within(ticks, start, end + int(nr_tick_ns(ticks)))
        u = max((t.u_kv for t in span), default=None)
        waiting = max((t.requests_waiting for t in span), default=None)
        running = max((t.requests_running for t in span), default=None)
        reqs = {req for _, req in pre[a:b]}
        inc = Incident(nr.node, epoch, "preemption_storm", start, end, b - a, "kv_pressure",
                       "KV pressure: running requests needed KV blocks and none were free, so vLLM preempted "
                       "(recompute) to make room")
        inc.details.append(f"{b - a} preemptions of {len(reqs)} request(s) in {(end - start) / NS_PER_S:.0f} s")
        if u is not None:
            inc.details.append(f"KV cache use up to {u:.1%}; up to {running} running and {waiting} waiting")
        inc.prevention += ["fewer concurrent sequences (--max-num-seqs) or a KV watermark (--watermark) so admission "
                           "leaves room for decode growth",
                           "kvguard's admission guard (hold new prompts while the KV cache is near full) or more "
                           "replicas"]
        out.append(inc)
    return out


def nr_tick_ns(ticks) -> int:
    if len(ticks) >= 2:
        return ticks[1].ts_ns - ticks[0].ts_ns
    return 10 * NS_PER_S


def _refusal_kind(flags: int, aux: int, ts: int, down) -> str:
    if flags == REFUSED:
        return "admission"
    if flags == NEVER_FITS:
        return "never_fits"
    if aux:
        return {int(Refusal.RESTARTING): "restarting", int(Refusal.QUEUE_REQS): "queue_reqs",
                int(Refusal.QUEUE_TOKENS): "queue_tokens", int(Refusal.PROMPT_TOO_LONG): "prompt_too_long"}.get(
            aux, "unknown")
    if any(a <= ts <= b for a, b in down):
        return "restarting"
    return "unknown"


def _refusals(nr, epoch, gap, down) -> list[Incident]:
    rows = sorted((ts, req, flags, aux) for ts, req, flags, e, aux in nr.finishes if e == epoch
                  and flags in (int(Outcome.REJECTED), REFUSED, NEVER_FITS))
    times = [r[0] for r in rows]
    out = []
    for a, b in _clusters(times, gap):
        group = rows[a:b]
        by: dict[str, int] = {}
        for ts, _, flags, aux in group:
            k = _refusal_kind(flags, aux, ts, down)
            by[k] = by.get(k, 0) + 1
        main = max(by, key=by.__getitem__)
        inc = Incident(nr.node, epoch, "refusals", group[0][0], group[-1][0], len(group), main,
                       f"{len(group)} request(s) turned away: " + ", ".join(f"{k} {v}" for k, v in sorted(by.items())))
        for k, v in sorted(by.items()):
            text = {"admission": "held/refused by kvguard's admission (Outcome.REFUSED)",
                    "never_fits": "refused by the governor: they can never fit (Outcome.NEVER_FITS)",
                    "restarting": REFUSAL_TEXT[int(Refusal.RESTARTING)],
                    "queue_reqs": REFUSAL_TEXT[int(Refusal.QUEUE_REQS)],
                    "queue_tokens": REFUSAL_TEXT[int(Refusal.QUEUE_TOKENS)],
                    "prompt_too_long": REFUSAL_TEXT[int(Refusal.PROMPT_TOO_LONG)]}.get(k, "the log does not say why")
            inc.details.append(f"{v}: {text}")
            inc.prevention.append(REFUSAL_FIX[k])
        out.append(inc)
    return out


def _queueing(nr, epoch, ticks, min_s, down) -> list[Incident]:
    out = []
    run: list = []
    for t in [*ticks, None]:
        if t is not None and t.requests_waiting > 0:
            run.append(t)
            continue
        if run and (run[-1].ts_ns - run[0].ts_ns) / NS_PER_S + run[0].tick_s >= min_s:
            out.append(_queue_incident(nr, epoch, run, down))
        run = []
    return out


def _queue_incident(nr, epoch, run, down) -> Incident:
    start, end = run[0].ts_ns - int(run[0].tick_s * NS_PER_S), run[-1].ts_ns
    waiting = max(t.requests_waiting for t in run)
    u = max(t.u_kv for t in run)
    downtime = sum(max(0, min(b, end) - max(a, start)) for a, b in down) / NS_PER_S
    waits = [(adm - nr.arrivals[(epoch, req)][0]) / NS_PER_S for adm, req, e in nr.admits
             if e == epoch and start <= adm <= end and (epoch, req) in nr.arrivals]
    if downtime >= 0.5 * (end - start) / NS_PER_S:
        cause, title = "restarting", "the engine was down, restarting after an OOM: arrivals waited or were refused"
        fix = ["the OOM before it (see its RCA): no crash, no downtime"]
    elif u >= KV_FULL:
        cause, title = "kv_full", "the KV cache was full: waiting requests had no blocks to be admitted into"
        fix = ["more KV cache (a higher --gpu-memory-utilization if the allocator's headroom allows it, or more "
               "replicas), or shorter outputs", "kvguard's admission guard keeps the queue bounded (refusals with "
               "Retry-After instead of minutes of queueing)"]
    else:
        cause, title = "budget", ("the KV cache had room: the step's token budget or its seats held requests back "
                                  "(--max-num-batched-tokens, --max-num-seqs) or a long prefill ran ahead of them")
        fix = ["a larger --max-num-batched-tokens or --max-num-seqs if the allocator's headroom allows it, or more "
               "replicas"]
    inc = Incident(nr.node, epoch, "queueing", start, end, waiting, cause, title)
    inc.details.append(f"requests waiting for {(end - start) / NS_PER_S:.0f} s, up to {waiting} at once; KV cache "
                       f"use up to {u:.1%}" + (f"; the engine down {downtime:.0f} s of it" if downtime else ""))
    if waits:
        inc.details.append(f"{len(waits)} request(s) admitted in it, after queueing up to {max(waits):.1f} s "
                           f"(median {sorted(waits)[len(waits) // 2]:.1f} s)")
    inc.prevention += fix
    return inc


def _decisions(inc: Incident, rows, cmds) -> dict[str, int]:
    lo, hi = inc.start_ns - 30 * NS_PER_S, inc.end_ns + 1
    out: dict[str, int] = {}
    for ts, kind, *_ in rows:
        if lo <= ts <= hi:
            key = "governor rows" if kind == GOVERN else "admission rows"
            out[key] = out.get(key, 0) + 1
    for ts, action, _ in cmds:
        if lo <= ts <= hi:
            key = f"policy: {action}"
            out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def incidents_markdown(incidents: list[Incident], images: dict[str, str] | None = None) -> list[str]:
    lines = ["## Incidents (not OOMs)", ""]
    if not incidents:
        return lines + ["No preemption storm, refusal or long queueing stretch in this log.", ""]
    lines += [f"![incidents on {node}]({name})" for node, name in sorted((images or {}).items())]
    if images:
        lines.append("")
    by: dict[str, int] = {}
    for inc in incidents:
        by[inc.kind] = by.get(inc.kind, 0) + 1
    lines += [", ".join(f"{k} {v}" for k, v in sorted(by.items())), ""]
    for k, inc in enumerate(incidents[:100]):
        epoch = f" (producer run {inc.epoch})" if inc.epoch else ""
        lines += [f"### Incident {k + 1}: {inc.kind} on {inc.node}{epoch}, t={inc.start_ns / NS_PER_S:.0f}–"
                  f"{inc.end_ns / NS_PER_S:.0f} s: {inc.cause}", "", f"**{inc.title}**", ""]
        lines += [f"- {d}" for d in inc.details]
        if inc.decisions:
            lines.append("- decisions in its span: " + ", ".join(f"{k2} {v}" for k2, v in inc.decisions.items()))
        lines += ["", "What would have prevented it:", ""] + [f"- {p}" for p in inc.prevention] + [""]
    if len(incidents) > 100:
        lines.append(f"({len(incidents) - 100} more in the JSON output)")
    return lines


def plot_incidents(node: str, ticks, incidents: list[Incident], path: str, *, commands=(), policy_rows=()) -> None:
    """One node's run with its incidents: U_kv, waiting and running requests, preemptions per tick, the
    incidents' spans shaded by kind, the policy's commands and the governor's / admission's rows as marks."""
    # matplotlib takes a second to import: only when a plot is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(ticks, key=lambda t: t.ts_ns)
    x = [t.ts_ns / NS_PER_S for t in rows]
    fig, (ax_u, ax_q, ax_lanes) = plt.subplots(3, 1, figsize=(10, 6), sharex=True,
                                               gridspec_kw={"height_ratios": [2, 2, 1]})
    ax_u.plot(x, [t.u_kv for t in rows], color="tab:blue", marker=".", label="U_kv (KV cache use)")
    ax_u.set_ylim(0, 1.05)
    ax_u.set_ylabel("fraction")
    ax_q.plot(x, [t.requests_waiting for t in rows], color="tab:red", marker=".", label="waiting")
    ax_q.plot(x, [t.requests_running for t in rows], color="tab:green", marker=".", label="running")
    ax_q.bar(x, [t.preemptions for t in rows], width=(rows[0].tick_s * 0.8) if rows else 1.0, color="tab:purple",
             alpha=0.5, label="preemptions per tick")
    ax_q.set_ylabel("requests")
    colors = {"preemption_storm": "tab:purple", "refusals": "tab:red", "queueing": "tab:orange"}
    kinds = ["preemption_storm", "refusals", "queueing"]
    for inc in incidents:
        a, b = inc.start_ns / NS_PER_S, max(inc.end_ns, inc.start_ns + NS_PER_S) / NS_PER_S
        y = kinds.index(inc.kind)
        ax_lanes.broken_barh([(a, b - a)], (y - 0.4, 0.8), color=colors[inc.kind], alpha=0.5)
        for axis in (ax_u, ax_q):
            axis.axvspan(a, b, color=colors[inc.kind], alpha=0.06)
    cmds = [ts / NS_PER_S for ts, *_ in commands]
    ax_lanes.plot(cmds, [3] * len(cmds), "v", color="tab:blue", ms=4)
    pol = [r[0] / NS_PER_S for r in policy_rows]
    ax_lanes.plot(pol, [4] * len(pol), "|", color="tab:green", ms=8)
    ax_lanes.set_yticks(range(5))
    ax_lanes.set_yticklabels([*kinds, f"policy ({len(cmds)})", f"governor/admission ({len(pol)})"], fontsize=7)
    ax_lanes.set_ylim(-0.6, 4.6)
    ax_lanes.set_xlabel("event time (s)")
    ax_u.set_title(f"{node}: {len(incidents)} incident(s) that are not OOMs", fontsize=10)
    for axis in (ax_u, ax_q):
        axis.legend(loc="upper left", fontsize=7, ncol=3)
        axis.grid(alpha=0.2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
