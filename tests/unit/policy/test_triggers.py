"""When a strategy acts (issue 12): predictive timing acts on the forecast, the fragmentation trigger on
F_ext > 0.6 of the layer where fragmentation lives, and a strategy off the presets runs end to end."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from kvguard.contracts.units import NS_PER_S
from kvguard.policy.engine import trigger_reason
from kvguard.policy.planner import NodeView
from kvguard.policy.strategy import DEFAULT, Granularity, HandlingChoice, Selection, Timing, Trigger

HARD = replace(DEFAULT, timing=Timing.SYNC, trigger=Trigger.HARD, threshold=0.85)
PREDICTIVE = replace(HARD, timing=Timing.PREDICTIVE, predictive_horizon_s=60.0)
FRAGMENTATION = replace(HARD, trigger=Trigger.FRAGMENTATION)  # threshold left at 0.85 on purpose


def view(**changes) -> NodeView:
    base = NodeView(node="n/gpu0", ts_ns=600 * NS_PER_S, u_kv=0.5, f_ext=0.1, f_int=0.0, psi=0.5,
                    dynamic_units=10_000, free_units=5_000, largest_free_run_units=4_000)
    return replace(base, **changes)


def test_predictive_timing_acts_on_the_forecast_within_its_horizon_not_on_the_level():
    rising = view(u_kv=0.6, u_kv_forecast=(0.7, 0.9, 0.99))  # points 30 s apart: 0.9 at 60 s
    assert trigger_reason(rising, PREDICTIVE, 30.0) == "forecast u_kv 0.900 > 0.85 within 60 s"
    assert trigger_reason(rising, HARD, 30.0) is None  # sync timing looks at the level only
    late = view(u_kv=0.6, u_kv_forecast=(0.7, 0.8, 0.99))  # crosses only after the horizon
    assert trigger_reason(late, PREDICTIVE, 30.0) is None
    high = view(u_kv=0.9, u_kv_forecast=(0.8, 0.7))  # above the line but falling
    assert trigger_reason(high, PREDICTIVE, 30.0) is None
    assert trigger_reason(high, HARD, 30.0) == "u_kv 0.900 > 0.85"
    falling = view(u_kv=0.97, u_kv_forecast=(0.8,))
    assert trigger_reason(falling, PREDICTIVE, 30.0) == "u_kv 0.970 past the hard line"  # the last resort


def test_the_fragmentation_trigger_fires_above_the_seeds_0_6_on_either_layer():
    assert trigger_reason(view(f_ext=0.65), FRAGMENTATION, 30.0) == "f_ext 0.65 > 0.6"
    assert trigger_reason(view(f_ext=0.55), FRAGMENTATION, 30.0) is None
    assert trigger_reason(view(f_ext=0.9, free_units=0), FRAGMENTATION, 30.0) is None  # nothing free to defragment
    uniform = view(f_ext=0.0, alloc_reserved_bytes=1 << 30, alloc_f_ext=0.7)  # vLLM blocks: the allocator's F_ext
    assert trigger_reason(uniform, FRAGMENTATION, 30.0) == "allocator f_ext 0.70 > 0.6"
    assert trigger_reason(replace(uniform, alloc_reserved_bytes=0), FRAGMENTATION, 30.0) is None
    assert trigger_reason(view(f_ext=0.65, u_kv=0.99), replace(FRAGMENTATION, f_ext_trigger=0.7), 30.0) is None


def test_a_strategy_off_the_presets_runs_end_to_end_on_the_closed_loop():
    from kvguard.runtime.bootstrap import bootstrap
    from kvguard.runtime.embedded import demo_workload, run_embedded

    custom = {"granularity": "request", "selection": "priority", "timing": "sync", "handling": "recompute",
              "trigger": "hard", "threshold": 0.8}
    graph = bootstrap(predictor=None, profile="llama3-8b-24gb", strategy_overrides={"default": custom})
    assert graph.engine_config.default.variant == "request/priority/sync/recompute/hard"
    wl = demo_workload(graph.profile, workload="mixed", rate_scale=3.0, duration_s=240.0, seed=1)
    result = asyncio.run(run_embedded(graph, wl, n_gpus=2, duration_s=240.0, seed=1, guarded=True))
    kv = result.summary["kvguard"]
    assert kv["policy"]["evict_commands"] > 0 and kv["actuators"]["executed"] > 0
    assert kv["actuators"]["rejected_signature"] == 0 and kv["actuators"]["malformed"] == 0
    # every executed command is kept with its time, for the report's timeline marks
    assert sum(len(v) for v in result.commands.values()) == kv["actuators"]["executed"]
    assert all(0 < t <= 240.0 for v in result.commands.values() for t, _ in v)
    assert graph.engine_config.default.key == (Granularity.REQUEST, Selection.PRIORITY, Timing.SYNC,
                                               HandlingChoice.RECOMPUTE, Trigger.HARD)
