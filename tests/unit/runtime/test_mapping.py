"""Settings into typed configs, once (kvguard.runtime.mapping): every field mapped by name, the
Settings model the only holder of defaults, no getattr fallback on a settings object anywhere."""

import ast
import dataclasses
from pathlib import Path

import pytest

from kvguard.config.settings import RedisSettings, Settings
from kvguard.contracts.tiers import AlertThresholds
from kvguard.runtime.mapping import (
    BootstrapError,
    budget_config,
    check_redis_url,
    redis_target,
    slo_config,
    stream_config,
    wire_limits,
)
from kvguard.streams.core import StreamConfig
from kvguard.wire.validate import WireLimits

ROOT = Path(__file__).resolve().parents[3]


def test_the_defaults_map_onto_the_cores_own_defaults():
    assert stream_config(Settings()) == StreamConfig()
    assert wire_limits(Settings().streams) == WireLimits()


def test_every_tier_threshold_comes_from_its_setting_of_the_same_name():
    names = [f.name for f in dataclasses.fields(AlertThresholds) if f.name != "p_oom"]
    # a distinct value per field, inside every field's bounds, so a field mapped from another shows
    values = {name: round(0.31 + 0.01 * i, 2) for i, name in enumerate(names)}
    settings = Settings(streams=values, predictor={"threshold": 0.27})
    thresholds = stream_config(settings).thresholds
    assert {name: getattr(thresholds, name) for name in names} == values
    assert thresholds.p_oom == 0.27


def test_the_stream_numbers_and_the_wire_caps_come_from_their_settings():
    settings = Settings(streams={"tick_s": 5, "slope_window_s": 60, "alpha": 3, "beta": 0.5, "max_epoch_jump": 99,
                                 "max_ts_skew_s": 50, "max_nodes": 7, "max_batch_events": 11,
                                 "max_dynamic_units": 12, "max_state_refs": 13})
    config = stream_config(settings, tick_s=2.0)  # an override wins
    assert (config.tick_s, config.slope_window_s, config.alpha, config.beta) == (2.0, 60, 3, 0.5)
    assert (config.max_epoch_jump, config.max_ts_skew_s, config.max_nodes) == (99, 50, 7)
    assert config.limits == WireLimits(max_dynamic_units=12, max_batch_events=11, max_state_refs=13)


def test_the_budget_and_the_slo_share_the_key_prefix_and_the_retention():
    settings = Settings(budget={"minutes_per_week": 30, "f_ext_threshold": 0.6, "retention_weeks": 3,
                                "key_prefix": "prod:budget", "cluster": "eu", "interval_s": 600,
                                "top_intervals": 2, "buffer_max": 9},
                        predictor={"horizon_s": 120})
    budget = budget_config(settings)
    assert (budget.budget_s, budget.threshold, budget.retention_weeks, budget.key_prefix, budget.cluster,
            budget.interval_s, budget.top_intervals, budget.buffer_max) == (1800.0, 0.6, 3, "prod:budget:", "eu",
                                                                            600, 2, 9)
    slo = slo_config(settings)
    assert (slo.horizon_s, slo.retention_weeks, slo.key_prefix) == (120, 3, "prod:budget:")


def test_a_redis_url_is_checked_and_the_option_named_without_its_password():
    assert check_redis_url("unix:///run/redis.sock", "--redis") == "unix:///run/redis.sock"
    with pytest.raises(BootstrapError, match="--redis: expected a redis://") as err:
        check_redis_url("http://user:hunter2@cache:6379", "--redis")
    assert err.value.field == "--redis" and "hunter2" not in str(err.value)


def test_the_redis_section_gives_the_url_with_password_and_tls():
    url, options = redis_target(RedisSettings(url="redis://cache:6379/1", password="p@ss:word", tls=True,
                                              ssl_cafile="/ca.pem"))
    assert url == "rediss://:p%40ss%3Aword@cache:6379/1" and options == {"ssl_ca_certs": "/ca.pem"}
    assert redis_target(RedisSettings(url="redis://:given@cache:6379/0", password="other"))[0] == \
        "redis://:given@cache:6379/0"
    with pytest.raises(BootstrapError, match="redis.url"):
        redis_target(RedisSettings(url="cache:6379"))


def getattr_on_settings(source: str) -> list[int]:
    """Lines of ``getattr(x, …)`` where ``x`` reads as a settings object or one of its sections."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" and node.args:
            target = ast.unparse(node.args[0])
            if "settings" in target or target in ("section", "streams", "budget", "policy", "kafka", "redis"):
                out.append(node.lineno)
    return out


def test_no_module_reads_a_setting_through_getattr():
    found = []
    for folder in ("kvguard", "producers", "streams", "policy", "actuators"):
        for path in (ROOT / folder).rglob("*.py"):
            found += [f"{path.relative_to(ROOT)}:{line}" for line in getattr_on_settings(path.read_text())]
    assert found == []


def test_the_getattr_check_catches_a_fallback():
    assert getattr_on_settings('x = getattr(settings.streams, "idle_flush_s", None)') == [1]
    assert getattr_on_settings('x = getattr(section, "tls", False)') == [1]
    assert getattr_on_settings('x = getattr(self, "name")') == []
