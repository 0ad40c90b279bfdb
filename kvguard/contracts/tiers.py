"""The alert tiers and their thresholds: one registry for the stream, the policy, the SLO ledger
and RCA (docs/ARCHITECTURE.md, "Alerts and prediction").

Three tiers raise alerts: 1 threshold (immediate), 2 slope (minutes; the fragmentation rule
``KVCacheOOMRisk`` is a tier-2 rule), 3 the predictor (P(OOM) within the horizon). Lead times
are reported per *signal*: the three tiers plus the fragmentation rule on its own, because it is
the one rule that looks at fragmentation rather than level or trend.
"""

from __future__ import annotations

from dataclasses import dataclass

TIER_NAMES: dict[int, str] = {1: "threshold", 2: "slope", 3: "lstm"}
ALERT_TIERS: tuple[str, ...] = tuple(TIER_NAMES.values())
LEAD_TIME_SIGNALS: tuple[str, ...] = ("threshold", "slope", "fragmentation", "lstm")


@dataclass(slots=True, frozen=True)
class AlertThresholds:
    """The tier defaults; field names as in ``kvguard.config.settings.StreamsSettings`` (``p_oom`` is
    ``predictor.threshold``). ``kvguard.streams.core.StreamConfig`` carries one of these."""

    u_kv_warning: float = 0.88
    u_kv_critical: float = 0.90
    psi_critical: float = 0.95
    threshold_for_s: float = 0.0
    slope_per_min: float = 0.05
    slope_for_s: float = 0.0
    frag_u_kv: float = 0.88
    frag_f_ext: float = 0.5
    frag_for_s: float = 120.0
    p_oom: float = 0.5
    lstm_for_s: float = 0.0
    resolve_for_s: float = 30.0


def signal_conditions(t: AlertThresholds, *, u_kv: float, psi: float, f_ext: float, slope_per_min: float,
                      p_oom: float | None, p_oom_threshold: float) -> dict[str, bool]:
    """Whether each lead-time signal's condition holds on one tick, without the rules' ``for``
    durations (lead time counts from the first tick the condition held)."""
    return {
        "threshold": u_kv > t.u_kv_critical or psi >= t.psi_critical,
        "slope": slope_per_min > t.slope_per_min,
        "fragmentation": u_kv > t.frag_u_kv and f_ext > t.frag_f_ext,
        "lstm": p_oom is not None and p_oom >= p_oom_threshold,
    }
