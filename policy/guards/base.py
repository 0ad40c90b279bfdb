"""What a policy guard is: one small unit, its own per-node state, one protocol.

``PolicyEngine.decide`` (``policy.engine``) runs every guard of the table in ``policy.guards.registry``
on each tick it decides on, in two phases:

* ``Phase.SIGNAL`` guards run before the plan. A finding's ``risk`` says the node is at risk (it
  makes the soft trigger agree and keeps the admission hold in place); its ``cause`` makes the
  planner act (compact, reclaim, evict) even when the strategy's trigger does not fire. The first
  risk and the first cause in table order are the ones used.
* ``Phase.ACT`` guards run after the plan, see why it acted (``reason``) and why the node counts as
  at risk (``at_risk``), and propose payloads. ``Placement.BEFORE_PLAN`` proposals go before the
  plan's commands, ``AFTER_PLAN`` ones after them, in table order: a command's idempotency id is
  derived from its position (``contracts.commands.command_id``), so a guard added at the end of the
  table leaves every other command's id as it was.

A guard never signs, numbers or sends anything (the engine does), reads no clock (time is the tick's
``ts_ns``) and does no I/O. ``restart(node)`` is called when the node's producer epoch moves on (a
restarted engine: drop what the fresh engine does not hold, keep what must be re-sent to it);
``forget(node)`` when the engine drops the node (idle timeout or its node cap): drop everything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, ClassVar, Protocol

from kvguard.contracts.commands import Mode, Payload
from kvguard.policy.planner import NodeView, Plan
from kvguard.policy.strategy import Strategy

if TYPE_CHECKING:
    from kvguard.policy.engine import EngineConfig


class Phase(Enum):
    SIGNAL = "signal"  # before the plan: a risk or a cause to act
    ACT = "act"  # after the plan: payloads to send


class Placement(Enum):
    BEFORE_PLAN = "before_plan"
    AFTER_PLAN = "after_plan"


@dataclass(slots=True, frozen=True)
class Proposal:
    payload: Payload
    reason: str


@dataclass(slots=True, frozen=True)
class Finding:
    risk: str | None = None
    cause: str | None = None
    proposals: tuple[Proposal, ...] = ()


NOTHING = Finding()


@dataclass(slots=True, frozen=True)
class Observation:
    """One decided tick of one node, as a guard sees it. The fields after ``budget_remaining_frac``
    are filled for ``Phase.ACT`` guards only (a signal guard sees their defaults)."""

    view: NodeView
    mode: Mode
    strategy: Strategy
    budget_remaining_frac: float | None = None
    risk: str | None = None  # the first signal guard's risk
    reason: str | None = None  # why the plan acted (the strategy's trigger, else a signal's cause); None: it did not
    at_risk: str | None = None  # why the node counts as at risk or busy; None: calm
    plan: Plan = field(default_factory=Plan)


class Guard(Protocol):
    """One policy guard. ``name`` is its key in the registry; built with the engine's config."""

    name: ClassVar[str]
    phase: ClassVar[Phase]
    placement: ClassVar[Placement]

    def __init__(self, config: EngineConfig) -> None: ...

    def observe(self, seen: Observation) -> Finding: ...

    def restart(self, node: str) -> None: ...

    def forget(self, node: str) -> None: ...


class StatelessGuard:
    """Base for a guard that holds no per-node state: ``restart`` and ``forget`` have nothing to drop."""

    placement: ClassVar[Placement] = Placement.AFTER_PLAN

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    def restart(self, node: str) -> None:
        return None

    def forget(self, node: str) -> None:
        return None
