"""The shadow fleet's engines by kind: the only place an engine kind is named.

A profile names its engine kind (``Profile.engine``; ``DEFAULT_KIND`` when its JSON object has no
``engine``). Each kind registers, once, everything that differs between engines:

- the engine class (an ``EnginePort``, ``kvguard.contracts.engine``) and its declared
  ``Capabilities``, which the policy reads instead of the kind's name (``runtime.bootstrap``);
- its node config class and how an engine is built from a profile;
- how its profiles are parsed, which prompts a run feeds it, and whether it takes ``vllm serve``'s
  start-up knobs (``EngineKnobs``).

``"vllm"`` is the vLLM-faithful engine (``kvguard.producers.sim.vllm``), the default profiles' kind;
``"sglang"`` the SGLang-faithful engine (``kvguard.producers.sim.sglang``), checked against SGLang's own
Python;
``"seed"`` is the seed's engine over its paged pool (``kvguard.producers.sim.seed``), quarantined for
comparison: this module is the only one that imports it. A new engine is one more entry here, and
the contract suite (tests/contract/test_engine_port.py) runs over every entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

from kvguard.contracts.engine import Capabilities
from kvguard.contracts.units import NS_PER_S
from kvguard.producers.sim.profile import EngineKnobs, Profile, ProfileError
from kvguard.producers.sim.seed.engine import Engine as SeedEngine
from kvguard.producers.sim.seed.engine import SeedEngineConfig
from kvguard.producers.sim.seed.pool import PagedPool
from kvguard.producers.sim.seed.profile import seed_profile, seed_prompt_cap_tokens
from kvguard.producers.sim.sglang.engine import SglangEngine, SglangEngineConfig
from kvguard.producers.sim.sglang.profile import sglang_profile
from kvguard.producers.sim.vllm.engine import VllmEngine, VllmEngineConfig
from kvguard.producers.sim.vllm.profile import apply_vllm_knobs, vllm_profile, vllm_prompt_cap_tokens

NodeConfig = VllmEngineConfig | SeedEngineConfig | SglangEngineConfig
SimEngine = VllmEngine | SeedEngine | SglangEngine


@dataclass(slots=True, frozen=True)
class EngineKind:
    """One engine kind and what differs with it (see the module docstring)."""

    name: str
    engine: type
    config: type
    build: Callable[[Profile, str, int, Any], SimEngine]  # (profile, node, seed, config or None)
    parse_profile: Callable[[str, dict, str], Profile]  # (name, JSON object, kind name)
    prompt_cap_tokens: Callable[[Profile], int | None]  # the longest prompt a run feeds it (None: any)
    apply_knobs: Callable[[EngineKnobs, dict], dict] | None = None  # None: takes no start-up knobs

    @property
    def capabilities(self) -> Capabilities:
        return self.engine.capabilities

    @property
    def takes_knobs(self) -> bool:
        return self.apply_knobs is not None

    def node_config(self, base: NodeConfig | None = None, **values: Any) -> NodeConfig:
        """This kind's node config (``base``, or its defaults) with ``values`` set; a field it does
        not have is a ``ValueError`` naming it."""
        known = {f.name for f in fields(self.config)}
        for name in values:
            if name not in known:
                raise ValueError(f"{name}: the {self.name!r} engine's config has no such field (it has {sorted(known)})")
        return replace(base, **values) if base is not None else self.config(**values)


def _build_vllm(profile: Profile, node: str, seed: int, config: Any) -> VllmEngine:
    if isinstance(config, SeedEngineConfig):  # a seed config's restart time carries over
        config = VllmEngineConfig(restart_s=config.restart_s)
    return VllmEngine(profile, node=node, seed=seed, config=config)


def _build_sglang(profile: Profile, node: str, seed: int, config: Any) -> SglangEngine:
    if config is not None and not isinstance(config, SglangEngineConfig):  # another kind's restart time carries over
        config = SglangEngineConfig(restart_s=config.restart_s)
    return SglangEngine(profile, node=node, seed=seed, config=config)


def _no_prompt_cap(profile: Profile) -> int | None:
    """SGLang takes prompts as they come and rejects those over its context length (None)."""
    return None


def _build_seed(profile: Profile, node: str, seed: int, config: Any) -> SeedEngine:
    if config is not None and not isinstance(config, SeedEngineConfig):
        raise ValueError(f"profile {profile.name!r} runs the seed engine: config must be a SeedEngineConfig, "
                         f"got {type(config).__name__}")
    return SeedEngine(make_pool(profile, node), profile, node=node, seed=seed, config=config)


KINDS: dict[str, EngineKind] = {
    "vllm": EngineKind("vllm", VllmEngine, VllmEngineConfig, _build_vllm, vllm_profile, vllm_prompt_cap_tokens,
                       apply_vllm_knobs),
    "sglang": EngineKind("sglang", SglangEngine, SglangEngineConfig, _build_sglang, sglang_profile, _no_prompt_cap),
    "seed": EngineKind("seed", SeedEngine, SeedEngineConfig, _build_seed, seed_profile, seed_prompt_cap_tokens),
}
DEFAULT_KIND = "seed"  # a profile object without "engine" (the seed's own profiles predate the field)


def kind_named(name: str, profile: str = "<profile>") -> EngineKind:
    if name not in KINDS:
        raise ProfileError(profile, "engine", f"one of {sorted(KINDS)}, got {name!r}")
    return KINDS[name]


def engine_kind(profile: Profile) -> EngineKind:
    """The kind that runs ``profile``."""
    return kind_named(profile.engine, profile.name)


def capabilities_of(profile: Profile) -> Capabilities:
    """What the engine that runs ``profile`` offers (the policy's guards follow from it)."""
    return engine_kind(profile).capabilities


def make_engine(profile: Profile, node: str, *, seed: int = 0, config: NodeConfig | None = None) -> SimEngine:
    """The engine ``profile`` names. ``config``: that kind's node config (a seed config given to the
    vLLM engine carries its ``restart_s`` over)."""
    return engine_kind(profile).build(profile, node, seed, config)


def parse_profile(name: str, d: dict) -> Profile:
    """A profile from its JSON object, by the parser of the kind it names."""
    kind = kind_named(d.get("engine", DEFAULT_KIND), name)
    return kind.parse_profile(name, d, kind.name)


def apply_knobs(name: str, d: dict, knobs: EngineKnobs) -> dict:
    """``d`` (a profile's JSON object) with ``knobs`` set; only kinds that take start-up knobs do."""
    if knobs.is_default():
        return d
    kind = kind_named(d.get("engine", DEFAULT_KIND), name)
    if kind.apply_knobs is None:
        takers = sorted(k.name for k in KINDS.values() if k.takes_knobs)
        raise ProfileError(name, "engine", f"one of {takers} to take engine knobs {knobs.to_dict()} "
                                           f"(the {kind.name!r} engine has none)")
    return kind.apply_knobs(knobs, d)


def make_pool(profile: Profile, node: str, *, retain_ttl_s: float = 300.0, checkpoint_dir=None) -> PagedPool:
    return PagedPool(profile.geometry, node=node, swap_capacity_units=profile.swap_capacity_units,
                     checkpoint_dir=checkpoint_dir, retain_ttl_ns=int(retain_ttl_s * NS_PER_S), fit="best")
