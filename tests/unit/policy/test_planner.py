"""The planner: how much to free, who pays, and compaction before eviction."""

from dataclasses import replace

import pytest

from kvguard.policy.planner import (
    Candidate,
    CostModel,
    NodeView,
    PlannerConfig,
    choose_victims,
    plan,
    units_to_free,
    view_from_tick,
)
from kvguard.policy.strategy import DEFAULT, EMERGENCY, Granularity, HandlingChoice, Selection, Timing, Trigger

D = 10_000
COST = CostModel()


def view(**changes) -> NodeView:
    base = NodeView(node="n0/gpu0", ts_ns=60_000_000_000, u_kv=0.5, f_ext=0.1, f_int=0.05, psi=0.6,
                    dynamic_units=D, free_units=4000, largest_free_run_units=3000)
    return replace(base, **changes)


def cand(req, *, priority=5, units=400, tokens=1600, last_s=10, shared=0, generated=0):
    return Candidate(req=req, priority=priority, units=units, tokens=tokens, last_ts_ns=last_s * 10**9,
                     shared_units=shared, generated_tokens=generated)


def test_nothing_to_free_below_target():
    assert units_to_free(view(), DEFAULT, PlannerConfig()) == 0


def test_units_bring_u_kv_back_to_target():
    v = view(u_kv=0.90, psi=0.5)
    assert units_to_free(v, DEFAULT, PlannerConfig()) == pytest.approx((0.90 - DEFAULT.target_u_kv) * D, abs=1)


def test_units_bring_psi_back_to_target_at_the_fragmentation_compaction_leaves():
    # psi = used * (1 + 2*0.2 + 0.1): used = 1.2 / 1.5 = 0.8 of D
    v = view(u_kv=0.6, f_ext=0.2, f_int=0.1, psi=1.2)
    strategy = replace(DEFAULT, target_psi=0.7)
    need = units_to_free(v, strategy, PlannerConfig(compacted_f_ext=0.05))
    expected = (1.2 / 1.5 - 0.7 / (1 + 2 * 0.05 + 0.1)) * D
    assert need == pytest.approx(expected, abs=1)


def test_fragmentation_alone_does_not_make_psi_evict():
    # Ψ over 1 only through F_ext: compaction, not eviction, is the cure
    v = view(u_kv=0.6, f_ext=0.6, f_int=0.02, psi=(0.6 + 0.05) * (1 + 1.2 + 0.02))
    assert units_to_free(v, DEFAULT, PlannerConfig()) == 0


def test_queued_prefills_count_as_the_predicted_trajectory():
    growing = cand(1, units=100, tokens=400, last_s=1)
    growing = replace(growing, prompt_tokens=400 + 4 * 1500)  # 1500 more units to prefill
    v = view(u_kv=0.70, psi=0.75, candidates=(growing,))
    assert v.pending_prefill_units == 1500
    expected = (0.70 + 1500 / D - DEFAULT.target_u_kv) * D
    assert units_to_free(v, DEFAULT, PlannerConfig()) == pytest.approx(expected, abs=1)


def test_forecast_counts_only_when_strategy_uses_prediction():
    v = view(u_kv=0.7, psi=0.75, u_kv_forecast=(0.8, 0.9, 0.95))
    assert units_to_free(v, DEFAULT, PlannerConfig()) == pytest.approx((0.95 - DEFAULT.target_u_kv) * D, abs=1)
    assert units_to_free(v, replace(DEFAULT, use_prediction=False), PlannerConfig()) == 0


def test_lru_picks_least_recently_active_and_breaks_ties_by_priority():
    cands = [cand(1, last_s=30), cand(2, last_s=10, priority=7), cand(3, last_s=10, priority=2)]
    victims = choose_victims(cands, 500, DEFAULT, COST)
    assert [v.req for v in victims] == [3, 2]


def test_priority_selection_evicts_lowest_priority_first():
    s = replace(DEFAULT, selection=Selection.PRIORITY)
    cands = [cand(1, priority=9, last_s=1), cand(2, priority=0, last_s=50), cand(3, priority=4, last_s=5)]
    assert [v.req for v in choose_victims(cands, 700, s, COST)] == [2, 3]


def test_missing_priority_counts_as_five_and_is_reported():
    s = replace(DEFAULT, selection=Selection.PRIORITY)
    cands = [cand(1, priority=6), cand(2, priority=None), cand(3, priority=4)]
    assert [v.req for v in choose_victims(cands, 1200, s, COST)] == [3, 2, 1]
    p = plan(view(u_kv=0.9, candidates=tuple(cands)), s, PlannerConfig(), COST, reason="t")
    assert p.priority_defaulted == 1
    assert [v.priority for v in p.victims if v.req == 2] == [5]


def test_cost_aware_prefers_fresh_requests_over_ones_deep_in_decode():
    s = replace(EMERGENCY)
    deep = cand(1, units=400, tokens=1600, generated=1500)
    fresh = cand(2, units=400, tokens=1600, generated=0)
    assert [v.req for v in choose_victims([deep, fresh], 100, s, COST)] == [2]


def test_cost_aware_ignores_units_shared_with_other_requests():
    s = replace(EMERGENCY)
    mostly_shared = cand(1, units=400, shared=380)
    private = cand(2, units=200)
    assert choose_victims([mostly_shared, private], 100, s, COST)[0].req == 2


def test_swap_is_cheaper_than_recompute_for_long_contexts_when_host_has_room():
    c = cand(1, units=2000, tokens=8000)
    recompute = COST.recovery_s(c, 2000, HandlingChoice.RECOMPUTE)
    swap = COST.recovery_s(c, 2000, HandlingChoice.SWAP)
    assert swap < recompute
    no_room = replace(COST, swap_free_units=10)
    assert no_room.recovery_s(c, 2000, HandlingChoice.SWAP) == pytest.approx(recompute)


def test_block_granularity_takes_only_the_missing_units_from_the_last_victim():
    cands = [cand(1, units=300, last_s=1), cand(2, units=300, last_s=2)]
    victims = choose_victims(cands, 400, DEFAULT, COST)
    assert [(v.req, v.units) for v in victims] == [(1, 300), (2, 100)]
    req_level = choose_victims(cands, 400, replace(DEFAULT, granularity=Granularity.REQUEST), COST)
    assert [(v.req, v.units) for v in req_level] == [(1, 0), (2, 0)]


def test_excluded_and_fully_shared_candidates_are_never_chosen():
    cands = [cand(1), cand(2, units=100, shared=100), cand(3)]
    victims = choose_victims(cands, 2000, DEFAULT, COST, exclude=frozenset({1}))
    assert [v.req for v in victims] == [3]


def test_fragmented_but_sufficient_free_space_is_compacted_not_evicted():
    # plenty free in total, but in slivers: Ψ is high only because of F_ext
    v = view(u_kv=0.50, f_ext=0.8, f_int=0.05, psi=(0.50 + 0.05) * (1 + 1.6 + 0.05),
             free_units=4500, largest_free_run_units=900, candidates=(cand(1), cand(2)))
    p = plan(v, DEFAULT, PlannerConfig(required_run_units=1024), COST, reason="frag")
    assert p.compact_moves > 0
    assert p.victims == ()


def test_pressure_beyond_what_compaction_cures_also_evicts():
    v = view(u_kv=0.92, f_ext=0.7, psi=1.5, free_units=300, largest_free_run_units=100,
             candidates=tuple(cand(i, last_s=i) for i in range(1, 10)))
    p = plan(v, DEFAULT, PlannerConfig(required_run_units=128), COST, reason="hot")
    assert p.victims
    assert sum(v.units for v in p.victims) >= p.units_needed


def test_short_free_space_reclaims_cached_pages_first():
    v = view(free_units=100, largest_free_run_units=100, cached_units=2000, u_kv=0.5, psi=0.6)
    p = plan(v, DEFAULT, PlannerConfig(required_run_units=512), COST, reason="room")
    assert p.reclaim_units == int(512 * 1.25) - 100
    assert p.victims == ()


def test_view_from_a_tick_record():
    tick = {"node": "n", "ts_ns": 5, "u_kv": 0.8, "f_ext": 0.3, "f_int": 0.1, "psi": 0.9,
            "dynamic_units": 100, "free_units": 20, "largest_free_run_units": 10, "cached_units": 3,
            "p_oom": 0.7, "u_kv_forecast": [0.8, 0.85],
            "candidates": [{"req": 4, "priority": 5, "units": 8, "tokens": 32, "prompt_tokens": 20,
                            "last_ts_ns": 1, "shared_units": 2, "pages": 2}]}
    v = view_from_tick(MetricTick.model_validate(tick).to_tick())
    assert v.dynamic_units == 100 and v.p_oom == 0.7 and v.u_kv_forecast == (0.8, 0.85)
    assert v.candidates[0].generated_tokens == 12 and v.candidates[0].freeable_units == 6


# -- the policy engine: the planner in context (modes, timing, headroom, signed commands) ------------

from kvguard.contracts.commands import Action, Mode, verify  # noqa: E402
from kvguard.policy.engine import EngineConfig, PolicyEngine  # noqa: E402

SECRET = b"s"


def engine(**changes) -> PolicyEngine:
    config = EngineConfig(planner=PlannerConfig(required_run_units=512), dynamic_units=D,
                          engine_reserve_units=600, **changes)
    return PolicyEngine(config, SECRET)


def busy(ts_s=60, **changes) -> NodeView:
    base = view(ts_ns=int(ts_s * 1e9), u_kv=0.80, f_ext=0.2, psi=0.9, free_units=1800,
                largest_free_run_units=1500, candidates=tuple(cand(i, last_s=i) for i in range(1, 8)))
    return replace(base, **changes)


def test_calm_node_gets_no_commands():
    assert engine().decide(view(u_kv=0.3)).commands == []


def test_a_busy_node_holds_headroom_before_any_risk_shows():
    decision = engine().decide(view(u_kv=0.6))
    assert [c.action for c in decision.commands] == [Action.HEADROOM]
    assert "busy" in decision.commands[0].reason


def test_contiguity_risk_holds_admission_headroom_and_compacts_with_signed_commands():
    decision = engine().decide(busy(largest_free_run_units=300, f_ext=0.8))
    actions = [c.action for c in decision.commands]
    assert actions == [Action.HEADROOM, Action.COMPACT]
    headroom = decision.commands[0]
    assert headroom.payload.units == int((1 - DEFAULT.target_u_kv) * D) - 600
    assert all(verify(c, SECRET) for c in decision.commands)
    assert all(c.issued_at_ns == busy().ts_ns and c.node == "n0/gpu0" for c in decision.commands)
    again = engine().decide(busy(largest_free_run_units=300, f_ext=0.8))
    assert [c.id for c in again.commands] == [c.id for c in decision.commands], "ids are idempotency keys"


def test_soft_trigger_needs_the_prediction_to_agree():
    quiet = engine().decide(busy(u_kv=0.9))
    assert not any(c.action is Action.EVICT for c in quiet.commands)
    predicted = engine().decide(busy(u_kv=0.9, p_oom=0.8))
    evict = [c for c in predicted.commands if c.action is Action.EVICT]
    assert evict and evict[0].payload.granularity is Granularity.BLOCK and "P(OOM" in evict[0].reason


def test_hard_trigger_fires_on_the_threshold_alone():
    hard = replace(DEFAULT, trigger=Trigger.HARD, threshold=0.85)
    decision = engine(default=hard).decide(busy(u_kv=0.9))
    assert any(c.action is Action.EVICT for c in decision.commands)


def test_async_strategy_scans_once_per_interval():
    e = engine()
    first = e.decide(busy(ts_s=60, u_kv=0.9, p_oom=0.9))
    second = e.decide(busy(ts_s=70, u_kv=0.9, p_oom=0.9))
    later = e.decide(busy(ts_s=90, u_kv=0.9, p_oom=0.9))
    assert any(c.action is Action.EVICT for c in first.commands)
    assert not any(c.action is Action.EVICT for c in second.commands)
    assert any(c.action is Action.EVICT for c in later.commands)


def test_a_victim_is_not_targeted_again_while_the_tick_may_be_stale():
    e = engine(default=replace(DEFAULT, timing=Timing.SYNC))
    first = e.decide(busy(ts_s=60, u_kv=0.9, p_oom=0.9))
    second = e.decide(busy(ts_s=70, u_kv=0.9, p_oom=0.9))
    targets = lambda d: {t.req for c in d.commands if c.action is Action.EVICT for t in c.payload.targets}  # noqa: E731
    assert targets(first) and not targets(first) & targets(second)


def test_an_oom_escalates_to_emergency_with_a_larger_hold():
    e = engine()
    decision = e.decide(busy(ooms=1))
    assert decision.mode is Mode.EMERGENCY and decision.mode_change is not None
    hold = [c for c in decision.commands if c.action is Action.HEADROOM][0]
    assert hold.payload.units == int((1 - EMERGENCY.target_u_kv) * D) - 600
    assert hold.mode is Mode.EMERGENCY and hold.variant == EMERGENCY.variant


def test_headroom_is_released_after_calm_ticks():
    e = engine(headroom_calm_ticks=2)
    e.decide(busy(ts_s=10, largest_free_run_units=300))
    holds = [[c.payload.units for c in e.decide(view(ts_ns=int(t * 1e9), u_kv=0.3)).commands
              if c.action is Action.HEADROOM]
             for t in (20, 30, 40)]
    assert holds == [[], [0], []]


def test_low_fragmentation_budget_makes_compaction_kick_in_earlier():
    v = busy(f_ext=0.55, largest_free_run_units=1500)
    assert not any(c.action is Action.COMPACT for c in engine().decide(v, budget_remaining_frac=0.9).commands)
    assert any(c.action is Action.COMPACT for c in engine().decide(v, budget_remaining_frac=0.1).commands)


# -- the fragmentation trigger read on the workspace need, and the prompt-sized admission hold -------

from kvguard.policy.planner import compaction_moves, compaction_run_units  # noqa: E402
from kvguard.wire.schemas import MetricTick


def test_compaction_when_the_largest_run_is_under_the_safety_multiple_and_free_space_suffices():
    config = PlannerConfig(required_run_units=512, compact_run_factor=4.0)
    assert compaction_run_units(config) == 2048
    fragmented = view(f_ext=0.1, free_units=3000, largest_free_run_units=1500)
    assert compaction_moves(fragmented, DEFAULT, config) > 0
    # the same run with plenty of it: nothing to cure
    assert compaction_moves(replace(fragmented, largest_free_run_units=2100), DEFAULT, config) == 0
    # free space short in total: compaction cannot make a 2048-unit run out of 1800 free units
    assert compaction_moves(replace(fragmented, free_units=1800), DEFAULT, config) == 0
    # the factor never goes under the run margin
    assert compaction_run_units(PlannerConfig(required_run_units=512, compact_run_factor=0.5)) == 640


def test_a_fragmented_node_with_enough_free_space_is_compacted_not_evicted():
    decision = engine().decide(view(u_kv=0.3, f_ext=0.3, free_units=3000, largest_free_run_units=1500))
    actions = [c.action for c in decision.commands]
    assert Action.COMPACT in actions and Action.EVICT not in actions
    assert "fragmented" in decision.reason


def big_prompt(req, prompt_tokens, last_s=50):
    return Candidate(req=req, priority=5, units=prompt_tokens // 4, tokens=prompt_tokens, last_ts_ns=last_s * 10**9,
                     prompt_tokens=prompt_tokens)


def test_the_hold_covers_the_largest_prompt_seen_on_any_node_then_expires():
    e = engine(prompt_horizon_s=300.0)
    strategy_hold = int((1 - DEFAULT.target_u_kv) * D) - 600
    # a 12000-token prompt (3000 units) seen on another node, at a calm moment
    e.decide(replace(view(u_kv=0.3), node="n0/gpu1", candidates=(big_prompt(1, 12000),)))
    assert e.largest_prompt_units() == 3000
    hold = [c for c in e.decide(view(ts_ns=70 * 10**9, u_kv=0.6)).commands if c.action is Action.HEADROOM]
    assert hold[0].payload.units == 3000 + 512 - 600 > strategy_hold
    # capped at max_headroom_frac of D
    e2 = engine(max_headroom_frac=0.25)
    e2.decide(replace(view(u_kv=0.3), node="n0/gpu1", candidates=(big_prompt(1, 12000),)))
    assert e2.headroom_units(Mode.DEFAULT) == int(0.25 * D) - 600
    # forgotten after the horizon: back to the strategy's own hold
    e.decide(view(ts_ns=(60 + 600) * 10**9, u_kv=0.3))
    assert e.largest_prompt_units() == 0 and e.headroom_units(Mode.DEFAULT) == strategy_hold
    # switched off: the strategy's hold only
    e3 = engine(prompt_headroom=False)
    e3.decide(replace(view(u_kv=0.3), candidates=(big_prompt(1, 12000),)))
    assert e3.headroom_units(Mode.DEFAULT) == strategy_hold


def test_calm_ticks_release_the_strategys_hold_but_keep_the_prompt_sized_part():
    e = engine(headroom_calm_ticks=2, prompt_horizon_s=3600.0)
    first = e.decide(busy(ts_s=10, candidates=(big_prompt(1, 12000),)))
    assert [c.payload.units for c in first.commands if c.action is Action.HEADROOM] == [3000 + 512 - 600]
    e2 = engine(headroom_calm_ticks=2, prompt_horizon_s=3600.0, max_headroom_frac=0.2)
    e2.decide(busy(ts_s=10, candidates=(big_prompt(1, 12000),)))  # prompt hold capped: 2000 - 600
    strategy_hold = int((1 - DEFAULT.target_u_kv) * D) - 600
    holds = [[c.payload.units for c in e2.decide(view(ts_ns=int(t * 1e9), u_kv=0.3)).commands
              if c.action is Action.HEADROOM] for t in (20, 30, 40)]
    assert holds == [[], [2000 - 600], []] and 2000 - 600 < strategy_hold


def tick_record(ts_s, epoch, **changes):
    """A tick as it arrives from the bus (a validated record), with its producer epoch."""
    from dataclasses import asdict, fields

    v = busy(ts_s=ts_s, **changes)
    d = {f.name: getattr(v, f.name) for f in fields(NodeView) if f.name != "candidates"}
    candidates = [{**asdict(c), "priority": -1 if c.priority is None else c.priority} for c in v.candidates]
    return MetricTick.model_validate({**d, "epoch": epoch, "candidates": candidates}).to_tick()


def test_a_restarted_node_newer_epoch_is_decided_on_from_its_new_clock():
    e = engine()
    before = e.decide(tick_record(600, epoch=1, u_kv=0.95, ooms=1))
    assert before.mode is Mode.EMERGENCY and before.commands
    assert e.decide(tick_record(600, epoch=1, u_kv=0.95)).stale
    # the node restarts: its clock starts over, its ticks carry a newer epoch
    after = e.decide(tick_record(10, epoch=2, u_kv=0.95))
    assert not after.stale and after.mode is Mode.DEFAULT and e.counters.restarts == 1
    actions = [c.action for c in after.commands]
    assert Action.HEADROOM in actions, "the fresh engine holds nothing: the hold is sent again"
    assert all(verify(c, SECRET) and c.issued_at_ns == 10 * 10**9 for c in after.commands)
    same_ts_old_epoch = engine().decide(tick_record(10, epoch=1, u_kv=0.95)).commands
    assert not {c.id for c in after.commands} & {c.id for c in same_ts_old_epoch}, "ids differ per epoch"
    assert not e.decide(tick_record(20, epoch=2, u_kv=0.95)).stale
    # the old run is over: its late ticks are stale, whatever their time
    late = e.decide(tick_record(900, epoch=1, u_kv=0.95))
    assert late.stale and late.commands == [] and "epoch" in late.reason
    assert e.counters.stale_ticks == 2 and e.counters.restarts == 1
