"""deploy/: every YAML parses and its references resolve, the rules hold their promises (for:,
runbooks, one paging path, kvguard's own absence), the Strimzi topics match the settings, and every
Grafana query names a series `kvguard export` serves. promtool and kubectl run where installed
(Debian's `prometheus` package has promtool); the schema checks run everywhere."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from kvguard.config.settings import Settings
from kvguard.contracts.units import NS_PER_S
from kvguard.ops.export_service import EXPORT_KINDS, ExportService
from kvguard.ops.exporter import RUNBOOKS
from kvguard.policy.budget import ALERT_RULE as BUDGET_ALERT
from kvguard.streams.alerts import default_rules
from kvguard.streams.app import DEFAULT_APP_ID, changelog_topic_name, leader_topic_name
from kvguard.wire.schemas import Ack, Alert, Command, DlqRecord, MetricTick

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "prometheus" / "kvguard-rules.yaml"
RULES_TEST = DEPLOY / "prometheus" / "kvguard-rules.test.yaml"
DASHBOARD = DEPLOY / "grafana" / "kvguard-dashboard.json"
KINDS = {"Namespace", "ConfigMap", "Secret", "Service", "Deployment", "DaemonSet", "Job", "PodDisruptionBudget",
         "ServiceMonitor", "PrometheusRule", "KafkaTopic", "Kustomization"}
K8S_DIRS = ("k8s", "k8s-overlays")
METRIC = re.compile(r"\bkvguard_[a-z0-9_]+\b")


def yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def base_resources() -> list[dict]:
    """The base's resources as its kustomization lists them (no kustomize needed)."""
    kustomization = documents(DEPLOY / "k8s" / "kustomization.yaml")[0]
    return [d for name in kustomization["resources"] for d in documents(DEPLOY / "k8s" / name)]


def by_kind(resources: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in resources if d["kind"] == kind}


def containers(resource: dict) -> list[dict]:
    return resource["spec"]["template"]["spec"]["containers"]


def served_series() -> set[str]:
    """Every sample name `kvguard export` serves once each kind of record has arrived."""
    settings = Settings()
    service = ExportService(None, {kind: settings.topics.name(kind) for kind in EXPORT_KINDS},
                            alertmanager_url="http://127.0.0.1:9", webhook_url="http://127.0.0.1:9/hook",
                            clock=lambda: 0)
    state = service.state
    fields = MetricTick(node="h/gpu0", ts_ns=NS_PER_S, u_kv=0.5, f_ext=0.1, f_int=0.1, psi=0.6, p_oom=0.1,
                        tick_s=10.0).model_dump()
    state.observe_tick(SimpleNamespace(**{**fields, "unit_bytes": 4096}), now_ns=0)
    state.observe_alert(Alert(node="h/gpu0", ts_ns=NS_PER_S, name=BUDGET_ALERT, tier="budget", severity="warning",
                              value=1.0, threshold=2.0, labels={"week": "2026-W48"}), now_ns=0)
    state.observe_command(Command(id="c", node="h/gpu0", action="evict", payload={"targets": [[3, 0]]}, issued_at_ns=1,
                                  ttl_ns=1), now_ns=0)
    state.observe_ack(Ack(command_id="c", node="h/gpu0", outcome="executed", executed_at_ns=1, action="evict"),
                      now_ns=0)
    state.observe_dlq(DlqRecord.of(reason="invalid", detail="", topic="t", partition=0, offset=0, key=None,
                                   value=b""))
    service.last_record_ns["metrics"] = 1
    service.decode_errors[("metrics", "malformed")] = 1
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name for family in text_string_to_metric_families(service.render()) for s in family.samples}


# ---- every file ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_in_deploy_parses_into_known_kinds(path):
    docs = documents(path)
    assert docs, f"{path} is empty"
    if path.parts[len(DEPLOY.parts)] in K8S_DIRS:
        for doc in docs:
            assert doc.get("apiVersion") and doc.get("kind") in KINDS, f"{path}: {doc.get('kind')!r}"
            assert doc["kind"] == "Kustomization" or doc["metadata"].get("name"), path
    elif path.name == "compose.yaml":
        assert {"worker", "export", "kafka"} <= set(docs[0]["services"])
    elif path == RULES:
        assert docs[0]["groups"]
    elif path == RULES_TEST:
        assert docs[0]["rule_files"] == [RULES.name] and docs[0]["tests"]


@pytest.mark.parametrize("kustomization", sorted(DEPLOY.rglob("kustomization.yaml")),
                         ids=lambda p: str(p.parent.relative_to(DEPLOY)))
def test_kustomizations_name_files_that_exist(kustomization):
    doc = documents(kustomization)[0]
    for entry in doc.get("resources", []):
        target = kustomization.parent / entry
        assert target.is_file() or (target / "kustomization.yaml").is_file(), f"{kustomization}: {entry}"


def test_base_references_resolve():
    resources = base_resources()
    config_maps, secrets = by_kind(resources, "ConfigMap"), by_kind(resources, "Secret")
    workloads = [*by_kind(resources, "Deployment").values(), *by_kind(resources, "DaemonSet").values(),
                 *by_kind(resources, "Job").values()]
    image_names = {i["name"] for i in documents(DEPLOY / "k8s" / "kustomization.yaml")[0]["images"]}
    for workload in workloads:
        pod = workload["spec"]["template"]["spec"]
        for volume in pod.get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in config_maps, workload["metadata"]["name"]
        for container in pod["containers"]:
            assert container["image"] in image_names
            for source in container.get("envFrom", []):
                ref = source.get("configMapRef") or source.get("secretRef")
                assert ref["name"] in (config_maps if "configMapRef" in source else secrets)
    deployments = by_kind(resources, "Deployment")
    service = by_kind(resources, "Service")["kvguard-export"]
    pod_labels = deployments["kvguard-export"]["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    monitor = by_kind(resources, "ServiceMonitor")["kvguard-export"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    assert all(e.get("honorLabels") for e in monitor["spec"]["endpoints"]), "the exporter's instance label"
    pdb = by_kind(resources, "PodDisruptionBudget")["kvguard-export"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    annotations = deployments["kvguard-export"]["spec"]["template"]["metadata"].get("annotations", {})
    assert not any(k.startswith("prometheus.io/") for k in annotations), "scraped once, by the ServiceMonitor"


def test_the_exporter_runs_two_replicas_with_exactly_one_paging_path():
    deployment = by_kind(base_resources(), "Deployment")["kvguard-export"]
    assert deployment["spec"]["replicas"] == 2
    compose = documents(DEPLOY / "compose.yaml")[0]["services"]["export"]["command"]
    for args in (containers(deployment)[0]["args"], compose):
        paging = args[args.index("--paging") + 1]
        assert paging in ("forwarder", "prometheus")
        assert ("--alertmanager" in args) == (paging == "forwarder"), args


def test_the_worker_compacts_its_changelog_wherever_the_broker_is_kafka():
    from typer.testing import CliRunner

    from kvguard.cli import app

    assert "--compact-changelog" in CliRunner().invoke(app, ["worker", "--help"], env={"COLUMNS": "300"}).output
    worker = by_kind(base_resources(), "Deployment")["kvguard-worker"]
    assert "--compact-changelog" in containers(worker)[0]["args"]
    assert "--compact-changelog" in documents(DEPLOY / "compose.yaml")[0]["services"]["worker"]["command"]


def test_the_settings_file_lists_every_section_of_the_settings():
    import tomllib

    sections = set(tomllib.loads((DEPLOY / "kvguard.toml").read_text()))
    assert sections == set(Settings.model_fields), f"missing {set(Settings.model_fields) - sections}"


def test_the_configmap_holds_the_settings_file_verbatim():
    config = by_kind(base_resources(), "ConfigMap")["kvguard-config"]
    assert config["data"]["kvguard.toml"] == (DEPLOY / "kvguard.toml").read_text(), \
        "run python scripts/sync-configmap.py after editing deploy/kvguard.toml"


def test_the_deployed_worker_runs_the_shipped_predictor_at_its_calibrated_threshold():
    from kvguard.runtime.bootstrap import bootstrap
    from kvguard.streams.loader import SHIPPED_DIR

    worker = by_kind(base_resources(), "Deployment")["kvguard-worker"]
    compose = documents(DEPLOY / "compose.yaml")[0]["services"]["worker"]["command"]
    for args in (containers(worker)[0]["args"], compose):
        assert "--no-predictor" not in args and "--model" not in args, args
    graph = bootstrap(Settings.load(DEPLOY / "kvguard.toml", env={}))  # the worker's default
    calibrated = json.loads((SHIPPED_DIR / "oom_trees.json").read_text())["threshold"]
    assert graph.predictor is not None, graph.predictor_note
    assert graph.core_config().thresholds.p_oom == calibrated
    # the policy builds the same graph: its SLO labels predictions where the workers' tier 3 fires
    from kvguard.policy.slo import MemorySloLedger

    assert graph.slo_recorder(MemorySloLedger()).threshold == calibrated


def test_strimzi_topics_match_the_settings_and_compact_the_changelog():
    settings = Settings.load(DEPLOY / "kvguard.toml", env={})
    topics = {d["spec"]["topicName"]: d for d in documents(DEPLOY / "k8s-overlays" / "prod" / "kafka-topics.yaml")}
    expected = {name: spec.partitions for name, spec in settings.topics.all().items()}
    expected[changelog_topic_name(DEFAULT_APP_ID)] = settings.topics.events.partitions
    expected[leader_topic_name(DEFAULT_APP_ID)] = 1
    assert {name: t["spec"]["partitions"] for name, t in topics.items()} == expected
    for name, spec in settings.topics.all().items():
        config = topics[name]["spec"]["config"]
        assert config["cleanup.policy"] == "delete" and config["retention.ms"] == spec.retention_ms, name
    assert topics[changelog_topic_name(DEFAULT_APP_ID)]["spec"]["config"]["cleanup.policy"] == "compact"
    for topic in topics.values():
        assert topic["metadata"]["namespace"] and topic["metadata"]["labels"]["strimzi.io/cluster"]
        assert topic["spec"]["replicas"] > topic["spec"]["config"]["min.insync.replicas"] >= 1
    prod = documents(DEPLOY / "k8s-overlays" / "prod" / "kustomization.yaml")[0]
    assert "kafka-topics.yaml" in prod["resources"]
    assert "--no-create-topics" in json.dumps(prod["patches"]), "the Topic Operator owns the topics in prod"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with kustomize) not installed")
@pytest.mark.parametrize("root", ["k8s", "k8s-overlays/dev", "k8s-overlays/prod"])
def test_kustomize_builds(root):
    done = subprocess.run(["kubectl", "kustomize", str(DEPLOY / root)], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    kinds = {d["kind"] for d in yaml.safe_load_all(done.stdout) if d}
    assert {"Deployment", "ServiceMonitor", "PrometheusRule"} <= kinds
    assert ("KafkaTopic" in kinds) == (root == "k8s-overlays/prod") and ("Job" in kinds) != ("KafkaTopic" in kinds)


# ---- rules -----------------------------------------------------------------------------------------


def rule_groups() -> dict[str, list[dict]]:
    return {g["name"]: g["rules"] for g in documents(RULES)[0]["groups"]}


def alert_rules() -> list[dict]:
    return [r for rules in rule_groups().values() for r in rules if "alert" in r]


def test_the_prometheus_rule_resource_holds_the_same_groups():
    assert documents(DEPLOY / "k8s" / "prometheusrule.yaml")[0]["spec"]["groups"] == documents(RULES)[0]["groups"]


def test_every_alert_waits_has_a_severity_a_summary_and_a_runbook_of_this_project():
    for rule in alert_rules():
        name = rule["alert"]
        assert re.fullmatch(r"\d+[smh]", str(rule.get("for", ""))), f"{name}: no for:"
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"], name
        runbook = rule["annotations"]["runbook_url"]
        assert runbook.startswith("docs/runbooks/") and (ROOT / runbook).is_file(), f"{name}: {runbook}"
        text = (ROOT / runbook).read_text()
        assert name in text and "## First five checks" in text and "## Commands" in text, runbook
        assert "unavoidable" not in json.dumps(rule), name


def test_the_alerts_kvguard_forwards_page_through_prometheus_only_when_asked():
    forwarded = {rule.name for rule in default_rules(with_predictor=True)} | {BUDGET_ALERT}
    gated = {r["alert"] for r in rule_groups()["kvguard-pressure"]}
    assert gated == forwarded
    for rule in alert_rules():
        is_gated = 'and on() kvguard_exporter_paging_info{path="prometheus"}' in " ".join(rule["expr"].split())
        assert is_gated == (rule["alert"] in forwarded), rule["alert"]
    for name in forwarded:  # the forwarder puts the same runbook on its alerts
        rule = next(r for r in alert_rules() if r["alert"] == name)
        assert rule["annotations"]["runbook_url"].endswith(RUNBOOKS[name])


def test_kvguard_itself_going_silent_is_an_alert():
    exprs = {r["alert"]: r["expr"] for r in alert_rules()}
    assert any("absent(" in e for e in exprs.values())
    assert "kvguard_node_last_seen_timestamp_seconds" in exprs["KvguardNodeStale"]
    assert "kvguard_exporter_records_total" in exprs["KvguardNoTicks"]


def test_rules_and_dashboard_name_only_series_the_exporter_serves():
    served = served_series() | {name.removesuffix("_total") for name in served_series()}
    in_rules = set(METRIC.findall(RULES.read_text().split("groups:", 1)[1]))
    in_dashboard = set(METRIC.findall(json.dumps(dashboard())))
    assert in_rules and in_dashboard
    assert in_rules <= served, sorted(in_rules - served)
    assert in_dashboard <= served, sorted(in_dashboard - served)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")
def test_promtool_checks_the_rules_and_runs_their_unit_tests():
    for command in (["check", "rules", RULES.name], ["test", "rules", RULES_TEST.name]):
        done = subprocess.run(["promtool", *command], cwd=RULES.parent, capture_output=True, text=True, timeout=120,
                              check=False)
        assert done.returncode == 0, done.stdout + done.stderr


# ---- the dashboard ---------------------------------------------------------------------------------


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def rows() -> list[tuple[str, list[dict]]]:
    out: list[tuple[str, list[dict]]] = []
    for panel in dashboard()["panels"]:
        if panel["type"] == "row":
            out.append((panel["title"], []))
        else:
            out[-1][1].append(panel)
    return out


def test_the_dashboard_opens_with_the_four_pressure_metrics_then_the_metric_groups():
    titles = [title for title, _ in rows()]
    first = [p["title"].split()[0] for p in rows()[0][1]]
    assert first == ["F_ext", "F_int", "U_kv", "Ψ"]
    for group in ("Utilization split", "Per-request pages", "Allocation failures", "Evictions, preemptions, OOMs",
                  "Throughput", "P(OOM)"):
        assert any(group in title for title in titles), group
    panels = [p for _, ps in rows() for p in ps]
    assert len({p["id"] for p in panels}) == len(panels)
    assert all(p["targets"] and all(t["expr"] for t in p["targets"]) for p in panels)


def test_the_dashboard_marks_kvguards_commands_and_the_ooms():
    annotations = {a["name"]: a["expr"] for a in dashboard()["annotations"]["list"] if "expr" in a}
    assert "kvguard_commands_total" in annotations["kvguard commands"]
    assert "kvguard_ooms_total" in annotations["OOMs"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")
def test_every_dashboard_query_is_valid_promql(tmp_path):
    board = dashboard()
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    exprs += [a["expr"] for a in board["annotations"]["list"] if "expr" in a]
    grafana = {"$__rate_interval": "1m", "$__interval": "1m", "$node": ".*", "$model": ".*"}
    rules = []
    for i, expr in enumerate(exprs):
        for variable, value in grafana.items():
            expr = expr.replace(variable, value)
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_f_ext_panel_draws_the_caching_allocators_fragmentation_labelled_as_such():
    """On uniform-block engines (vLLM) the KV layer's F_ext is 0 by construction: the F_ext panel also
    draws the allocator's F_ext and its reserved-but-unallocated bytes (issue 20), each named by its layer."""
    panel = rows()[0][1][0]
    legends = {t["legendFormat"]: t["expr"] for t in panel["targets"]}
    assert "kvguard_f_ext" in legends["{{node}} KV layer"]
    assert "kvguard_allocator_f_ext" in legends["{{node}} caching allocator"]
    unallocated = legends["{{node}} allocator reserved but unallocated"]
    assert "kvguard_allocator_reserved_bytes" in unallocated and "- kvguard_allocator_allocated_bytes" in unallocated
    bytes_axis = [o for o in panel["fieldConfig"]["overrides"]
                  if {"id": "unit", "value": "bytes"} in o["properties"]]
    ref = next(t["refId"] for t in panel["targets"] if "reserved_bytes" in t["expr"])
    assert [o["matcher"] for o in bytes_axis] == [{"id": "byFrameRefID", "options": ref}]
