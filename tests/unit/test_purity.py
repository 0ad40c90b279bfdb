"""The pure core imports no Faust, Kafka, Redis or pydantic (checked in a fresh interpreter)."""

import importlib.util
import subprocess
import sys

PURE = ["kvguard.contracts.events", "kvguard.contracts.pressure", "kvguard.wire.eventlog",
        "kvguard.producers.sim.seed.pool", "kvguard.producers.sim.seed.free_runs", "kvguard.producers.sim.seed.engine", "kvguard.producers.sim.fleet", "kvguard.producers.sim.workloads",
        "kvguard.producers.sim.profiles",
        "kvguard.streams.mirror", "kvguard.streams.metrics", "kvguard.streams.alerts", "kvguard.streams.core", "kvguard.streams.predictor",
        "kvguard.policy.strategy", "kvguard.policy.modes", "kvguard.policy.planner", "kvguard.policy.engine", "kvguard.contracts.commands", "kvguard.policy.budget",
        "kvguard.policy.slo", "kvguard.actuators.executor", "kvguard.producers.sim.torch_allocator.caching_allocator",
        "kvguard.producers.torch_snapshot.snapshot", "kvguard.producers.vllm.step_memory"]
FORBIDDEN = ["faust", "aiokafka", "redis", "pydantic"]


def test_pure_core_modules_import_no_adapters():
    present = [m for m in PURE if importlib.util.find_spec(m.rsplit(".", 1)[0]) is not None
               and importlib.util.find_spec(m) is not None]
    assert {"kvguard.streams.core", "kvguard.streams.mirror", "kvguard.contracts.events"} <= set(present)
    code = ("import sys, importlib\n"
            f"for m in {present!r}: importlib.import_module(m)\n"
            f"print(','.join(sorted(b for b in {FORBIDDEN!r} if b in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"pure modules pulled in: {out.stdout.strip()}"
