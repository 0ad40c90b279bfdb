"""The engine port: what kvguard calls on a serving engine, and what each engine declares it offers.

Two protocols, one per caller:

- ``ActuationPort``: what the executor (``actuators.executor``) calls to carry out a command, between
  the engine's steps, on the engine's thread. Every engine implements every method; a knob it does
  not have is declared absent in its ``Capabilities``, so the executor never calls it and acks NOOP
  with the engine's own reason instead (the method raises ``KnobUnavailable``, or, where the engine's
  API already had it as an explicit no-op, does nothing).
- ``EnginePort``: a shadow engine the simulated fleet runs (``producers.sim``): the actuation port
  plus requests in, steps, event rows out and the run's summary.

``Capabilities`` is a frozen value each engine class declares once (``capabilities``): which
actions it carries out (its knobs), and the two facts about its memory that decide which of the
policy's guards apply (uniform KV blocks; a caching allocator beside the KV blocks). The policy
reads them through the profile's engine (``runtime.bootstrap``), never by the engine's name.

Pure: standard library only (the pool value types are named for type checkers only).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from kvguard.contracts.commands import Action
from kvguard.contracts.dimensions import Granularity, HandlingChoice

if TYPE_CHECKING:
    from kvguard.contracts.events import Handling
    from kvguard.contracts.pool_types import EvictResult, PageInfo

# the capability that lets an engine carry out each action (evict: ``evict_granularities``, non-empty)
KNOB_OF: dict[Action, str] = {
    Action.EVICT: "evict_granularities",
    Action.COMPACT: "compact",
    Action.RECLAIM: "reclaim_cached",
    Action.HEADROOM: "admission_headroom",
    Action.BATCH_CAP: "token_budget",
    Action.HOLD: "admission_hold",
    Action.RELEASE: "admission_hold",
    Action.ABORT: "abort",
    Action.EMPTY_CACHE: "empty_cache",
}


class KnobUnavailable(NotImplementedError):
    """An engine was asked for a knob its ``Capabilities`` say it does not have."""

    def __init__(self, engine: str, knob: str) -> None:
        super().__init__(f"{engine} has no {knob} (its Capabilities say so; the executor acks NOOP instead)")
        self.knob = knob


@dataclass(slots=True, frozen=True)
class Capabilities:
    """What one engine offers. Every field is stated by every engine (no defaults), so a new knob
    makes each engine say whether it has it.

    Memory model:
    - ``uniform_blocks``: every KV block has one size (vLLM's paged blocks): there is no contiguous
      free run to keep for a step's workspace, and a KV shortage preempts instead of failing;
    - ``caching_allocator``: the engine's non-KV memory (activations, logits) comes from PyTorch's
      caching allocator, whose OOMs are this engine's OOMs and whose transient peak the per-step
      token budget bounds;
    - ``prompt_logprobs``: the engine serves requests that ask for prompt logprobs (a sampler), and
      with them the node-side logprob guard.

    Knobs (the executor's actions): ``evict_granularities`` (empty: no eviction) and
    ``evict_handlings`` (another handling asked for is carried out as recompute, with a note),
    ``admission_headroom`` (headroom), ``token_budget`` (batch_cap), ``admission_hold`` (hold and
    release), ``abort``, ``empty_cache``, ``compact``, ``reclaim_cached`` (reclaim).

    ``notes``: (knob, why this engine lacks it), the reason its NOOP acks carry.
    """

    uniform_blocks: bool
    caching_allocator: bool
    prompt_logprobs: bool
    evict_granularities: frozenset[Granularity]
    evict_handlings: frozenset[HandlingChoice]
    admission_headroom: bool
    token_budget: bool
    admission_hold: bool
    abort: bool
    empty_cache: bool
    compact: bool
    reclaim_cached: bool
    notes: tuple[tuple[str, str], ...] = ()

    def offers(self, action: Action) -> bool:
        return bool(getattr(self, KNOB_OF[action]))

    def note(self, knob: str) -> str:
        """Why this engine lacks ``knob`` (its own words when it gave them)."""
        return next((why for name, why in self.notes if name == knob), f"this engine has no {knob.replace('_', ' ')}")

    def lacks(self, action: Action) -> str | None:
        """The NOOP reason for ``action`` on this engine, or None when it carries the action out."""
        if self.offers(action):
            return None
        return f"{action.value}: {self.note(KNOB_OF[action])}"


class ActuationPort(Protocol):
    """What the executor calls on an engine (between its steps, on its thread). Units are the engine's
    KV units (vLLM: blocks); times are the engine's clock in ns."""

    node: str
    capabilities: ClassVar[Capabilities]

    @property
    def pool_units(self) -> int:
        """The KV units of the engine's pool: no command may ask for more (headroom, targets, moves)."""
        ...

    def evict_request(self, req: int, now_ns: int, *, granularity: str = ..., handling: Handling = ...,
                      pages: Any = None) -> EvictResult:
        """Free a running request's pages (``pages``: the tail count at block granularity, the page
        offsets at token granularity); a request that is not running is a no-op result (0 pages)."""
        ...

    def request_pages(self, req: int) -> list[PageInfo]:
        """The request's page table (raises ``UnknownRequest`` when it holds none)."""
        ...

    def compact(self, now_ns: int, max_moves: int) -> int:
        """Migrate up to ``max_moves`` pages to coalesce free runs; the units moved."""
        ...

    def reclaim_cached(self, units: int, now_ns: int) -> int:
        """Drop up to ``units`` units of cached prefix pages; the units freed."""
        ...

    def set_admission_headroom(self, units: int) -> None:
        """Hold ``units`` back from admission on top of the engine's watermark (0 releases)."""
        ...

    def set_batch_token_cap(self, tokens: int, steps: int = 0) -> None:
        """At most ``tokens`` per step for ``steps`` non-empty steps (0: until released); 0 releases."""
        ...

    def hold_admissions(self, max_prompt_tokens: int, steps: int = 0) -> None:
        """Admit no prompt longer than ``max_prompt_tokens`` (0: none) for ``steps`` steps (0: until released)."""
        ...

    def release_admissions(self) -> bool:
        """End the hold; False when there was none."""
        ...

    def abort_request(self, req: int, now_ns: int) -> int | None:
        """End a request now; the units only it held, None when the engine does not have it."""
        ...

    def empty_cache(self, now_ns: int) -> int | None:
        """Return cached allocator segments to the device; the bytes returned, None when it cannot now."""
        ...


class EnginePort(ActuationPort, Protocol):
    """A shadow engine the simulated fleet runs: the actuation port, requests in, steps, rows out."""

    now_ns: int
    profile: Any  # the producers.sim profile it runs

    def submit(self, request: Any) -> None:
        """Queue a request (``producers.sim.workloads.Request``); it arrives at its ``arrival_ns``."""
        ...

    def advance(self, until_ns: int) -> None:
        """Run steps until the engine's clock reaches ``until_ns``."""
        ...

    def take_events(self) -> Any:
        """Every event row (``EVENT_DTYPE``) recorded since the last call."""
        ...

    def is_up(self, at_ns: int) -> bool:
        """Whether a request arriving at ``at_ns`` should be routed here (the router's health check)."""
        ...

    def outstanding_tokens(self) -> int:
        """Prompt and output tokens of the requests it holds (the router's load measure)."""
        ...

    def running_requests(self) -> list[Any]:
        """The running requests (``producers.sim.run.RunningView``)."""
        ...

    def queue_lengths(self) -> dict[str, int]:
        """``pending``, ``waiting``, ``running`` and ``swapped`` request counts."""
        ...

    def summary(self) -> Any:
        """The run's outcomes (``producers.sim.run.RunSummary``)."""
        ...

    @property
    def ooms_by_cause(self) -> Mapping[str, int]:
        """OOMs by ``layer:cause`` (``allocator:fragmentation``, ``kv_arena:peak``, …)."""
        ...

    @property
    def rejected_by_reason(self) -> Mapping[str, int]:
        """Requests refused at arrival, by reason (empty where the engine records none)."""
        ...


__all__ = ["KNOB_OF", "ActuationPort", "Capabilities", "EnginePort", "KnobUnavailable"]
