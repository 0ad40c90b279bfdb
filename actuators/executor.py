"""Carry out one verified command against a node's shadow engine and its paged pool.

The executor translates a command's intent into engine/pool calls; it never checks signatures,
TTLs or duplicates (``actuators.actuator`` does that before calling it) and never reads a clock.

* ``evict``: for each target, free memory at the command's granularity and handling:
  - request: every page (``Engine.evict_request(granularity="request")``); the request goes back
    to the waiting queue (recompute), the swapped queue (swap, checkpoint) and returns later;
  - block: the tail pages that cover the target's units (all private pages when units = 0),
    never the shared prefix: the request keeps its prefix and re-prefills only the tail;
  - token: the least recently written private page runs covering the units (the oldest
    non-shared pages of its page table).
  A swap that finds the host swap space full falls back to recompute (noted in the errors).
  A target that already finished (or is not running any more) is a no-op, never an error.
* ``compact``: migrate up to ``max_moves`` pages so that free runs coalesce.
* ``reclaim``: drop up to ``units_needed`` units of cached prefix pages.
* ``headroom``: hold ``units_needed`` units back from admission on top of the engine's own
  watermark (0 releases it). Evicted requests go back to the engine's queues and are re-admitted
  as soon as the free-space count allows, so without this an eviction only buys time; with it
  the freed space stays free and the next step's workspace and pages find contiguous room.

* ``batch_cap``: cap the engine's per-step token budget (vLLM's ``max_num_batched_tokens``).
* ``hold`` / ``release``: hold admissions of prompts longer than ``units_needed`` tokens (0: all,
  a drain) for ``max_moves`` steps, or end the hold (``hold_admissions``, ``release_admissions``).
* ``abort``: end each target's request now (``abort_request``; a finished one is a no-op).
* ``empty_cache``: return cached allocator segments to the device (``empty_cache``).
An engine without the entry point an action needs acks NOOP with the reason.

Every change the pool makes is recorded as events (EVICT, SWAP_OUT, MIGRATE, RECLAIM, …), so
executed actions reach ``kvguard.events`` through the node's producer like any other event.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from kvguard.contracts.commands import AckOutcome, Action, Command, Target
from kvguard.contracts.dimensions import Granularity, HandlingChoice
from kvguard.contracts.events import Handling
from kvguard.contracts.pool_types import PageState, SwapFull, UnknownRequest

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
    """Executes commands on one engine (``producers.sim.seed.engine.Engine``: ``evict_request``,
    ``compact``, ``pool``)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._actions: dict[Action, Callable[[Command, int], ExecutionResult]] = {
            Action.EVICT: self._evict,
            Action.COMPACT: self._compact,
            Action.RECLAIM: self._reclaim,
            Action.HEADROOM: self._headroom,
            Action.BATCH_CAP: self._knob("set_batch_token_cap", "batch_cap: this engine has no per-step token "
                                                                "budget to cap"),
            Action.HOLD: self._knob("hold_admissions", "hold: this engine has no admission hold"),
            Action.RELEASE: self._release,
            Action.ABORT: self._abort,
            Action.EMPTY_CACHE: self._empty_cache,
        }

    def execute(self, command: Command, now_ns: int) -> ExecutionResult:
        return self._actions[command.action](command, now_ns)

    # -- actions -----------------------------------------------------------------------------

    def _evict(self, command: Command, now_ns: int) -> ExecutionResult:
        return _per_target(command, lambda target: self._evict_one(target, command, now_ns))

    def _evict_one(self, target: Target, command: Command, now_ns: int) -> tuple[int | None, str]:
        """Units freed from one target (None: nothing to do), and a note when it fell back."""
        granularity = command.granularity
        pages: Any = None
        if granularity is not Granularity.REQUEST:
            try:
                pages = self._select_pages(target, granularity)
            except UnknownRequest:
                return None, ""  # finished (or never here): nothing holds memory any more
            if not pages:
                return None, ""
        handling = HANDLINGS[command.handling]
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
            return None, note
        return int(result.units_freed), note

    def _compact(self, command: Command, now_ns: int) -> ExecutionResult:
        moves = max(1, int(command.max_moves))
        try:
            moved = int(self.engine.compact(now_ns, moves))
        except Exception as err:
            return _result(0, 0, 0, 0, [f"compact: {type(err).__name__}: {err}"])
        return _result(0, moved, 1 if moved else 0, 0 if moved else 1, [])

    def _reclaim(self, command: Command, now_ns: int) -> ExecutionResult:
        try:
            freed = int(self.engine.pool.reclaim_cached(max(1, int(command.units_needed)), now_ns))
        except Exception as err:
            return _result(0, 0, 0, 0, [f"reclaim: {type(err).__name__}: {err}"])
        return _result(freed, 0, 1 if freed else 0, 0 if freed else 1, [])

    def _headroom(self, command: Command, now_ns: int) -> ExecutionResult:
        self.engine.set_admission_headroom(max(0, int(command.units_needed)))
        return _result(0, 0, 1, 0, [])

    def _knob(self, entry: str, missing: str) -> Callable[[Command, int], ExecutionResult]:
        """An action that sets one engine knob to (``units_needed``, ``max_moves``): the token cap, the
        admission hold. NOOP with ``missing`` when the engine has no such knob."""
        def run(command: Command, now_ns: int) -> ExecutionResult:
            setter = getattr(self.engine, entry, None)
            if setter is None:
                return _result(0, 0, 0, 1, [missing])
            setter(max(0, int(command.units_needed)), max(0, int(command.max_moves)))
            return _result(0, 0, 1, 0, [])
        return run

    def _release(self, command: Command, now_ns: int) -> ExecutionResult:
        release = getattr(self.engine, "release_admissions", None)
        if release is None:
            return _result(0, 0, 0, 1, ["release: this engine has no admission hold"])
        return _result(0, 0, 1, 0, []) if release() else _result(0, 0, 0, 1, [])

    def _abort(self, command: Command, now_ns: int) -> ExecutionResult:
        abort = getattr(self.engine, "abort_request", None)
        if abort is None:
            return _result(0, 0, 0, len(command.targets) or 1, ["abort: this engine cannot abort a request"])
        return _per_target(command, lambda target: (abort(target.req, now_ns), ""))

    def _empty_cache(self, command: Command, now_ns: int) -> ExecutionResult:
        empty = getattr(self.engine, "empty_cache", None)
        if empty is None:
            return _result(0, 0, 0, 1, ["empty_cache: this engine has no caching allocator"])
        try:
            released = empty(now_ns)
        except Exception as err:
            return _result(0, 0, 0, 0, [f"empty_cache: {type(err).__name__}: {err}"])
        if released is None:
            return _result(0, 0, 0, 1, ["empty_cache: no CUDA in this process"])
        return _result(0, 0, 1, 0, [f"empty_cache: {int(released)} bytes returned to the device"])

    # -- page choice -------------------------------------------------------------------------

    def _private_pages(self, req: int) -> list[Any]:
        """The request's own live pages in page-table order (shared prefix pages excluded)."""
        return [p for p in self.engine.pool.request_pages(req)
                if p.offset >= 0 and p.state is PageState.LIVE and p.refcount <= 1]

    def _select_pages(self, target: Target, granularity: Granularity) -> Any:
        private = self._private_pages(target.req)
        if not private:
            return None
        wanted = target.units if target.units > 0 else sum(p.size for p in private)
        if granularity is Granularity.BLOCK:
            # the pool evicts the last N live pages: count them from the tail until the units are
            # covered, stopping at the first shared page (the prefix stays)
            live = [p for p in self.engine.pool.request_pages(target.req) if p.state is PageState.LIVE]
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


def _per_target(command: Command, act: Callable[[Target], tuple[int | None, str]]) -> ExecutionResult:
    """``act`` on each target: (units freed, or None for nothing to do; a note). One failing target
    does not stop the others; its error goes into the ack."""
    freed = done = noop = 0
    errors: list[str] = []
    for target in command.targets:
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


def _result(freed: int, moved: int, done: int, noop: int, errors: list[str]) -> ExecutionResult:
    if done:
        outcome = AckOutcome.EXECUTED
    elif errors and not noop:
        outcome = AckOutcome.FAILED
    else:
        outcome = AckOutcome.NOOP
    return ExecutionResult(outcome, freed, moved, done, noop, tuple(errors))
