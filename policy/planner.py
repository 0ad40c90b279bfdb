"""How much to free on a node, from which requests, and whether compaction does it more cheaply.

Inputs are a ``NodeView`` (one tick of one node: U_kv, F_ext, F_int, Ψ, free space, the largest
free run, the prediction and the victim candidates) and a ``Strategy``. Output is a ``Plan``:
an optional compaction, an optional cache reclaim and a list of victims with the units to free
from each. Pure: it never reads a clock, never touches a pool; the actuator executes the plan.

How much to free
----------------
Three targets, the largest need wins (fractions of the dynamic region D):

* U_kv back to ``target_u_kv``: ``u_kv - target_u_kv``;
* Ψ back to ``target_psi``. Ψ = used/D · m with m = 1 + α·F_ext + β·F_int. Fragmentation is
  what compaction cures, so the need is computed at the F_ext a compaction leaves
  (``compacted_f_ext``): the live KV to drop is ``used/D - target_psi / m_after``. Ψ with the
  current F_ext stays ≥ 1 for much of a busy run that never OOMs (docs/RESULTS.md,
  "Figures moved from module docstrings"), so targeting it uncompacted would evict far more than needed;
* the predicted trajectory, when the strategy uses the prediction: the LSTM's U_kv forecast
  over the next minutes, and the tick's own short-term trajectory — the units the candidates'
  unfinished prompts will still take (``pending_prefill_units``) on top of today's U_kv:
  ``max(forecast, u_kv + pending/D) - target_u_kv``.

Compaction instead of eviction
------------------------------
Free space can be plentiful and still useless: an engine step needs its workspace buffer as one
contiguous run, and with several page sizes a large-class page needs an aligned contiguous run
too. ``required_run_units`` is one full step's workspace and a largest-class page. The
fragmentation trigger (docs/ARCHITECTURE.md, "Policy") is read on that need, not on F_ext alone: when the largest
free run is below ``compact_run_factor`` × the requirement (a safety multiple: between two
10-second ticks an engine runs hundreds of steps, and on the shadow engine the run a workspace
OOM finds was ~3000 units ten seconds earlier) but the free space in total is at least that,
or F_ext is over the strategy's fragmentation threshold, the plan compacts (migrates pages to
coalesce runs):
a migration costs one device-to-device copy of the page (HBM bandwidth, microseconds per page)
and loses no request any work, while an eviction costs the victim a re-prefill or a round trip
over the host link. Eviction is planned only for what compaction cannot cure: when the free
space *in total* is short of one requirement (plus ``run_margin``), cached pages are reclaimed
and live pages evicted for the shortfall (and the engine holds admission headroom, see
``policy.engine``).

Recovery-cost model (cost-aware selection)
------------------------------------------
For a victim losing ``u`` units holding ``t`` tokens (unit = ``unit_tokens`` tokens of
``unit_bytes`` bytes), the seconds of work the fleet spends to get it back to where it was:

* recompute: ``a + b·t`` — one re-prefill of the dropped tokens, where ``a`` is the step's fixed
  cost and ``b`` the profile's prefill seconds per token (prefix pages shared with other requests
  stay live and are reused through the prefix cache, so they are not part of ``t``);
* swap: ``2·u·unit_bytes / host_link_bytes_per_s`` — out to host memory and back over PCIe/NVLink-C2C;
  unavailable (infinite) when the host swap space is full;
* checkpoint: ``2·u·unit_bytes / storage_bytes_per_s`` — the same round trip to local storage;
* plus decode progress at risk: ``c·g`` for ``g`` generated tokens, where ``c`` is the decode
  seconds per sequence-step. A requeued request that is hit again, or fails, loses those decode
  steps; requests far into their decode are therefore dearer victims than fresh ones.

The victim's cost is that of the handling the strategy chose (a swap with no room falls back to
recompute). Cost-aware selection ranks candidates by cost per unit freed, cheapest first, so it
prefers large, fresh requests that hold few shared pages.

Priorities
----------
A candidate without a priority is treated as 5 (the middle of 0–10); each such candidate is
counted in ``Plan.priority_defaulted`` so the service can warn. Lower priority is evicted first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Sequence

from kvguard.contracts.pressure import ALPHA, BETA
from kvguard.contracts.tick import Candidate, Tick
from kvguard.policy.strategy import Granularity, HandlingChoice, Selection, Strategy


@dataclass(slots=True, frozen=True)
class NodeView:
    """What the planner needs from one tick of one node (fractions of D unless in units)."""

    node: str
    ts_ns: int
    u_kv: float
    f_ext: float
    f_int: float
    psi: float
    dynamic_units: int
    free_units: int
    largest_free_run_units: int
    workspace_units: int = 0
    cached_units: int = 0
    slope_per_min: float = 0.0
    p_oom: float | None = None
    u_kv_forecast: tuple[float, ...] = ()
    ooms: int = 0
    preemptions: int = 0
    alloc_failures: int = 0
    candidates: tuple[Candidate, ...] = ()
    unit_tokens: int = 4
    alloc_retries: int = 0  # caching allocator: cached blocks released and a malloc retried, in the interval
    alloc_reserved_bytes: int = 0  # 0: the node reports no allocator layer
    alloc_f_ext: float = 0.0  # 1 - largest cached free block / cached free bytes (the allocator's F_ext)
    endpoint_saturation: float | None = None  # the node's predicted KV saturation (admission gate; issue 29)

    @property
    def pending_prefill_units(self) -> int:
        """Units the candidates' unfinished prompts will still take (their own trajectory)."""
        unit = self.unit_tokens
        return sum(max(0, -(-(c.prompt_tokens - c.tokens) // unit)) for c in self.candidates)


@dataclass(slots=True, frozen=True)
class CostModel:
    """Recovery-cost coefficients (see the module docstring). Defaults: the default profile."""

    step_base_s: float = 0.014
    prefill_s_per_token: float = 0.00012
    decode_s_per_token: float = 0.00015
    unit_tokens: int = 4
    unit_bytes: int = 4 * 131072
    host_link_bytes_per_s: float = 25e9
    storage_bytes_per_s: float = 2e9
    swap_free_units: int | None = None  # None: unknown, assume room

    def recovery_s(self, candidate: Candidate, units: int, handling: HandlingChoice) -> float:
        units = max(0, min(units, candidate.freeable_units))
        tokens = min(candidate.tokens, units * self.unit_tokens)
        progress_s = self.decode_s_per_token * candidate.decoded_tokens
        if handling is HandlingChoice.SWAP and (self.swap_free_units is None or self.swap_free_units >= units):
            return 2.0 * units * self.unit_bytes / self.host_link_bytes_per_s + progress_s
        if handling is HandlingChoice.CHECKPOINT:
            return 2.0 * units * self.unit_bytes / self.storage_bytes_per_s + progress_s
        return self.step_base_s + self.prefill_s_per_token * tokens + progress_s


@dataclass(slots=True, frozen=True)
class PlannerConfig:
    """Node-independent numbers of the planner; ``required_run_units`` comes from the profile
    (the workspace buffer of a full step plus the largest page class)."""

    required_run_units: int = 0
    run_margin: float = 0.25  # keep the largest run this much above the requirement
    compact_run_factor: float = 4.0  # compact while the largest run is under this many requirements
    compacted_f_ext: float = 0.05  # F_ext expected right after a compaction
    moves_per_missing_unit: float = 0.25  # compaction moves per unit the largest run lacks
    min_units: int = 16  # do not bother evicting less than this
    reclaim_cached: bool = True  # False on vLLM engines: cached blocks already count as free there
    alpha: float = ALPHA
    beta: float = BETA


@dataclass(slots=True, frozen=True)
class Victim:
    req: int
    units: int  # units to free from it (0 = all)
    priority: int
    cost_s: float


@dataclass(slots=True, frozen=True)
class Plan:
    units_needed: int = 0
    compact_moves: int = 0
    reclaim_units: int = 0
    victims: tuple[Victim, ...] = ()
    reason: str = ""
    priority_defaulted: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def empty(self) -> bool:
        return not (self.compact_moves or self.reclaim_units or self.victims)


Ranker = Callable[[Sequence[Candidate], Strategy, CostModel], list[Candidate]]


def rank_lru(candidates: Sequence[Candidate], strategy: Strategy, cost: CostModel) -> list[Candidate]:
    """Least recently active first; ties by lower priority (when enabled), then newest request."""
    if strategy.priority_tie_break:
        return sorted(candidates, key=lambda c: (c.last_ts_ns, c.effective_priority, -c.req))
    return sorted(candidates, key=lambda c: (c.last_ts_ns, -c.req))


def rank_priority(candidates: Sequence[Candidate], strategy: Strategy, cost: CostModel) -> list[Candidate]:
    """Lowest priority first; ties: least recently active, then newest (vLLM preempts newest)."""
    return sorted(candidates, key=lambda c: (c.effective_priority, c.last_ts_ns, -c.req))


def rank_cost(candidates: Sequence[Candidate], strategy: Strategy, cost: CostModel) -> list[Candidate]:
    """Cheapest recovery per unit freed first; ties by lower priority."""

    def per_unit(c: Candidate) -> float:
        units = c.freeable_units
        if units <= 0:
            return math.inf
        return cost.recovery_s(c, units, strategy.handling) / units

    return sorted(candidates, key=lambda c: (per_unit(c), c.effective_priority, -c.req))


SELECTORS: dict[Selection, Ranker] = {
    Selection.LRU: rank_lru,
    Selection.PRIORITY: rank_priority,
    Selection.COST: rank_cost,
}


def units_to_free(view: NodeView, strategy: Strategy, config: PlannerConfig) -> int:
    """Units of live KV to release so U_kv, Ψ and the predicted trajectory come back under target."""
    multiplier_now = 1.0 + config.alpha * view.f_ext + config.beta * view.f_int
    used = view.psi / multiplier_now if multiplier_now > 0 else view.psi
    multiplier_after = 1.0 + config.alpha * min(view.f_ext, config.compacted_f_ext) + config.beta * view.f_int
    needs = [view.u_kv - strategy.target_u_kv, used - strategy.target_psi / multiplier_after]
    if strategy.use_prediction:
        d = max(1, view.dynamic_units)
        trajectory = [view.u_kv + view.pending_prefill_units / d, *view.u_kv_forecast]
        needs.append(max(trajectory) - strategy.target_u_kv)
    need = max(needs)
    if need <= 0:
        return 0
    return int(math.ceil(need * view.dynamic_units))


def compaction_run_units(config: PlannerConfig) -> int:
    """The largest free run below which compaction is worth doing (see "Compaction" above)."""
    return int(config.required_run_units * max(1.0 + config.run_margin, config.compact_run_factor))


def compaction_moves(view: NodeView, strategy: Strategy, config: PlannerConfig) -> int:
    """Migration moves worth doing now (0 when the free space is not fragmented or too small)."""
    wanted_run = compaction_run_units(config)
    short_run = wanted_run > 0 and view.largest_free_run_units < wanted_run <= view.free_units
    fragmented = view.f_ext > strategy.fragmentation_threshold and view.free_units > 0
    if not (short_run or fragmented):
        return 0
    missing = max(wanted_run - view.largest_free_run_units,
                  int((view.f_ext - config.compacted_f_ext) * view.free_units), 1)
    return max(1, min(strategy.max_compaction_moves, int(math.ceil(missing * config.moves_per_missing_unit))))


def choose_victims(candidates: Iterable[Candidate], units_needed: int, strategy: Strategy,
                   cost: CostModel, *, exclude: frozenset[int] = frozenset()) -> tuple[Victim, ...]:
    """Victims in the selection policy's order until ``units_needed`` is covered.

    Request granularity frees each victim whole; block and token granularity take only what is
    still missing from the last victim (its tail pages / least recent runs), never its shared prefix.
    """
    pool = [c for c in candidates if c.req not in exclude and c.freeable_units > 0]
    ranked = SELECTORS[strategy.selection](pool, strategy, cost)
    victims: list[Victim] = []
    remaining = units_needed
    for c in ranked:
        if remaining <= 0 or len(victims) >= strategy.max_victims:
            break
        if strategy.granularity is Granularity.REQUEST:
            take, units_field = c.freeable_units, 0
        else:
            take = min(c.freeable_units, remaining)
            units_field = take
        victims.append(Victim(c.req, units_field, c.effective_priority,
                              cost.recovery_s(c, take, strategy.handling)))
        remaining -= take
    return tuple(victims)


def plan(view: NodeView, strategy: Strategy, config: PlannerConfig, cost: CostModel, *,
         reason: str, exclude: frozenset[int] = frozenset(), relieve: bool = True) -> Plan:
    """The whole decision for one triggered node: compaction first, then eviction for the rest.
    ``relieve=False``: only cure fragmentation and a shortfall of free space, no U_kv target."""
    moves = compaction_moves(view, strategy, config)
    need = units_to_free(view, strategy, config) if relieve else 0
    notes: list[str] = []
    # free space too small in total for one full step: cached prefix pages (owned by nobody, they
    # cost only future prefix hits) go first, live pages cover the rest
    wanted_run = int(config.required_run_units * (1.0 + config.run_margin))
    shortfall = max(0, wanted_run - view.free_units) if config.required_run_units else 0
    reclaim = min(view.cached_units, shortfall) if config.reclaim_cached else 0
    if reclaim:
        notes.append(f"reclaim {reclaim} cached units")
    live_need = max(need, shortfall - reclaim)
    victims: tuple[Victim, ...] = ()
    if live_need >= config.min_units:
        victims = choose_victims(view.candidates, live_need, strategy, cost, exclude=exclude)
        if not victims:
            notes.append(f"needed {live_need} units but no eligible candidate")
    defaulted = sum(1 for c in view.candidates if not c.priority_given)
    return Plan(units_needed=live_need, compact_moves=moves, reclaim_units=reclaim, victims=victims,
                reason=reason, priority_defaulted=defaulted, notes=tuple(notes))


def view_from_tick(tick: Tick, *, dynamic_units: int | None = None, unit_tokens: int = 4) -> NodeView:
    """What the planner reads of a tick; ``dynamic_units`` (D) overrides the tick's when given."""
    return NodeView(
        node=tick.node, ts_ns=tick.ts_ns, u_kv=float(tick.u_kv), f_ext=float(tick.f_ext), f_int=float(tick.f_int),
        psi=float(tick.psi), dynamic_units=int(dynamic_units or tick.dynamic_units or 0),
        free_units=int(tick.free_units or 0), largest_free_run_units=int(tick.largest_free_run_units or 0),
        workspace_units=int(tick.workspace_units or 0), cached_units=int(tick.cached_units or 0),
        slope_per_min=float(tick.slope_per_min or 0.0), p_oom=None if tick.p_oom is None else float(tick.p_oom),
        u_kv_forecast=tuple(float(x) for x in tick.u_kv_forecast or ()), ooms=int(tick.ooms or 0),
        preemptions=int(tick.preemptions or 0), alloc_failures=int(tick.alloc_failures or 0),
        candidates=tuple(c if c.generated_tokens is not None else replace(c, generated_tokens=c.decoded_tokens)
                         for c in tick.candidates),
        unit_tokens=unit_tokens, alloc_retries=int(tick.alloc_retries or 0),
        alloc_reserved_bytes=int(tick.alloc_reserved_bytes or 0), alloc_f_ext=float(tick.alloc_f_ext or 0.0),
        endpoint_saturation=None if getattr(tick, "endpoint_saturation", None) is None
        else float(tick.endpoint_saturation),
    )


