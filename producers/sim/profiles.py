"""The profile catalogue: ``profiles.json`` (or another file) read into typed ``Profile`` values.

A profile fixes one GPU's memory ledger, its scheduler limits and its step-time model
(``producers.sim.profile``). Numbers and their sources live in the JSON, so a new model or GPU is a
data change, not a code change. Each profile names the engine kind that runs it (``engine``); the
kind's parser, registered in ``producers.sim.registry``, reads its object (a vLLM-engine profile's
ledger is measured as vLLM measures it, the seed engine's is stated), and the kind decides whether
it takes ``vllm serve``'s start-up knobs (``EngineKnobs``) and which prompts a run feeds it.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from pathlib import Path

from kvguard.producers.sim import registry
from kvguard.producers.sim.profile import EngineKnobs, Profile, ProfileError, VllmSpec


def profile_from_dict(name: str, d: dict) -> Profile:
    """A profile from its JSON object (the parser of the engine kind it names)."""
    return registry.parse_profile(name, d)


@lru_cache(maxsize=4)
def _load(path: str | None) -> dict:
    if path is None:
        text = resources.files("kvguard.producers.sim").joinpath("profiles.json").read_text()
    else:
        text = Path(path).read_text()
    return json.loads(text)


def default_profile_name(engine: str | None = None) -> str:
    """The catalogue's default profile, or its default for the engine kind ``engine``."""
    data = _load(None)
    if engine is None:
        return data["default"]
    by_engine = data.get("default_by_engine", {})
    if engine not in by_engine:
        raise ProfileError(engine, "engine", f"one of {sorted(by_engine)} (the kinds the catalogue has a default for)")
    return by_engine[engine]


def profile_names(path: str | None = None) -> list[str]:
    return sorted(_load(path)["profiles"])


def prompt_cap_tokens(profile: Profile) -> int | None:
    """The longest prompt a run feeds the engine (``kvguard simulate``, the demo and the ML dataset share
    this rule), by its kind: the seed engine caps prompts that could never fit one GPU's KV region (said
    in the workload notes); the vLLM engine takes them as they are and rejects those over
    ``max_model_len``, as vLLM does (None)."""
    return registry.engine_kind(profile).prompt_cap_tokens(profile)


def profile_object(name: str | None = None, path: str | None = None, knobs: EngineKnobs | None = None) -> dict:
    """The named profile's JSON object with ``knobs`` applied, not yet measured (``load_profile`` measures it)."""
    data = _load(path)
    name = name or data["default"]
    if name not in data["profiles"]:
        raise ProfileError(name, "name", f"one of {sorted(data['profiles'])}")
    if knobs is None or knobs.is_default():
        return data["profiles"][name]
    return registry.apply_knobs(name, data["profiles"][name], knobs)


def load_profile(name: str | None = None, path: str | None = None, knobs: EngineKnobs | None = None) -> Profile:
    """The named profile (default: the file's ``default``) from ``profiles.json`` or ``path``, with
    ``knobs`` applied (the profile's name then ends in ``@`` and the knobs' label)."""
    data = _load(path)
    name = name or data["default"]
    if name not in data["profiles"]:
        raise ProfileError(name, "name", f"one of {sorted(data['profiles'])}")
    if knobs is None or knobs.is_default():
        return profile_from_dict(name, data["profiles"][name])
    return profile_from_dict(f"{name}@{knobs.label()}", registry.apply_knobs(name, data["profiles"][name], knobs))


__all__ = ["EngineKnobs", "Profile", "ProfileError", "VllmSpec", "default_profile_name", "load_profile",
           "profile_from_dict", "profile_names", "profile_object", "prompt_cap_tokens"]
