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

import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import numpy as np

from kvguard.contracts.events import F_PROMPT_LOGPROBS, EventBatch, EventKind, OomCause, OomLayer, Outcome
from kvguard.contracts.tiers import ALERT_TIERS, TIER_NAMES
from kvguard.contracts.units import NS_PER_S
from kvguard.ml.dataset import firing_by_tier
from kvguard.ml.evaluation import lead_times_s
from kvguard.ops.rca_explain import OomContext, StepRequest, explain
from kvguard.ops.rca_incidents import find_incidents, incidents_markdown
from kvguard.streams.alerts import FIRING
from kvguard.streams.mirror import AllocatorMirror

TIERS = ALERT_TIERS
GIB = 1 << 30
_OOM_STEP = int(EventKind.OOM_STEP)
_ADMIT, _OOM, _RESET = int(EventKind.ADMIT), int(EventKind.OOM), int(EventKind.RESET)
_LIFECYCLE = [int(k) for k in (EventKind.ADMIT, EventKind.FINISH, EventKind.PREEMPT, EventKind.OOM, EventKind.RESET)]
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
    tick_s: float = 10.0
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
                   partial=bool(tick.partial), tick_s=float(tick.tick_s))


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
    context: OomContext | None = None  # what ``rca_explain.explain`` reads


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
    running: dict[int, set[int]] = field(default_factory=dict)  # epoch -> requests running (replay state)
    preempts: list[tuple[int, int, int]] = field(default_factory=list)  # (ts, req, epoch)
    # (ts, req, Outcome, epoch, aux: the Refusal of a REJECTED row) of FINISH rows that are not completions
    finishes: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    commands: list[tuple[int, str, int]] = field(default_factory=list)  # (ts, action, epoch) the policy would issue
    # GOVERN / ADMISSION rows when the log has them: (ts, kind, cls, flags, req, size, tokens, aux, epoch)
    policy_rows: list[tuple[int, int, int, int, int, int, int, int, int]] = field(default_factory=list)
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
        d["cause_key"] = self.cause_key
        # an allocator OOM's row is in bytes, its aux the reserved-but-unallocated bytes (not a free run)
        d["unit"] = "bytes" if self.allocator else "kv_units"
        if self.allocator:
            d["largest_free_run"] = None
        return d

    @property
    def cause_key(self) -> str:
        """``layer:cause`` as the engine counts it (``ooms_by_cause``), e.g. ``allocator:prompt_logprobs``."""
        if self.explanation is None:
            return "kv_arena:fragmentation" if self.fragmentation else "kv_arena:capacity"
        return f"{self.explanation['layer']}:{self.explanation['cause'].removeprefix('kv_')}"

    @property
    def allocator(self) -> bool:
        return self.layer == int(OomLayer.ALLOCATOR)

    def first_warning(self) -> str | None:
        best = max(self.tiers.values(), key=lambda t: t.lead_s, default=None)
        return best.tier if best is not None and best.lead_s > 0 else None


def replay(batches: Iterable[EventBatch], core, *, node: str | None = None,
           progress: Callable[[int], None] | None = None, policy=None) -> Replay:
    """Run ``batches`` (one log, in order) through ``core``; with ``node`` only that node's batches.
    ``progress(events_so_far)`` is called after each batch. A batch at or before its node's last
    ``(epoch, seq)`` is a duplicate (a log fed twice) and counted once only, as the core does;
    a batch the core rejects is counted in neither the events nor the OOMs, and listed in
    ``Replay.skipped`` (node, epoch, seq, reason) as the stream worker dead-letters it. The end of the
    log is the core's ``finish()``: each node's last, partial interval (its last OOM, say) gets its tick.
    ``policy``: a policy engine (``decide(tick)``) whose commands are kept per node for the timeline,
    executing nothing (as ``kvguard replay`` does)."""
    nodes: dict[str, NodeReplay] = {}
    mirrors: dict[str, AllocatorMirror] = {}
    cfg = core.config
    total = 0
    skipped: list[dict] = []
    current_epoch: dict[str, int] = {}

    def absorb(ticks, alerts) -> None:
        epoch_at: dict[tuple[str, int], int] = {}
        for tick in ticks:
            nr = nodes.setdefault(tick.node, NodeReplay(tick.node))
            nr.ticks.append(TickRow.of(tick))
            epoch_at[(tick.node, int(tick.ts_ns))] = int(getattr(tick, "epoch", 0))
            if policy is not None:
                nr.commands.extend((int(tick.ts_ns), str(c.action), int(getattr(tick, "epoch", 0)))
                                   for c in policy.decide(tick).commands)
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
    geometry = mirror.geometry if mirror is not None else batch.geometry
    running = _running_at_ooms(nr, ev, epoch)
    for i in np.flatnonzero(kind == EventKind.OOM).tolist():
        free = None
        alloc = None
        if mirror is not None:
            _apply(mirror, ev, start, i, batch, last_snap)
            start = i
            free = int(mirror.metrics().free_units)
            alloc = mirror.allocator.metrics()
        ctx = OomContext(layer=int(ev["cls"][i]), cause=int(ev["flags"][i]), requested=int(ev["size"][i]),
                         aux=int(ev["aux"][i]), kv_free_units=free, step_rows=_step_rows(ev, i),
                         lost=_lost(nr, ev, i, epoch, running.get(i, set())))
        if alloc is not None and alloc.segments:
            ctx.mirror_reserved, ctx.mirror_allocated = int(alloc.reserved_bytes), int(alloc.allocated_bytes)
            ctx.mirror_largest_free_block = int(alloc.largest_free_block_bytes)
        if geometry is not None:
            ctx.total_bytes, ctx.context_bytes = int(geometry.total_bytes), int(geometry.context_bytes)
            ctx.gpu_memory_utilization = float(geometry.gpu_memory_utilization)
        nr.ooms.append(OomRow(node=batch.node, ts_ns=int(ev["ts_ns"][i]), req=int(ev["req"][i]),
                              requested_units=int(ev["size"][i]), largest_free_run=int(ev["aux"][i]),
                              free_units=free, epoch=epoch, layer=int(ev["cls"][i]),
                              cause=int(ev["flags"][i]), context=ctx))
    if mirror is not None:
        _apply(mirror, ev, start, len(ev), batch, last_snap)
    _scan_incident_rows(nr, ev, epoch)


_GOVERN = int(EventKind.GOVERN)  # the step governor's rows
_ADMISSION = int(EventKind.ADMISSION)  # the admission gate's rows


def _scan_incident_rows(nr: NodeReplay, ev: np.ndarray, epoch: int) -> None:
    """Keep what the incidents and the timeline read: PREEMPT rows, FINISH rows that refused or rejected
    a request, and the governor's and admission's rows where the log has them."""
    kind = ev["kind"]
    for i in np.flatnonzero(kind == EventKind.PREEMPT).tolist():
        nr.preempts.append((int(ev["ts_ns"][i]), int(ev["req"][i]), epoch))
    fin = np.flatnonzero((kind == EventKind.FINISH) & (ev["flags"] != int(Outcome.COMPLETED))).tolist()
    for i in fin:
        nr.finishes.append((int(ev["ts_ns"][i]), int(ev["req"][i]), int(ev["flags"][i]), epoch, int(ev["aux"][i])))
    for i in np.flatnonzero((kind == _GOVERN) | (kind == _ADMISSION)).tolist():
        nr.policy_rows.append((int(ev["ts_ns"][i]), int(kind[i]), int(ev["cls"][i]), int(ev["flags"][i]),
                               int(ev["req"][i]), int(ev["size"][i]), int(ev["tokens"][i]), int(ev["aux"][i]), epoch))


def _step_rows(ev: np.ndarray, i: int) -> list[tuple[int, int, int, int, int, int, int]]:
    """The OOM_STEP rows written right before the OOM row ``i`` (contiguous with it)."""
    j = i
    while j > 0 and ev["kind"][j - 1] == _OOM_STEP:
        j -= 1
    rows = ev[j:i]
    return list(zip(rows["cls"].tolist(), rows["flags"].tolist(), rows["req"].tolist(), rows["offset"].tolist(),
                    rows["size"].tolist(), rows["tokens"].tolist(), rows["aux"].tolist()))


def _running_at_ooms(nr: NodeReplay, ev: np.ndarray, epoch: int) -> dict[int, set[int]]:
    """Row index of each OOM -> the requests running then (admitted, not finished, preempted or reset
    since), following the lifecycle rows in order; the node's running set carries over batches."""
    running = nr.running.setdefault(epoch, set())
    kind = ev["kind"]
    idx = np.flatnonzero(np.isin(kind, _LIFECYCLE)).tolist()
    out: dict[int, set[int]] = {}
    for i, k, req in zip(idx, kind[idx].tolist(), ev["req"][idx].tolist()):
        if k == _ADMIT:
            running.add(req)
        elif k == _OOM:
            out[i] = set(running)
        elif k == _RESET:
            running.clear()
        else:  # FINISH, PREEMPT
            running.discard(req)
    return out


def _lost(nr: NodeReplay, ev: np.ndarray, i: int, epoch: int, running: set[int]) -> list[StepRequest]:
    """The requests running when the engine crashed, with the shapes their ARRIVE rows give (what a log
    without OOM_STEP rows tells of the crashing step); their context from the FINISH FAILED_OOM row's
    generated tokens where the producer writes one."""
    ts = ev["ts_ns"][i]
    after = ev[i + 1:]
    mask = (after["kind"] == EventKind.FINISH) & (after["flags"] == int(Outcome.FAILED_OOM)) & (after["ts_ns"] == ts)
    generated = dict(zip(after["req"][mask].tolist(), after["tokens"][mask].tolist()))
    out = []
    for req in sorted(running):
        arr = nr.arrivals.get((epoch, req))
        prompt = arr[1] if arr else None
        gen = generated.get(req)
        out.append(StepRequest(req, None, prompt, None if prompt is None or gen is None else prompt + int(gen), None,
                               bool(arr and arr[3] & F_PROMPT_LOGPROBS)))
    return out


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
            admitted_lookback_s: float = ADMITTED_LOOKBACK_S, snapshot: dict | None = None) -> list[OomReport]:
    """One report per OOM, by node, producer run (epoch), then time. ``snapshot``: a PyTorch snapshot's
    figures (``producers.torch_snapshot.figures``) for the OOM it was taken at: the allocator OOM whose
    requested bytes its ``oom`` entry records, else the log's last allocator OOM."""
    if snapshot is not None:
        _attach_snapshot(rep, snapshot)
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


def _attach_snapshot(rep: Replay, snapshot: dict) -> None:
    ooms = [o for nr in rep.nodes.values() for o in nr.ooms
            if o.layer == int(OomLayer.ALLOCATOR) and o.context is not None]
    if not ooms:
        return
    asked = snapshot.get("requested_bytes")
    match = [o for o in ooms if asked is not None and o.requested_units == asked]
    (match or ooms)[-1].context.snapshot = snapshot


def incidents(rep: Replay, **kw) -> list:
    """Preemption storms, refusals and long queueing stretches (``kvguard.ops.rca_incidents``)."""
    return find_incidents(rep, commands={n: nr.commands for n, nr in rep.nodes.items()}, **kw)


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
        explanation = explain(oom.context).to_dict() if oom.context is not None else None
        if explanation is not None:
            _pressure(explanation, nr, epoch, oom.ts_ns, lookback_ns, before, kv)
        out.append(OomReport(
            node=name, ts_ns=oom.ts_ns, req=oom.req, requested_units=oom.requested_units,
            largest_free_run=oom.largest_free_run, free_units=oom.free_units if kv else None,
            fragmentation=is_fragmentation(oom.requested_units, oom.largest_free_run, oom.free_units) if kv
            else oom.cause == int(OomCause.FRAGMENTATION),
            last_ticks=before, tiers=outcomes,
            spans=[s for s in spans if (s.end_ns is None or s.end_ns >= oom.ts_ns - window_ns)
                   and s.start_ns <= oom.ts_ns],
            admitted=admitted, trigger=trigger, crashed_req_prompt_tokens=crashed[1] if crashed else None,
            epoch=epoch, layer=oom.layer, cause=oom.cause,
            explanation=explanation))
    return out


def _pressure(ex: dict, nr: NodeReplay, epoch: int, ts_ns: int, lookback_ns: int, before: list[TickRow],
              kv: bool) -> None:
    """KV pressure before the OOM: the preemptions of the minute before and the queue over the last ticks."""
    pre = [req for ts, req, e in nr.preempts if e == epoch and ts_ns - lookback_ns <= ts <= ts_ns]
    waiting = max((t.requests_waiting for t in before), default=0)
    ex["preemptions_before"] = len(pre)
    ex["waiting_max_before"] = waiting
    if pre or waiting:
        line = (f"KV pressure before it: {len(pre)} preemption(s) of {len(set(pre))} request(s) in the minute before, "
                f"up to {waiting} request(s) waiting over the last ticks")
        ex["details"].append(line)
        if kv and pre:
            ex["prevention"].append("admission that leaves room for the running requests' growth (a KV watermark, "
                                    "kvguard's admission guard) before the arena fills")


def prevention_summary(reports: list[OomReport]) -> dict:
    """What would have prevented the log's OOMs taken together: the lowest utilization any OOM needed, the
    smallest logprob-guard cap, the fragmentation OOMs (expandable_segments)."""
    utils, caps = [], []
    for r in reports:
        for p in (r.explanation or {}).get("prevention", []):
            m = re.match(r"--gpu-memory-utilization (\d+\.\d+)", p)
            if m:
                utils.append(float(m.group(1)))
            m = re.search(r"caps such a step at about ([\d,]+) tokens", p)
            if m:
                caps.append(int(m.group(1).replace(",", "")))
    frag = sum(1 for r in reports if (r.explanation or {}).get("allocator_reason") == "fragmentation")
    return {"gpu_memory_utilization": min(utils) if utils else None, "logprob_guard_cap_tokens": min(caps) if caps
            else None, "fragmentation_ooms": frag, "ooms_with_a_utilization": len(utils)}


def node_summaries(rep: Replay, reports: list[OomReport]) -> list[dict]:
    out = []
    for name in sorted(rep.nodes):
        nr = rep.nodes[name]
        mine = [r for r in reports if r.node == name]
        out.append({"node": name, "events": nr.events, "ticks": len(nr.ticks), "ooms": len(mine),
                    "fragmentation_ooms": sum(r.fragmentation for r in mine),
                    "alert_transitions": len(nr.transitions)})
    return out


def summary(rep: Replay, reports: list[OomReport], incidents: list | None = None) -> dict:
    tiers = TIERS if rep.with_lstm else TIERS[:2]
    leads = {t: [r.tiers[t].lead_s for r in reports] for t in tiers}
    return {
        "incidents": len(incidents or []),
        "incidents_by_kind": _count(i.kind for i in incidents or []),
        "incidents_by_cause": _count(f"{i.kind}:{i.cause}" for i in incidents or []),
        "skipped_batches": len(rep.skipped),
        "prevention": prevention_summary(reports),
        "ooms": len(reports),
        "fragmentation_ooms": sum(r.fragmentation for r in reports),
        "ooms_by_cause": _count(r.cause_key for r in reports),
        "nodes": len(rep.nodes),
        "tick_s": rep.tick_s,
        "lstm": rep.with_lstm,
        "warned": {t: sum(v > 0 for v in leads[t]) for t in tiers},
        "lead_time_median_s": {t: (round(float(np.median(v)), 3) if v else None) for t, v in leads.items()},
        "unwarned_ooms": sum(r.first_warning() is None for r in reports),
    }


def _count(items: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return dict(sorted(out.items()))


def markdown(reports: list[OomReport], summ: dict, images: dict[int, str], source: str,
             incidents: list | None = None, skipped: list[dict] | None = None,
             incident_images: dict[str, str] | None = None) -> str:
    by_cause = ", ".join(f"{k} {v}" for k, v in summ.get("ooms_by_cause", {}).items())
    lines = [f"# kvguard RCA: {source}", "",
             f"{summ['ooms']} OOM(s) on {summ['nodes']} node(s)" + (f" ({by_cause})" if by_cause else "")
             + f"; tick {summ['tick_s']:g} s, predictor tier {'on' if summ['lstm'] else 'off'}.", ""]
    pv = summ.get("prevention") or {}
    if pv.get("gpu_memory_utilization") is not None or pv.get("logprob_guard_cap_tokens") is not None \
            or pv.get("fragmentation_ooms"):
        lines += ["What would have prevented the OOMs taken together (estimates from the failures; each OOM's own "
                  "section says how):", ""]
        if pv.get("gpu_memory_utilization") is not None:
            lines.append(f"- --gpu-memory-utilization {pv['gpu_memory_utilization']:.2f} (the lowest any of "
                         f"{pv['ooms_with_a_utilization']} OOM(s) needed)")
        if pv.get("logprob_guard_cap_tokens") is not None:
            lines.append(f"- kvguard's logprob guard (--logprobs-guard): steps capped at about "
                         f"{pv['logprob_guard_cap_tokens']:,} tokens while a prompt-logprob request prefills")
        if pv.get("fragmentation_ooms"):
            lines.append(f"- PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for the {pv['fragmentation_ooms']} "
                         "OOM(s) the allocator saw as fragmentation")
        lines.append("")
    if skipped:
        lines += ["## Batches left out", "", "Invalid batches, named and skipped as the stream worker dead-letters "
                  "them; the rest of the log was replayed.", ""]
        lines += [f"- line {s.get('line') or '-'}: node {s.get('node')!s} epoch {s.get('epoch')} seq {s.get('seq')}: "
                  f"{s.get('reason')}" for s in skipped[:50]]
        lines.append("")
    if not reports:
        lines.append("No OOM in this log.")
    for i, r in enumerate(reports):
        ex = r.explanation or {}
        epoch = f" (producer run {r.epoch})" if r.epoch else ""
        lines += [f"## OOM {i + 1}: {r.node} at t={r.ts_s:.1f} s{epoch}: {r.cause_key}", ""]
        if r.allocator:
            lines += [f"**{ex.get('title', '')}**", ""]
            lines += [f"- {d}" for d in ex.get("details", [])]
            lines.append(f"- the allocator figures come from {ex.get('picture_source', '?')}; the step from "
                         f"{ex.get('step_source', '?')}")
        else:
            lines += [f"- requested {r.requested_units} units; largest free run {r.largest_free_run}; "
                      f"free units {r.free_units if r.free_units is not None else 'unknown'} -> "
                      f"**{'fragmentation OOM' if r.fragmentation else 'capacity OOM'}**"]
        lines.append("- lead time: " + ", ".join(f"{t.tier} {t.lead_s:.0f} s" + (f" ({', '.join(t.rules_firing)})"
                                                                                 if t.rules_firing else "")
                                                 for t in r.tiers.values()))
        if r.allocator and ex.get("requests"):
            lines += ["", "The requests in the crashing step:", "",
                      "| request | tokens in step | prompt | context | prompt logprobs | speculative |",
                      "|---:|---:|---:|---:|:---:|---:|"]
            reqs = sorted(ex["requests"], key=lambda q: (-(q["tokens"] or 0), -(q["prompt_tokens"] or 0)))
            for q in reqs[:12]:
                lines.append(f"| {q['req']} | {_n(q['tokens'])} | {_n(q['prompt_tokens'])} | {_n(q['context_tokens'])} | "
                             f"{'yes' if q['prompt_logprobs'] else ''} | {_n(q['spec_tokens'])} |")
            if len(reqs) > 12:
                lines.append(f"| … {len(reqs) - 12} more | | | | | |")
        if not r.allocator and r.trigger is not None:
            lines.append(f"- likely trigger: request {r.trigger.req}, prompt {r.trigger.prompt_tokens} tokens, "
                         f"admitted {(r.ts_ns - r.trigger.admit_ts_ns) / NS_PER_S:.1f} s before")
        lines.append("")
        lines.append(f"- {len(r.admitted)} request(s) admitted in the minute before")
        if ex.get("prevention"):
            lines += ["", "What would have prevented it:", ""] + [f"- {p}" for p in ex["prevention"]]
        if not r.last_ticks:
            lines.append("- no tick before the OOM (the log starts less than a tick before it)")
        elif r.allocator:
            lines += ["", "| t (s) | U_kv | reserved (GiB) | allocated (GiB) | reserved-but-unallocated (GiB) | "
                      "allocator F_ext | waiting | P(OOM) |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
            for t in r.last_ticks:
                p = "-" if t.p_oom is None else f"{t.p_oom:.3f}"
                lines.append(f"| {t.ts_ns / NS_PER_S:.0f} | {t.u_kv:.3f} | {t.alloc_reserved_bytes / GIB:.2f} | "
                             f"{t.alloc_allocated_bytes / GIB:.2f} | "
                             f"{(t.alloc_reserved_bytes - t.alloc_allocated_bytes) / GIB:.2f} | {t.alloc_f_ext:.3f} | "
                             f"{t.requests_waiting} | {p} |")
            lines.append("")
            lines.append("(the KV layer's F_ext is 0 by construction on this uniform-block pool: any free block "
                         "serves any request; the fragmentation that matters is the caching allocator's)")
        else:
            lines += ["", "| t (s) | U_kv | F_ext | F_int | Psi | largest run / requested | waiting | P(OOM) |",
                      "|---:|---:|---:|---:|---:|---:|---:|---:|"]
            for t in r.last_ticks:
                p = "-" if t.p_oom is None else f"{t.p_oom:.3f}"
                lines.append(f"| {t.ts_ns / NS_PER_S:.0f} | {t.u_kv:.3f} | {t.f_ext:.3f} | {t.f_int:.3f} | "
                             f"{t.psi:.3f} | {t.largest_free_run_units} / {r.requested_units} | {t.requests_waiting} | "
                             f"{p} |")
        if i in images:
            lines += ["", f"![OOM {i + 1}]({images[i]})"]
        lines.append("")
    if incidents is not None:
        lines += incidents_markdown(incidents, incident_images)
    return "\n".join(lines) + "\n"


def _n(v) -> str:
    return "-" if v is None else f"{v:,}"


def plot_oom(report: OomReport, ticks: list[TickRow], path: str, *, window_s: float,
             other_ooms_ns: Iterable[int] = (), commands: Iterable[tuple[int, str]] = (),
             policy_rows: Iterable[tuple] = ()) -> None:
    """The window before the OOM. A KV-arena OOM: U_kv and F_ext, largest-free-run/requested, P(OOM).
    An allocator OOM (where the KV layer has nothing to show: uniform blocks, KV F_ext 0 by
    construction): U_kv with the caching allocator's F_ext, its reserved / allocated /
    reserved-but-unallocated bytes against the requested size and the headroom start-up left, P(OOM).
    Then one lane per alert tier with its firing spans, a lane for the policy's commands and one for
    the governor's and admission's rows (when the log has them); the OOM (and earlier ones) marked."""
    # matplotlib takes a second to import: only when a plot is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lo = report.ts_ns - int(window_s * NS_PER_S)
    rows = [t for t in ticks if lo <= t.ts_ns <= report.ts_ns]
    minutes = lambda ns: (ns - report.ts_ns) / NS_PER_S / 60  # noqa: E731
    x = np.array([minutes(t.ts_ns) for t in rows])
    fig, axes = plt.subplots(4, 1, figsize=(10, 8), sharex=True, gridspec_kw={"height_ratios": [3, 2.4, 2, 1.6]})
    ax_u, ax_mid, ax_p, ax_lanes = axes
    ex = report.explanation or {}
    if rows:
        ax_u.plot(x, [t.u_kv for t in rows], label="U_kv (KV cache use)", color="tab:blue", marker=".")
        if report.allocator:
            ax_u.plot(x, [t.alloc_f_ext for t in rows], label="caching allocator F_ext", color="tab:green",
                      marker=".")
            ax_u.text(0.99, 0.04, "KV F_ext is 0 by construction (uniform blocks)", transform=ax_u.transAxes,
                      ha="right", fontsize=7, color="grey")
        else:
            ax_u.plot(x, [t.f_ext for t in rows], label="F_ext (KV arena)", color="tab:green", marker=".")
        p = np.array([np.nan if t.p_oom is None else t.p_oom for t in rows])
        if not np.all(np.isnan(p)):
            ax_p.plot(x, p, color="tab:red", marker=".", label="P(OOM)")
    if report.allocator:
        g = float(GIB)
        if rows:
            ax_mid.plot(x, [t.alloc_reserved_bytes / g for t in rows], color="tab:orange", marker=".",
                        label="reserved")
            ax_mid.plot(x, [t.alloc_allocated_bytes / g for t in rows], color="tab:brown", marker=".",
                        label="allocated")
            ax_mid.plot(x, [(t.alloc_reserved_bytes - t.alloc_allocated_bytes) / g for t in rows], color="tab:olive",
                        marker=".", label="reserved-but-unallocated")
        ax_mid.axhline(report.requested_units / g, color="red", ls="--", lw=1,
                       label=f"requested at the OOM ({report.requested_units / g:.2f} GiB)")
        if ex.get("startup_headroom_bytes"):
            ax_mid.axhline(ex["startup_headroom_bytes"] / g, color="grey", ls=":", lw=1,
                           label=f"headroom start-up left ({ex['startup_headroom_bytes'] / g:.2f} GiB)")
        if ex.get("device_free_bytes") is not None:
            room = (ex["device_free_bytes"] + (ex.get("reserved_unallocated_bytes") or 0)) / g
            ax_mid.scatter([0], [room], color="black", zorder=5, s=20,
                           label=f"device free + reserved-but-unallocated at the OOM ({room:.2f} GiB)")
        ax_mid.set_ylabel("allocator GiB")
        ax_mid.set_ylim(bottom=0)
    else:
        cap = 3.0
        if rows:
            ratio = [min(t.largest_free_run_units / max(report.requested_units, 1), cap) for t in rows]
            ax_mid.plot(x, ratio, color="black", marker=".", label=f"largest free run / requested (capped at {cap:g})")
        ax_mid.set_ylim(0, cap * 1.05)
        ax_mid.axhline(1.0, color="grey", ls=":", lw=1)
        ax_mid.text(-window_s / 60 if not rows else float(x.min()), 1.05, "fits", fontsize=7, color="grey")
        ax_mid.set_ylabel("run / requested")
    ax_u.set_xlim(-window_s / 60 if not rows else min(float(x.min()), -0.5), 0.25)
    ax_u.set_ylim(0, 1.05)
    ax_u.set_ylabel("fraction")
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
        for axis in (ax_u, ax_mid, ax_p):
            axis.axvspan(a, b, color=colors[s.tier], alpha=0.04)
    labels = [f"{t} ({report.tiers[t].lead_s:.0f} s)" for t in lanes]
    cmds = [(minutes(ts), a) for ts, a in commands if lo <= ts <= report.ts_ns]
    y_cmd = len(labels)
    labels.append(f"policy ({len(cmds)})")
    for xm, action in cmds:
        ax_lanes.plot([xm], [y_cmd], marker="v", color="tab:blue", ms=5)
    if cmds:
        ax_lanes.text(cmds[-1][0], y_cmd + 0.25, cmds[-1][1], fontsize=6)
    rows_pol = [r for r in policy_rows if lo <= r[0] <= report.ts_ns]
    y_pol = len(labels)
    labels.append(f"governor/admission ({len(rows_pol)})")
    for r in rows_pol:
        ax_lanes.plot([minutes(r[0])], [y_pol], marker="|", color="tab:green" if r[1] == _GOVERN else "tab:pink", ms=8)
    ax_lanes.set_yticks(range(len(labels)))
    ax_lanes.set_yticklabels(labels, fontsize=7)
    ax_lanes.set_ylim(-0.6, len(labels) - 0.4)
    ax_lanes.set_xlabel("minutes before the OOM (lanes: alert tiers with lead time, policy commands, governor and "
                        "admission rows)")
    for axis in axes:
        axis.axvline(0, color="red", lw=2)
        for t in other_ooms_ns:
            if lo <= t < report.ts_ns:
                axis.axvline(minutes(t), color="red", lw=1, ls="--")
        axis.grid(alpha=0.2)
    ax_u.plot([], [], color="red", lw=2, label="this OOM")
    ax_u.plot([], [], color="red", lw=1, ls="--", label="earlier OOM")
    if report.allocator:
        title = f"{report.node}: {report.cause_key} at t={report.ts_s:.1f} s (requested " \
                f"{report.requested_units / GIB:.2f} GiB, allocator {ex.get('allocator_reason')})"
    else:
        kind = "fragmentation" if report.fragmentation else "capacity"
        title = f"{report.node}: {kind} OOM at t={report.ts_s:.1f} s (requested {report.requested_units} units, " \
                f"largest free run {report.largest_free_run}, free {report.free_units})"
    ax_u.set_title(title, fontsize=10)
    ax_u.legend(loc="upper left", fontsize=7, ncol=4)
    for axis in (ax_mid, ax_p):
        if any(not line.get_label().startswith("_") for line in axis.lines) or axis.collections:
            axis.legend(loc="upper left", fontsize=7, ncol=2)
    fig.align_ylabels(axes)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
