"""Settings into the typed configs of the parts: where a setting becomes a value, once.

``kvguard.config.settings`` is the pydantic model and holds every default and bound; the wings take
plain dataclasses (``StreamConfig``, ``BudgetConfig``, ``SloConfig``, ``CanaryConfig``) and never
read a settings section themselves. Each function below reads typed fields only: no ``getattr``, no
default of its own, so a setting's default lives in one place. The composition root
(``kvguard.runtime.bootstrap``) and the commands call these; the policy's strategy numbers, which
also need the node profile, are ``bootstrap.engine_config_from``.

This module is in the runtime because it names the wings' configs, and the base may not import
the wings.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from kvguard.config.settings import RedisSettings, Settings, StreamsSettings
from kvguard.contracts.commands import Mode
from kvguard.contracts.tiers import AlertThresholds
from kvguard.policy.budget import BudgetConfig
from kvguard.policy.canary import CanaryConfig, CanaryConfigError, resolve_candidate
from kvguard.policy.engine import EngineConfig
from kvguard.policy.slo import SloConfig
from kvguard.streams.core import StreamConfig
from kvguard.wire.validate import WireLimits

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


class BootstrapError(ValueError):
    """A setting (or the option that set it) needed to build the graph is missing or wrong;
    ``field`` names it."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


def wire_limits(streams: StreamsSettings) -> WireLimits:
    """What one record may ask a consumer to hold (``streams.max_*``)."""
    return WireLimits(max_dynamic_units=streams.max_dynamic_units, max_batch_events=streams.max_batch_events,
                      max_state_refs=streams.max_state_refs)


def stream_config(settings: Settings, **overrides: Any) -> StreamConfig:
    """The stream core's config from ``streams`` and ``predictor``; ``overrides`` win (a command's
    ``--tick``). Tier 3 fires at ``predictor.threshold``; when that is null, the composition root puts
    the loaded model's calibrated threshold in (without a model: the core's default). ``reserved_frac``
    is taken only when it was set explicitly (file/env): by default each GPU's geometry decides, so
    Ψ stays equal to the pool's own."""
    streams = settings.streams
    p_oom = settings.predictor.threshold
    thresholds = AlertThresholds(
        u_kv_warning=streams.u_kv_warning, u_kv_critical=streams.u_kv_critical, psi_critical=streams.psi_critical,
        threshold_for_s=streams.threshold_for_s, slope_per_min=streams.slope_per_min,
        slope_for_s=streams.slope_for_s, frag_u_kv=streams.frag_u_kv, frag_f_ext=streams.frag_f_ext,
        frag_for_s=streams.frag_for_s, p_oom=AlertThresholds().p_oom if p_oom is None else p_oom,
        lstm_for_s=streams.lstm_for_s, resolve_for_s=streams.resolve_for_s)
    values: dict[str, Any] = dict(
        tick_s=streams.tick_s, slope_window_s=streams.slope_window_s, alpha=streams.alpha, beta=streams.beta,
        reserved_frac=streams.reserved_frac if "reserved_frac" in streams.model_fields_set else None,
        thresholds=thresholds, max_epoch_jump=streams.max_epoch_jump, max_ts_skew_s=streams.max_ts_skew_s,
        max_ts_backwards_s=streams.max_ts_backwards_s, max_nodes=streams.max_nodes, limits=wire_limits(streams))
    values.update(overrides)
    return StreamConfig(**values)


def _key_prefix(prefix: str) -> str:
    """Keys read ``<prefix>:budget:{week}:…``: a prefix gets its trailing ``:``."""
    return prefix if not prefix or prefix.endswith(":") else f"{prefix}:"


def budget_config(settings: Settings) -> BudgetConfig:
    """The fragmentation budget's ledger config (``budget``)."""
    budget = settings.budget
    return BudgetConfig(budget_s=budget.minutes_per_week * 60.0, threshold=budget.f_ext_threshold,
                        retention_weeks=budget.retention_weeks, key_prefix=_key_prefix(budget.key_prefix),
                        cluster=budget.cluster, interval_s=budget.interval_s, top_intervals=budget.top_intervals,
                        buffer_max=budget.buffer_max)


def slo_config(settings: Settings) -> SloConfig:
    """The SLO ledger's config: the budget's key prefix and retention, the predictor's horizon."""
    return SloConfig(horizon_s=settings.predictor.horizon_s, retention_weeks=settings.budget.retention_weeks,
                     key_prefix=_key_prefix(settings.budget.key_prefix))


def canary_config(settings: Settings, engine_config: EngineConfig) -> CanaryConfig | None:
    """The canary rollout from ``canary`` (None when off): the candidate against the strategy of
    ``canary.mode`` as the settings configure it (the control)."""
    section = settings.canary
    if not section.enabled:
        return None
    mode = Mode(section.mode)
    control = engine_config.emergency if mode is Mode.EMERGENCY else engine_config.default
    try:
        return CanaryConfig(candidate=resolve_candidate(section.candidate, control), control=control, mode=mode,
                            stages=tuple(section.stages), min_node_hours=section.min_node_hours,
                            oom_rate_factor=section.oom_rate_factor, completion_margin=section.completion_margin,
                            min_resolved_evictions=section.min_resolved_evictions,
                            evaluate_every_s=section.evaluate_every_s, rollout_id=section.rollout_id)
    except CanaryConfigError as err:
        raise BootstrapError(err.field, str(err).split(": ", 1)[1]) from None


def check_redis_url(url: str, option: str) -> str:
    """``url`` when its scheme is one redis-py connects with; ``BootstrapError`` naming ``option``
    otherwise (a mistyped URL must not leave a service running without its ledgers)."""
    if not url.startswith(REDIS_SCHEMES):
        shown = url.split("@", 1)[-1] if "@" in url else url  # never echo a password
        raise BootstrapError(option, f"expected a redis://, rediss:// or unix:// URL, got {shown!r}")
    return url


def redis_target(section: RedisSettings) -> tuple[str, dict[str, Any]]:
    """(url, connect options) from ``redis``: ``password`` goes into the URL when the URL has none,
    ``tls`` turns ``redis://`` into ``rediss://``, ``ssl_cafile`` is the CA bundle for TLS."""
    url = check_redis_url(section.url, "redis.url")
    if section.tls and url.startswith("redis://"):
        url = "rediss://" + url[len("redis://"):]
    scheme, _, rest = url.partition("://")
    if section.password and "@" not in rest:
        url = f"{scheme}://:{quote(section.password, safe='')}@{rest}"
    return url, ({"ssl_ca_certs": section.ssl_cafile} if section.ssl_cafile else {})
