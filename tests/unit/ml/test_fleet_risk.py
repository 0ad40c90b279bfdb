"""The per-fleet risk forecast: the pure hazard (kvguard.ml.fleet_risk), its evaluation on its own
(kvguard.ml.evaluation, fleet part), the exporter's kvguard_fleet_risk gauge against the pure
function, and the autoscaling examples in deploy/."""

import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvguard.contracts.tick import Tick
from kvguard.contracts.units import NS_PER_S
from kvguard.ml.evaluation import evaluate_fleet_risk, fleet_threshold, fleet_trace, labels_for_ticks
from kvguard.ml.fleet_risk import (
    LOAD_HALF,
    TOKENS_PER_UNIT,
    NodeLoad,
    fleet_risk,
    fleet_series,
    hazard_of,
)
from kvguard.ops.exporter import ExportState
from kvguard.wire.schemas import MetricTick

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
TICK_NS = 10 * NS_PER_S
UNITS = 1000  # KV units per GPU: 16,000 tokens of KV capacity


def load(ts_s: float, prefill_tokens_per_s: float = 800.0, *, arrivals: int = 4, events: int = 50,
         synced: bool = True) -> NodeLoad:
    return NodeLoad(ts_ns=int(ts_s * NS_PER_S), tick_s=10.0, prefill_tokens=prefill_tokens_per_s * 10.0,
                    arrivals=arrivals, kv_token_capacity=UNITS * TOKENS_PER_UNIT, synced=synced, events=events)


def minute(node_count: int = 4, **kw) -> dict[str, list[NodeLoad]]:
    """``node_count`` GPUs, six ticks each ending at t = 60 s."""
    return {f"h/gpu{g}": [load(t, **kw) for t in range(10, 70, 10)] for g in range(node_count)}


def make_tick(node: str, ts_s: float, *, tokens_per_s=1000.0, decode_tokens_per_s=200.0, arrivals=4, events=50,
              **kw) -> Tick:
    base = dict(node=node, ts_ns=int(ts_s * NS_PER_S), tick_s=10.0, synced=True, u_kv=0.3, f_ext=0.0, f_int=0.1,
                psi=0.4, slope_per_min=0.0, live_units=300, cached_units=0, retained_units=0, workspace_units=0,
                free_units=700, largest_free_run_units=700, n_free_runs=1, dynamic_units=UNITS, tokens_stored=4000,
                util_weights=0.5, util_kv_live=0.1, util_kv_cached=0.0, util_workspace=0.0, util_free=0.3,
                util_headroom=0.1, util_reserved=0.0, reserved_frac=0.0, pages_per_request_p50=10.0,
                pages_per_request_p95=20.0, pages_per_request_p99=30.0, requests_running=8,
                requests_holding_pages=8, arrivals=arrivals, finished=4, alloc_failures=0, alloc_fail_per_s=0.0,
                evicted_pages=0, evicted_requests=0, evicted_tokens=0, preemptions=0, ooms=0,
                tokens_per_s=tokens_per_s, decode_tokens_per_s=decode_tokens_per_s, events=events)
    return Tick(**{**base, **kw})


# ---- the hazard ------------------------------------------------------------------------------------


def test_hazard_is_the_load_ratio_of_prompt_tokens_per_minute_to_the_kv_capacity_of_the_gpus_up():
    risk = fleet_risk(minute(4, prefill_tokens_per_s=800.0))
    # 4 GPUs x 800 tok/s x 60 s over 4 x 16,000 tokens
    assert risk.load_ratio == pytest.approx(4 * 800 * 60 / (4 * UNITS * TOKENS_PER_UNIT))
    assert risk.hazard == pytest.approx(risk.load_ratio / (risk.load_ratio + LOAD_HALF))
    assert (risk.gpus, risk.gpus_up, risk.gpus_down) == (4, 4, 0)


def test_hazard_rises_with_load_and_stays_in_the_unit_interval():
    values = [fleet_risk(minute(4, prefill_tokens_per_s=r)).hazard for r in (0.0, 50.0, 400.0, 3000.0, 1e7)]
    assert values[0] == 0.0
    assert all(0.0 <= v <= 1.0 for v in values)
    assert values == sorted(values) and len(set(values)) == len(values)
    assert hazard_of(math.inf) == 1.0 and hazard_of(LOAD_HALF) == pytest.approx(0.5)


def test_a_gpu_routed_around_in_a_busy_tick_is_down_and_its_capacity_leaves():
    history = minute(4)
    before = fleet_risk(history)
    history["h/gpu3"][-1] = replace(history["h/gpu3"][-1], events=0, arrivals=0, prefill_tokens=0.0)
    after = fleet_risk(history)
    assert after.gpus_down == 1 and after.kv_token_capacity == 3 * UNITS * TOKENS_PER_UNIT
    assert after.hazard > before.hazard
    without = fleet_risk(history, with_down=False)
    assert without.gpus_down == 1 and without.kv_token_capacity == 4 * UNITS * TOKENS_PER_UNIT


def test_a_silent_gpu_in_a_quiet_tick_is_idle_not_down():
    history = minute(4, arrivals=0)
    history["h/gpu3"] = [replace(x, events=0, prefill_tokens=0.0) for x in history["h/gpu3"]]
    assert fleet_risk(history).gpus_down == 0


def test_stale_unsynced_or_missing_nodes_are_down():
    history = minute(3)
    history["h/gpu1"] = history["h/gpu1"][:3]  # newest tick 30 s behind the fleet's
    history["h/gpu2"][-1] = replace(history["h/gpu2"][-1], synced=False)
    history["h/gpu9"] = []
    assert fleet_risk(history).gpus_down == 3


def test_every_gpu_down_with_prompts_arriving_is_full_hazard():
    history = minute(2)
    for loads in history.values():
        loads[-1] = replace(loads[-1], synced=False)
    risk = fleet_risk(history)
    assert risk.gpus_up == 0 and risk.load_ratio == math.inf and risk.hazard == 1.0


def test_only_the_newest_window_counts():
    history = {"h/gpu0": [load(t, prefill_tokens_per_s=1e6) for t in (10, 20)] + [load(t) for t in range(80, 140, 10)]}
    assert fleet_risk(history) == fleet_risk({"h/gpu0": history["h/gpu0"][2:]})


def test_crash_history_is_not_an_input():
    a = [make_tick("h/gpu0", t) for t in range(10, 70, 10)]
    b = [replace(t, ooms=3, s_since_oom=5.0) for t in a]
    assert fleet_series({"h/gpu0": a}) == fleet_series({"h/gpu0": b})


def test_node_load_reads_ticks_and_wire_records_alike():
    t = make_tick("h/gpu0", 10)
    record = MetricTick(**{k: v for k, v in t.to_dict().items() if k in MetricTick.model_fields})
    assert NodeLoad.of(t) == NodeLoad.of(record)
    assert NodeLoad.of(t).prefill_tokens == pytest.approx(800.0 * 10.0)
    assert NodeLoad.of(t).kv_token_capacity == UNITS * TOKENS_PER_UNIT


def test_fleet_series_is_the_hazard_of_each_prefix_of_the_ticks():
    ticks = {f"h/gpu{g}": [make_tick(f"h/gpu{g}", t, tokens_per_s=500.0 + 100 * g + 10 * t) for t in range(10, 200, 10)]
             for g in range(3)}
    series = fleet_series(ticks)
    assert len(series) == 19
    for k in (0, 5, 18):
        now = series[k].ts_ns
        prefix = {n: [NodeLoad.of(t) for t in ts if t.ts_ns <= now] for n, ts in ticks.items()}
        assert series[k] == fleet_risk(prefix, now)


# ---- evaluation on its own -------------------------------------------------------------------------


def test_the_fleet_label_is_any_gpus_oom_and_the_end_is_censored():
    ts = np.arange(1, 121, dtype=np.int64) * TICK_NS  # 20 minutes
    trace = fleet_trace("f", ts, np.zeros(len(ts)), np.array([600, 300]) * NS_PER_S, int(ts[-1]))
    assert trace.censored.sum() == 30  # the last 300 s
    assert (labels_for_ticks(trace.ts_ns, trace.oom_ts_ns) == (ts < 600 * NS_PER_S)).all()  # (t, t + 300 s]


def _fleets(informative: bool, seed: int = 0) -> list:
    """Fleets whose hazard rises for 4 minutes before each OOM wave (or is noise)."""
    rng = np.random.default_rng(seed)
    out = []
    for f in range(6):
        ts = np.arange(1, 361, dtype=np.int64) * TICK_NS  # an hour
        waves = np.array([60, 220]) + 10 * f  # ticks; far enough apart that each wave's first OOM is isolated
        ooms = np.concatenate([(w * 10 + np.array([2, 15])) * NS_PER_S for w in waves])
        hazard = 0.3 + 0.05 * rng.standard_normal(len(ts))
        if informative:
            for w in waves:
                hazard[w - 24:w + 1] += 0.5
        out.append(fleet_trace(f"f{f}", ts, np.clip(hazard, 0, 1), ooms, int(ts[-1])))
    return out


def test_an_informative_hazard_scores_high_auc_and_lead_and_noise_does_not():
    good = evaluate_fleet_risk(_fleets(True), bootstrap_draws=50)
    noise = evaluate_fleet_risk(_fleets(False), bootstrap_draws=50)
    assert good["auc"] > 0.75 and good["auc_ci"][0] > 0.6 and good["isolated_lead_time_median_s"] >= 120
    assert 0.3 < noise["auc"] < 0.7 and noise["recall_at_fpr_5pct"] < 0.3
    assert good["events"] == 12 and good["ooms"] == 24 and good["threshold_source"].startswith("these ticks")


def test_a_calibrated_threshold_comes_from_other_fleets():
    calibration, held_out = _fleets(True, seed=1), _fleets(True, seed=2)
    threshold = fleet_threshold(calibration)
    figures = evaluate_fleet_risk(held_out, threshold=threshold, bootstrap_draws=0)
    assert figures["threshold"] == pytest.approx(threshold, abs=1e-6)
    assert figures["threshold_source"] == "calibration fleets" and figures["auc_ci"] is None
    assert figures["at_threshold"]["fpr"] <= 0.2


# ---- the exporter ----------------------------------------------------------------------------------


def served(state: ExportState, name: str) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value for f in text_string_to_metric_families(state.render(0))
            for s in f.samples if s.name == name}


def record(t: Tick, model: str | None = None, **kw):
    """The tick as the exporter gets it; with ``model``, a record that names its model (duck-typed, as
    the exporter reads it: the wire model has no such field yet)."""
    wire = MetricTick(**{**{k: v for k, v in t.to_dict().items() if k in MetricTick.model_fields}, **kw})
    return wire if model is None else SimpleNamespace(**wire.model_dump(), model=model)


def test_the_exporter_serves_the_pure_fleet_risk_of_each_models_nodes():
    state = ExportState(model="")
    ticks: dict[str, list[Tick]] = {}
    for t_s in range(10, 130, 10):
        for g in range(3):
            node = f"a/gpu{g}"
            t = make_tick(node, t_s, tokens_per_s=600.0 + 150 * g + 5 * t_s, events=0 if (g, t_s) == (2, 120) else 50)
            ticks.setdefault(node, []).append(t)
            state.observe_tick(record(t), now_ns=0)
        other = make_tick("b/gpu0", t_s, tokens_per_s=4000.0)
        ticks.setdefault("b/gpu0", []).append(other)
        state.observe_tick(record(other, model="big"), now_ns=0)
    expected = fleet_risk({n: [NodeLoad.of(t) for t in ts] for n, ts in ticks.items() if n.startswith("a/")})
    big = fleet_risk({"b/gpu0": [NodeLoad.of(t) for t in ticks["b/gpu0"]]})
    assert expected.gpus_down == 1  # a/gpu2 went silent in a busy tick
    assert served(state, "kvguard_fleet_risk") == {(("model", ""),): pytest.approx(expected.hazard),
                                                   (("model", "big"),): pytest.approx(big.hazard)}
    assert served(state, "kvguard_fleet_load_ratio")[(("model", ""),)] == pytest.approx(expected.load_ratio)
    assert served(state, "kvguard_fleet_gpus")[(("model", ""), ("state", "down"))] == 1.0
    assert served(state, "kvguard_fleet_gpus")[(("model", ""), ("state", "up"))] == 2.0
    assert all(len(s.loads) == 6 for s in state.nodes.values())  # one minute of ticks per node, no more


def test_a_restarted_node_starts_its_fleet_window_over():
    state = ExportState()
    for t_s in range(10, 70, 10):
        state.observe_tick(record(make_tick("a/gpu0", t_s, tokens_per_s=9000.0)), now_ns=0)
    state.observe_tick(record(make_tick("a/gpu0", 10, tokens_per_s=300.0), epoch=1), now_ns=0)
    expected = fleet_risk({"a/gpu0": [NodeLoad.of(make_tick("a/gpu0", 10, tokens_per_s=300.0))]})
    assert served(state, "kvguard_fleet_risk")[(("model", ""),)] == pytest.approx(expected.hazard)


# ---- deploy/ ---------------------------------------------------------------------------------------


def test_the_keda_scaled_object_scales_the_serving_deployment_on_the_served_fleet_risk():
    (scaled,) = [d for d in yaml.safe_load_all((DEPLOY / "autoscaling" / "keda-scaledobject.yaml").read_text()) if d]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1" and scaled["kind"] == "ScaledObject"
    target = scaled["spec"]["scaleTargetRef"]
    serving = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "vllm-node.yaml").read_text()) if d]
    assert any(d["kind"] == target["kind"] == "Deployment" and d["metadata"]["name"] == target["name"]
               for d in serving)
    trigger, saturation = scaled["spec"]["triggers"]  # the fleet risk; the gates' predicted saturation (issue 29)
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "Value"
    assert "kvguard_fleet_risk" in trigger["metadata"]["query"]
    assert 0.0 < float(trigger["metadata"]["threshold"]) < 1.0
    assert "kvguard_endpoint_saturation" in saturation["metadata"]["query"]
    assert 0.0 < float(saturation["metadata"]["threshold"]) < 1.0
    state = ExportState()
    state.observe_tick(record(make_tick("a/gpu0", 10)), now_ns=0)
    assert served(state, "kvguard_fleet_risk")


def test_the_prometheus_adapter_example_serves_the_same_metric_to_an_hpa():
    rules, hpa = [d for d in yaml.safe_load_all((DEPLOY / "autoscaling" / "prometheus-adapter-rules.yaml").read_text())
                  if d]
    (rule,) = rules["rules"]["external"]
    assert "kvguard_fleet_risk" in rule["seriesQuery"] and rule["name"]["as"] == "kvguard_fleet_risk"
    (metric,) = hpa["spec"]["metrics"]
    assert hpa["kind"] == "HorizontalPodAutoscaler" and metric["external"]["metric"]["name"] == "kvguard_fleet_risk"
    assert hpa["spec"]["scaleTargetRef"]["name"] == "kvguard-vllm"


def test_fleets_at_risk_all_the_time_get_figures_without_an_alarm():
    ts = np.arange(1, 31, dtype=np.int64) * TICK_NS
    trace = fleet_trace("f", ts, np.full(len(ts), 0.9), np.arange(5, 700, 60) * NS_PER_S, None)
    figures = evaluate_fleet_risk([trace], bootstrap_draws=0)
    assert figures["threshold"] is None and figures["threshold_source"].startswith("none")
    assert figures["auc"] is None and figures["lead_time_recall"] == 0.0
