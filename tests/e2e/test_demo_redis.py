"""`kvguard demo --redis`: the run's ticks land in the budget ledger and its predictions, OOMs and
evictions in the SLO ledger, readable with `kvguard budget status` and `kvguard slo report`; a
second run never merges with the first; a Redis outage is said, not swallowed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


# the ledgers burn on KV-arena fragmentation (F_ext), which the seed engine has and uniform vLLM blocks do not
SEED_PROFILE = "llama3-8b-24gb"


def kvguard(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD_")}
    return subprocess.run([sys.executable, "-c", "from kvguard.cli import main; main()", *args],
                          capture_output=True, cwd=ROOT, env=env, timeout=timeout)


def slo_report(redis_url: str) -> dict:
    report = kvguard("slo", "report", "--redis", redis_url, "--json", timeout=60)
    assert report.returncode == 0, report.stderr.decode()
    return json.loads(report.stdout)


def test_demo_records_the_run_in_the_redis_ledgers(redis_url, tmp_path):
    # the session's Redis may hold other tests' records of week 1970-W01: compare the difference
    before = slo_report(redis_url)
    runs = []
    for _ in range(2):  # a second run must not merge with the first (same seed, same simulated times)
        out = kvguard("demo", "--profile", SEED_PROFILE, "--quick", "--gpus", "2", "--redis", redis_url, "--json", "--no-report")
        assert out.returncode == 0, out.stderr.decode()[-3000:]
        runs.append(json.loads(out.stdout))
    first, second = runs
    assert first["run_id"] != second["run_id"] and set(first["nodes"]).isdisjoint(second["nodes"])
    ledger = first["ledger"]
    assert ledger["backend"] == "redis" and ledger["problems"] == []
    assert ledger["budget"]["outages"] == 0 and ledger["budget"]["buffered"] == 0

    status = kvguard("budget", "status", "--redis", redis_url, "--json", timeout=60)
    assert status.returncode == 0, status.stderr.decode()
    used = {row["node"]: row["used_s"] for row in json.loads(status.stdout)["nodes"]}
    for run in runs:
        expected = {node: t["over_threshold_s"] for node, t in run["ledger"]["ticks"].items()
                    if t["over_threshold_s"] > 0}
        assert expected, "the stress burns budget on some node"
        assert {node: used[node] for node in used if node in run["nodes"]} == expected

    slo = slo_report(redis_url)
    assert slo["week"] == "1970-W01"  # simulated time starts at the epoch
    if before["week"] != slo["week"]:
        before = {"predictions": {k: 0 for k in ("tp", "fp", "tn", "fn")}, "ooms": 0, "evictions": {"events": 0}}
    counted = [run["guarded"]["kvguard"]["slo"] for run in runs]
    predictions = sum(slo["predictions"][k] - before["predictions"][k] for k in ("tp", "fp", "tn", "fn"))
    assert predictions == sum(c["predictions"] for c in counted)
    if first["guarded"]["kvguard"]["predictor"].startswith("predictor tier:"):  # P(OOM) on the ticks
        assert predictions > 0
    assert {t["tier"] for t in slo["tiers"]} >= {"threshold", "slope", "fragmentation"}
    ooms = slo["ooms"] - before["ooms"]
    assert ooms == sum(c["ooms"] for c in counted) == sum(r["guarded"]["ooms"] for r in runs) > 0
    assert slo["evictions"]["events"] - before["evictions"]["events"] == sum(c["evictions"] for c in counted)


def test_demo_says_when_redis_is_unreachable(redis_server):
    server = redis_server()
    url = server.url
    server.stop()
    out = kvguard("demo", "--profile", SEED_PROFILE, "--duration", "2m", "--gpus", "1", "--no-lstm", "--redis", url, "--json",
                  "--no-report", timeout=200)
    err = out.stderr.decode()
    assert out.returncode == 3, err[-3000:]
    assert "unreachable" in err and "ledger:" in err
    result = json.loads(out.stdout)
    assert any("unreachable" in p for p in result["ledger"]["problems"])
    buffered = result["ledger"]["budget"]["buffered"] + result["ledger"]["slo"]["buffered"]
    assert buffered == 0 or "buffering writes in memory" in err, err[-3000:]


def test_demo_over_kafka_records_in_redis_and_deletes_its_topics(kafka_bootstrap, redis_url):
    import asyncio

    from aiokafka.admin import AIOKafkaAdminClient

    out = kvguard("demo", "--profile", SEED_PROFILE, "--duration", "3m", "--gpus", "2", "--no-lstm", "--bus", f"kafka://{kafka_bootstrap}",
                  "--redis", redis_url, "--speed", "20", "--json", "--no-report", timeout=300)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    result = json.loads(out.stdout)
    kv = result["guarded"]["kvguard"]
    assert result["mode"] == "kafka" and kv["topics_deleted"] and kv["policy"]["ticks"] > 0
    assert all(node.startswith(f"demo-{result['run_id']}/") for node in result["nodes"])
    assert kv["slo"]["ticks"] > 0 and result["ledger"]["problems"] == []

    async def topics():
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        await admin.start()
        try:
            return await admin.list_topics()
        finally:
            await admin.close()

    assert [t for t in asyncio.run(topics()) if t.startswith(kv["topic_prefix"])] == []


def test_on_vllm_the_budget_debits_the_caching_allocators_fragmentation(redis_url):
    """On uniform vLLM blocks the KV layer's F_ext is 0 by construction: the budget debits the layer where
    fragmentation exists, the caching allocator's (issue 20), so `kvguard budget status` lists the nodes."""
    out = kvguard("demo", "--duration", "2m", "--gpus", "1", "--no-lstm", "--no-arms", "--redis", redis_url, "--json",
                  "--no-report", timeout=200)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    run = json.loads(out.stdout)
    assert run["profile"].startswith("llama3-8b-24gb-vllm")
    expected = {node: t["over_threshold_s"] for node, t in run["ledger"]["ticks"].items()}
    assert set(expected) == set(run["nodes"]) and all(s > 0 for s in expected.values())
    status = kvguard("budget", "status", "--redis", redis_url, "--json", timeout=60)
    assert status.returncode == 0, status.stderr.decode()
    used = {row["node"]: row["used_s"] for row in json.loads(status.stdout)["nodes"] if row["node"] in run["nodes"]}
    assert used == expected
