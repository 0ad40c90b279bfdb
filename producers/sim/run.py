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
    refused: int = 0  # refused by kvguard's admission gate (retryable, Retry-After; issue 29)
    slo: str = ""  # the SLO counted against, as ``vllm bench serve --goodput`` spells it
    slo_attainment_by_priority: dict | None = None  # priority (0-10, as a string) -> attainment

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(slots=True, frozen=True)
class SloTargets:
    """A request meets its SLO when it completes with TTFT <= ``ttft_s``, mean TPOT <= ``tpot_s`` and,
    when ``e2el_s`` is set, end-to-end latency <= ``e2el_s`` (DistServe's per-request attainment;
    ``vllm bench serve --goodput ttft:2000 tpot:100``, the default, are interactive-chat targets)."""

    ttft_s: float = 2.0
    tpot_s: float = 0.1
    e2el_s: float | None = None

    @property
    def name(self) -> str:
        """As ``vllm bench serve --goodput`` spells it (milliseconds): ``ttft:2000 tpot:100``."""
        parts = [f"ttft:{self.ttft_s * 1000:g}", f"tpot:{self.tpot_s * 1000:g}"]
        if self.e2el_s is not None:
            parts.append(f"e2el:{self.e2el_s * 1000:g}")
        return " ".join(parts)


DEFAULT_SLO = SloTargets()
GOODPUT_KEYS = ("ttft", "tpot", "e2el")  # vllm/benchmarks/serve.py check_goodput_args: the keys it accepts


def parse_goodput(items) -> SloTargets:
    """``--goodput`` as ``vllm bench serve`` takes it (``vllm/benchmarks/serve.py``
    ``parse_goodput``: ``KEY:VALUE`` pairs, milliseconds, keys ttft/tpot/e2el, values >= 0); a string
    is split on spaces. Keys not given keep the default (ttft 2000, tpot 100); raises ``ValueError``
    naming the bad pair."""
    if isinstance(items, str):
        items = items.split()
    values: dict[str, float] = {}
    for item in items:
        key, sep, value = str(item).partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if not sep or key not in GOODPUT_KEYS or ms < 0:
            raise ValueError(f"--goodput: expected KEY:MILLISECONDS with KEY one of {', '.join(GOODPUT_KEYS)} "
                             f"and a value >= 0 (e.g. ttft:2000 tpot:100), got {item!r}")
        values[key] = ms / 1000.0
    return SloTargets(values.get("ttft", DEFAULT_SLO.ttft_s), values.get("tpot", DEFAULT_SLO.tpot_s), values.get("e2el"))


def slo_fields(served, requests: int, sim_s: float, slo: SloTargets = DEFAULT_SLO, *, priorities=None) -> dict:
    """The SLO fields of ``RunSummary`` from ``served`` = (ttft_ns, mean tpot_ns, output tokens) of each
    completed request, out of ``requests`` arrivals (the rest are misses). ``priorities``:
    (the priority of each ``served`` entry, {priority: arrivals}) for ``slo_attainment_by_priority``."""
    met = tokens = 0
    ttft_cap, tpot_cap = slo.ttft_s * NS_PER_S, slo.tpot_s * NS_PER_S
    e2el_cap = slo.e2el_s * NS_PER_S if slo.e2el_s is not None else None
    ttfts = []
    met_by: dict[int, int] = {}
    served_prio = priorities[0] if priorities is not None else None
    for i, (ttft, tpot, generated) in enumerate(served):
        ttfts.append(ttft)
        if ttft <= ttft_cap and tpot <= tpot_cap and (
                e2el_cap is None or ttft + tpot * max(0, generated - 1) <= e2el_cap):
            met += 1
            tokens += generated
            if served_prio is not None:
                met_by[served_prio[i]] = met_by.get(served_prio[i], 0) + 1
    p99_all = None
    if requests:
        k = int(np.ceil(0.99 * requests)) - 1  # the nearest-rank p99 of all requests, misses sorted last
        if k < len(ttfts):
            p99_all = round(float(np.partition(np.asarray(ttfts, dtype=np.float64), k)[k]) / NS_PER_S, 6)
    by_priority = None
    if priorities is not None:
        by_priority = {str(p): round(met_by.get(p, 0) / n, 6) for p, n in sorted(priorities[1].items()) if n}
    return {"slo_met": met, "slo_attainment": round(met / requests, 6) if requests else None,
            "slo_goodput_tokens_per_s": round(tokens / sim_s, 3) if sim_s > 0 else 0.0, "ttft_p99_all_s": p99_all,
            "slo": slo.name, "slo_attainment_by_priority": by_priority}


@dataclass(slots=True, frozen=True)
class RunningView:
    req: int
    priority: int
    prompt_tokens: int
    generated_tokens: int
    units: int
    last_step_ns: int
    state: SeqState
