"""The shadow fleet's engines by kind: the only place an engine kind is named.

A profile names its engine (``Profile.engine``); ``make_engine`` builds it. ``"vllm"`` is the
vLLM-faithful engine (``kvguard.producers.sim.vllm.engine``), the default; ``"sglang"`` the
SGLang-faithful engine (``kvguard.producers.sim.sglang.engine``); ``"seed"`` is the seed's
engine over its paged pool (``kvguard.producers.sim.seed``), kept for comparison only.
"""

from __future__ import annotations

from kvguard.contracts.units import NS_PER_S
from kvguard.producers.sim.profiles import Profile
from kvguard.producers.sim.seed.engine import Engine as SeedEngine
from kvguard.producers.sim.seed.engine import SeedEngineConfig
from kvguard.producers.sim.seed.pool import PagedPool
from kvguard.producers.sim.sglang.engine import SglangEngine, SglangEngineConfig
from kvguard.producers.sim.vllm.engine import VllmEngine, VllmEngineConfig

NodeConfig = VllmEngineConfig | SeedEngineConfig | SglangEngineConfig
SimEngine = VllmEngine | SeedEngine | SglangEngine


def make_engine(profile: Profile, node: str, *, seed: int = 0, config: NodeConfig | None = None) -> SimEngine:
    """The engine ``profile`` names. ``config``: an ``SeedEngineConfig`` (seed engine; for the vLLM engine only
    its ``restart_s`` carries over) or a ``VllmEngineConfig``."""
    if profile.engine == "vllm":
        if isinstance(config, SeedEngineConfig):
            config = VllmEngineConfig(restart_s=config.restart_s)
        return VllmEngine(profile, node=node, seed=seed, config=config)
    if profile.engine == "sglang":
        if not isinstance(config, SglangEngineConfig):
            config = SglangEngineConfig(restart_s=config.restart_s) if config is not None else None
        return SglangEngine(profile, node=node, seed=seed, config=config)
    if config is not None and not isinstance(config, SeedEngineConfig):
        raise ValueError(f"profile {profile.name!r} runs the seed engine: config must be a SeedEngineConfig, "
                         f"got {type(config).__name__}")
    return SeedEngine(make_pool(profile, node), profile, node=node, seed=seed, config=config)


def make_pool(profile: Profile, node: str, *, retain_ttl_s: float = 300.0, checkpoint_dir=None) -> PagedPool:
    return PagedPool(profile.geometry, node=node, swap_capacity_units=profile.swap_capacity_units,
                     checkpoint_dir=checkpoint_dir, retain_ttl_ns=int(retain_ttl_s * NS_PER_S), fit="best")
