"""What every shadow engine shares: a run's summary, the SLO it is counted against, request states.

``RunSummary`` counts every request (issue 12): completed, failed (the engine crashed under it),
rejected and unfinished; ``slo_fields`` derives SLO attainment over all of them. ``RunningView`` is
what an engine shows the actuators of a running request.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from kvguard.contracts.dimensions import Granularity
from kvguard.contracts.units import NS_PER_S


class SeqState(IntEnum):
    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    FINISHED = 3

GRANULARITIES = tuple(g.value for g in Granularity)


@dataclass(slots=True)
class RunSummary:
    requests: int
    completed: int
    failed: int  # finished FAILED_OOM (the engine crashed under them)
    rejected: int  # refused: the prompt could never fit, or the engine was down when it arrived
    unfinished: int  # still queued, running or swapped when the run ended
    ooms: int
    preemptions: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p99_s: float | None
    goodput_tokens_per_s: float
    downtime_s: float
    sim_seconds: float
    events: int
    # every request counted (issue 12): met = completed with TTFT <= slo.ttft_s and mean TPOT <= slo.tpot_s;
    # failed, rejected and unfinished requests are misses, also in ttft_p99_all_s (None: the p99 is a miss)
    slo_met: int = 0
    slo_attainment: float | None = None
    slo_goodput_tokens_per_s: float = 0.0
    ttft_p99_all_s: float | None = None

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(slots=True, frozen=True)
class SloTargets:
    """A request meets its SLO when it completes with TTFT <= ``ttft_s`` and mean TPOT <= ``tpot_s``
    (DistServe's per-request attainment; 2 s / 100 ms are interactive-chat targets)."""

    ttft_s: float = 2.0
    tpot_s: float = 0.1


DEFAULT_SLO = SloTargets()


def slo_fields(served, requests: int, sim_s: float, slo: SloTargets = DEFAULT_SLO) -> dict:
    """The SLO fields of ``RunSummary`` from ``served`` = (ttft_ns, mean tpot_ns, output tokens) of each
    completed request, out of ``requests`` arrivals (the rest are misses)."""
    met = tokens = 0
    ttft_cap, tpot_cap = slo.ttft_s * NS_PER_S, slo.tpot_s * NS_PER_S
    ttfts = []
    for ttft, tpot, generated in served:
        ttfts.append(ttft)
        if ttft <= ttft_cap and tpot <= tpot_cap:
            met += 1
            tokens += generated
    p99_all = None
    if requests:
        k = int(np.ceil(0.99 * requests)) - 1  # the nearest-rank p99 of all requests, misses sorted last
        if k < len(ttfts):
            p99_all = round(float(np.partition(np.asarray(ttfts, dtype=np.float64), k)[k]) / NS_PER_S, 6)
    return {"slo_met": met, "slo_attainment": round(met / requests, 6) if requests else None,
            "slo_goodput_tokens_per_s": round(tokens / sim_s, 3) if sim_s > 0 else 0.0, "ttft_p99_all_s": p99_all}


@dataclass(slots=True, frozen=True)
class RunningView:
    req: int
    priority: int
    prompt_tokens: int
    generated_tokens: int
    units: int
    last_step_ns: int
    state: SeqState
