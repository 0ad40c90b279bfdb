"""Helpers for the bus integration tests: real simulated event logs and bounded consumption."""

from __future__ import annotations

import asyncio
import time

from kvguard.contracts.events import EventBatch
from kvguard.contracts.units import NS_PER_S

# the seed engine (an alternative profile since issue 11): these logs exercise its arena OOMs, snapshots
# and fragmentation; the vLLM engine's own events are tested in tests/unit/cli/test_simulate_vllm.py
SEED_PROFILE = "llama3-8b-24gb"

def fleet_event_log(n_gpus: int = 3, seconds: int = 60, step_s: int = 5, seed: int = 3) -> list[EventBatch]:
    """Batches from the real shadow-engine fleet, drained every ``step_s`` of simulated time."""
    from kvguard.producers.sim.fleet import Fleet
    from kvguard.producers.sim.profiles import load_profile
    from kvguard.producers.sim.workloads import load_workload

    fleet = Fleet(n_gpus, load_profile(SEED_PROFILE), seed=seed)
    fleet.submit_workload(load_workload("mixed", window=seconds, seed=seed))
    batches: list[EventBatch] = []
    for t in range(step_s, seconds + step_s, step_s):
        fleet.advance(t * NS_PER_S)
        batches.extend(fleet.take_batches(t * NS_PER_S))
    return [b for b in batches if len(b)]


def batch_source(batches: list[EventBatch], per_call: int = 4):
    """A publisher source handing out ``per_call`` batches per call, then nothing."""
    pending = list(batches)

    def take() -> list[EventBatch]:
        out = pending[:per_call]
        del pending[:per_call]
        return out

    take.remaining = pending  # type: ignore[attr-defined]
    return take


async def consume(subscription, count: int, *, limit_s: float = 90.0, commit: bool = False) -> list:
    """Records until ``count`` arrived; fails (not hangs) after ``limit_s``, reporting what came."""
    records: list = []
    deadline = time.monotonic() + limit_s
    while len(records) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"received {len(records)} of {count} records within {limit_s} s")
        got = await subscription.getmany(1000, 0.5)
        records.extend(got)
        if commit and got:
            await subscription.commit()
    return records


async def drain_quietly(subscription, settle_s: float = 1.5) -> list:
    """Whatever else arrives within ``settle_s`` (used to check nothing unexpected follows)."""
    extra: list = []
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline:
        extra.extend(await subscription.getmany(1000, 0.2))
        await asyncio.sleep(0)
    return extra
