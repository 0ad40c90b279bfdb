"""Alert tiers: for-durations, hysteresis, transitions only, stable fingerprints."""

from dataclasses import replace

from kvguard.contracts.tick import Tick
from kvguard.contracts.units import NS_PER_S
from kvguard.streams.alerts import FIRING, RESOLVED, AlertEvaluator, AlertThresholds, default_rules, fingerprint


def tick(ts_s: float, u_kv=0.5, f_ext=0.1, psi=0.5, slope=0.0, p_oom=None, synced=True, node="n") -> Tick:
    zeros = {f: 0 for f in Tick.__dataclass_fields__ if f not in ("node", "ts_ns", "synced", "u_kv", "f_ext", "psi",
                                                                  "slope_per_min", "p_oom", "u_kv_forecast",
                                                                  "candidates")}
    return Tick(node=node, ts_ns=int(ts_s * NS_PER_S), synced=synced, u_kv=u_kv, f_ext=f_ext, psi=psi,
                slope_per_min=slope, p_oom=p_oom, **zeros)


def run(ticks, **kw):
    ev = AlertEvaluator(default_rules(AlertThresholds(**kw.pop("thresholds", {})), **kw))
    return [(a.ts_ns // NS_PER_S, a.rule, a.state) for t in ticks for a in ev.evaluate(t)]


def test_threshold_tiers_fire_immediately_and_resolve_after_the_clear_period():
    seq = [tick(0, u_kv=0.5), tick(10, u_kv=0.89), tick(20, u_kv=0.91), tick(30, u_kv=0.5),
           tick(40, u_kv=0.91), tick(50, u_kv=0.5), tick(80, u_kv=0.5), tick(110, u_kv=0.5)]
    out = run(seq, thresholds={"resolve_for_s": 60})
    assert out == [(10, "KVCacheUsageHigh", FIRING), (20, "KVCacheUsageCritical", FIRING),
                   (110, "KVCacheUsageCritical", RESOLVED), (110, "KVCacheUsageHigh", RESOLVED)]


def test_oom_risk_needs_both_conditions_for_two_minutes():
    seq = [tick(s, u_kv=0.885, f_ext=0.6) for s in range(0, 130, 10)]
    out = [x for x in run(seq) if x[1] == "KVCacheOOMRisk"]
    assert out == [(120, "KVCacheOOMRisk", FIRING)]
    broken = [tick(s, u_kv=0.885, f_ext=0.6 if s != 60 else 0.4) for s in range(0, 200, 10)]
    out = [x for x in run(broken) if x[1] == "KVCacheOOMRisk"]
    assert out == [(70 + 120, "KVCacheOOMRisk", FIRING)]  # the run restarts after the break at 60


def test_slope_rule_has_its_for_duration():
    seq = [tick(s, slope=0.06) for s in range(0, 40, 10)]
    assert [x for x in run(seq, thresholds={"slope_for_s": 30})] == [(30, "KVCacheUsageRising", FIRING)]


def test_unsynced_ticks_do_not_move_rule_state():
    seq = [tick(0, u_kv=0.95, synced=False), tick(10, u_kv=0.5)]
    assert run(seq) == []


def test_predictor_rule_only_with_a_predictor_and_uses_p_oom():
    seq = [tick(0, p_oom=0.2), tick(10, p_oom=0.7), tick(20, p_oom=0.1), tick(90, p_oom=0.1)]
    assert run(seq) == []
    assert run(seq, with_predictor=True, thresholds={"resolve_for_s": 60}) == [(10, "KVCacheOOMPredicted", FIRING),
                                             (90, "KVCacheOOMPredicted", RESOLVED)]


def test_alert_records_are_ready_for_alertmanager_and_fingerprints_are_stable():
    ev = AlertEvaluator(default_rules())
    (a,) = [x for x in ev.evaluate(tick(0, psi=0.97, node="h/gpu3")) if x.rule == "KVCachePressureCritical"]
    assert a.fingerprint == fingerprint("h/gpu3", "KVCachePressureCritical") == \
        AlertEvaluator(default_rules()).evaluate(tick(5, psi=0.99, node="h/gpu3"))[0].fingerprint
    assert a.fingerprint != fingerprint("h/gpu4", "KVCachePressureCritical")
    assert a.labels == {"alertname": "KVCachePressureCritical", "node": "h/gpu3", "severity": "critical",
                        "tier": "threshold", "service": "kvguard"}
    assert "0.97" in a.annotations["description"] and a.starts_at_ns == 0 and a.ends_at_ns is None
    assert type(a).from_dict(a.to_dict()) == a


def test_rule_state_round_trips():
    ev = AlertEvaluator(default_rules())
    ev.evaluate(tick(0, u_kv=0.885, f_ext=0.6))
    copy = AlertEvaluator(default_rules())
    copy.load_state_list(ev.state_list())
    later = replace(tick(120, u_kv=0.885, f_ext=0.6))
    assert [a.rule for a in copy.evaluate(later) if a.rule == "KVCacheOOMRisk"] == ["KVCacheOOMRisk"]
