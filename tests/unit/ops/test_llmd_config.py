"""deploy/llm-d/epp-config.yaml reads series the exporter really serves (issue 29)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvguard.contracts.units import NS_PER_S
from kvguard.ops.exporter import TICK_GAUGES, ExportState
from kvguard.wire.schemas import MetricTick

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "deploy" / "llm-d" / "epp-config.yaml"
# what llm-d-router's core-metrics-extractor reads of vLLM by default (peers.md, factories.go)
VLLM_DEFAULTS = {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:lora_requests_info", "vllm:cache_config_info"}


def _epp() -> dict:
    outer = yaml.safe_load(CONFIG.read_text())
    return yaml.safe_load(outer["data"]["epp-config.yaml"])


def _specs(epp: dict) -> set[str]:
    names = set()
    for plugin in epp["plugins"]:
        if plugin["type"] != "core-metrics-extractor":
            continue
        for engine in plugin["parameters"]["engineConfigs"]:
            for key, value in engine.items():
                if key.endswith("Spec") and value:
                    names.add(re.sub(r"\{.*\}$", "", value))
            names |= {m["metricSpec"] for m in engine.get("customMetrics", [])}
    return names


def _served_names(**endpoint) -> set[str]:
    """Fold one tick (the wire model the exporter consumes) and read the exposition back."""
    state = ExportState()
    state.observe_tick(MetricTick(node="pod-a/gpu0", ts_ns=10 * NS_PER_S, u_kv=0.5, f_ext=0.0, f_int=0.1, psi=0.6,
                                  slope_per_min=0.0, **endpoint), now_ns=10 * NS_PER_S)
    text = state.render(10 * NS_PER_S)
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_every_kvguard_series_the_router_reads_is_served_by_the_exporter():
    specs = _specs(_epp())
    kvguard = {n for n in specs if n.startswith("kvguard_")}
    assert kvguard == {"kvguard_endpoint_admit", "kvguard_endpoint_saturation", "kvguard_endpoint_queue_delay_seconds"}
    assert kvguard <= set(TICK_GAUGES)
    assert kvguard <= _served_names(endpoint_admit=1, endpoint_saturation=0.42, endpoint_queue_delay_s=0.3)
    assert not kvguard & _served_names()  # a node without the gate: absent, not 0
    assert specs - kvguard <= VLLM_DEFAULTS  # the rest are vLLM's own names


def test_the_saturation_is_llm_ds_kv_usage_attribute():
    engine = next(p for p in _epp()["plugins"] if p["type"] == "core-metrics-extractor")["parameters"]["engineConfigs"][0]
    assert engine["kvUsageSpec"] == "kvguard_endpoint_saturation"
