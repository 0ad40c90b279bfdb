"""Carry out one verified command on a node's engine, through the engine port (kvguard.contracts.engine).

The executor translates a command's payload into port calls; it never checks signatures, TTLs or
duplicates (``actuators.actuator`` does that before calling it) and never reads a clock. Each action
maps to one typed method of the port (the table in ``Executor.__init__``), and runs only where the
engine's ``Capabilities`` say it has the knob: elsewhere the ack is NOOP with the engine's reason.

Check, then act: a payload whose numbers exceed what this node has (a headroom, a target's units,
a reclaim or a compaction larger than its pool of ``pool_units``) is refused as REJECTED_PAYLOAD
with the reason before anything changes. Static bounds (negative numbers, absurd sizes) never get
here: the payload refuses them when it is built (``kvguard.contracts.commands``).

* ``evict``: for each target, free memory at the payload's granularity and handling:
  - request: every page (``evict_request(granularity="request")``); the request goes back to the
    waiting queue (recompute), the swapped queue (swap, checkpoint) and returns later;
  - block: the tail pages that cover the target's units (all private pages when units = 0),
    never the shared prefix: the request keeps its prefix and re-prefills only the tail;
  - token: the least recently written private page runs covering the units (the oldest
    non-shared pages of its page table).
  A granularity the engine does not offer is a NOOP with its reason; a handling it does not offer
  is carried out as recompute, with a note. A swap that finds the host swap space full falls back
  to recompute (noted). A target that already finished (or is not running any more) is a no-op,
  never an error.
* ``compact``: migrate up to ``max_moves`` pages so that free runs coalesce.
* ``reclaim``: drop up to ``units`` units of cached prefix pages.
* ``headroom``: hold ``units`` back from admission on top of the engine's own watermark (0
  releases it). Evicted requests go back to the engine's queues and are re-admitted as soon as the
  free-space count allows, so without this an eviction only buys time; with it the freed space
  stays free and the next step's workspace and pages find contiguous room.
* ``batch_cap``: cap the engine's per-step token budget (vLLM's ``max_num_batched_tokens``).
* ``hold`` / ``release``: hold admissions of prompts longer than ``max_prompt_tokens`` (0: all, a
  drain) for ``steps`` steps, or end the hold.
* ``abort``: end each request now (a finished one is a no-op).
* ``empty_cache``: return cached allocator segments to the device.

Every NOOP and FAILED result says why in ``errors``. Every change the engine makes is recorded as
events (EVICT, SWAP_OUT, MIGRATE, RECLAIM, …), so executed actions reach ``kvguard.events`` through
the node's producer like any other event.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvguard.contracts.commands import (
    AbortPayload,
    AckOutcome,
    Action,
    BatchCapPayload,
    Command,
    CompactPayload,
    EmptyCachePayload,
    EvictPayload,
    HeadroomPayload,
    HoldPayload,
    ReclaimPayload,
    ReleasePayload,
    Target,
)
from kvguard.contracts.dimensions import Granularity, HandlingChoice
from kvguard.contracts.engine import ActuationPort
from kvguard.contracts.events import Handling
from kvguard.contracts.pool_types import PageInfo, PageState, SwapFull, UnknownRequest

NO_CACHE_TO_EMPTY = "empty_cache: no CUDA in this process (or the worker is down): nothing to release"
HANDLINGS: dict[HandlingChoice, Handling] = {
    HandlingChoice.RECOMPUTE: Handling.RECOMPUTE,
    HandlingChoice.SWAP: Handling.SWAP,
    HandlingChoice.CHECKPOINT: Handling.CHECKPOINT,
}


@dataclass(slots=True, frozen=True)
class ExecutionResult:
    outcome: AckOutcome
    units_freed: int = 0
    units_moved: int = 0
    targets_done: int = 0
    targets_noop: int = 0
    errors: tuple[str, ...] = field(default_factory=tuple)


class Executor:
    """Executes commands on one engine through its port."""

    def __init__(self, engine: ActuationPort) -> None:
        self.engine = engine
        self._actions: dict[Action, Callable[[Any, int], ExecutionResult]] = {
            Action.EVICT: self._evict,
            Action.COMPACT: self._compact,
            Action.RECLAIM: self._reclaim,
            Action.HEADROOM: self._headroom,
            Action.BATCH_CAP: self._batch_cap,
            Action.HOLD: self._hold,
            Action.RELEASE: self._release,
            Action.ABORT: self._abort,
            Action.EMPTY_CACHE: self._empty_cache,
        }

    def execute(self, command: Command, now_ns: int) -> ExecutionResult:
        refused = self.refusal(command)
        if refused is not None:
            return ExecutionResult(AckOutcome.REJECTED_PAYLOAD, errors=(refused,))
        missing = self.engine.capabilities.lacks(command.action)
        if missing is not None:
            return _result(0, 0, 0, _subjects(command), [missing])
        return self._actions[command.action](command.payload, now_ns)

    def refusal(self, command: Command) -> str | None:
        """Why this node refuses the payload's numbers (more than its pool holds), or None."""
        sized = POOL_SIZED.get(type(command.payload))
        if sized is None:
            return None
        pool = self.engine.pool_units
        for what, number in sized(command.payload):
            if number > pool:
                return (f"{command.action.value}: {what} {number} exceeds this node's pool of {pool} units "
                        "(refused, nothing changed)")
        return None

    # -- actions -----------------------------------------------------------------------------

    def _evict(self, payload: EvictPayload, now_ns: int) -> ExecutionResult:
        capabilities = self.engine.capabilities
        if payload.granularity not in capabilities.evict_granularities:
            offered = ", ".join(sorted(g.value for g in capabilities.evict_granularities))
            why = capabilities.note("evict_granularities")
            return _result(0, 0, 0, len(payload.targets),
                           [f"evict at {payload.granularity.value} granularity: {why} (offered: {offered})"])
        handling, notes = HANDLINGS[payload.handling], []
        if payload.handling not in capabilities.evict_handlings:
            handling = Handling.RECOMPUTE
            notes.append(f"evict: {payload.handling.value} {capabilities.note('evict_handlings')}: recomputed instead")
        result = _per_target(payload.targets, lambda target: self._evict_one(target, payload.granularity, handling,
                                                                              now_ns))
        return _with_notes(result, notes)

    def _evict_one(self, target: Target, granularity: Granularity, handling: Handling,
                   now_ns: int) -> tuple[int | None, str]:
        """Units freed from one target (None: nothing to do), and a note (why not, or a fallback)."""
        pages: Any = None
        idle = f"req {target.req}: not running (finished, waiting or unknown): nothing to free"
        if granularity is not Granularity.REQUEST:
            try:
                pages = self._select_pages(target, granularity)
            except UnknownRequest:
                return None, idle  # finished (or never here): nothing holds memory any more
            if not pages:
                return None, f"req {target.req}: no private pages to free at {granularity.value} granularity"
        note = ""
        try:
            result = self.engine.evict_request(target.req, now_ns, granularity=str(granularity),
                                               handling=handling, pages=pages)
        except SwapFull:
            # the pool refused with its state unchanged: recompute costs more but frees the same
            note = f"req {target.req}: host swap full, recomputed instead"
            result = self.engine.evict_request(target.req, now_ns, granularity=str(granularity),
                                               handling=Handling.RECOMPUTE, pages=pages)
        if result.pages == 0:
            return None, note or idle
        return int(result.units_freed), note

    def _compact(self, payload: CompactPayload, now_ns: int) -> ExecutionResult:
        try:
            moved = int(self.engine.compact(now_ns, payload.max_moves))
        except Exception as err:
            return _result(0, 0, 0, 0, [f"compact: {type(err).__name__}: {err}"])
        if not moved:
            return _result(0, 0, 0, 1, ["compact: nothing moved (no page could close a gap)"])
        return _result(0, moved, 1, 0, [])

    def _reclaim(self, payload: ReclaimPayload, now_ns: int) -> ExecutionResult:
        try:
            freed = int(self.engine.reclaim_cached(payload.units, now_ns))
        except Exception as err:
            return _result(0, 0, 0, 0, [f"reclaim: {type(err).__name__}: {err}"])
        if not freed:
            return _result(0, 0, 0, 1, ["reclaim: no cached prefix pages to drop"])
        return _result(freed, 0, 1, 0, [])

    def _headroom(self, payload: HeadroomPayload, now_ns: int) -> ExecutionResult:
        self.engine.set_admission_headroom(payload.units)
        return _result(0, 0, 1, 0, [])

    def _batch_cap(self, payload: BatchCapPayload, now_ns: int) -> ExecutionResult:
        self.engine.set_batch_token_cap(payload.tokens, payload.steps)
        return _result(0, 0, 1, 0, [])

    def _hold(self, payload: HoldPayload, now_ns: int) -> ExecutionResult:
        self.engine.hold_admissions(payload.max_prompt_tokens, payload.steps)
        return _result(0, 0, 1, 0, [])

    def _release(self, payload: ReleasePayload, now_ns: int) -> ExecutionResult:
        if self.engine.release_admissions():
            return _result(0, 0, 1, 0, [])
        return _result(0, 0, 0, 1, ["release: no hold in place"])

    def _abort(self, payload: AbortPayload, now_ns: int) -> ExecutionResult:
        def abort(target: Target) -> tuple[int | None, str]:
            freed = self.engine.abort_request(target.req, now_ns)
            return freed, "" if freed is not None else f"req {target.req}: not in the engine (finished or unknown)"
        return _per_target(tuple(Target(r) for r in payload.requests), abort)

    def _empty_cache(self, payload: EmptyCachePayload, now_ns: int) -> ExecutionResult:
        try:
            released = self.engine.empty_cache(now_ns)
        except Exception as err:
            return _result(0, 0, 0, 0, [f"empty_cache: {type(err).__name__}: {err}"])
        if released is None:
            return _result(0, 0, 0, 1, [NO_CACHE_TO_EMPTY])
        return _result(0, 0, 1, 0, [f"empty_cache: {int(released)} bytes returned to the device"])

    # -- page choice -------------------------------------------------------------------------

    def _private_pages(self, req: int) -> list[PageInfo]:
        """The request's own live pages in page-table order (shared prefix pages excluded)."""
        return [p for p in self.engine.request_pages(req)
                if p.offset >= 0 and p.state is PageState.LIVE and p.refcount <= 1]

    def _select_pages(self, target: Target, granularity: Granularity) -> int | list[int] | None:
        private = self._private_pages(target.req)
        if not private:
            return None
        wanted = target.units if target.units > 0 else sum(p.size for p in private)
        if granularity is Granularity.BLOCK:
            # the pool evicts the last N live pages: count them from the tail until the units are
            # covered, stopping at the first shared page (the prefix stays)
            live = [p for p in self.engine.request_pages(target.req) if p.state is PageState.LIVE]
            count = units = 0
            for p in reversed(live):
                if units >= wanted or p.refcount > 1:
                    break
                count += 1
                units += p.size
            return count or None
        chosen, units = [], 0
        for p in private:  # token granularity: oldest private runs first
            if units >= wanted:
                break
            chosen.append(p.offset)
            units += p.size
        return chosen


# the payload numbers that count units of the node's pool, by payload type: none may exceed it
POOL_SIZED: dict[type, Callable[[Any], list[tuple[str, int]]]] = {
    HeadroomPayload: lambda p: [("headroom", p.units)],
    ReclaimPayload: lambda p: [("reclaim", p.units)],
    CompactPayload: lambda p: [("max_moves", p.max_moves)],
    EvictPayload: lambda p: [(f"req {t.req}: units", t.units) for t in p.targets],
}


def _subjects(command: Command) -> int:
    """What a NOOP of the whole command counts as not done: its targets, or the one action."""
    payload = command.payload
    if isinstance(payload, EvictPayload):
        return len(payload.targets)
    if isinstance(payload, AbortPayload):
        return len(payload.requests)
    return 1


def _per_target(targets: Iterable[Target], act: Callable[[Target], tuple[int | None, str]]) -> ExecutionResult:
    """``act`` on each target: (units freed, or None for nothing to do; a note, which a no-op
    always has). One failing target does not stop the others; its error goes into the ack."""
    freed = done = noop = 0
    errors: list[str] = []
    for target in targets:
        try:
            units, note = act(target)
        except Exception as err:  # one bad target must not stop the others
            errors.append(f"req {target.req}: {type(err).__name__}: {err}")
            continue
        if note:
            errors.append(note)
        if units is None:
            noop += 1
        else:
            done += 1
            freed += int(units)
    return _result(freed, 0, done, noop, errors)


def _with_notes(result: ExecutionResult, notes: list[str]) -> ExecutionResult:
    if not notes:
        return result
    return ExecutionResult(result.outcome, result.units_freed, result.units_moved, result.targets_done,
                           result.targets_noop, tuple(notes) + result.errors)


def _result(freed: int, moved: int, done: int, noop: int, errors: list[str]) -> ExecutionResult:
    if done:
        outcome = AckOutcome.EXECUTED
    elif errors and not noop:
        outcome = AckOutcome.FAILED
    else:
        outcome = AckOutcome.NOOP
    return ExecutionResult(outcome, freed, moved, done, noop, tuple(errors))
