"""The strategy space: 243 validated points, two presets, config errors that name the field."""

import pytest

from kvguard.policy.strategy import (
    DEFAULT,
    EMERGENCY,
    Granularity,
    HandlingChoice,
    Selection,
    Strategy,
    StrategyError,
    Timing,
    Trigger,
    all_strategies,
    strategy_from_mapping,
)


def test_space_has_243_distinct_strategies():
    space = all_strategies()
    assert len(space) == 243
    assert len({s.key for s in space}) == 243
    assert len({s.variant for s in space}) == 243


def test_default_preset_matches_design():
    assert DEFAULT.key == (Granularity.BLOCK, Selection.LRU, Timing.ASYNC, HandlingChoice.RECOMPUTE, Trigger.SOFT)
    assert DEFAULT.threshold == 0.85
    assert DEFAULT.use_prediction and DEFAULT.priority_tie_break
    assert DEFAULT.scan_interval_s == 30.0
    assert DEFAULT.variant == "block/lru/async/recompute/soft"


def test_emergency_preset_matches_design():
    assert EMERGENCY.key == (Granularity.REQUEST, Selection.COST, Timing.SYNC, HandlingChoice.RECOMPUTE,
                             Trigger.HARD)
    assert EMERGENCY.threshold == 0.95


def test_mapping_from_environment_strings_builds_a_strategy():
    s = strategy_from_mapping({"granularity": "TOKEN", "selection": "priority", "timing": "predictive",
                               "handling": "swap", "trigger": "fragmentation", "threshold": "0.6",
                               "use_prediction": "false", "max_victims": "3"})
    assert s.key == (Granularity.TOKEN, Selection.PRIORITY, Timing.PREDICTIVE, HandlingChoice.SWAP,
                     Trigger.FRAGMENTATION)
    assert s.threshold == 0.6 and s.use_prediction is False and s.max_victims == 3


def test_mapping_can_start_from_a_preset():
    s = strategy_from_mapping({"preset": "emergency", "threshold": 0.97})
    assert s.key == EMERGENCY.key and s.threshold == 0.97


@pytest.mark.parametrize(
    "values, field",
    [
        ({"trigger": "loud"}, "policy.default.trigger"),
        ({"granularity": "page"}, "policy.default.granularity"),
        ({"threshold": "high"}, "policy.default.threshold"),
        ({"threshold": 1.5}, "policy.default.threshold"),
        ({"scan_interval_s": 0}, "policy.default.scan_interval_s"),
        ({"use_prediction": "maybe"}, "policy.default.use_prediction"),
        ({"colour": "red"}, "policy.default.colour"),
        ({"preset": "panic"}, "policy.default.preset"),
    ],
)
def test_bad_value_fails_naming_the_field(values, field):
    with pytest.raises(StrategyError) as info:
        strategy_from_mapping(values, field_prefix="policy.default")
    assert info.value.field == field
    assert field in str(info.value)


def test_strategy_value_is_validated_on_construction():
    with pytest.raises(StrategyError, match="target_psi"):
        Strategy(target_psi=-0.1)


def test_settings_file_and_environment_reach_the_policy_engine_config(tmp_path):
    from kvguard.config.settings import Settings
    from kvguard.producers.sim.profiles import load_profile
    from kvguard.runtime.bootstrap import engine_config_from

    path = tmp_path / "kvguard.toml"
    path.write_text('[policy.default]\nselection = "priority"\nthreshold = 0.8\n')
    settings = Settings.load(path, env={"KVGUARD_POLICY__EMERGENCY": '{"handling": "swap"}'})
    config = engine_config_from(settings, load_profile(), {})
    assert config.default.selection is Selection.PRIORITY and config.default.threshold == 0.8
    assert config.default.granularity is Granularity.BLOCK, "unnamed fields keep the preset's"
    assert config.emergency.handling is HandlingChoice.SWAP and config.emergency.trigger is Trigger.HARD
    bad = Settings.load(env={"KVGUARD_POLICY__DEFAULT": '{"trigger": "loud"}'})
    with pytest.raises(StrategyError) as info:
        engine_config_from(bad, load_profile(), {})
    assert info.value.field == "policy.default.trigger"
