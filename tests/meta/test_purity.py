"""The pure core imports no Faust, Kafka, Redis or pydantic (checked in a fresh interpreter).

The pure modules are derived from the folders: every module of the base's contracts and of the core
wings (producers, streams, policy, actuators) is pure, except the shells named below, which connect
the pure parts to the bus, Redis or the wire schemas. A new module is pure unless it is added there.
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PURE_FOLDERS = {"kvguard.contracts": ROOT / "kvguard" / "contracts", "kvguard.producers": ROOT / "producers",
                "kvguard.streams": ROOT / "streams", "kvguard.policy": ROOT / "policy",
                "kvguard.actuators": ROOT / "actuators"}
PURE_MODULES = {"kvguard.wire.eventlog", "kvguard.wire.validate"}
SHELLS = {
    "kvguard.producers.publisher",  # the node's edge: wire encoding (pydantic) onto the bus
    "kvguard.streams.app", "kvguard.streams.embedded", "kvguard.streams.outputs",  # Faust, the bus, wire records
    "kvguard.policy.service", "kvguard.policy.budget_redis", "kvguard.policy.slo_redis",  # the bus, Redis
    "kvguard.actuators.actuator",  # commands and acks on the bus
}
FORBIDDEN = ["faust", "aiokafka", "redis", "pydantic"]


def pure_modules() -> list[str]:
    out = set(PURE_MODULES)
    for prefix, folder in PURE_FOLDERS.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if "__pycache__" in parts or parts[-1] == "__init__":
                continue
            out.add(".".join([prefix, *parts]))
    return sorted(out - SHELLS)


def _imported_adapters(modules: list[str]) -> list[str]:
    code = ("import sys, importlib\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            f"print(','.join(sorted(b for b in {FORBIDDEN!r} if b in sys.modules)))")
    return [b for b in subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                      check=True).stdout.strip().split(",") if b]


def test_pure_core_modules_import_no_adapters():
    modules = pure_modules()
    assert {"kvguard.streams.core", "kvguard.producers.sim.vllm.engine", "kvguard.policy.engine",
            "kvguard.producers.vllm.step_memory", "kvguard.contracts.events"} <= set(modules)
    found = _imported_adapters(modules)
    assert found == [], f"pure modules pulled in: {found}"


def test_every_shell_exists_and_is_a_shell():
    # a listed shell that no longer needs an adapter belongs to the pure core: take it off the list
    for module in sorted(SHELLS):
        assert _imported_adapters([module]), f"{module} imports no adapter: remove it from SHELLS"
