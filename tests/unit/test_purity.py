"""The pure core imports no Faust, Kafka, Redis or pydantic (checked in a fresh interpreter)."""

import importlib.util
import subprocess
import sys

PURE = ["kvguard.events", "kvguard.pressure", "kvguard.eventlog",
        "producers.pool", "producers.allocator", "producers.engine", "producers.fleet", "producers.workloads",
        "producers.profiles",
        "streams.mirror", "streams.metrics", "streams.alerts", "streams.core", "streams.predictor",
        "policy.strategy", "policy.modes", "policy.planner", "policy.engine", "policy.commands", "policy.budget",
        "policy.slo", "actuators.executor"]
FORBIDDEN = ["faust", "aiokafka", "redis", "pydantic"]


def test_pure_core_modules_import_no_adapters():
    present = [m for m in PURE if importlib.util.find_spec(m.rsplit(".", 1)[0]) is not None
               and importlib.util.find_spec(m) is not None]
    assert {"streams.core", "streams.mirror", "kvguard.events"} <= set(present)
    code = ("import sys, importlib\n"
            f"for m in {present!r}: importlib.import_module(m)\n"
            f"print(','.join(sorted(b for b in {FORBIDDEN!r} if b in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"pure modules pulled in: {out.stdout.strip()}"
