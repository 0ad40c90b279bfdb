"""Commands of another run, from the future or valid for too long are rejected; weak secrets are
refused; settings never print a secret; the applied-command journal is on by default (issue 15)."""

from dataclasses import replace

import pytest
from typer.testing import CliRunner

from kvguard.actuators.actuator import Actuator
from kvguard.actuators.executor import Executor
from kvguard.config.settings import Settings
from kvguard.contracts.commands import AckOutcome, Command, sign, verify
from kvguard.contracts.units import NS_PER_S
from tests.unit.actuators.test_actuator import NODE, SECRET, evict_command
from tests.unit.actuators.test_executor import running_engine

STRONG = "a5d7631065b7b68dee5e4ce06fc6c5f2d64ea94dfc578fc1-strong"  # random hex: the check estimates entropy


def actuator(engine, **kw) -> Actuator:
    return Actuator(NODE, Executor(engine), SECRET, **kw)


def test_a_command_of_the_previous_run_is_rejected_after_a_restart():
    """Signed 900 s into the old run (TTL 30 s), delivered 1 s after the node restarted."""
    old_run = sign(replace(evict_command(issued_s=900.0, ttl_s=30.0), epoch=1_000, signature=""), SECRET)
    e = running_engine()  # the restarted node's clock is near 0
    units_before = e.pool.metrics().live_units
    ack = actuator(e, epoch=2_000).handle(old_run, now_ns=1 * NS_PER_S)
    assert ack.outcome is AckOutcome.REJECTED_EPOCH and "epoch 1000" in ack.errors[0]
    assert ack.units_freed == 0 and e.pool.metrics().live_units == units_before


def test_the_epoch_is_signed():
    cmd = sign(replace(evict_command(), epoch=7, signature=""), SECRET)
    assert verify(cmd, SECRET) and not verify(replace(cmd, epoch=8), SECRET)
    assert Command.from_dict(cmd.to_dict()) == cmd


def test_the_current_run_s_commands_are_executed():
    cmd = sign(replace(evict_command(), epoch=2_000, signature=""), SECRET)
    e = running_engine()
    assert actuator(e, epoch=2_000).handle(cmd, e.now_ns).outcome is AckOutcome.EXECUTED


def test_a_command_from_the_future_or_valid_for_too_long_is_rejected():
    e = running_engine()
    act = actuator(e, max_skew_ns=60 * NS_PER_S, max_ttl_ns=3600 * NS_PER_S)
    future = sign(replace(evict_command(issued_s=1e6, ttl_s=1e9), signature=""), SECRET)
    ack = act.handle(future, e.now_ns)
    assert ack.outcome is AckOutcome.REJECTED_FUTURE and "ahead of the node's clock" in ack.errors[0]
    forever = sign(replace(evict_command(issued_s=e.now_ns / NS_PER_S, ttl_s=1e9, position=1), signature=""), SECRET)
    ack = act.handle(forever, e.now_ns)
    assert ack.outcome is AckOutcome.REJECTED_TTL and "command_max_ttl_s" in ack.errors[0]
    assert act.counters.rejected_future == act.counters.rejected_ttl == 1 and act.counters.executed == 0
    assert act.counters.as_dict()["rejected_future"] == 1


def test_the_engine_signs_the_tick_s_epoch_into_its_commands():
    from kvguard.policy.engine import EngineConfig, PolicyEngine
    from kvguard.wire.schemas import MetricTick

    engine = PolicyEngine(EngineConfig(dynamic_units=1000), SECRET)
    tick = MetricTick(node=NODE, ts_ns=10 * NS_PER_S, epoch=1_234, tick_s=10.0, u_kv=0.97, f_ext=0.2, f_int=0.0,
                      psi=1.0, free_units=30, largest_free_run_units=30).to_tick()
    commands = engine.decide(tick).commands
    assert commands and {c.epoch for c in commands} == {1_234} and all(verify(c, SECRET) for c in commands)


def test_graph_actuators_take_the_run_s_epoch_and_the_node_settings():
    from kvguard.runtime.bootstrap import bootstrap

    settings = Settings.load(env={"KVGUARD_NODE__COMMAND_MAX_SKEW_S": "5", "KVGUARD_NODE__COMMAND_MAX_TTL_S": "90",
                                  "KVGUARD_POLICY__HMAC_SECRET": STRONG})
    graph = bootstrap(settings, predictor=None, require_secret=True)
    (act,) = graph.actuators([running_engine()], epoch=42).values()
    assert (act.epoch, act.max_skew_ns, act.max_ttl_ns) == (42, 5 * NS_PER_S, 90 * NS_PER_S)


# ---- secrets ---------------------------------------------------------------------------------


@pytest.mark.parametrize("secret", ["x", "change-me-dev-only", "replace-me", "e2e-shared-secret", "a" * 40])
def test_weak_secrets_are_refused_in_multi_process_mode(secret):
    from kvguard.runtime.bootstrap import BootstrapError, bootstrap

    settings = Settings.load(env={"KVGUARD_POLICY__HMAC_SECRET": secret})
    with pytest.raises(BootstrapError, match="policy.hmac_secret"):
        bootstrap(settings, predictor=None, require_secret=True)
    assert bootstrap(settings, predictor=None, require_secret=True, insecure_dev=True).secret == secret.encode()
    assert bootstrap(settings, predictor=None).secret == secret.encode()  # in-process: warned, not refused


def test_a_strong_secret_is_accepted_and_the_embedded_mode_makes_one_up():
    from kvguard.runtime.bootstrap import bootstrap

    graph = bootstrap(Settings.load(env={"KVGUARD_POLICY__HMAC_SECRET": STRONG}), predictor=None, require_secret=True)
    assert graph.secret == STRONG.encode() and not graph.secret_generated
    made_up = bootstrap(Settings.load(env={}), predictor=None)
    assert made_up.secret_generated and len(made_up.secret) >= 32


@pytest.mark.parametrize("command", ["policy", "node"])
def test_the_services_refuse_a_placeholder_secret_unless_insecure_dev(command, monkeypatch):
    monkeypatch.setenv("KVGUARD_POLICY__HMAC_SECRET", "change-me-dev-only")
    result = CliRunner().invoke(__import__("kvguard.cli", fromlist=["app"]).app, [command, "--bus", "kafka://127.0.0.1:1"])
    assert result.exit_code == 2 and "policy.hmac_secret" in result.output and "--insecure-dev" in result.output


def test_repr_and_str_of_settings_show_no_secret():
    env = {"KVGUARD_KAFKA__SASL_PASSWORD": "sasl-pw-1", "KVGUARD_REDIS__PASSWORD": "redis-pw-2",
           "KVGUARD_REDIS__URL": "redis://user:url-pw-3@redis:6379/0", "KVGUARD_POLICY__HMAC_SECRET": "hmac-pw-4",
           "KVGUARD_KAFKA__PRODUCER_OPTIONS": '{"sasl_plain_password": "opt-pw-5", "linger_ms": 3}'}
    settings = Settings.load(env=env)
    shown = repr(settings) + str(settings) + repr(settings.kafka) + str(settings.redis) + repr(settings.policy)
    for secret in ("sasl-pw-1", "redis-pw-2", "url-pw-3", "hmac-pw-4", "opt-pw-5"):
        assert secret not in shown
    assert "linger_ms': 3" in shown and "redis://user:***@redis:6379/0" in shown
    # the values themselves are intact (a settings file written from them still works)
    assert settings.kafka.sasl_password == "sasl-pw-1" and "url-pw-3" in settings.model_dump_json()


# ---- the journal -----------------------------------------------------------------------------


def test_the_journal_is_on_by_default_for_a_node_process(monkeypatch, tmp_path):
    import kvguard.runtime.node as node_loop

    seen = {}

    async def fake_run_node(graph, bus, workload, **kwargs):
        seen.update(kwargs)
        return {"gpus": kwargs["n_gpus"]}

    monkeypatch.setattr(node_loop, "run_node", fake_run_node)
    monkeypatch.setenv("KVGUARD_POLICY__HMAC_SECRET", STRONG)
    monkeypatch.setenv("KVGUARD_NODE__JOURNAL_DIR", str(tmp_path / "journal"))
    from kvguard.cli import app

    result = CliRunner().invoke(app, ["node", "--bus", "inproc://", "--duration", "1s", "--json"])
    assert result.exit_code == 0, result.output
    assert seen["journal_dir"] == str(tmp_path / "journal")
    assert Settings.load(env={}).node.journal_dir  # a path by default, not memory-only
