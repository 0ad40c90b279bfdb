"""The layers point one way (docs/ARCHITECTURE.md): base ← wings ← runtime ← cli.

Every module's imports are read from its syntax tree (function-local imports included, so an
import hidden in a function cannot cross a layer unseen) and checked against the rules below.
The rules are data; ``violations`` is a pure function over {module name: source}, so the tests at
the bottom feed it deliberately broken modules and check that each kind of violation is caught.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# where each import-name prefix lives on disk (the installed distribution maps the same way)
SOURCE_DIRS = {
    "kvguard": ROOT / "kvguard",
    "kvguard.producers": ROOT / "producers",
    "kvguard.streams": ROOT / "streams",
    "kvguard.policy": ROOT / "policy",
    "kvguard.actuators": ROOT / "actuators",
}

BASE = ("kvguard.contracts", "kvguard.config", "kvguard.wire", "kvguard.bus")
CORE_WINGS = ("kvguard.producers", "kvguard.streams", "kvguard.policy", "kvguard.actuators")
TOOL_WINGS = ("kvguard.ml", "kvguard.ops")
RUNTIME = "kvguard.runtime"
TESTING = "kvguard.testing"  # broker and Redis rigs for tests and benchmarks: base only, imported by no wing
CLI = "kvguard.cli"
ENTRY_POINTS = ("kvguard", "kvguard.__main__")  # the package root may name the CLI for `python -m kvguard`
OLD_TOP_LEVEL = ("producers", "streams", "policy", "actuators", "tests.rigs")

# What a tool wing (offline ML, operator tools) may use of another wing: its public modules.
# Everything else in a wing is internal to it.
PUBLIC = {
    "kvguard.producers": {"sim.fleet", "sim.profiles", "sim.workloads", "sim.run", "sim.registry", "sim.vllm.engine",
                          "sim.vllm.external", "vllm.step_memory", "publisher"},
    "kvguard.streams": {"alerts", "core", "embedded", "loader", "lstm", "metrics", "mirror", "outputs", "predictor",
                        "tick_model", "trend_model"},
    "kvguard.policy": {"engine", "service", "strategy", "budget", "slo", "drain_guard"},
    "kvguard.actuators": {"actuator", "executor"},
    "kvguard.ml": {"dataset", "evaluation", "training", "baselines", "tick_training", "fleet_risk", "trend",
                   "trend_eval", "trend_act"},
    "kvguard.ops": {"exporter", "rca", "demo_report", "export_service", "static_sweep", "timeline_report"},
}

# Rooms inside the node side. What runs inside a production engine (the plugin, the CUDA observer,
# the sinks, the publisher, snapshot ingest) never imports the shadow fleet; the seed's engine is
# quarantined: only the registry builds it.
PRODUCTION_ROOMS = ("kvguard.producers.vllm", "kvguard.producers.sglang", "kvguard.producers.trtllm",
                    "kvguard.producers.exposition", "kvguard.producers.torch_cuda", "kvguard.producers.sinks",
                    "kvguard.producers.publisher", "kvguard.producers.torch_snapshot")
SIM = "kvguard.producers.sim"
QUARANTINED = "kvguard.producers.sim.seed"
QUARANTINE_DOOR = "kvguard.producers.sim.registry"


def layer_of(module: str) -> str:
    for prefix in BASE:
        if _under(module, prefix):
            return "base"
    for prefix in CORE_WINGS + TOOL_WINGS:
        if _under(module, prefix):
            return prefix
    if _under(module, RUNTIME):
        return "runtime"
    if _under(module, TESTING):
        return "testing"
    if _under(module, CLI):
        return "cli"
    if module.startswith("bench."):
        return "bench"
    if module == "tests" or module.startswith("tests."):
        return "tests"
    return "root" if module in ENTRY_POINTS else "other"


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def imported_modules(source: str, module: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``source``, at any depth."""
    out = []
    package = module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            # `from kvguard.streams import mirror` imports the module kvguard.streams.mirror; a
            # lower-case name from a package is read as a module (kvguard's classes are CamelCase)
            submodules = [f"{name}.{alias.name}" for alias in node.names
                          if name.startswith("kvguard") and alias.name.islower() and _is_package(name)]
            out += [(node.lineno, m) for m in submodules] or [(node.lineno, name)]
    return out


def _is_package(name: str) -> bool:
    """Whether ``name`` is a package of this tree (a folder with ``__init__.py``)."""
    for prefix, directory in sorted(SOURCE_DIRS.items(), key=lambda kv: -len(kv[0])):
        if _under(name, prefix):
            rest = name[len(prefix):].lstrip(".")
            return (directory.joinpath(*rest.split(".")) / "__init__.py").exists() if rest else True
    return False


def _wing_of(module: str) -> str | None:
    return next((w for w in CORE_WINGS + TOOL_WINGS if _under(module, w)), None)


def _public(target: str, wing: str) -> bool:
    rest = target[len(wing) + 1:] if target != wing else ""
    return rest == "" or any(rest == p or rest.startswith(p + ".") for p in PUBLIC.get(wing, set()))


def check_import(importer: str, target: str) -> str | None:
    """The rule ``importer`` breaks by importing ``target``, or None."""
    src, dst = layer_of(importer), layer_of(target)
    if src == "bench" and dst == "tests":
        return f"imports {target}: benchmarks import the runtime, never tests/"
    if any(_under(target, old) for old in OLD_TOP_LEVEL):
        return f"imports {target}: the installed name is kvguard.{target}"
    if not target.startswith("kvguard"):
        return None  # the standard library and third-party packages
    if dst == "cli" and src not in ("cli", "root"):
        return f"imports the CLI ({target}): only the entry point does"
    if src == "base" and dst != "base":
        return f"a base module imports {target} ({dst})"
    if src == "testing" and dst not in ("base", "testing"):
        return f"a test rig imports {target} ({dst}): rigs use the base only"
    if dst == "testing" and src not in ("testing", "bench", "tests"):
        return f"imports the test rigs ({target}): only tests and benchmarks do"
    if any(_under(importer, room) for room in PRODUCTION_ROOMS) and _under(target, SIM):
        return f"production code imports the shadow fleet ({target})"
    if _under(target, QUARANTINED) and not (_under(importer, QUARANTINED) or importer == QUARANTINE_DOOR
                                             or src in ("tests", "bench")):
        return f"imports the quarantined seed engine ({target}): build engines through {QUARANTINE_DOOR}"
    if src in CORE_WINGS:
        if dst == "runtime":
            return f"a wing imports the runtime ({target})"
        if dst in CORE_WINGS + TOOL_WINGS and dst != src:
            return f"wing {src} imports another wing ({target}); share it through the base"
    if src in TOOL_WINGS:
        if dst == "runtime":
            return f"a wing imports the runtime ({target})"
        wing = _wing_of(target)
        if wing is not None and wing != src and not _public(target, wing):
            return f"wing {src} imports {target}, an internal module of {wing}"
    return None


def violations(sources: dict[str, str]) -> list[str]:
    found = []
    for module, source in sorted(sources.items()):
        for line, target in imported_modules(source, module):
            problem = check_import(module, target)
            if problem:
                found.append(f"{module}:{line}: {problem}")
    return found


def module_sources() -> dict[str, str]:
    out = {}
    for prefix, directory in SOURCE_DIRS.items():
        for path in directory.rglob("*.py"):
            rel = path.relative_to(directory).with_suffix("").parts
            if prefix == "kvguard" and rel and rel[0] in ("producers", "streams", "policy", "actuators"):
                continue
            parts = [prefix, *rel]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path.read_text()
    for path in (ROOT / "bench").glob("*.py"):
        out[f"bench.{path.stem}"] = path.read_text()
    return out


def test_the_tree_keeps_its_layers():
    sources = module_sources()
    assert "kvguard.streams.core" in sources and "kvguard.contracts.events" in sources and "bench.bench_sim" in sources
    assert violations(sources) == []


@pytest.mark.parametrize("module, source, expected", [
    ("kvguard.contracts.events", "from kvguard.streams.core import StreamCore", "a base module imports"),
    ("kvguard.wire.schemas", "def f():\n    import kvguard.policy.engine", "a base module imports"),
    ("kvguard.ops.rca", "from kvguard.streams import mirror\nfrom kvguard.producers.sim.seed.pool import PagedPool",
     "quarantined seed engine"),
    ("kvguard.ml.dataset", "from kvguard.runtime.embedded import run_embedded", "imports the runtime"),
    ("kvguard.streams.core", "from kvguard.producers.sim.fleet import Fleet", "imports another wing"),
    ("kvguard.actuators.actuator", "from kvguard.policy.service import deliver_all", "imports another wing"),
    ("kvguard.runtime.embedded", "from kvguard.cli.node import run_node", "imports the CLI"),
    ("kvguard.ops.rca", "from ..cli import app", "imports the CLI"),
    ("bench.bench_decision_latency", "from tests.rigs import TansuBroker", "never tests/"),
    ("bench.bench_decision_latency", "from kvguard.cli.demo import run_embedded", "imports the CLI"),
    ("kvguard.policy.engine", "import streams.metrics", "the installed name is kvguard.streams.metrics"),
    ("kvguard.producers.vllm.plugin", "from kvguard.producers.sim.vllm.engine import VllmEngine",
     "production code imports the shadow fleet"),
    ("kvguard.producers.torch_cuda", "def f():\n    from kvguard.producers.sim.torch_allocator import caching_allocator",
     "production code imports the shadow fleet"),
    ("kvguard.producers.sim.fleet", "from kvguard.producers.sim.seed.engine import Engine", "quarantined seed engine"),
    ("kvguard.runtime.bootstrap", "from kvguard.producers.sim.seed.pool import PagedPool", "quarantined seed engine"),
    ("kvguard.ops.rca", "from kvguard.producers.sim.vllm.kv import BlockPoolView", "an internal module of kvguard.producers"),
    ("kvguard.runtime.embedded", "from kvguard.testing.rigs import TansuBroker", "only tests and benchmarks"),
    ("kvguard.testing.rigs.tansu", "from kvguard.runtime.bootstrap import bootstrap", "rigs use the base only"),
])
def test_each_kind_of_violation_is_caught(module, source, expected):
    found = violations({module: source})
    assert found and expected in found[0], found


def test_allowed_imports_pass():
    ok = {
        "kvguard.streams.core": "from kvguard.contracts import pressure\nfrom kvguard.streams.mirror import AllocatorMirror",
        "kvguard.ml.dataset": "from kvguard.producers.sim.fleet import Fleet\nimport numpy as np",
        "kvguard.runtime.embedded": "from kvguard.producers.sim.registry import make_engine\nfrom kvguard.ops.rca import analyse",
        "kvguard.producers.sim.registry": "from kvguard.producers.sim.seed.engine import Engine",
        "kvguard.producers.sim.vllm.engine": "from kvguard.producers.vllm.step_memory import Batch",
        "kvguard.ops.plan": "from kvguard.producers.vllm.step_memory import kv_cache_bytes",
        "kvguard.cli.demo": "from kvguard.cli.app import app\nfrom kvguard.runtime.embedded import run_embedded",
        "bench.bench_sim": "from kvguard.testing.rigs import TansuBroker",
        "kvguard": "from kvguard.cli import main",
    }
    assert violations(ok) == []
