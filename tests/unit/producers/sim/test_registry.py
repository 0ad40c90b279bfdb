"""The registry is the only place an engine kind is named: profiles, engines, node configs and the
policy's guards all follow from a kind's entry and the capabilities its engine declares."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvguard.contracts.engine import Capabilities
from kvguard.producers.sim.profiles import EngineKnobs, ProfileError, load_profile, profile_from_dict, profile_names
from kvguard.producers.sim.registry import DEFAULT_KIND, KINDS, capabilities_of, engine_kind, make_engine
from kvguard.producers.sim.seed.engine import Engine as SeedEngine
from kvguard.runtime.bootstrap import engine_config_from


def test_every_catalogue_profile_is_parsed_by_its_kind_and_builds_that_kind_s_engine():
    for name in profile_names():
        profile = load_profile(name)
        kind = engine_kind(profile)
        assert kind is KINDS[profile.engine]
        assert isinstance(make_engine(profile, "r/gpu0"), kind.engine)
        assert capabilities_of(profile) is kind.engine.capabilities


def test_an_unknown_kind_is_refused_with_the_field_named():
    with pytest.raises(ProfileError, match="'engine'.*one of"):
        profile_from_dict("x", {"engine": "trtllm"})
    assert DEFAULT_KIND in KINDS


def test_only_kinds_that_take_start_up_knobs_take_them():
    takers = [k for k in KINDS.values() if k.takes_knobs]
    assert takers and all(not k.takes_knobs for k in KINDS.values() if k not in takers)
    for name in profile_names():
        profile = load_profile(name)
        if not engine_kind(profile).takes_knobs:
            with pytest.raises(ProfileError, match="'engine'"):
                load_profile(name, knobs=EngineKnobs(gpu_memory_utilization=0.95))
            return
    pytest.fail("no catalogue profile of a kind without start-up knobs")


def test_a_node_config_names_a_field_its_kind_lacks():
    for kind in KINDS.values():
        assert isinstance(kind.node_config(), kind.config)
        with pytest.raises(ValueError, match="no_such_knob"):
            kind.node_config(no_such_knob=1)


FLAGS = ("use_headroom", "allocator_guard", "batch_cap_on_prediction")


def test_the_policy_s_guards_follow_the_declared_capabilities_not_the_kind_s_name(monkeypatch):
    """A new kind that declares the vLLM engine's memory model on the seed engine gets the vLLM guards."""
    from kvguard.config.settings import Settings

    settings = Settings.load(env={})
    seed_profile = next(p for p in map(load_profile, profile_names()) if p.engine == "seed")
    vllm_caps = KINDS["vllm"].capabilities
    as_vllm = Capabilities(**{f: getattr(vllm_caps, f) for f in Capabilities.__dataclass_fields__})

    class Declared(SeedEngine):
        capabilities = as_vllm

    monkeypatch.setitem(KINDS, "declared", replace(KINDS["seed"], name="declared", engine=Declared))
    declared = engine_config_from(settings, replace(seed_profile, engine="declared"), {})
    seed = engine_config_from(settings, seed_profile, {})
    vllm = engine_config_from(settings, load_profile(), {})
    assert [getattr(declared, f) for f in FLAGS] == [getattr(vllm, f) for f in FLAGS] == [False, True, False]
    assert [getattr(seed, f) for f in FLAGS] == [True, False, True]
    assert declared.planner.reclaim_cached is vllm.planner.reclaim_cached is False and seed.planner.reclaim_cached
    assert declared.batch_cap_tokens > 0 == seed.batch_cap_tokens

