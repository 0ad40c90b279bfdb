"""Node ids are bounded where they enter (issue 28): at most 48 characters (stricter than a
Kubernetes label value's 63) of letters, digits and - _ . / :, beginning and ending with a letter or digit.
Every id kvguard builds passes; a hostile one is refused at decode, in settings and at the node."""

from __future__ import annotations

import string

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvguard.contracts.node_id import NODE_ID_MAX_CHARS, check_node_id, node_id_problem
from kvguard.wire.schemas import DecodeError, decode

OURS = ["sim-0/gpu0", "sim-12/gpu7", "demo-3f9a1c2b/gpu0", "synthetic-3/gpu1", "snapshot/decomfl_memory/gpu0",
        "gpu-host-7/gpu0", "ip-10-0-12-34.us-west-2.compute.internal/gpu3", "vllm-0:3", "llama-70b-6c9f8d-x2kqp:1",
        "t/gpu0", "a", "n"]
HOSTILE = {
    "empty": "",
    "one too long": "h" * 44 + "/gpu0",
    "10,005 characters": "x" * 10_000 + "/gpu0",
    "NUL": "sim-0/gpu0\x00",
    "newline": "sim-0/gpu0\nkvguard_u_kv 1",
    "RTL override": "sim-0/\u202egpu0",
    "space": "sim 0/gpu0",
    "quote": 'sim-0/gpu0"',
    "backslash": "sim-0\\gpu0",
    "leading separator": "/gpu0",
    "trailing separator": "sim-0:",
    "a letter past ASCII": "sïm-0/gpu0",
    "a digit past ASCII": "sim-\u0663/gpu0",
}


@pytest.mark.parametrize("node", OURS)
def test_every_id_kvguard_builds_is_a_node_id(node):
    assert node_id_problem(node) is None and check_node_id(node) == node


def test_the_ids_of_the_fleet_the_demo_and_the_plugin_are_node_ids():
    from kvguard.producers.sim.fleet import Fleet
    from kvguard.producers.sim.profiles import load_profile
    from kvguard.producers.sinks import node_id_from_env

    fleet = Fleet(8, load_profile("llama3-8b-24gb"), seed=0)
    assert all(node_id_problem(e.node) is None for e in fleet.engines)
    assert node_id_problem(node_id_from_env({"NODE_NAME": "gke-prod-gpu-pool-1a2b3c4d-xk2p", "CUDA_VISIBLE_DEVICES": "3"})) is None


@pytest.mark.parametrize("what", sorted(HOSTILE))
def test_a_hostile_id_is_refused_with_the_rule(what):
    node = HOSTILE[what]
    problem = node_id_problem(node)
    assert problem is not None
    with pytest.raises(ValueError, match="node"):
        check_node_id(node)
    tick = {"schema": "1.0", "node": node, "ts_ns": 1, "u_kv": 0.5, "f_ext": 0.1, "f_int": 0.0, "psi": 0.6}
    with pytest.raises(DecodeError) as err:
        decode("metrics", orjson.dumps(tick))
    assert err.value.reason == "invalid" and err.value.detail.startswith("node: ") and "node id" in err.value.detail


def test_a_hundred_ticks_with_ten_thousand_character_ids_are_refused_at_decode():
    for i in range(100):
        node = f"{i:05d}" + "n" * 9_995
        tick = {"schema": "1.0", "node": node, "ts_ns": 1, "u_kv": 0.5, "f_ext": 0.1, "f_int": 0.0, "psi": 0.6}
        with pytest.raises(DecodeError) as err:
            decode("metrics", orjson.dumps(tick))
        assert err.value.reason == "invalid"
        assert "node id is 10000 characters, at most 48" in err.value.detail
        assert len(err.value.detail) < 300  # the reason names the rule, it does not repeat the id


@pytest.mark.parametrize("kind, record", [
    ("events", {"seq": 0, "cols": {}}),
    ("alerts", {"ts_ns": 1, "name": "X", "tier": "threshold", "severity": "warning"}),
    ("commands", {"schema": "2.0", "id": "c", "action": "hold", "payload": {"max_prompt_tokens": 0, "steps": 0},
                  "issued_at_ns": 1, "ttl_ns": 1}),
    ("acks", {"command_id": "c", "outcome": "executed", "executed_at_ns": 1}),
])
def test_every_record_naming_a_node_bounds_it(kind, record):
    with pytest.raises(DecodeError) as err:
        decode(kind, orjson.dumps({"schema": "1.0", "node": "x" * 49, **record}))
    assert err.value.reason == "invalid" and "node id is 49 characters" in err.value.detail


@given(st.text(alphabet=string.printable + "\u202e\u00e9\x00", max_size=80))
def test_an_accepted_id_prints_as_itself_in_a_label_a_log_line_and_a_terminal(text):
    if node_id_problem(text) is not None:
        return
    assert 1 <= len(text) <= NODE_ID_MAX_CHARS and text.isascii() and text.isprintable()
    assert not any(c.isspace() or c in "\"'\\{}=,`" for c in text)
    assert text[0].isalnum() and text[-1].isalnum()


def test_a_node_id_setting_that_consumers_would_refuse_fails_at_start():
    from kvguard.config.settings import ConfigError, Settings

    with pytest.raises(ConfigError, match="node.node_id"):
        Settings.load(env={"KVGUARD_NODE__NODE_ID": "x" * 100})
    assert Settings.load(env={"KVGUARD_NODE__NODE_ID": "gpu-host-7/gpu0"}).node.node_id == "gpu-host-7/gpu0"


def test_an_engine_with_a_long_or_odd_name_still_serves_under_a_fitted_id(caplog):
    """Kubernetes names run to 253 characters ($(NODE_NAME)/$(POD_NAME), deploy/k8s/vllm-node.yaml):
    the plugin must not stop an engine over its name; it publishes under a fitted id and says so."""
    from kvguard.contracts.node_id import NODE_ID_MAX_CHARS, fit_node_id, node_id_problem
    from kvguard.producers.sinks import node_id_from_env

    pod = "gke-inference-prod-a100-pool-7f3c2d1e-x9k2/vllm-llama3-70b-instruct-deployment-7f8d9c6b5-abcde"
    fitted = node_id_from_env({"KVGUARD_NODE_ID": pod})
    assert node_id_problem(fitted) is None and len(fitted) <= NODE_ID_MAX_CHARS
    assert fitted.startswith("gke-inference-prod-a100-pool") and fitted == node_id_from_env({"KVGUARD_NODE_ID": pod})
    assert "publishing as" in caplog.text
    # two pods of one node (the same prefix) keep different ids
    assert fit_node_id(pod) != fit_node_id(pod.replace("abcde", "fghij"))
    assert node_id_problem(node_id_from_env({"NODE_NAME": "h" * 70})) is None
    assert node_id_problem(node_id_from_env({"KVGUARD_NODE_ID": "bad id\u202e"})) is None
    assert fit_node_id("sim-0/gpu0") == "sim-0/gpu0"  # a valid id is kept as it is


@given(st.text(min_size=1, max_size=400))
def test_every_fitted_id_is_a_node_id(raw):
    from kvguard.contracts.node_id import fit_node_id, node_id_problem

    assert node_id_problem(fit_node_id(raw)) is None


@pytest.mark.parametrize("kind, field, record", [
    ("alerts", "name", {"ts_ns": 1, "tier": "threshold", "severity": "warning"}),
    ("alerts", "severity", {"ts_ns": 1, "name": "X", "tier": "threshold"}),
    ("acks", "outcome", {"command_id": "c", "executed_at_ns": 1}),
])
def test_a_value_the_exporter_writes_as_a_label_is_bounded(kind, field, record):
    long = {"schema": "1.0", "node": "n/gpu0", **record, field: "x" * 10_000}
    with pytest.raises(DecodeError) as err:
        decode(kind, orjson.dumps(long))
    assert err.value.reason == "invalid" and field in err.value.detail
    odd = {"schema": "1.0", "node": "n/gpu0", **record, field: "a\nb"}
    with pytest.raises(DecodeError):
        decode(kind, orjson.dumps(odd))
