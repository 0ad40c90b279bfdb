"""Values and errors of the paged pool (``kvguard.producers.sim.seed.pool``), shared with the actuators that execute on it.

Pure: standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from kvguard.contracts.events import Handling


class PageState(IntEnum):
    """Where a page (or a page-table entry) is. LIVE/CACHED/RETAINED pages occupy units of D."""

    LIVE = 0
    CACHED = 1
    RETAINED = 2
    SWAPPED = 3  # contents in host swap; no units
    CHECKPOINTED = 4  # contents in the checkpoint store; no units
    DROPPED = 5  # contents lost (evicted for recompute, or retention expired); no units
    FREED = 6  # a page object whose units went back to the free runs (never reused)


class PoolError(Exception):
    """Base of every refusal the pool raises. A refusal leaves the pool unchanged."""


class PoolExhausted(PoolError):
    """No contiguous free run fits the request; ``largest_free_run`` says how far off it is."""

    def __init__(self, requested_units: int, largest_free_run: int, free_units: int, what: str = "pages"):
        self.requested_units = requested_units
        self.largest_free_run = largest_free_run
        self.free_units = free_units
        self.what = what
        super().__init__(
            f"pool exhausted: {what} need {requested_units} units, largest free run is "
            f"{largest_free_run} of {free_units} free units; reclaim cached pages, evict or compact")


class SwapFull(PoolError):
    """Host swap space cannot take the pages to be swapped out."""

    def __init__(self, requested_units: int, free_swap_units: int):
        self.requested_units = requested_units
        self.free_swap_units = free_swap_units
        super().__init__(f"host swap full: need {requested_units} units, {free_swap_units} free; "
                         f"use Handling.RECOMPUTE or CHECKPOINT, or raise swap_capacity_units")


class UnknownRequest(PoolError, KeyError):
    """The request holds nothing in this pool (never grown, released, or reset away)."""

    def __init__(self, req: int):
        self.req = req
        super().__init__(f"request {req} has no pages in this pool")

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


class UnknownPage(PoolError, KeyError):
    """No page (of this request, where one is named) starts at ``offset``."""

    def __init__(self, offset: int, req: int | None = None):
        self.offset = offset
        self.req = req
        who = f" of request {req}" if req is not None else ""
        super().__init__(f"no live page{who} starts at unit offset {offset}")

    def __str__(self) -> str:
        return self.args[0]


class UnknownWorkspace(PoolError, KeyError):
    """No workspace buffer starts at ``offset``."""

    def __init__(self, offset: int):
        self.offset = offset
        super().__init__(f"no workspace buffer starts at unit offset {offset}")

    def __str__(self) -> str:
        return self.args[0]


class CheckpointMissing(PoolError):
    """A checkpointed page set is gone from the checkpoint store (file deleted or unreadable)."""

    def __init__(self, req: int, where: str):
        self.req = req
        self.where = where
        super().__init__(f"checkpoint of request {req} missing or unreadable at {where}")


@dataclass(slots=True, frozen=True)
class EvictResult:
    """What one ``evict`` did. ``units_freed`` went back to the free runs; ``units_retained`` stay
    occupied for remap; ``shared_pages`` stayed live because other requests still hold them."""

    req: int
    handling: Handling
    pages: int = 0
    units_freed: int = 0
    units_retained: int = 0
    tokens: int = 0
    swap_units: int = 0
    shared_pages: int = 0


@dataclass(slots=True, frozen=True)
class PageInfo:
    """One entry of a request's page table. ``offset`` is -1 for entries that hold no units."""

    offset: int
    size: int
    cls: int
    tokens: int
    state: PageState
    refcount: int
    hashed: bool


@dataclass(slots=True, frozen=True)
class PoolMetrics:
    """Exact pool metrics (docs/CONTRACTS.md, "Exact metric definitions"); units of D."""

    dynamic_units: int
    live_units: int
    cached_units: int
    retained_units: int
    workspace_units: int
    free_units: int
    largest_free_run: int
    n_free_runs: int
    tokens_stored: int
    u_kv: float
    f_ext: float
    f_int: float
    psi: float
    n_requests: int
    swap_used_units: int


@dataclass(slots=True, frozen=True)
class UtilizationSplit:
    """The device ledger split in bytes: where M goes. ``reserved_bytes`` is the Ψ headroom
    (reserved_frac of D); it is part of ``free_bytes``, not in addition to it."""

    total_bytes: int
    unmanaged_bytes: int  # M * (1 - u): outside the engine's budget
    weights_bytes: int
    context_bytes: int
    workspace_bytes: int
    kv_live_bytes: int
    kv_cached_bytes: int
    kv_retained_bytes: int
    reserved_bytes: int
    free_bytes: int
