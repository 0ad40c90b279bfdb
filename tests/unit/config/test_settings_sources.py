"""Settings on pydantic-settings (issue 16): its env source parses ``KVGUARD_<SECTION>__<FIELD>``,
the loader keeps kvguard's contract around it (errors name the field and the variable or file,
nothing ambient in ``Settings(...)``, unknown names are errors)."""

import pytest

from kvguard.config.settings import ConfigError, Settings


def test_a_value_is_json_only_where_the_field_wants_a_structure():
    s = Settings.load(env={"KVGUARD_KAFKA__CLIENT_ID": "[blue]", "KVGUARD_KAFKA__SASL_USERNAME": "",
                           "KVGUARD_POLICY__DEFAULT": '{"selection": "priority"}',
                           "KVGUARD_KAFKA__CONSUMER_OPTIONS__METADATA_MAX_AGE_MS": "500"})
    assert s.kafka.client_id == "[blue]" and s.kafka.sasl_username == ""
    assert s.policy.default == {"selection": "priority"}
    assert s.kafka.consumer_options == {"metadata_max_age_ms": "500"}


@pytest.mark.parametrize(
    "env, message",
    [
        ({"KVGUARD_KAFKA__PRODUCER_OPTIONS": '{"linger": 1'},
         "kafka.producer_options: not valid JSON: Expecting ',' delimiter"),
        ({"KVGUARD_KAFKAX__LINGER_MS": "1"}, "kafkax.linger_ms: unknown setting (from env KVGUARD_KAFKAX__LINGER_MS)"),
        ({"KVGUARD_KAFKA____LINGER_MS": "1"}, "kafka..linger_ms: empty name part"),
        ({"KVGUARD_KAFKA__LINGER_MS": "1", "KVGUARD_KAFKA__LINGER_MS__MAX": "2"},
         "kafka.linger_ms.max: conflicts with another variable (from env KVGUARD_KAFKA__LINGER_MS__MAX)"),
        ({"KVGUARD_KAFKA__LINGER_MS": ""}, "kafka.linger_ms: must be an integer (from env KVGUARD_KAFKA__LINGER_MS)"),
    ],
)
def test_bad_variables_name_the_field_and_the_variable(env, message):
    with pytest.raises(ConfigError) as info:
        Settings.load(env=env)
    assert message in str(info.value)


def test_only_load_reads_the_environment(monkeypatch, tmp_path):
    path = tmp_path / "kvguard.toml"
    path.write_text("[kafka]\nlinger_ms = 2\n")
    monkeypatch.setenv("KVGUARD_CONFIG", str(path))
    monkeypatch.setenv("KVGUARD_KAFKA__BOOTSTRAP", "env:9092")
    assert Settings(kafka={"client_id": "x"}).kafka.bootstrap == "127.0.0.1:9092"
    loaded = Settings.load()
    assert (loaded.kafka.bootstrap, loaded.kafka.linger_ms) == ("env:9092", 2)


def test_a_json_file_must_hold_an_object(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a table/object at the top level"):
        Settings.load(path, env={})
    path.write_text('{"kafka": ')
    with pytest.raises(ConfigError, match="is not valid JSON"):
        Settings.load(path, env={})
