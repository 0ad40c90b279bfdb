"""The exporter's pure part: exposition text, idempotent folding of ticks, alert mapping."""

import re
from datetime import datetime

import pytest

from kvguard.contracts.units import NS_PER_S
from kvguard.ops.exporter import (
    ExportError,
    ExportState,
    alert_dedupe_key,
    alertmanager_alert,
    format_value,
    rfc3339,
    webhook_payload,
)
from kvguard.wire.schemas import Ack, Alert, DlqRecord, MetricTick

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*\})? (\S+)$')
RULES_METRICS = {"kvguard_u_kv", "kvguard_f_ext", "kvguard_f_int", "kvguard_psi", "kvguard_u_kv_slope_per_min",
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
    return samples[(name, frozenset(labels.items()))]


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
    state = ExportState()
    state.observe_tick(tick(node='we"ird\\node\nx'), now_ns=0)
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
    assert 'kvguard_alert_firing{node="n",alertname="KVCacheUsageHigh"' in state.render(now_ns=0)
    state.observe_alert(fired.model_copy(update={"status": "resolved"}), now_ns=0)
    assert "kvguard_alert_firing" not in state.render(now_ns=0)


def test_values_format_as_prometheus_floats():
    assert [format_value(v) for v in (1.0, 0.25, float("nan"), float("inf"), -float("inf"))] == \
        ["1", "0.25", "NaN", "+Inf", "-Inf"]


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
