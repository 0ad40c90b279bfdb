"""Settings: defaults < file < env < overrides; bad config names the field and its source."""

import json

import pytest

from kvguard.config.settings import ConfigError, Settings


def test_defaults_follow_the_design():
    s = Settings.load(env={})
    assert s.streams.tick_s == 10 and s.streams.alpha == 2 and s.streams.beta == 1
    assert s.streams.reserved_frac == 0.05 and s.streams.slope_window_s == 300
    assert s.budget.minutes_per_week == 60 and s.budget.f_ext_threshold == 0.5
    assert s.topics.name("events") == "kvguard.events"
    assert sorted(s.topics.all()) == sorted(
        f"kvguard.{k}" for k in ("events", "metrics", "alerts", "commands", "acks", "dlq"))


def test_file_then_env_then_overrides(tmp_path):
    path = tmp_path / "kvguard.toml"
    path.write_text('[kafka]\nbootstrap = "file:9092"\nlinger_ms = 3\n[topics.events]\npartitions = 24\n')
    s = Settings.load(path, env={"KVGUARD_KAFKA__LINGER_MS": "9"},
                      overrides={"redis": {"url": "redis://x:1/0"}})
    assert s.kafka.bootstrap == "file:9092"
    assert s.kafka.linger_ms == 9
    assert s.topics.events.partitions == 24
    assert s.topics.events.name == "events"  # a partial topic spec keeps the kind's defaults
    assert s.redis.url == "redis://x:1/0"


def test_json_file_and_config_env_variable(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"policy": {"hmac_secret": "s3", "command_ttl_s": 5}}))
    s = Settings.load(env={"KVGUARD_CONFIG": str(path)})
    assert s.policy.hmac_secret == "s3" and s.policy.command_ttl_s == 5
    assert "s3" not in repr(s)


def test_env_json_values_and_booleans():
    s = Settings.load(env={"KVGUARD_KAFKA__PRODUCER_OPTIONS": '{"metadata_max_age_ms": 1000}',
                           "KVGUARD_KAFKA__IDEMPOTENT": "true", "KVGUARD_UNRELATED": "x"})
    assert s.kafka.producer_options == {"metadata_max_age_ms": 1000}
    assert s.kafka.idempotent is True


@pytest.mark.parametrize(
    "env, message",
    [
        ({"KVGUARD_KAFKA__LINGER_MS": "-1"}, "kafka.linger_ms: must be ≥ 0 (from env KVGUARD_KAFKA__LINGER_MS)"),
        ({"KVGUARD_KAFKA__LINGERMS": "1"}, "kafka.lingerms: unknown setting"),
        ({"KVGUARD_TOPICS__EVENTS__PARTITIONS": "0"}, "topics.events.partitions: must be > 0"),
        ({"KVGUARD_STREAMS__TICK_S": "soon"}, "streams.tick_s: must be a number"),
        ({"KVGUARD_POLICY__PRESET": "yolo"}, "policy.preset: must be one of"),
    ],
)
def test_bad_env_names_field_and_source(env, message):
    with pytest.raises(ConfigError) as info:
        Settings.load(env=env)
    assert message in str(info.value)


def test_bad_file_value_names_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[budget]\nminutes_per_week = 0\n")
    with pytest.raises(ConfigError) as info:
        Settings.load(path, env={})
    assert info.value.field == "budget.minutes_per_week"
    assert str(path) in str(info.value)


def test_unreadable_or_broken_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        Settings.load(tmp_path / "missing.toml", env={})
    broken = tmp_path / "broken.toml"
    broken.write_text("[kafka\n")
    with pytest.raises(ConfigError, match="not valid"):
        Settings.load(broken, env={})


def test_the_deploy_config_file_is_valid():
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "deploy" / "kvguard.toml"
    s = Settings.load(path, env={})
    assert s.kafka.bootstrap == "kafka:9092"
    assert s.topics.events.partitions == 12
