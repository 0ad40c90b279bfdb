"""`kvguard worker` as deployed: the real process with deploy/kvguard.toml on a real broker (Tansu).

Only the broker's address, a private topic prefix and Tansu's limits (no idempotent producer, short
group sessions) are changed from the shipped file. The worker must run tier 3 with the shipped model
at the model's calibrated threshold, say so at start, and produce the ticks and alerts the
composition root's embedded core (what the demo runs) makes of the same batches.
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import replace

from kvguard.config.settings import Settings
from kvguard.contracts.units import NS_PER_S
from kvguard.producers.sim.registry import engine_kind
from kvguard.producers.sim.vllm.external import Leak
from kvguard.producers.sim.workloads import load_workload
from kvguard.runtime.bootstrap import bootstrap
from kvguard.streams.loader import SHIPPED_DIR
from kvguard.streams.outputs import encode_alert, encode_tick
from tests.conftest import fast_group_options
from tests.integration.streams_helpers import ROOT, OutputReader, publish_batches, tick_map

SHIPPED_SETTINGS = ROOT / "deploy" / "kvguard.toml"


def tansu_env(bootstrap_address: str, prefix: str) -> dict[str, str]:
    """The shipped settings' overrides for the test broker, as an operator would set them."""
    env = {"KVGUARD_KAFKA__BOOTSTRAP": bootstrap_address, "KVGUARD_TOPICS__PREFIX": prefix,
           "KVGUARD_KAFKA__IDEMPOTENT": "false"}  # Tansu 0.6 has no InitProducerId
    env.update({f"KVGUARD_KAFKA__{k.upper()}": str(v) for k, v in fast_group_options().items()})
    return env


def leaking_vllm_batches(graph, seconds: int = 250):
    """Two vLLM-faithful GPUs kept busy while memory leaks at 20 GiB/h (class C7), stopped just before
    the leak reaches the allocator's headroom (no OOM, events in every 2 s batch: each batch closes at
    most one tick of its node). The shipped trend model stays quiet on calm runs, so the growth is what
    raises its tier-3 alerts."""
    kind = engine_kind(graph.profile)
    leaking = replace(graph, node_config=kind.node_config(graph.node_config, leak=Leak.parse("20GiB/h")))
    fleet = leaking.fleet(2, seed=0, snapshot_every_s=30)
    fleet.submit_workload(load_workload("azure-conv", rate_scale=1.0, window=seconds, seed=0))
    batches = [b for _, step in fleet.steps(seconds * NS_PER_S, step_ns=2 * NS_PER_S) for b in step]
    assert fleet.summary().ooms == 0
    return batches


async def test_the_deployed_worker_runs_the_shipped_predictor_at_its_calibrated_threshold(kafka_bootstrap, tmp_path):
    prefix = f"t{uuid.uuid4().hex[:12]}."
    env = tansu_env(kafka_bootstrap, prefix)
    settings = Settings.load(SHIPPED_SETTINGS, env=env)
    graph = bootstrap(settings)  # what the demo builds from the same settings
    calibrated = json.loads((SHIPPED_DIR / "oom_trees.json").read_text())["threshold"]
    assert graph.predictor is not None and settings.predictor.threshold != calibrated
    batches = leaking_vllm_batches(graph)
    core = graph.stream_core()
    ticks, alerts = [], []
    for batch in batches:  # one batch at a time, as the worker's agent applies them
        new_ticks, new_alerts = core.process(batch)
        ticks += new_ticks
        alerts += new_alerts
    expected = {(t.node, t.ts_ns): json.loads(encode_tick(t)) for t in ticks}
    expected_tier3 = [json.loads(encode_alert(a)) for a in alerts if a.tier == 3]
    assert expected_tier3, "the workload must raise tier-3 alerts to see their threshold"

    log = tmp_path / "worker.log"
    worker = subprocess.Popen(
        [sys.executable, "-c", "from kvguard.cli import main; main()", "worker", "--config", str(SHIPPED_SETTINGS),
         "--app-id", f"{prefix}streams", "--datadir", str(tmp_path / "faust"), "--loglevel", "info"],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), **env), start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while "Ready" not in log.read_text(errors="replace"):  # topics created, Faust up
            assert worker.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.2)
        async with OutputReader(settings, "reader") as out:
            await publish_batches(settings, batches)
            await out.until(lambda o: len(tick_map(o.of("metrics"))[0]) >= len(expected), what="every tick")
            await out.until(lambda o: any(json.loads(r.value)["tier"] == "lstm" for r in o.of("alerts")),
                            what="a tier-3 alert")
            await out.settle()
        started = next(line for line in log.read_text().splitlines() if line.startswith("kvguard worker"))
        assert f"tier 3 at P(OOM) >= {calibrated:.4f} (the model's calibrated threshold)" in started, started
        assert "trend trees (oom), shipped model" in started
        got, _ = tick_map(out.of("metrics"))
        assert {k: v for k, v in got.items() if not v.get("partial")} == expected
        assert all(v["p_oom"] is not None for v in got.values())
        tier3 = [json.loads(r.value) for r in out.of("alerts") if json.loads(r.value)["tier"] == "lstm"]
        assert {a["threshold"] for a in tier3} == {calibrated}
        seen = {(a["node"], a["ts_ns"], a["state"]) for a in tier3}
        assert {(a["node"], a["ts_ns"], a["state"]) for a in expected_tier3} <= seen
        assert out.of("dlq") == []
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(10)
