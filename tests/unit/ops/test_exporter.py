"""The exporter's pure part: exposition text (prometheus_client's encoders over our collector),
idempotent folding of ticks, labels and units, the node cap, alert mapping."""

import re
from datetime import datetime

import pytest

from kvguard.contracts.units import NS_PER_S
from kvguard.ops.exporter import (
    ExportError,
    ExportState,
    alert_dedupe_key,
    alertmanager_alert,
    node_labels,
    rfc3339,
    webhook_payload,
)
from kvguard.wire.schemas import Ack, Alert, Command, DlqRecord, MetricTick

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*\})? (\S+)$')
RULES_METRICS = {"kvguard_u_kv", "kvguard_f_ext", "kvguard_f_int", "kvguard_psi", "kvguard_u_kv_slope_per_second",
                 "kvguard_p_oom", "kvguard_ooms_total", "kvguard_budget_remaining_seconds",
                 "kvguard_dlq_records_total"}


def tick(node="sim-0/gpu0", ts_s=10, u_kv=0.5, ooms=0, p_oom=None, **kw):
    return MetricTick(node=node, ts_ns=ts_s * NS_PER_S, u_kv=u_kv, f_ext=0.25, f_int=0.125, psi=0.75,
                      slope_per_min=0.01, ooms=ooms, p_oom=p_oom, **kw)


def parse(text: str) -> tuple[dict[tuple[str, frozenset], float], dict[str, str], dict[str, int]]:
    """Strict parse: every line is HELP, TYPE or a sample; returns samples, types, HELP counts."""
    samples, types, helps = {}, {}, {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split()[2]
            helps[name] = helps.get(name, 0) + 1
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert name not in types, f"TYPE {name} twice"
            types[name] = kind
        else:
            m = SAMPLE.match(line)
            assert m, f"not a sample line: {line!r}"
            labels = frozenset(re.findall(r'([a-zA-Z_]\w*)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
            assert m.group(1) in types, f"sample {m.group(1)} before its TYPE"
            samples[(m.group(1), labels)] = float(m.group(4))
    return samples, types, helps


def value(samples, name, **labels):
    """The one sample of ``name`` whose labels include ``labels`` (the node's gpu/model/instance
    labels need not be spelled out)."""
    wanted = set(labels.items())
    found = [v for (n, have), v in samples.items() if n == name and wanted <= have]
    assert len(found) == 1, f"{len(found)} samples of {name} match {labels}"
    return found[0]


def test_exposition_is_parseable_with_help_and_type_once_per_family():
    state = ExportState()
    for node in ("sim-0/gpu0", "sim-0/gpu1"):
        for ts_s in (10, 20):
            state.observe_tick(tick(node, ts_s, ooms=1, p_oom=0.3), now_ns=0)
    state.observe_dlq(DlqRecord.of(reason="malformed", detail="", topic="kvguard.events", partition=0, offset=1,
                                   key=None, value=b"x"))
    samples, types, helps = parse(state.render(now_ns=0))
    assert all(n == 1 for n in helps.values()) and set(helps) == set(types)
    assert value(samples, "kvguard_u_kv", node="sim-0/gpu1") == 0.5
    assert value(samples, "kvguard_p_oom", node="sim-0/gpu0") == 0.3
    assert value(samples, "kvguard_ooms_total", node="sim-0/gpu0") == 2
    assert value(samples, "kvguard_dlq_records_total", reason="malformed") == 1
    assert types["kvguard_ooms_total"] == "counter" and types["kvguard_psi"] == "gauge"


def test_every_metric_the_prometheus_rules_use_is_rendered_with_the_expected_type():
    state = ExportState()
    state.observe_tick(tick(ooms=1, p_oom=0.7), now_ns=0)
    state.observe_alert(Alert(node="sim-0/gpu0", ts_ns=NS_PER_S, name="FragmentationBudgetExhausted", tier="budget",
                              severity="warning", value=4000.0, threshold=3600.0, labels={"week": "2026-W48"}),
                        now_ns=0)
    state.observe_dlq(DlqRecord.of(reason="invalid", detail="", topic="t", partition=0, offset=0, key=None,
                                   value=b""))
    samples, types, _ = parse(state.render(now_ns=0))
    assert RULES_METRICS <= set(types)
    assert all(types[n] == "counter" for n in RULES_METRICS if n.endswith("_total"))
    assert value(samples, "kvguard_budget_remaining_seconds", node="sim-0/gpu0", week="2026-W48") == -400


def test_label_values_are_escaped():
    # the wire refuses such a node id (kvguard.contracts.node_id); the exporter escapes whatever it gets
    state = ExportState()
    state.observe_tick(MetricTick.model_construct(**(tick().model_dump() | {"node": 'we"ird\\node\nx'})), now_ns=0)
    text = state.render(now_ns=0)
    assert 'node="we\\"ird\\\\node\\nx"' in text
    parse(text)


def test_an_older_redelivered_tick_does_not_move_gauges_back():
    state = ExportState()
    state.observe_tick(tick(ts_s=20, u_kv=0.9), now_ns=0)
    state.observe_tick(tick(ts_s=10, u_kv=0.1), now_ns=0)
    samples, _, _ = parse(state.render(now_ns=0))
    assert value(samples, "kvguard_u_kv", node="sim-0/gpu0") == 0.9
    assert value(samples, "kvguard_tick_timestamp_seconds", node="sim-0/gpu0") == 20
    assert state.counters.ticks_stale == 1


def test_redelivered_ticks_are_counted_once():
    state = ExportState()
    for _ in range(3):
        for ts_s in (10, 20, 30):
            state.observe_tick(tick(ts_s=ts_s, ooms=1, preemptions=2), now_ns=0)
    samples, _, _ = parse(state.render(now_ns=0))
    assert value(samples, "kvguard_ooms_total", node="sim-0/gpu0") == 3
    assert value(samples, "kvguard_preemptions_total", node="sim-0/gpu0") == 6
    assert state.counters.ticks_duplicate == 6


def test_a_restarted_node_newer_epoch_resets_its_series_and_older_epochs_are_ignored():
    state = ExportState()
    for ts_s in (590, 600):
        state.observe_tick(tick(ts_s=ts_s, u_kv=0.9, ooms=1, epoch=1), now_ns=0)
    # the node restarts: its event time starts over, its ticks carry a newer epoch
    assert state.observe_tick(tick(ts_s=10, u_kv=0.3, ooms=1, epoch=2), now_ns=0) is True
    samples, _, _ = parse(state.render(now_ns=0))
    assert value(samples, "kvguard_u_kv", node="sim-0/gpu0") == 0.3
    assert value(samples, "kvguard_tick_timestamp_seconds", node="sim-0/gpu0") == 10
    assert value(samples, "kvguard_ooms_total", node="sim-0/gpu0") == 1, "a counter reset"
    state.observe_tick(tick(ts_s=20, u_kv=0.4, ooms=1, epoch=2), now_ns=0)
    assert state.observe_tick(tick(ts_s=610, u_kv=0.99, ooms=5, epoch=1), now_ns=0) is False  # the old run, late
    samples, _, _ = parse(state.render(now_ns=0))
    assert value(samples, "kvguard_u_kv", node="sim-0/gpu0") == 0.4
    assert value(samples, "kvguard_ooms_total", node="sim-0/gpu0") == 2
    assert state.counters.node_restarts == 1 and state.counters.ticks_old_epoch == 1
    assert state.counters.ticks_stale == 0 and state.counters.ticks_duplicate == 0


def test_a_tick_older_than_the_bounded_dedupe_window_counts_as_already_seen():
    state = ExportState(dedupe_ticks=4)
    for ts_s in range(1, 11):
        state.observe_tick(tick(ts_s=ts_s, ooms=1), now_ns=0)
    assert state.observe_tick(tick(ts_s=2, ooms=1), now_ns=0) is False
    samples, _, _ = parse(state.render(now_ns=0))
    assert value(samples, "kvguard_ooms_total", node="sim-0/gpu0") == 10


def test_p_oom_absent_until_a_predictor_reports_it():
    state = ExportState()
    state.observe_tick(tick(p_oom=None), now_ns=0)
    assert "kvguard_p_oom" not in state.render(now_ns=0)


def test_silent_nodes_are_dropped_after_the_ttl():
    state = ExportState(ttl_s=60)
    state.observe_tick(tick(node="a"), now_ns=0)
    state.observe_tick(tick(node="b"), now_ns=50 * NS_PER_S)
    samples, _, _ = parse(state.render(now_ns=100 * NS_PER_S))
    assert {dict(labels)["node"] for (_, labels) in samples if ("node", "a") in labels or ("node", "b") in labels} \
        == {"b"}
    assert state.counters.nodes_expired == 1


def test_acks_and_dlq_records_are_counted_once_per_identity():
    state = ExportState()
    ack = Ack(command_id="c1", node="n", outcome="done", executed_at_ns=1, action="evict", units_freed=7)
    assert state.observe_ack(ack, now_ns=0) and not state.observe_ack(ack, now_ns=0)
    dead = DlqRecord.of(reason="malformed", detail="", topic="kvguard.events", partition=2, offset=9, key=None,
                        value=b"x", group="streams")
    assert state.observe_dlq(dead) and not state.observe_dlq(dead)
    samples, _, _ = parse(state.render(now_ns=0))
    assert value(samples, "kvguard_acks_total", node="n", action="evict", outcome="done") == 1
    assert value(samples, "kvguard_ack_units_freed_total", node="n") == 7
    assert value(samples, "kvguard_dlq_records_total", reason="malformed") == 1


def test_a_redelivered_command_acked_as_duplicate_counts_as_its_own_outcome():
    state = ExportState()
    executed = Ack(command_id="c1", node="n", outcome="executed", executed_at_ns=1, action="evict")
    duplicate = executed.model_copy(update={"outcome": "duplicate"})
    assert state.observe_ack(executed, now_ns=0) and state.observe_ack(duplicate, now_ns=0)
    assert not state.observe_ack(duplicate, now_ns=0)
    samples, _, _ = parse(state.render(now_ns=0))
    assert value(samples, "kvguard_acks_total", node="n", action="evict", outcome="executed") == 1
    assert value(samples, "kvguard_acks_total", node="n", action="evict", outcome="duplicate") == 1


def test_firing_gauge_follows_firing_and_resolved_alerts():
    state = ExportState()
    fired = Alert(node="n", ts_ns=NS_PER_S, name="KVCacheUsageHigh", tier="threshold", severity="warning")
    state.observe_alert(fired, now_ns=0)
    samples, _, _ = parse(state.render(now_ns=0))
    assert value(samples, "kvguard_alert_firing", node="n", alertname="KVCacheUsageHigh", severity="warning",
                 tier="threshold") == 1
    state.observe_alert(fired.model_copy(update={"status": "resolved"}), now_ns=0)
    assert "kvguard_alert_firing" not in state.render(now_ns=0)


def test_bad_settings_and_records_name_the_field():
    with pytest.raises(ExportError, match="ttl_s"):
        ExportState(ttl_s=0)
    with pytest.raises(ExportError, match="ooms"):
        ExportState().observe_tick(tick(ooms=-1), now_ns=0)


# ---- alert mapping -----------------------------------------------------------------------------


def stream_alert(status="firing", **kw):
    fields = dict(node="sim-0/gpu0", ts_ns=1_800_000_000 * NS_PER_S, name="KVCacheOOMRisk", tier="slope",
                  severity="critical", status=status, fingerprint="ab12", started_at_ns=1_799_999_000 * NS_PER_S,
                  value=0.62, threshold=0.5, summary="nearly full and fragmented",
                  labels={"cluster": "c1", "node": "spoofed"}, annotations={"runbook": "docs/runbook.md"})
    fields.update(kw)
    return Alert(**fields)


def test_a_firing_alert_maps_to_alertmanager_without_an_end():
    out = alertmanager_alert(stream_alert(), generator_url="http://kvguard/alerts")
    assert out["labels"] == {"cluster": "c1", "node": "sim-0/gpu0", "alertname": "KVCacheOOMRisk",
                             "severity": "critical", "tier": "slope"}
    assert out["annotations"]["summary"] == "nearly full and fragmented"
    assert out["annotations"]["runbook"] == "docs/runbook.md" and out["annotations"]["value"] == "0.62"
    assert out["startsAt"] == "2027-01-15T07:43:20.000Z"
    assert "endsAt" not in out and out["generatorURL"] == "http://kvguard/alerts"


def test_a_resolved_alert_maps_with_its_end_time():
    out = alertmanager_alert(stream_alert("resolved", ends_at_ns=1_800_000_030 * NS_PER_S))
    assert out["endsAt"] == rfc3339(1_800_000_030 * NS_PER_S)
    assert datetime.fromisoformat(out["endsAt"].replace("Z", "+00:00")) > \
        datetime.fromisoformat(out["startsAt"].replace("Z", "+00:00"))
    assert alertmanager_alert(stream_alert("resolved"))["endsAt"] == rfc3339(1_800_000_000 * NS_PER_S)


def test_dedupe_key_separates_status_and_episodes_not_redeliveries():
    first = stream_alert()
    assert alert_dedupe_key(first) == alert_dedupe_key(first.model_copy())
    assert alert_dedupe_key(first) != alert_dedupe_key(stream_alert("resolved"))
    assert alert_dedupe_key(first) != alert_dedupe_key(stream_alert(started_at_ns=1_800_000_500 * NS_PER_S))
    assert alert_dedupe_key(stream_alert(fingerprint="")) == alert_dedupe_key(stream_alert(fingerprint=""))


def test_unknown_status_is_refused_with_the_field():
    with pytest.raises(ExportError, match="status"):
        alertmanager_alert(stream_alert(status="pending"))


def test_webhook_payload_carries_the_record():
    alert = stream_alert()
    body = webhook_payload(alert, {"name": alert.name})
    assert body["status"] == "firing" and body["record"] == {"name": "KVCacheOOMRisk"}
    assert body["alert"]["labels"]["alertname"] == "KVCacheOOMRisk"


def test_a_redelivered_older_firing_does_not_undo_a_resolve():
    state = ExportState()
    fired = Alert(node="n", ts_ns=NS_PER_S, name="KVCacheUsageHigh", tier="threshold", severity="warning")
    state.observe_alert(fired, now_ns=0)
    state.observe_alert(fired.model_copy(update={"status": "resolved", "ts_ns": 2 * NS_PER_S}), now_ns=0)
    state.observe_alert(fired, now_ns=0)
    assert "kvguard_alert_firing" not in state.render(now_ns=0)
    assert state.counters.alerts_stale == 1


def test_a_firing_alert_promised_until_a_time_carries_that_end():
    out = alertmanager_alert(stream_alert(), valid_until_ns=1_800_000_240 * NS_PER_S)
    assert out["endsAt"] == "2027-01-15T08:04:00.000Z"


def test_the_exporter_core_imports_no_aiohttp_pydantic_or_kafka():
    import subprocess
    import sys

    code = ("import sys, kvguard.ops.exporter\n"
            "print(','.join(m for m in ('aiohttp', 'pydantic', 'aiokafka', 'faust', 'redis') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


# ---- prometheus_client exposition, labels, units, bounds -----------------------------------------


def duck_tick(**fields):
    """A tick with fields the wire model does not carry yet (model, unit_bytes): the state is duck-typed."""
    from types import SimpleNamespace

    return SimpleNamespace(**{**tick().model_dump(), **fields})


def test_both_formats_parse_with_prometheus_clients_own_parsers():
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
    from prometheus_client.parser import text_string_to_metric_families as text_families

    state = ExportState()
    state.observe_tick(tick(ooms=1, p_oom=0.2, tokens_per_s=3.0, tick_s=10.0), now_ns=0)
    state.observe_ack(Ack(command_id="c", node="sim-0/gpu0", outcome="executed", executed_at_ns=1, action="evict"),
                      now_ns=0)
    text, openmetrics = state.render(now_ns=0), state.render(now_ns=0, openmetrics=True)
    assert openmetrics.endswith("# EOF\n") and "# EOF" not in text
    om = {f.name: f for f in openmetrics_families(openmetrics)}
    classic = {f.name: f for f in text_families(text)}
    assert om["kvguard_ooms"].type == "counter" and om["kvguard_ooms"].samples[0].name == "kvguard_ooms_total"
    assert classic["kvguard_ooms"].type == "counter" and om["kvguard_u_kv"].type == "gauge"
    assert set(om) == set(classic)


def test_series_are_labelled_node_gpu_model_instance():
    state = ExportState(model="llama-3-8b")
    state.observe_tick(tick(node="host-a/gpu3"), now_ns=0)
    state.observe_tick(tick(node="pod-x:0"), now_ns=0)
    state.observe_tick(duck_tick(node="host-b/gpu0", model="qwen-7b"), now_ns=0)
    samples, _, _ = parse(state.render(now_ns=0))
    labels = {dict(have)["node"]: dict(have) for (name, have) in samples if name == "kvguard_u_kv"}
    assert labels["host-a/gpu3"] == {"node": "host-a/gpu3", "gpu": "3", "model": "llama-3-8b", "instance": "host-a"}
    assert labels["pod-x:0"] == {"node": "pod-x:0", "gpu": "", "model": "llama-3-8b", "instance": "pod-x:0"}
    assert labels["host-b/gpu0"]["model"] == "qwen-7b"
    assert node_labels("a/b/gpu12") == ("a/b/gpu12", "12", "", "a/b")


def test_rates_are_counters_and_the_slope_is_per_second():
    state = ExportState()
    for ts_s in (10, 20):
        state.observe_tick(tick(ts_s=ts_s, tokens_per_s=12.5, decode_tokens_per_s=2.0, tick_s=10.0,
                                alloc_fail_per_s=0.3, alloc_failures=3, arrivals=4, finished=2), now_ns=0)
    samples, types, _ = parse(state.render(now_ns=0))
    assert value(samples, "kvguard_tokens_total", node="sim-0/gpu0") == 250
    assert value(samples, "kvguard_decode_tokens_total", node="sim-0/gpu0") == 40
    assert value(samples, "kvguard_alloc_failures_total", node="sim-0/gpu0") == 6
    assert value(samples, "kvguard_requests_arrived_total", node="sim-0/gpu0") == 8
    assert types["kvguard_tokens_total"] == "counter"
    assert not [n for n in types if n.endswith("_per_second") and n != "kvguard_u_kv_slope_per_second"]
    assert value(samples, "kvguard_u_kv_slope_per_second", node="sim-0/gpu0") == pytest.approx(0.01 / 60)


def test_allocator_units_become_bytes_only_where_the_tick_gives_the_unit_size():
    state = ExportState()
    state.observe_tick(tick(node="a/gpu0", free_units=10, largest_free_run_units=4, dynamic_units=100), now_ns=0)
    state.observe_tick(duck_tick(node="b/gpu0", free_units=10, largest_free_run_units=4, dynamic_units=100,
                                 live_units=60, cached_units=5, retained_units=1, unit_bytes=2048), now_ns=0)
    samples, _, _ = parse(state.render(now_ns=0))
    assert value(samples, "kvguard_kv_free_units", node="a/gpu0") == 10
    assert value(samples, "kvguard_kv_free_bytes", node="b/gpu0") == 10 * 2048
    assert value(samples, "kvguard_kv_pool_bytes", node="b/gpu0") == 100 * 2048
    assert value(samples, "kvguard_kv_cached_bytes", node="b/gpu0") == 6 * 2048
    assert not [have for (name, have) in samples if name == "kvguard_kv_free_bytes" and ("node", "a/gpu0") in have]


def test_utilization_split_and_page_quantiles_are_labelled_gauges():
    state = ExportState()
    state.observe_tick(tick(util_weights=0.4, util_kv_live=0.3, util_free=0.2, pages_per_request_p50=3,
                            pages_per_request_p99=40), now_ns=0)
    state.observe_tick(tick(node="m/gpu0", utilization={"weights": 0.5, "allocator_reserved": 0.1}), now_ns=0)
    samples, _, _ = parse(state.render(now_ns=0))
    assert value(samples, "kvguard_memory_utilization_ratio", node="sim-0/gpu0", part="kv_live") == 0.3
    assert value(samples, "kvguard_memory_utilization_ratio", node="m/gpu0", part="allocator_reserved") == 0.1
    assert value(samples, "kvguard_request_pages", node="sim-0/gpu0", quantile="0.99") == 40


def test_the_node_cap_refuses_new_nodes_until_an_idle_one_expires_and_counts_both():
    state = ExportState(max_nodes=2, ttl_s=60)
    assert state.observe_tick(tick(node="a"), now_ns=0) and state.observe_tick(tick(node="b"), now_ns=0)
    assert state.observe_tick(tick(node="c"), now_ns=10 * NS_PER_S) is False
    state.observe_alert(Alert(node="c", ts_ns=1, name="KVCacheUsageHigh", tier="threshold", severity="warning"),
                        now_ns=10 * NS_PER_S)
    assert set(state.nodes) == {"a", "b"} and state.counters.records_over_cap == 2
    state.observe_tick(tick(node="b", ts_s=20), now_ns=50 * NS_PER_S)
    assert state.observe_tick(tick(node="c"), now_ns=70 * NS_PER_S) is True  # "a" was idle past the TTL
    assert set(state.nodes) == {"b", "c"} and state.counters.nodes_expired == 1
    samples, _, _ = parse(state.render(now_ns=70 * NS_PER_S))
    assert value(samples, "kvguard_exporter_nodes") == 2 and value(samples, "kvguard_exporter_nodes_limit") == 2
    assert value(samples, "kvguard_exporter_state_events_total", event="records_over_cap") == 2
    assert value(samples, "kvguard_exporter_state_events_total", event="nodes_expired") == 1
    with pytest.raises(ExportError, match="max_nodes"):
        ExportState(max_nodes=0)


def test_commands_are_counted_once_per_id():
    state = ExportState()
    command = Command(id="cmd-1", node="sim-0/gpu0", action="evict", payload={"targets": [[3, 0]]}, mode="emergency",
                      issued_at_ns=1, ttl_ns=10)
    assert state.observe_command(command, now_ns=0) and not state.observe_command(command, now_ns=0)
    samples, _, _ = parse(state.render(now_ns=0))
    assert value(samples, "kvguard_commands_total", node="sim-0/gpu0", action="evict", mode="emergency") == 1


def test_help_texts_make_no_claim_that_psi_above_one_means_an_unavoidable_oom():
    state = ExportState()
    state.observe_tick(tick(), now_ns=0)
    assert "unavoidable" not in state.render(now_ns=0)


def test_a_simulated_alert_starts_at_the_wall_time_it_was_received_not_1970():
    simulated = stream_alert(ts_ns=583 * NS_PER_S, started_at_ns=563 * NS_PER_S)
    wall_first, wall_now = 1_800_000_000 * NS_PER_S, 1_800_000_020 * NS_PER_S
    out = alertmanager_alert(simulated, received_ns=wall_now, first_received_ns=wall_first)
    assert out["startsAt"] == rfc3339(wall_first) and out["annotations"]["event_time"].startswith("583.0 s")
    assert "wall time of receipt" in out["annotations"]["time_source"]
    resolved = alertmanager_alert(stream_alert("resolved", ts_ns=600 * NS_PER_S, started_at_ns=563 * NS_PER_S,
                                               ends_at_ns=600 * NS_PER_S), received_ns=wall_now,
                                  first_received_ns=wall_first)
    assert resolved["endsAt"] == rfc3339(wall_now)
    real = alertmanager_alert(stream_alert(), received_ns=wall_now)  # a fleet's event time is wall time
    assert real["startsAt"] == rfc3339(1_799_999_000 * NS_PER_S) and real["annotations"]["time_source"] == "event time"
    assert real["annotations"]["runbook_url"] == "docs/runbooks/kv-cache-oom-risk.md"


def test_the_collector_registers_on_a_prometheus_client_registry_and_expires_on_its_clock():
    from prometheus_client import CollectorRegistry, generate_latest

    from kvguard.ops.exporter import ExportCollector

    state, now = ExportState(ttl_s=60), [0]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ExportCollector(state, lambda: now[0]))
    state.observe_tick(tick(), now_ns=0)
    assert b"kvguard_u_kv{" in generate_latest(registry)
    now[0] = 61 * NS_PER_S  # a scrape after the TTL drops the silent node
    assert b"kvguard_u_kv{" not in generate_latest(registry) and state.counters.nodes_expired == 1


def longest_node_ids(n: int) -> list[str]:
    """``n`` node ids of the longest length the wire takes, in both of kvguard's forms (``<pod>:<rank>``
    puts the whole id into ``instance`` too, the larger exposition)."""
    from kvguard.contracts.node_id import NODE_ID_MAX_CHARS

    ids = []
    for i in range(n):
        ids.append(f"h{i:03d}".ljust(NODE_ID_MAX_CHARS - 5, "x") + "/gpu0" if i % 2 else
                   f"h{i:03d}".ljust(NODE_ID_MAX_CHARS - 3, "x") + ":07")
    assert all(len(node) == NODE_ID_MAX_CHARS for node in ids)
    return ids


def full_tick(node: str, ts_s: int) -> MetricTick:
    """A tick that fills every per-node series the exporter has: each gauge, counter and quantile,
    the bytes gauges (unit_bytes), the allocator family and the whole utilization split."""
    return tick(node=node, ts_s=ts_s, ooms=1, p_oom=0.1, unit_bytes=4096, preemptions=2, evicted_pages=3,
                evicted_requests=1, evicted_tokens=5, alloc_retries=1, alloc_failures=1, tokens_per_s=5.0,
                decode_tokens_per_s=4.0, arrivals=3, finished=2, requests_running=3, requests_waiting=1,
                requests_holding_pages=3, alloc_reserved_bytes=1, alloc_segments=2, alloc_allocated_bytes=3,
                alloc_inactive_split_bytes=1, alloc_largest_free_block_bytes=1, alloc_f_ext=0.1, free_units=10,
                largest_free_run_units=5, dynamic_units=100, live_units=50, cached_units=5, workspace_units=3,
                pages_per_request_p50=1, pages_per_request_p95=2, pages_per_request_p99=3,
                utilization={"weights": 0.4, "kv_live": 0.3, "kv_cached": 0.1, "workspace": 0.1, "free": 0.05,
                             "headroom": 0.03, "reserved": 0.02})


def test_metrics_of_a_hundred_nodes_with_the_longest_ids_stay_under_one_megabyte():
    # issue 28: 100 nodes with 10,005-character ids made /metrics 93 MB; the id is bounded at the wire
    state = ExportState()
    for node in longest_node_ids(100):
        for ts_s in (10, 20):
            state.observe_tick(full_tick(node, ts_s), now_ns=0)
        state.observe_alert(Alert(node=node, ts_ns=20 * NS_PER_S, name="KVCacheOOMRisk", tier="threshold",
                                  severity="critical"), now_ns=0)
        command = Command(id=f"{node}/evict", node=node, action="evict", payload={"targets": [[1, 0]]},
                          issued_at_ns=1, ttl_ns=1)
        state.observe_command(command, now_ns=0)
        state.observe_ack(Ack(command_id=command.id, node=node, outcome="executed", executed_at_ns=2,
                              action="evict", units_freed=4), now_ns=0)
    for openmetrics in (False, True):
        text = state.render(now_ns=0, openmetrics=openmetrics)
        per_node = [line for line in text.splitlines() if line.startswith("kvguard_") and 'node="h042' in line]
        assert len(per_node) >= 50  # every per-node series is there
        assert len(text.encode()) < 1_000_000, len(text.encode())
