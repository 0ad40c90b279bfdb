"""Helpers for the streams integration tests: worker processes, publishing logs, reading outputs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvguard.contracts.events import EventBatch
from kvguard.contracts.units import NS_PER_S

ROOT = Path(__file__).resolve().parents[2]


# the seed engine (an alternative profile since issue 11): these logs exercise its arena OOMs, snapshots
# and fragmentation; the vLLM engine's own events are tested in tests/unit/cli/test_simulate_vllm.py
SEED_PROFILE = "llama3-8b-24gb"

def shadow_log(n_gpus: int = 3, seconds: int = 150, step_s: int = 2, seed: int = 5,
               rate_scale: float = 3.0) -> list[EventBatch]:
    """A busy shadow-engine log: batches per node every ``step_s``, snapshots every 30 s."""
    from kvguard.producers.sim.fleet import Fleet
    from kvguard.producers.sim.profiles import load_profile
    from kvguard.producers.sim.workloads import load_workload

    fleet = Fleet(n_gpus, load_profile(SEED_PROFILE), seed=seed, snapshot_every_s=30)
    fleet.submit_workload(load_workload("mixed", rate_scale=rate_scale, window=seconds, seed=seed))
    batches: list[EventBatch] = []
    for t in range(step_s, seconds + step_s, step_s):
        fleet.advance(t * NS_PER_S)
        batches.extend(fleet.take_batches(t * NS_PER_S))
    return batches


def expected_records(batches: list[EventBatch], config=None) -> tuple[dict, dict]:
    """What the embedded core makes of ``batches``: {(node, ts_ns): tick record}, {(node, ts, rule, state): alert}."""
    from kvguard.streams.core import StreamConfig, StreamCore
    from kvguard.streams.outputs import encode_alert, encode_tick

    core = StreamCore(config or StreamConfig())
    ticks, alerts = core.process_many(batches)
    return ({(t.node, t.ts_ns): json.loads(encode_tick(t)) for t in ticks},
            {(a.node, a.ts_ns, a.rule, a.state): json.loads(encode_alert(a)) for a in alerts})


async def publish_batches(settings, batches: list[EventBatch], extra: list[tuple[str, bytes]] = ()) -> None:
    from kvguard.bus.kafka import KafkaBus
    from kvguard.wire.schemas import batch_headers, encode_batch

    bus = KafkaBus(settings)
    await bus.start()
    try:
        topic = settings.topics.name("events")
        for b in batches:
            await bus.publish(topic, b.node, encode_batch(b), batch_headers(b))
        for key, value in extra:
            await bus.publish(topic, key, value, ())
        await bus.flush()
    finally:
        await bus.stop()


class WorkerProcess:
    """``kvguard worker`` as a real process (so a test can SIGKILL it)."""

    def __init__(self, settings, app_id: str, directory: Path, *, checkpoint_every_ticks: int = 2, name: str = "w",
                 predictor: bool = False):
        self.dir = Path(directory) / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config = self.dir / "settings.json"
        if settings.streams.idle_flush_s is None:
            # the idle flush runs on wall time: on a loaded machine it can publish a node's pending tick
            # as partial before the batch that completes it is consumed, and a test comparing every tick
            # with the embedded core's would see that race; tests of the idle flush set their own value
            settings = settings.model_copy(update={"streams": settings.streams.model_copy(
                update={"idle_flush_s": 3600.0})})
        self.config.write_text(settings.model_dump_json())
        self.app_id = app_id
        self.checkpoint_every_ticks = checkpoint_every_ticks
        self.name = name
        self.predictor = predictor
        self.logs: list[Path] = []
        self.proc: subprocess.Popen | None = None

    def start(self) -> "WorkerProcess":
        log_path = self.dir / f"{self.name}-{len(self.logs)}.log"
        self.logs.append(log_path)
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from kvguard.cli import main; main()", "worker", "--config", str(self.config), "--app-id", self.app_id,
             "--checkpoint-every-ticks", str(self.checkpoint_every_ticks), "--loglevel", "info",
             # no tier 3 unless asked: most tests compare the ticks with the embedded core's without a
             # predictor (expected_records); test_worker_shipped_settings runs the worker as deployed
             "--datadir", str(self.dir / "data"), *([] if self.predictor else ["--no-predictor"])],
            stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT, env=env,
            start_new_session=True)
        return self

    def kill(self) -> None:
        """SIGKILL: no flush, no commit, no goodbye to the group."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_text(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in self.logs if p.exists())

    def assigned_partitions(self) -> list[int]:
        """Partitions of the events topic in this worker's latest assignment."""
        last = None
        for line in self.log_text().splitlines():
            if "kvguard-streams assigned" in line:
                last = line
        if last is None:
            return []
        return json.loads(last.rsplit("partitions", 1)[1].strip())


class OutputReader:
    """Reads kvguard.metrics / alerts / dlq from the beginning with a private group."""

    def __init__(self, settings, group: str):
        self.settings = settings
        self.group = group
        self.records: list = []

    async def __aenter__(self) -> "OutputReader":
        from kvguard.bus.kafka import KafkaBus

        self.bus = KafkaBus(self.settings)
        await self.bus.start()
        names = [self.settings.topics.name(k) for k in ("metrics", "alerts", "dlq")]
        self.sub = self.bus.subscribe(names, self.group)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.sub.close()
        await self.bus.stop()

    def of(self, kind: str) -> list:
        name = self.settings.topics.name(kind)
        return [r for r in self.records if r.topic == name]

    async def until(self, predicate, limit_s: float = 90.0, what: str = "records") -> None:
        deadline = time.monotonic() + limit_s
        while not predicate(self):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {limit_s} s waiting for {what}; have "
                                     f"{len(self.of('metrics'))} ticks, {len(self.of('alerts'))} alerts, "
                                     f"{len(self.of('dlq'))} dlq")
            self.records.extend(await self.sub.getmany(1000, 0.5))

    async def settle(self, quiet_s: float = 2.0) -> None:
        """Read until nothing arrived for ``quiet_s``."""
        deadline = time.monotonic() + quiet_s
        while time.monotonic() < deadline:
            got = await self.sub.getmany(1000, 0.25)
            if got:
                self.records.extend(got)
                deadline = time.monotonic() + quiet_s


def tick_map(records) -> tuple[dict, int]:
    """{(node, ts_ns): record dict} and how many duplicates (same key, same content) came."""
    out: dict = {}
    duplicates = 0
    for r in records:
        d = json.loads(r.value)
        key = (d["node"], d["ts_ns"])
        if key in out:
            if out[key] != d:
                raise AssertionError(f"two different ticks for {key}:\n{out[key]}\n{d}")
            duplicates += 1
        out[key] = d
    return out, duplicates


