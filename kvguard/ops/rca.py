"""Root-cause analysis of OOMs in a recorded event log (``kvguard rca``).

``replay`` runs the batches through a ``StreamCore`` (ticks, alerts) and, next to it, one allocator
mirror per node applied up to each OOM row, so the free units *at the OOM* are known (a tick is up
to ``tick_s`` stale). It also keeps the ARRIVE/ADMIT rows (prompt tokens per admitted request).
``analyse`` turns that into one ``OomReport`` per OOM: the last ticks before it, each alert tier's
lead time (``kvguard.ml.evaluation.lead_times_s`` over ``kvguard.ml.dataset.firing_by_tier``), whether it
was a fragmentation OOM (free units >= requested but largest free run < requested) and the
requests admitted in the minute before.

Pure-ish: numpy and the standard library plus kvguard/streams modules; time comes from the events.
``plot_oom`` imports matplotlib (Agg) inside.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import numpy as np

from kvguard.contracts.events import EventBatch, EventKind, OomCause, OomLayer
from kvguard.contracts.tiers import ALERT_TIERS, TIER_NAMES
from kvguard.contracts.units import NS_PER_S
from kvguard.ml.dataset import firing_by_tier
from kvguard.ml.evaluation import lead_times_s
from kvguard.streams.alerts import FIRING
from kvguard.streams.mirror import AllocatorMirror

TIERS = ALERT_TIERS
ADMITTED_LOOKBACK_S = 60.0


@dataclass(slots=True)
class TickRow:
    """The fields of one stream tick that the report shows (a ``Tick`` without its candidates)."""

    ts_ns: int
    synced: bool
    u_kv: float
    f_ext: float
    f_int: float
    psi: float
    free_units: int
    largest_free_run_units: int
    requests_waiting: int
    p_oom: float | None
    epoch: int = 0  # the producer run: ts_ns orders ticks only within one epoch (a restart's clock starts over)
    alloc_reserved_bytes: int = 0
    alloc_allocated_bytes: int = 0
    alloc_f_ext: float = 0.0
    preemptions: int = 0
    ooms: int = 0
    arrivals: int = 0
    requests_running: int = 0
    unit_bytes: int = 0
    partial: bool = False

    @classmethod
    def of(cls, tick) -> "TickRow":
        return cls(ts_ns=int(tick.ts_ns), synced=bool(tick.synced), u_kv=float(tick.u_kv), f_ext=float(tick.f_ext),
                   f_int=float(tick.f_int), psi=float(tick.psi), free_units=int(tick.free_units),
                   largest_free_run_units=int(tick.largest_free_run_units),
                   requests_waiting=int(tick.requests_waiting),
                   p_oom=None if tick.p_oom is None else float(tick.p_oom), epoch=int(getattr(tick, "epoch", 0)),
                   alloc_reserved_bytes=int(tick.alloc_reserved_bytes),
                   alloc_allocated_bytes=int(tick.alloc_allocated_bytes), alloc_f_ext=float(tick.alloc_f_ext),
                   preemptions=int(tick.preemptions), ooms=int(tick.ooms), arrivals=int(tick.arrivals),
                   requests_running=int(tick.requests_running), unit_bytes=int(tick.unit_bytes),
                   partial=bool(tick.partial))


@dataclass(slots=True)
class OomRow:
    """One OOM event row, with the mirror's free units just before it (None: no geometry yet)."""

    node: str
    ts_ns: int
    req: int
    requested_units: int
    largest_free_run: int
    free_units: int | None
    epoch: int = 0
    layer: int = 0  # OomLayer: KV_ARENA (units) or ALLOCATOR (bytes)
    cause: int = 0  # OomCause (the row's flags)


@dataclass(slots=True)
class Admitted:
    req: int
    admit_ts_ns: int
    arrive_ts_ns: int | None
    prompt_tokens: int | None
    priority: int | None


@dataclass(slots=True)
class AlertSpan:
    rule: str
    tier: str
    start_ns: int
    end_ns: int | None  # None: still firing at the end of the log


@dataclass(slots=True)
class NodeReplay:
    node: str
    ticks: list[TickRow] = field(default_factory=list)
    transitions: list[tuple[int, str, int, bool]] = field(default_factory=list)  # (ts, rule, tier, firing)
    transition_epochs: list[int] = field(default_factory=list)  # the epoch of each transition
    ooms: list[OomRow] = field(default_factory=list)
    # (epoch, req) -> (ts, prompt tokens, priority, ARRIVE flags): request ids are per producer run
    arrivals: dict[tuple[int, int], tuple[int, int, int, int]] = field(default_factory=dict)
    admits: list[tuple[int, int, int]] = field(default_factory=list)  # (ts, req, epoch)
    events: int = 0
    duplicates: int = 0  # batches at or before the node's last (epoch, seq): a log fed twice, a redelivery
    rejected: int = 0  # batches the stream core rejected (impossible contents, an epoch jump)


@dataclass(slots=True)
class Replay:
    nodes: dict[str, NodeReplay]
    tick_s: float
    with_lstm: bool
    skipped: list[dict] = field(default_factory=list)  # batches left out: {line, node, epoch, seq, reason}


@dataclass(slots=True)
class TierOutcome:
    tier: str
    lead_s: float  # 0 = not firing at the last tick before the OOM (a miss)
    rules_firing: list[str]  # rules of the tier firing at the last tick before the OOM


@dataclass(slots=True)
class OomReport:
    node: str
    ts_ns: int
    req: int
    requested_units: int
    largest_free_run: int
    free_units: int | None
    fragmentation: bool
    last_ticks: list[TickRow]
    tiers: dict[str, TierOutcome]
    spans: list[AlertSpan]
    admitted: list[Admitted]
    trigger: Admitted | None  # the longest prompt admitted in the minute before, if any
    crashed_req_prompt_tokens: int | None
    epoch: int = 0
    layer: int = 0  # OomLayer
    cause: int = 0  # OomCause (the OOM row's flags)
    explanation: dict | None = None  # kvguard.ops.rca_explain: the allocator picture, the step, prevention

    @property
    def ts_s(self) -> float:
        return self.ts_ns / NS_PER_S

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ts_s"] = round(self.ts_s, 3)
        d["first_warning_tier"] = self.first_warning()
        return d

    def first_warning(self) -> str | None:
        best = max(self.tiers.values(), key=lambda t: t.lead_s, default=None)
        return best.tier if best is not None and best.lead_s > 0 else None


def replay(batches: Iterable[EventBatch], core, *, node: str | None = None,
           progress: Callable[[int], None] | None = None) -> Replay:
    """Run ``batches`` (one log, in order) through ``core``; with ``node`` only that node's batches.
    ``progress(events_so_far)`` is called after each batch. A batch at or before its node's last
    ``(epoch, seq)`` is a duplicate (a log fed twice) and counted once only, as the core does;
    a batch the core rejects is counted in neither the events nor the OOMs, and listed in
    ``Replay.skipped`` (node, epoch, seq, reason) as the stream worker dead-letters it. The end of the
    log is the core's ``finish()``: each node's last, partial interval (its last OOM, say) gets its tick."""
    nodes: dict[str, NodeReplay] = {}
    mirrors: dict[str, AllocatorMirror] = {}
    cfg = core.config
    total = 0
    skipped: list[dict] = []
    current_epoch: dict[str, int] = {}

    def absorb(ticks, alerts) -> None:
        epoch_at: dict[tuple[str, int], int] = {}
        for tick in ticks:
            nodes.setdefault(tick.node, NodeReplay(tick.node)).ticks.append(TickRow.of(tick))
            epoch_at[(tick.node, int(tick.ts_ns))] = int(getattr(tick, "epoch", 0))
        for a in alerts:
            nr = nodes.setdefault(a.node, NodeReplay(a.node))
            nr.transitions.append((int(a.ts_ns), a.rule, int(a.tier), a.state == FIRING))
            nr.transition_epochs.append(epoch_at.get((a.node, int(a.ts_ns)), current_epoch.get(a.node, 0)))

    position: dict[str, tuple[int, int]] = {}  # node -> (epoch, seq) of its last applied batch
    for batch in batches:
        if node is not None and batch.node != node:
            continue
        nr = nodes.setdefault(batch.node, NodeReplay(batch.node))
        key = (batch.epoch, batch.seq)
        if batch.node in position and key <= position[batch.node]:
            nr.duplicates += 1
            continue
        outputs = core.process(batch)
        if core.rejected:
            nr.rejected += 1
            skipped.extend({"line": None, "node": r.batch.node, "epoch": int(r.batch.epoch), "seq": int(r.batch.seq),
                            "reason": f"{r.reason}: {r.detail}"} for r in core.rejected)
            absorb(*outputs)
            continue
        position[batch.node] = key
        current_epoch[batch.node] = int(batch.epoch)
        ev = batch.events
        nr.events += len(ev)
        total += len(ev)
        _scan_rows(nr, batch, mirrors, cfg)
        absorb(*outputs)
        if progress is not None:
            progress(total)
    absorb(*core.finish())
    return Replay(nodes=nodes, tick_s=float(cfg.tick_s), with_lstm=core.predictor is not None, skipped=skipped)


def _scan_rows(nr: NodeReplay, batch: EventBatch, mirrors: dict[str, AllocatorMirror], cfg) -> None:
    """Keep ARRIVE/ADMIT rows; apply the batch to this node's own mirror, stopping at each OOM row
    to read the free units at that moment."""
    ev = batch.events
    kind = ev["kind"]
    epoch = int(batch.epoch)
    for i in np.flatnonzero(kind == EventKind.ARRIVE).tolist():
        nr.arrivals[(epoch, int(ev["req"][i]))] = (int(ev["ts_ns"][i]), int(ev["tokens"][i]), int(ev["cls"][i]),
                                                   int(ev["flags"][i]))
    for i in np.flatnonzero(kind == EventKind.ADMIT).tolist():
        nr.admits.append((int(ev["ts_ns"][i]), int(ev["req"][i]), epoch))
    mirror = mirrors.get(batch.node)
    if batch.geometry is not None and (mirror is None or mirror.geometry != batch.geometry):
        mirror = mirrors[batch.node] = AllocatorMirror(batch.geometry, reserved_frac=cfg.reserved_frac,
                                                       alpha=cfg.alpha, beta=cfg.beta)
    snaps = np.flatnonzero(kind == EventKind.SNAPSHOT)
    last_snap = int(snaps[-1]) if snaps.size else -1
    start = 0
    for i in np.flatnonzero(kind == EventKind.OOM).tolist():
        free = None
        if mirror is not None:
            _apply(mirror, ev, start, i, batch, last_snap)
            start = i
            free = int(mirror.metrics().free_units)
        nr.ooms.append(OomRow(node=batch.node, ts_ns=int(ev["ts_ns"][i]), req=int(ev["req"][i]),
                              requested_units=int(ev["size"][i]), largest_free_run=int(ev["aux"][i]),
                              free_units=free, epoch=int(batch.epoch), layer=int(ev["cls"][i]),
                              cause=int(ev["flags"][i])))
    if mirror is not None:
        _apply(mirror, ev, start, len(ev), batch, last_snap)


def _apply(mirror: AllocatorMirror, ev: np.ndarray, start: int, stop: int, batch: EventBatch, last_snap: int) -> None:
    if stop > start:
        mirror.apply(ev[start:stop], batch.state if start <= last_snap < stop else None)


def is_fragmentation(requested_units: int, largest_free_run: int, free_units: int | None) -> bool:
    """Free space would have sufficed, only a contiguous run was missing."""
    return free_units is not None and free_units >= requested_units and largest_free_run < requested_units


def alert_spans(transitions: list[tuple[int, str, int, bool]]) -> list[AlertSpan]:
    """Firing spans per rule from one node's alert transitions, in emission order."""
    open_: dict[str, tuple[int, int]] = {}
    spans: list[AlertSpan] = []
    for ts, rule, tier, firing in transitions:
        if firing and rule not in open_:
            open_[rule] = (ts, tier)
        elif not firing and rule in open_:
            start, t = open_.pop(rule)
            spans.append(AlertSpan(rule, TIER_NAMES[t], start, ts))
    spans.extend(AlertSpan(rule, TIER_NAMES[t], start, None) for rule, (start, t) in open_.items())
    return sorted(spans, key=lambda s: (s.start_ns, s.rule))


def analyse(rep: Replay, *, window_s: float = 1800.0, last_ticks: int = 6,
            admitted_lookback_s: float = ADMITTED_LOOKBACK_S) -> list[OomReport]:
    """One report per OOM, by node then time."""
    out: list[OomReport] = []
    window_ns = int(window_s * NS_PER_S)
    lookback_ns = int(admitted_lookback_s * NS_PER_S)
    for name in sorted(rep.nodes):
        nr = rep.nodes[name]
        if not nr.ooms:
            continue
        # one producer run (epoch) at a time: a restarted producer's clock starts over, so ticks,
        # alerts and OOMs are ordered by event time only within their epoch
        for epoch in sorted({o.epoch for o in nr.ooms}):
            out += _analyse_epoch(rep, nr, epoch, window_ns, lookback_ns, last_ticks)
    return out


def _analyse_epoch(rep: Replay, nr: NodeReplay, epoch: int, window_ns: int, lookback_ns: int,
                   last_ticks: int) -> list[OomReport]:
    name = nr.node
    out: list[OomReport] = []
    ticks = sorted((t for t in nr.ticks if t.epoch == epoch), key=lambda t: t.ts_ns)
    ts = np.array([t.ts_ns for t in ticks], dtype=np.int64)
    transitions = [tr for tr, e in zip(nr.transitions, nr.transition_epochs) if e == epoch]
    firing = firing_by_tier(ts, transitions)
    ooms = sorted((o for o in nr.ooms if o.epoch == epoch), key=lambda o: o.ts_ns)
    oom_ts = np.array([o.ts_ns for o in ooms], dtype=np.int64)
    tiers = TIERS if rep.with_lstm else TIERS[:2]
    leads = {tier: lead_times_s(ts, firing[tier], oom_ts) for tier in tiers}
    spans = alert_spans(transitions)
    admits = sorted((a for a in nr.admits if a[2] == epoch), key=lambda a: a[0])
    admit_ts = np.array([a for a, _, _ in admits], dtype=np.int64)
    for k, oom in enumerate(ooms):
        last = int(np.searchsorted(ts, oom.ts_ns, side="left"))  # ticks [.., last) are before the OOM
        before = ticks[max(0, last - last_ticks):last]
        outcomes = {}
        for tier in tiers:
            rules = sorted({s.rule for s in spans if s.tier == tier and last > 0
                            and s.start_ns <= ts[last - 1] and (s.end_ns is None or s.end_ns > ts[last - 1])})
            outcomes[tier] = TierOutcome(tier, float(leads[tier][k]), rules)
        lo = np.searchsorted(admit_ts, oom.ts_ns - lookback_ns, "left")
        hi = np.searchsorted(admit_ts, oom.ts_ns, "right")
        admitted = []
        for a_ts, req, _ in admits[lo:hi]:
            arr = nr.arrivals.get((epoch, req))
            admitted.append(Admitted(req, a_ts, arr[0] if arr else None, arr[1] if arr else None,
                                     arr[2] if arr else None))
        with_prompt = [a for a in admitted if a.prompt_tokens is not None]
        trigger = max(with_prompt, key=lambda a: (a.prompt_tokens, a.admit_ts_ns)) if with_prompt else None
        crashed = nr.arrivals.get((epoch, oom.req))
        kv = oom.layer == int(OomLayer.KV_ARENA)
        out.append(OomReport(
            node=name, ts_ns=oom.ts_ns, req=oom.req, requested_units=oom.requested_units,
            largest_free_run=oom.largest_free_run, free_units=oom.free_units if kv else None,
            fragmentation=is_fragmentation(oom.requested_units, oom.largest_free_run, oom.free_units) if kv
            else oom.cause == int(OomCause.FRAGMENTATION),
            last_ticks=before, tiers=outcomes,
            spans=[s for s in spans if (s.end_ns is None or s.end_ns >= oom.ts_ns - window_ns)
                   and s.start_ns <= oom.ts_ns],
            admitted=admitted, trigger=trigger, crashed_req_prompt_tokens=crashed[1] if crashed else None,
            epoch=epoch, layer=oom.layer, cause=oom.cause))
    return out


def node_summaries(rep: Replay, reports: list[OomReport]) -> list[dict]:
    out = []
    for name in sorted(rep.nodes):
        nr = rep.nodes[name]
        mine = [r for r in reports if r.node == name]
        out.append({"node": name, "events": nr.events, "ticks": len(nr.ticks), "ooms": len(mine),
                    "fragmentation_ooms": sum(r.fragmentation for r in mine),
                    "alert_transitions": len(nr.transitions)})
    return out


def summary(rep: Replay, reports: list[OomReport]) -> dict:
    tiers = TIERS if rep.with_lstm else TIERS[:2]
    leads = {t: [r.tiers[t].lead_s for r in reports] for t in tiers}
    return {
        "ooms": len(reports),
        "fragmentation_ooms": sum(r.fragmentation for r in reports),
        "nodes": len(rep.nodes),
        "tick_s": rep.tick_s,
        "lstm": rep.with_lstm,
        "warned": {t: sum(v > 0 for v in leads[t]) for t in tiers},
        "lead_time_median_s": {t: (round(float(np.median(v)), 3) if v else None) for t, v in leads.items()},
        "unwarned_ooms": sum(r.first_warning() is None for r in reports),
    }


def markdown(reports: list[OomReport], summ: dict, images: dict[int, str], source: str) -> str:
    lines = [f"# kvguard RCA: {source}", "",
             f"{summ['ooms']} OOM(s) on {summ['nodes']} node(s), {summ['fragmentation_ooms']} from fragmentation; "
             f"tick {summ['tick_s']:g} s, predictor tier {'on' if summ['lstm'] else 'off'}.", ""]
    if not reports:
        lines.append("No OOM in this log.")
    for i, r in enumerate(reports):
        lines += [f"## OOM {i + 1}: {r.node} at t={r.ts_s:.1f} s", "",
                  f"- requested {r.requested_units} units; largest free run {r.largest_free_run}; "
                  f"free units {r.free_units if r.free_units is not None else 'unknown'} -> "
                  f"**{'fragmentation OOM' if r.fragmentation else 'capacity OOM'}**",
                  "- lead time: " + ", ".join(f"{t.tier} {t.lead_s:.0f} s" + (f" ({', '.join(t.rules_firing)})"
                                                                               if t.rules_firing else "")
                                               for t in r.tiers.values())]
        if r.trigger is not None:
            lines.append(f"- likely trigger: request {r.trigger.req}, prompt {r.trigger.prompt_tokens} tokens, "
                         f"admitted {(r.ts_ns - r.trigger.admit_ts_ns) / NS_PER_S:.1f} s before")
        lines.append(f"- {len(r.admitted)} request(s) admitted in the minute before")
        if not r.last_ticks:
            lines.append("- no tick before the OOM (the log starts less than a tick before it)")
        lines += ["", "| t (s) | U_kv | F_ext | F_int | Psi | largest run / requested | waiting | P(OOM) |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for t in r.last_ticks:
            p = "-" if t.p_oom is None else f"{t.p_oom:.3f}"
            lines.append(f"| {t.ts_ns / NS_PER_S:.0f} | {t.u_kv:.3f} | {t.f_ext:.3f} | {t.f_int:.3f} | {t.psi:.3f} | "
                         f"{t.largest_free_run_units} / {r.requested_units} | {t.requests_waiting} | {p} |")
        if i in images:
            lines += ["", f"![OOM {i + 1}]({images[i]})"]
        lines.append("")
    return "\n".join(lines) + "\n"


def plot_oom(report: OomReport, ticks: list[TickRow], path: str, *, window_s: float,
             other_ooms_ns: Iterable[int] = ()) -> None:
    """U_kv and F_ext, largest-free-run/requested and P(OOM) over the window before the OOM; one lane
    per alert tier with its firing spans shaded; the OOM (and earlier OOMs of the node) marked."""
    # matplotlib takes a second to import: only when a plot is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lo = report.ts_ns - int(window_s * NS_PER_S)
    rows = [t for t in ticks if lo <= t.ts_ns <= report.ts_ns]
    minutes = lambda ns: (ns - report.ts_ns) / NS_PER_S / 60  # noqa: E731
    x = np.array([minutes(t.ts_ns) for t in rows])
    fig, axes = plt.subplots(4, 1, figsize=(10, 7.5), sharex=True,
                             gridspec_kw={"height_ratios": [3, 2, 2, 1.2]})
    ax_u, ax_run, ax_p, ax_lanes = axes
    if rows:
        ax_u.plot(x, [t.u_kv for t in rows], label="U_kv", color="tab:blue", marker=".")
        ax_u.plot(x, [t.f_ext for t in rows], label="F_ext", color="tab:green", marker=".")
        cap = 3.0
        ratio = [min(t.largest_free_run_units / max(report.requested_units, 1), cap) for t in rows]
        ax_run.plot(x, ratio, color="black", marker=".", label=f"largest free run / requested (capped at {cap:g})")
        ax_run.set_ylim(0, cap * 1.05)
        p = np.array([np.nan if t.p_oom is None else t.p_oom for t in rows])
        if not np.all(np.isnan(p)):
            ax_p.plot(x, p, color="tab:red", marker=".", label="P(OOM)")
    ax_run.axhline(1.0, color="grey", ls=":", lw=1)
    ax_run.text(-window_s / 60 if not rows else float(x.min()), 1.05, "fits", fontsize=7, color="grey")
    ax_u.set_xlim(-window_s / 60 if not rows else min(float(x.min()), -0.5), 0.25)
    ax_u.set_ylim(0, 1.05)
    ax_u.set_ylabel("fraction of D")
    ax_run.set_ylabel("run / requested")
    ax_p.set_ylim(0, 1.05)
    ax_p.set_ylabel("P(OOM)")
    lanes = [t for t in TIERS if t in report.tiers]
    colors = {"threshold": "tab:orange", "slope": "tab:purple", "lstm": "tab:red"}
    for s in report.spans:
        if s.tier not in lanes:
            continue
        a = minutes(max(s.start_ns, lo))
        b = minutes(report.ts_ns if s.end_ns is None else min(s.end_ns, report.ts_ns))
        y = lanes.index(s.tier)
        ax_lanes.broken_barh([(a, max(b - a, 1e-3))], (y - 0.4, 0.8), color=colors[s.tier], alpha=0.35)
        for axis in (ax_u, ax_run, ax_p):
            axis.axvspan(a, b, color=colors[s.tier], alpha=0.04)
    ax_lanes.set_yticks(range(len(lanes)))
    ax_lanes.set_yticklabels([f"{t} ({report.tiers[t].lead_s:.0f} s)" for t in lanes], fontsize=8)
    ax_lanes.set_ylim(-0.6, len(lanes) - 0.4)
    ax_lanes.set_xlabel("minutes before the OOM (alert lanes: tier, lead time)")
    for axis in axes:
        axis.axvline(0, color="red", lw=2)
        for t in other_ooms_ns:
            if lo <= t < report.ts_ns:
                axis.axvline(minutes(t), color="red", lw=1, ls="--")
        axis.grid(alpha=0.2)
    ax_u.plot([], [], color="red", lw=2, label="this OOM")
    ax_u.plot([], [], color="red", lw=1, ls="--", label="earlier OOM")
    kind = "fragmentation" if report.fragmentation else "capacity"
    ax_u.set_title(f"{report.node}: {kind} OOM at t={report.ts_s:.1f} s "
                   f"(requested {report.requested_units} units, largest free run {report.largest_free_run}, "
                   f"free {report.free_units})", fontsize=10)
    ax_u.legend(loc="upper left", fontsize=8, ncol=4)
    for axis in (ax_run, ax_p):
        if any(not line.get_label().startswith("_") for line in axis.lines):
            axis.legend(loc="upper left", fontsize=8)
    fig.align_ylabels(axes)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
