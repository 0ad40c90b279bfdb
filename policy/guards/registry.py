"""The policy guards' table: every guard ``PolicyEngine.decide`` runs, in the order it runs them.

The one place a guard is named, like the executor's action table (``actuators.executor``). Order
matters twice: the first signal guard's risk (and the first cause) is the one used, and the proposals
of ``AFTER_PLAN`` guards are numbered in table order, so a new guard goes at the end of the table
(every existing command then keeps its position and its idempotency id). A guard's ``name`` is its
key; ``PolicyEngine.guard(name)`` returns the engine's instance.
"""

from __future__ import annotations

from kvguard.policy.guards.base import Guard
from kvguard.policy.guards.batch_cap import BatchCap
from kvguard.policy.guards.headroom import AdmissionHeadroom
from kvguard.policy.guards.structural import ContiguityRisk, StructuralGuard

GUARDS: tuple[type[Guard], ...] = (
    ContiguityRisk,
    StructuralGuard,
    AdmissionHeadroom,
    BatchCap,
)


def _check(table: tuple[type[Guard], ...]) -> None:
    names = [g.name for g in table]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise ValueError(f"policy guards registered twice: {duplicated}")


_check(GUARDS)
