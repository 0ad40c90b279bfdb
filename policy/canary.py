"""Canary rollout of a strategy variant (docs/ARCHITECTURE.md, "Canary rollout").

A candidate strategy replaces the control (the mode's current strategy) on a growing share of
the nodes, stage by stage (default 5 → 25 → 50 → 100 %), while the SLO ledger compares the two
groups; a stage that is worse for the candidate rolls every node back to the control at once.

* **Buckets.** ``node_bucket(node)`` is the first 8 bytes of SHA-256 over the node id's UTF-8
  bytes, big-endian, modulo 100: the same bucket in every process and on every restart (Python's
  ``hash`` is salted per process). At a stage of p % a node runs the candidate iff its bucket
  < p, so the candidate's nodes at one stage stay candidates at every later stage.
* **Outcomes.** Per stage and arm (control / candidate): node-hours (ticks × their ``tick_s``),
  OOMs, commands issued (and evictions among them), and evicted requests with their later
  outcome (completed or failed). They are recorded in the SLO ledger next to its weekly records,
  keyed by the rollout, not by the week; a record of another stage than the stored one (a policy
  instance that has not seen a move yet) does not count.
* **Rules** (``judge``), once both arms have ``min_node_hours`` in the stage: roll back when the
  candidate's OOMs per node-hour exceed the control's × ``oom_rate_factor``, or when both arms
  have ``min_resolved_evictions`` resolved evictions and the candidate's completion rate is
  below the control's − ``completion_margin``; promote to the next stage otherwise. Reaching the
  last stage (100 %) is the promotion: no control is left to compare with.
* **State** (stage, status, why) is stored with the ledger and moved by compare-and-set, so a
  restarted policy (or a second instance) goes on from the stored stage; until the state has
  been read every node runs the control. The same ticks give the same stage.

Pure: standard library and the policy core only; the ledgers (``policy.slo``,
``policy.slo_redis``) store the records.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from kvguard.contracts.commands import Action, Mode
from kvguard.contracts.dimensions import Granularity, HandlingChoice, Selection, Timing, Trigger
from kvguard.contracts.units import NS_PER_S
from kvguard.policy.strategy import PRESETS, Strategy, all_strategies

log = logging.getLogger(__name__)

CONTROL, CANDIDATE = "control", "candidate"
ARMS = (CONTROL, CANDIDATE)
RUNNING, PROMOTED, ROLLED_BACK = "running", "promoted", "rolled_back"
BUCKETS = 100
COUNT_FIELDS = ("ticks", "node_ms", "ooms", "commands", "evict_commands", "evictions", "completed", "failed")
PENDING = "pending"
MAX_EVICTED = 100_000  # evicted requests awaiting their outcome, per rollout (memory ledger)


class CanaryConfigError(ValueError):
    """A canary setting is wrong; ``field`` is its dotted path (``canary.candidate``)."""

    def __init__(self, field: str, value: Any, expected: str) -> None:
        super().__init__(f"{field}: got {value!r}, expected {expected}")
        self.field = field


def node_bucket(node: str) -> int:
    """The node's bucket in 0..99: SHA-256 of its id, first 8 bytes big-endian, mod 100."""
    digest = hashlib.sha256(node.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % BUCKETS


def in_candidate(node: str, percent: int) -> bool:
    return node_bucket(node) < percent


_DIMENSIONS = (Granularity, Selection, Timing, HandlingChoice, Trigger)
_GRID_SIZE = 3 ** len(_DIMENSIONS)


def resolve_candidate(name: str, control: Strategy) -> Strategy:
    """The candidate named by a preset (``default``/``emergency``), a grid index (0..242, the
    order of ``all_strategies``) or a variant (``request/cost/async/recompute/hard``); grid points
    keep the control's numbers. Raises ``CanaryConfigError`` naming ``canary.candidate``."""
    text = str(name).strip().lower()
    expected = (f"default|emergency, a grid index 0..{_GRID_SIZE - 1}, or a variant such as "
                "request/cost/async/recompute/hard")
    if text in PRESETS:
        candidate = PRESETS[text]
    elif text.isdigit():
        if int(text) >= _GRID_SIZE:
            raise CanaryConfigError("canary.candidate", name, expected)
        candidate = replace(all_strategies(control)[int(text)], name="canary")
    else:
        parts = text.split("/")
        if len(parts) != len(_DIMENSIONS):
            raise CanaryConfigError("canary.candidate", name, expected)
        try:
            values = [enum(part) for enum, part in zip(_DIMENSIONS, parts)]
        except ValueError:
            raise CanaryConfigError("canary.candidate", name, expected) from None
        g, s, t, h, tr = values
        candidate = replace(control, granularity=g, selection=s, timing=t, handling=h, trigger=tr, name="canary")
    if candidate.variant == control.variant:
        raise CanaryConfigError("canary.candidate", name, f"a variant other than the control's ({control.variant})")
    return candidate


@dataclass(slots=True, frozen=True)
class CanaryConfig:
    """``candidate`` replaces ``control`` (the strategy of ``mode``) on the candidate's nodes."""

    candidate: Strategy
    control: Strategy
    mode: Mode = Mode.DEFAULT
    stages: tuple[int, ...] = (5, 25, 50, 100)
    min_node_hours: float = 50.0
    oom_rate_factor: float = 1.5
    completion_margin: float = 0.05
    min_resolved_evictions: int = 20
    evaluate_every_s: float = 60.0
    rollout_id: str = ""

    def __post_init__(self) -> None:
        stages = tuple(self.stages)
        if (not stages or any(not 0 < p <= 100 for p in stages) or list(stages) != sorted(set(stages))
                or stages[-1] != 100):
            raise CanaryConfigError("canary.stages", list(stages), "increasing percentages in 1..100 ending at 100")
        if self.candidate.variant == self.control.variant:
            raise CanaryConfigError("canary.candidate", self.candidate.variant, "a variant other than the control's")
        for name in ("min_node_hours", "evaluate_every_s"):
            if not getattr(self, name) > 0:
                raise CanaryConfigError(f"canary.{name}", getattr(self, name), "a positive number")
        if not self.oom_rate_factor > 0:
            raise CanaryConfigError("canary.oom_rate_factor", self.oom_rate_factor, "a positive number")
        if not 0 <= self.completion_margin <= 1:
            raise CanaryConfigError("canary.completion_margin", self.completion_margin, "a fraction in [0, 1]")
        if any(c in self.rollout for c in "{}|"):
            raise CanaryConfigError("canary.rollout_id", self.rollout, "a name without {, } or |")

    @property
    def rollout(self) -> str:
        """The rollout's key in the ledger: ``rollout_id``, else ``<candidate>~<control>``."""
        return self.rollout_id or f"{self.candidate.variant}~{self.control.variant}"

    @property
    def last_stage(self) -> int:
        return len(self.stages) - 1

    def meta(self) -> dict[str, str]:
        return {"candidate": self.candidate.variant, "control": self.control.variant,
                "mode": str(self.mode), "stages": ",".join(str(p) for p in self.stages)}


@dataclass(slots=True, frozen=True)
class CanaryState:
    stage: int = 0
    status: str = RUNNING
    since_ns: int = 0
    reason: str = ""

    def percent(self, stages: tuple[int, ...]) -> int:
        """The share of buckets on the candidate: 0 after a rollback, 100 once promoted."""
        if self.status == ROLLED_BACK:
            return 0
        return 100 if self.status == PROMOTED else stages[min(self.stage, len(stages) - 1)]


@dataclass(slots=True, frozen=True)
class ArmStats:
    nodes: int = 0
    ticks: int = 0
    node_ms: int = 0
    ooms: int = 0
    commands: int = 0
    evict_commands: int = 0
    evictions: int = 0
    completed: int = 0
    failed: int = 0

    @property
    def node_hours(self) -> float:
        return self.node_ms / 3_600_000.0

    @property
    def ooms_per_node_hour(self) -> float | None:
        return self.ooms / self.node_hours if self.node_ms else None

    @property
    def resolved(self) -> int:
        return self.completed + self.failed

    @property
    def completion_rate(self) -> float | None:
        return self.completed / self.resolved if self.resolved else None

    def __add__(self, other: "ArmStats") -> "ArmStats":
        return ArmStats(*(getattr(self, f) + getattr(other, f) for f in self.__slots__))

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "ticks": self.ticks, "node_hours": round(self.node_hours, 6),
                "ooms": self.ooms, "ooms_per_node_hour": self.ooms_per_node_hour,
                "commands": self.commands, "evict_commands": self.evict_commands,
                "evictions": {"requests": self.evictions, "completed": self.completed, "failed": self.failed,
                              "pending": self.evictions - self.resolved, "completion_rate": self.completion_rate}}


@dataclass(slots=True, frozen=True)
class Verdict:
    action: str  # "promote" | "rollback"
    reason: str


def judge(config: CanaryConfig, control: ArmStats, candidate: ArmStats) -> Verdict | None:
    """The stage's verdict, or None while either arm has fewer than ``min_node_hours``."""
    need = config.min_node_hours
    if control.node_hours < need or candidate.node_hours < need:
        return None
    cand_rate, ctrl_rate = candidate.ooms_per_node_hour or 0.0, control.ooms_per_node_hour or 0.0
    if cand_rate > ctrl_rate * config.oom_rate_factor:
        return Verdict("rollback", f"candidate {cand_rate:.4g} OOMs/node-hour > control {ctrl_rate:.4g} "
                                   f"x {config.oom_rate_factor:g}")
    enough = min(control.resolved, candidate.resolved) >= max(1, config.min_resolved_evictions)
    if enough and candidate.completion_rate < control.completion_rate - config.completion_margin:
        return Verdict("rollback", f"candidate completion rate {candidate.completion_rate:.3f} < control "
                                   f"{control.completion_rate:.3f} - {config.completion_margin:g}")
    return Verdict("promote", f"candidate {cand_rate:.4g} OOMs/node-hour vs control {ctrl_rate:.4g}, completion "
                              f"{_rate(candidate.completion_rate)} vs {_rate(control.completion_rate)}")


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def next_state(config: CanaryConfig, state: CanaryState, verdict: Verdict, now_ns: int) -> CanaryState:
    if verdict.action == "rollback":
        return CanaryState(state.stage, ROLLED_BACK, now_ns, verdict.reason)
    stage = state.stage + 1
    return CanaryState(stage, PROMOTED if stage >= config.last_stage else RUNNING, now_ns, verdict.reason)


@dataclass(slots=True, frozen=True)
class CanaryReport:
    """One rollout as the ledger holds it: state, meta (variants, mode, stages), per-stage stats."""

    rollout: str
    state: CanaryState
    meta: Mapping[str, str]
    per_stage: Mapping[tuple[int, str], ArmStats]
    history: tuple[Mapping[str, Any], ...] = ()
    distinct_nodes: Mapping[str, int] = field(default_factory=dict)  # arm -> nodes over all stages

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(int(p) for p in str(self.meta.get("stages", "100")).split(",") if p)

    def arm(self, stage: int, arm: str) -> ArmStats:
        return self.per_stage.get((stage, arm), ArmStats())

    def total(self, arm: str) -> ArmStats:
        total = ArmStats()
        for (_, which), stats in sorted(self.per_stage.items()):
            if which == arm:
                total = total + stats
        return replace(total, nodes=self.distinct_nodes.get(arm, total.nodes))

    def to_dict(self) -> dict[str, Any]:
        stages = self.stages
        variants = [{"arm": arm, "variant": self.meta.get(arm, ""), **self.total(arm).to_dict()} for arm in ARMS]
        per_stage = [{"stage": i, "percent": p, **{arm: self.arm(i, arm).to_dict() for arm in ARMS}}
                     for i, p in enumerate(stages) if any((i, arm) in self.per_stage for arm in ARMS)]
        return {"rollout": self.rollout, "status": self.state.status, "stage": self.state.stage,
                "percent": self.state.percent(stages) if stages else None, "stages": list(stages),
                "mode": self.meta.get("mode"), "reason": self.state.reason, "since_ns": self.state.since_ns,
                "variants": variants, "per_stage": per_stage, "history": [dict(h) for h in self.history]}


def history_entry(old: CanaryState, new: CanaryState) -> str:
    return json.dumps({"from_stage": old.stage, "to_stage": new.stage, "status": new.status,
                       "ts_ns": new.since_ns, "reason": new.reason}, sort_keys=True)


# ----------------------------------------------------------------------------- memory records

@dataclass(slots=True)
class _Rollout:
    state: CanaryState
    meta: dict[str, str]
    hwm: dict[str, tuple[int, int]] = field(default_factory=dict)  # node -> (epoch, ts_ns) last counted
    counts: dict[tuple[int, str], dict[str, int]] = field(default_factory=dict)
    nodes: dict[tuple[int, str], set[str]] = field(default_factory=dict)
    evicted: dict[tuple[str, str], tuple[int, str, str]] = field(default_factory=dict)
    history: list[str] = field(default_factory=list)

    def counting(self, stage: int) -> bool:
        return self.state.stage == stage and self.state.status in (RUNNING, PROMOTED)


class MemoryCanaryLedger:
    """The canary records in memory (``MemorySloLedger`` is one); same semantics as Redis's.
    Record methods return True when the record counted."""

    def __init__(self) -> None:
        self._rollouts: dict[str, _Rollout] = {}

    def canary_begin(self, rollout: str, meta: Mapping[str, str]) -> CanaryState:
        """Register the rollout at stage 0 unless it is stored already; its stored state."""
        return self._rollouts.setdefault(rollout, _Rollout(CanaryState(), dict(meta))).state

    def canary_move(self, rollout: str, old: CanaryState, new: CanaryState) -> bool:
        """Compare-and-set: move only from ``old``'s stage and status."""
        held = self._rollouts.get(rollout)
        if held is None or (held.state.stage, held.state.status) != (old.stage, old.status):
            return False
        held.state = new
        held.history.append(history_entry(old, new))
        return True

    def record_canary_tick(self, rollout: str, stage: int, arm: str, node: str, epoch: int, ts_ns: int, *,
                           node_ms: int, ooms: int, commands: int, evict_commands: int) -> bool:
        held = self._rollouts.get(rollout)
        if held is None or not held.counting(stage) or (epoch, ts_ns) <= held.hwm.get(node, (-1, -1)):
            return False
        held.hwm[node] = (epoch, ts_ns)
        counts = held.counts.setdefault((stage, arm), dict.fromkeys(COUNT_FIELDS, 0))
        for name, value in (("ticks", 1), ("node_ms", node_ms), ("ooms", ooms), ("commands", commands),
                            ("evict_commands", evict_commands)):
            counts[name] += int(value)
        held.nodes.setdefault((stage, arm), set()).add(node)
        return True

    def record_canary_eviction(self, rollout: str, stage: int, arm: str, node: str, req: str) -> bool:
        held = self._rollouts.get(rollout)
        if held is None or not held.counting(stage) or (node, str(req)) in held.evicted:
            return False
        held.evicted[(node, str(req))] = (stage, arm, PENDING)
        while len(held.evicted) > MAX_EVICTED:
            del held.evicted[next(iter(held.evicted))]
        held.counts.setdefault((stage, arm), dict.fromkeys(COUNT_FIELDS, 0))["evictions"] += 1
        return True

    def record_canary_outcome(self, rollout: str, node: str, req: str, completed: bool) -> bool:
        held = self._rollouts.get(rollout)
        entry = held.evicted.get((node, str(req))) if held is not None else None
        if entry is None or entry[2] != PENDING:
            return False
        stage, arm, _ = entry
        outcome = "completed" if completed else "failed"
        held.evicted[(node, str(req))] = (stage, arm, outcome)
        held.counts.setdefault((stage, arm), dict.fromkeys(COUNT_FIELDS, 0))[outcome] += 1
        return True

    def canary_report(self, rollout: str) -> CanaryReport | None:
        held = self._rollouts.get(rollout)
        if held is None:
            return None
        keys = set(held.counts) | set(held.nodes)
        per_stage = {key: ArmStats(nodes=len(held.nodes.get(key, ())),
                                   **{f: held.counts.get(key, {}).get(f, 0) for f in COUNT_FIELDS})
                     for key in keys}
        distinct = {arm: len(set().union(*(nodes for (_, a), nodes in held.nodes.items() if a == arm)))
                    for arm in ARMS}
        return CanaryReport(rollout, held.state, dict(held.meta), per_stage,
                            tuple(json.loads(h) for h in held.history), distinct)

    def canary_rollouts(self) -> list[str]:
        return sorted(self._rollouts)


# ----------------------------------------------------------------------------- the rollout

@dataclass(slots=True, frozen=True)
class Transition:
    rollout: str
    old: CanaryState
    new: CanaryState


class Canary:
    """Which arm each node is on, fed by the policy's ticks, decisions and evictions.

    ``ledger``: anything with the canary record methods (``MemoryCanaryLedger``, the SLO ledgers).
    Ledger trouble is counted in ``errors`` and logged once, never raised: a ledger that cannot be
    read keeps the last known state (every node on the control before the first read)."""

    def __init__(self, config: CanaryConfig, ledger: Any) -> None:
        self.config = config
        self.ledger = ledger
        self.state: CanaryState | None = None
        self.transitions: list[Transition] = []
        self.errors = 0
        self._last_slot: int | None = None
        self._logged_error = False
        self.load()

    @property
    def rollout(self) -> str:
        return self.config.rollout

    @property
    def percent(self) -> int:
        return 0 if self.state is None else self.state.percent(self.config.stages)

    def load(self) -> CanaryState | None:
        """Read (or register) the stored state."""
        state = self._try(self.ledger.canary_begin, self.rollout, self.config.meta())
        if state is not None:
            self.state = state
        return self.state

    def arm(self, node: str) -> str:
        return CANDIDATE if in_candidate(node, self.percent) else CONTROL

    def strategy_for(self, mode: Mode, node: str, control: Strategy) -> Strategy:
        """The candidate on a candidate node in the canary's mode; ``control`` otherwise."""
        if mode is self.config.mode and self.arm(node) == CANDIDATE:
            return self.config.candidate
        return control

    def _counting(self) -> bool:
        return self.state is not None and self.state.status in (RUNNING, PROMOTED)

    def observe_decision(self, tick: Any, decision: Any) -> Transition | None:
        """Record a decided tick for its node's arm, then evaluate when an interval has passed."""
        if self._counting():
            commands = list(getattr(decision, "commands", ()))
            self._try(self.ledger.record_canary_tick, self.rollout, self.state.stage, self.arm(tick.node),
                      tick.node, int(getattr(tick, "epoch", 0) or 0), int(tick.ts_ns),
                      node_ms=int(round(float(tick.tick_s) * 1000)), ooms=int(tick.ooms),
                      commands=len(commands), evict_commands=sum(c.action is Action.EVICT for c in commands))
        return self.maybe_evaluate(int(tick.ts_ns))

    def observe_eviction(self, node: str, req: Any) -> None:
        if self._counting():
            self._try(self.ledger.record_canary_eviction, self.rollout, self.state.stage, self.arm(node),
                      node, str(req))

    def observe_outcome(self, node: str, req: Any, completed: bool) -> None:
        self._try(self.ledger.record_canary_outcome, self.rollout, node, str(req), completed)

    def maybe_evaluate(self, now_ns: int) -> Transition | None:
        """Evaluate once per ``evaluate_every_s`` of event time (the first tick after a start too)."""
        slot = now_ns // int(self.config.evaluate_every_s * NS_PER_S)
        if self._last_slot is not None and slot <= self._last_slot:
            return None
        self._last_slot = slot
        return self.evaluate(now_ns)

    def evaluate(self, now_ns: int) -> Transition | None:
        """Judge the current stage on the ledger's records; move (compare-and-set) on a verdict."""
        report = self._try(self.ledger.canary_report, self.rollout)
        if report is None:
            self.load()
            return None
        self.state = state = report.state
        if state.status != RUNNING or state.stage >= self.config.last_stage:
            return None
        verdict = judge(self.config, report.arm(state.stage, CONTROL), report.arm(state.stage, CANDIDATE))
        if verdict is None:
            return None
        new = next_state(self.config, state, verdict, now_ns)
        moved = self._try(self.ledger.canary_move, self.rollout, state, new)
        if moved is False:  # another instance moved first: take the stored state
            self.load()
            return None
        self.state = new  # True, or buffered while Redis is down (the move is replayed in order)
        transition = Transition(self.rollout, state, new)
        self.transitions.append(transition)
        log.warning("canary %s: %s (stage %d, %d%% -> %d%%): %s", self.rollout, verdict.action, state.stage,
                    state.percent(self.config.stages), new.percent(self.config.stages), verdict.reason)
        return transition

    def _try(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - an unreachable ledger must not stop the policy
            self.errors += 1
            if not self._logged_error:
                self._logged_error = True
                log.warning("canary %s: ledger call failed: %s: %s", self.rollout, type(err).__name__, err)
            return None
