"""The composition root: the one place that turns settings into kvguard's object graph.

``bootstrap(settings, bus=…, ledger=…)`` returns a ``Graph`` whose factories build what each
command needs — the demo, a node process, the policy service, the stream worker, the exporter, the
vLLM plugin's command side, a simulation — from the same settings, so a number (tick, thresholds,
TTL, secret, profile, the predictor and its operating threshold) is read in one place only and what
is deployed runs what the demo measures. Settings become the parts' typed configs in
``kvguard.runtime.mapping``. Tests pass small working parts (an ``InprocBus``, a
``MemoryBudgetLedger``); nothing here connects, starts or reads a clock at import time, and the
bus/ledger are only built when asked for.

The predictor: tier 3 runs the shipped model (``predictor.model_path`` to name another,
``predictor.enabled = false`` or a command's ``--no-predictor`` for none) at the model's calibrated
threshold, unless ``predictor.threshold`` names one.

Secrets: in multi-process mode (``require_secret``: the policy service, a node with actuators)
the shared HMAC secret must be at least ``MIN_SECRET_BYTES`` long and not a known placeholder
(``x``, ``change-me-dev-only``, …); otherwise the process refuses to start, unless
``insecure_dev`` (``--insecure-dev``) says this is a throwaway setup. The embedded in-process
mode makes up a random secret when none is set.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from kvguard.actuators.actuator import Actuator, AppliedJournal
from kvguard.actuators.executor import Executor
from kvguard.bus.base import Bus
from kvguard.bus.inproc import InprocBus
from kvguard.config.extras import missing_extra
from kvguard.config.hmac_secret import secret_problem
from kvguard.config.settings import Settings
from kvguard.policy.budget import BudgetLedger, MemoryBudgetLedger
from kvguard.policy.canary import Canary, CanaryConfig
from kvguard.policy.engine import EngineConfig, PolicyEngine
from kvguard.policy.planner import CostModel, PlannerConfig
from kvguard.policy.service import PolicyService, SloRecorder
from kvguard.policy.slo import MemorySloLedger, SloLedger
from kvguard.policy.strategy import PRESETS, strategy_from_mapping
from kvguard.producers.sim.fleet import Fleet
from kvguard.producers.sim.profiles import EngineKnobs, Profile, load_profile
from kvguard.producers.sim.registry import NodeConfig, capabilities_of
from kvguard.runtime.mapping import (
    BootstrapError,
    budget_config,
    canary_config,
    check_redis_url,
    slo_config,
    stream_config,
)
from kvguard.streams.core import StreamConfig, StreamCore
from kvguard.streams.loader import load_predictor, with_model_threshold
from kvguard.streams.metrics import FEATURE_NAMES
from kvguard.streams.predictor import ModelError, Predictor
from kvguard.streams.tick_model import TickModelPredictor

__all__ = ["BootstrapError", "Graph", "bootstrap", "check_kafka_options", "engine_config_from", "make_bus",
           "make_ledger", "make_slo_ledger", "redis_ledgers", "secret_problem", "shared_secret"]

log = logging.getLogger(__name__)



@dataclass(slots=True)
class Graph:
    settings: Settings
    profile: Profile
    secret: bytes
    secret_generated: bool
    engine_config: EngineConfig
    bus: Bus | None = None
    ledger: BudgetLedger | None = None
    slo_ledger: SloLedger | None = None
    predictor: Predictor | None = None
    predictor_note: str = ""
    notes: list[str] = field(default_factory=list)
    node_config: NodeConfig | None = None  # the engines' own config; None: defaults
    canary_config: CanaryConfig | None = None  # None: no canary rollout (the default)

    # -- stream side ----------------------------------------------------------------------------

    def stream_config(self, **overrides: Any) -> StreamConfig:
        """The settings' stream config (``overrides`` win) with tier 3 at the predictor's calibrated
        threshold unless ``predictor.threshold`` names one."""
        config = stream_config(self.settings, **overrides)
        if self.settings.predictor.threshold is None and self.predictor is not None:
            config = with_model_threshold(config, self.predictor)
        return config

    def core_config(self, *, with_predictor: bool = True) -> StreamConfig:
        """What ``stream_core`` runs, the embedded loop and the Faust worker alike: ``stream_config``
        with a feature history as long as the predictor's window."""
        window = self.predictor.window_ticks if with_predictor and self.predictor is not None else None
        return self.stream_config(**({"window_ticks": window} if window else {}))

    def stream_core(self, *, with_predictor: bool = True) -> StreamCore:
        return StreamCore(self.core_config(with_predictor=with_predictor),
                          predictor=self.predictor if with_predictor else None)

    def tier3(self) -> str:
        """One line on tier 3 as this graph runs it: the model and its operating threshold."""
        if self.predictor is None:
            return self.predictor_note
        origin = ("the model's calibrated threshold" if self.settings.predictor.threshold is None
                  else "predictor.threshold")
        return f"{self.predictor_note}; tier 3 at P(OOM) >= {self.stream_config().thresholds.p_oom:.4f} ({origin})"

    # -- policy side ----------------------------------------------------------------------------

    def policy_engine(self, canary: Canary | None = None) -> PolicyEngine:
        return PolicyEngine(self.engine_config, self.secret, canary=canary)

    def canary(self, slo_ledger: SloLedger | None = None) -> Canary | None:
        """The canary rollout over ``slo_ledger`` (its records and state live there; default: the
        graph's, else a fresh in-memory one); None when ``canary.enabled`` is off."""
        if self.canary_config is None:
            return None
        if slo_ledger is None:
            slo_ledger = self.slo_ledger
        if slo_ledger is None:
            slo_ledger = MemorySloLedger(slo_config(self.settings))
        return Canary(self.canary_config, slo_ledger)

    def slo_recorder(self, slo_ledger: SloLedger | None = None, *, confirm_with_acks: bool = False
                     ) -> SloRecorder | None:
        """The SLO recorder over ``slo_ledger`` (default: the graph's; None when neither is set).
        Predictions are labelled at the operating threshold: the predictor's calibrated one unless
        ``predictor.threshold`` names one, the same line the stream's tier-3 alert uses."""
        slo_ledger = slo_ledger if slo_ledger is not None else self.slo_ledger
        if slo_ledger is None:
            return None
        thresholds = self.stream_config().thresholds
        return SloRecorder(slo_ledger, threshold=thresholds.p_oom, thresholds=thresholds,
                           horizon_s=slo_config(self.settings).horizon_s,
                           confirm_with_acks=confirm_with_acks, max_nodes=self.settings.policy.max_nodes)

    def policy_service(self, *, bus: Bus | None = None, ledger: BudgetLedger | None = None,
                       slo: SloRecorder | None = None) -> PolicyService:
        """``slo``: an ``SloRecorder`` (default: one over the graph's SLO ledger, if any). With
        ``canary.enabled`` the engine, the service and the recorder share one ``Canary`` over the
        recorder's SLO ledger (an in-memory one, and a recorder over it, when there is none)."""
        slo = slo if slo is not None else self.slo_recorder()
        canary = None
        if self.canary_config is not None:
            if slo is None:
                slo = self.slo_recorder(MemorySloLedger(slo_config(self.settings)))
            canary = self.canary(slo.ledger)
            slo.canary = canary
        return PolicyService(self.policy_engine(canary), self.settings, bus=bus or self.bus,
                             ledger=ledger if ledger is not None else self.ledger, slo=slo, canary=canary)

    # -- node side ------------------------------------------------------------------------------

    def fleet(self, n_gpus: int, *, seed: int = 0, host: str = "sim-0", snapshot_every_s: float = 60.0,
              router: str = "least_loaded") -> Fleet:
        return Fleet(n_gpus, self.profile, seed=seed, host=host, snapshot_every_s=snapshot_every_s,
                     config=self.node_config, router=router)

    def with_node(self, profile: Profile, node_config: NodeConfig | None = None) -> "Graph":
        """The same graph over another node-side configuration (a demo arm): the profile (with its
        engine knobs) and the engines' config; the policy's numbers follow the profile."""
        return replace(self, profile=profile, node_config=node_config,
                       engine_config=engine_config_from(self.settings, profile, {}), notes=list(self.notes))

    def actuators(self, engines: list[Any], *, journal_dir: str | Path | None = None,
                  epoch: int | None = None) -> dict[str, Actuator]:
        """One actuator per engine (a shadow engine, or the plugin's adapter of a real one); with
        ``journal_dir`` each keeps its applied-id journal there (the node process passes
        ``node.journal_dir``; None keeps it in memory, as the embedded loop does). ``epoch``: the
        producer epoch of the engines' run (commands of another epoch are rejected; None: not
        checked). Skew and TTL caps from ``node.command_max_*``."""
        node_settings = self.settings.node
        out = {}
        for engine in engines:
            path = None
            if journal_dir is not None:
                path = Path(journal_dir).expanduser() / (engine.node.replace("/", "_").replace(":", "_") + ".applied")
            out[engine.node] = Actuator(engine.node, Executor(engine), self.secret,
                                        journal=AppliedJournal(path), epoch=epoch,
                                        max_skew_ns=int(node_settings.command_max_skew_s * 1e9),
                                        max_ttl_ns=int(node_settings.command_max_ttl_s * 1e9))
        return out

    # -- the outside world: built only when asked for ------------------------------------------------

    def make_bus(self, bus_url: str | None = None) -> Bus:
        """The bus of ``bus_url`` (default: Kafka at ``kafka.bootstrap``); see ``make_bus``."""
        return make_bus(self.settings, bus_url if bus_url else f"kafka://{self.settings.kafka.bootstrap}")


def bootstrap(settings: Settings | None = None, *, bus: Bus | None = None, ledger: BudgetLedger | None = None,
              slo_ledger: SloLedger | None = None, profile: str | None = None, knobs: EngineKnobs | None = None,
              node_config: NodeConfig | None = None, predictor: Predictor | str | Path | None = "shipped",
              strategy_overrides: Mapping[str, Mapping[str, Any]] | None = None,
              require_secret: bool = False, insecure_dev: bool = False) -> Graph:
    """Build the graph. ``predictor``: ``"shipped"`` (the shipped model, or ``predictor.model_path``;
    none when ``predictor.enabled`` is off), ``None`` (no tier 3), a path, or a ready predictor.
    ``require_secret``: multi-process mode, where policy and actuators must share
    ``policy.hmac_secret`` (an embedded run makes one up), and a weak one is refused unless
    ``insecure_dev``."""
    settings = settings if settings is not None else Settings.load()
    prof = load_profile(profile, knobs=knobs)
    secret, generated = _secret(settings, require_secret, insecure_dev)
    engine_config = engine_config_from(settings, prof, strategy_overrides or {})
    graph = Graph(settings=settings, profile=prof, secret=secret, secret_generated=generated,
                  engine_config=engine_config, bus=bus, ledger=ledger, slo_ledger=slo_ledger, node_config=node_config,
                  canary_config=canary_config(settings, engine_config))
    graph.predictor, graph.predictor_note = _predictor(settings, predictor)
    return graph


def engine_config_from(settings: Settings, profile: Profile,
                       strategy_overrides: Mapping[str, Mapping[str, Any]]) -> EngineConfig:
    """Policy numbers: the strategies from settings (and overrides), the rest from the profile."""
    policy = settings.policy
    default = replace(PRESETS[policy.preset], scan_interval_s=float(policy.async_scan_s), name=policy.preset)
    emergency = PRESETS["emergency"]
    for name in ("default", "emergency"):
        values = dict(policy.default if name == "default" else policy.emergency)
        values.update(strategy_overrides.get(name, {}))
        if values:
            base = default if name == "default" else emergency
            built = strategy_from_mapping(values, base=base, field_prefix=f"policy.{name}")
            default, emergency = (built, emergency) if name == "default" else (default, built)
    geometry = profile.geometry
    engine = capabilities_of(profile)  # what the profile's engine offers decides which guards apply
    workspace = profile.workspace_units(profile.max_batched_tokens)
    cost = CostModel(step_base_s=profile.step_base_s, prefill_s_per_token=profile.step_prefill_token_s,
                     decode_s_per_token=profile.step_decode_seq_s, unit_tokens=geometry.unit_tokens,
                     unit_bytes=geometry.unit_bytes, host_link_bytes_per_s=profile.host_bandwidth_bytes_per_s)
    planner = PlannerConfig(required_run_units=workspace + max(geometry.page_classes),
                            reclaim_cached=engine.reclaim_cached)
    allocator_guard = engine.caching_allocator and engine.token_budget
    return EngineConfig(default=default, emergency=emergency, planner=planner, cost=cost,
                        command_ttl_s=float(policy.command_ttl_s), dynamic_units=geometry.dynamic_units,
                        unit_tokens=geometry.unit_tokens,
                        engine_reserve_units=workspace + int(0.01 * geometry.dynamic_units),
                        budget_f_ext=float(settings.budget.f_ext_threshold),
                        max_nodes=policy.max_nodes, max_epoch_jump=policy.max_epoch_jump,
                        # uniform KV blocks (vLLM): a KV shortage preempts, and the full-sequence gate admits
                        # only what fits whole, so no contiguous run needs holding back; with a caching
                        # allocator the OOMs are the allocator's, whose peaks the token budget bounds, and
                        # the cap follows the allocator's own pressure, not P(OOM), which predicts none of them
                        use_headroom=engine.admission_headroom and not engine.uniform_blocks,
                        allocator_guard=allocator_guard, batch_cap_on_prediction=not engine.caching_allocator,
                        batch_cap_tokens=max(profile.max_num_seqs, profile.max_batched_tokens // 2)
                        if allocator_guard else 0)


def make_ledger(settings: Settings, redis_url: str | None = None, *, option: str = "--redis") -> BudgetLedger:
    """The budget ledger: Redis when a URL is given (``option`` named when it is no Redis URL),
    else the in-memory one (embedded)."""
    config = budget_config(settings)
    if not redis_url:
        return MemoryBudgetLedger(config)
    # redis is loaded only when a ledger URL is given
    from kvguard.policy.budget_redis import RedisBudgetLedger

    return RedisBudgetLedger(check_redis_url(redis_url, option), config)


def make_slo_ledger(settings: Settings, redis_url: str | None = None, *, option: str = "--redis") -> SloLedger:
    """The SLO ledger: Redis when a URL is given (``option`` named when it is no Redis URL), else
    the in-memory one (embedded)."""
    config = slo_config(settings)
    if not redis_url:
        return MemorySloLedger(config)
    # redis is loaded only when a ledger URL is given
    from kvguard.policy.slo_redis import RedisSloLedger

    return RedisSloLedger(check_redis_url(redis_url, option), config)


def redis_ledgers(settings: Settings, redis_url: str, *, option: str = "--redis") -> tuple[BudgetLedger, SloLedger]:
    """Both ledgers in Redis at ``redis_url``, once Redis answers there: ``BootstrapError`` naming
    ``option`` when the URL is no Redis URL, ``LedgerUnavailable`` naming it when nothing answers (a
    service must not run for hours without its ledgers and say so only when it stops)."""
    # redis is loaded only when a ledger URL is given
    from kvguard.policy.budget import LedgerUnavailable
    from kvguard.policy.budget_redis import RedisBudgetLedger
    from kvguard.policy.slo_redis import RedisSloLedger

    url = check_redis_url(redis_url, option)
    ledgers = RedisBudgetLedger(url, budget_config(settings)), RedisSloLedger(url, slo_config(settings))
    try:
        for ledger in ledgers:
            ledger.ping()
    except LedgerUnavailable as err:
        for ledger in ledgers:
            ledger.close()
        raise LedgerUnavailable(f"{option}: {err}") from None
    return ledgers


def make_bus(settings: Settings, bus_url: str | None) -> Bus:
    """``None``/``inproc://`` → the in-process bus; ``kafka://host:port`` → Kafka, its pass-through
    client options checked against aiokafka's (``BootstrapError`` naming an unknown key)."""
    if not bus_url or bus_url.startswith("inproc"):
        return InprocBus.from_settings(settings)
    if not bus_url.startswith("kafka://"):
        raise BootstrapError("--bus", f"expected kafka://HOST:PORT or inproc://, got {bus_url!r}")
    check_kafka_options(settings)
    # aiokafka is loaded only for a Kafka bus
    from kvguard.bus.kafka import KafkaBus

    kafka = settings.kafka.model_copy(update={"bootstrap": bus_url[len("kafka://"):]})
    return KafkaBus(kafka)


def check_kafka_options(settings: Settings) -> None:
    """``BootstrapError`` naming the first pass-through Kafka option (``kafka.producer_options`` /
    ``consumer_options``) that aiokafka does not take."""
    # aiokafka's signatures: loaded only where Kafka is used
    from kvguard.bus.kafka import unknown_client_options

    for section, key in unknown_client_options(settings.kafka):
        raise BootstrapError(f"kafka.{section}.{key}", f"not an aiokafka {section.split('_')[0]} option")


def shared_secret(settings: Settings) -> bytes:
    """The HMAC secret shared by the policy, the actuators and an operator's `kvguard command`
    (``policy.hmac_secret``); ``BootstrapError`` naming the field when it is empty or weak."""
    return _secret(settings, True)[0]


def _secret(settings: Settings, required: bool, insecure_dev: bool = False) -> tuple[bytes, bool]:
    text = settings.policy.hmac_secret
    if text:
        problem = secret_problem(text)
        if problem is not None and required and not insecure_dev:
            raise BootstrapError("policy.hmac_secret", f"{problem}; policy and actuators trust whoever holds it. "
                                 "Generate one (python -c 'import secrets; print(secrets.token_hex(32))') and set "
                                 "KVGUARD_POLICY__HMAC_SECRET on the policy and every node, or pass --insecure-dev "
                                 "for a throwaway setup")
        if problem is not None:
            log.warning("policy.hmac_secret %s (accepted: %s)", problem,
                        "--insecure-dev" if required else "in-process mode")
        return text.encode(), False
    if required:
        raise BootstrapError("policy.hmac_secret", "empty; policy and actuators in separate processes must "
                             "share it (set KVGUARD_POLICY__HMAC_SECRET or policy.hmac_secret in the file)")
    return secrets.token_hex(16).encode(), True


def _predictor(settings: Settings, predictor: Predictor | str | Path | None) -> tuple[Predictor | None, str]:
    """The tier-3 predictor and a note on it (the tier keeps its historical name ``lstm`` on the wire;
    the shipped model is gradient-boosted trees, streams/models/README.md)."""
    if predictor is None:
        return None, "no predictor tier (disabled)"
    if predictor == "shipped" and not settings.predictor.enabled:
        return None, "no predictor tier (predictor.enabled is false)"
    if not isinstance(predictor, (str, Path)):
        return predictor, "predictor tier: given predictor"
    path = settings.predictor.model_path if predictor == "shipped" else predictor
    try:
        model = load_predictor(path, expected_features=list(FEATURE_NAMES))
    except ImportError as err:  # an LSTM artifact without torch installed
        return None, f"no predictor tier (an LSTM artifact {missing_extra(err) or err})"
    except ModelError as err:
        return None, f"no predictor tier: {err}"
    kind = "boosted trees" if isinstance(model, TickModelPredictor) else \
        f"trend trees ({model.metadata.target})" if hasattr(model, "score_derived") else "LSTM"
    return model, f"predictor tier: {kind}, {path or 'shipped model'}"
