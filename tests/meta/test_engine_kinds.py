"""An engine kind is named in one place, the registry (producers/sim/registry.py): no other module of
the product, the benchmarks or the scripts compares a kind's name; they read the engine's declared
capabilities (kvguard.contracts.engine) or ask the registry."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("kvguard", "producers", "streams", "policy", "actuators", "bench", "scripts")
REGISTRY = Path("producers/sim/registry.py")
# a comparison with a kind's name, either way round (`kind == "vllm"`, `"seed" != profile.engine`)
COMPARISON = re.compile(r"""[=!]=\s*["'](vllm|seed)["']|["'](vllm|seed)["']\s*[=!]=""")


def kind_comparisons(source: str) -> list[int]:
    return [n for n, line in enumerate(source.splitlines(), 1) if COMPARISON.search(line)]


def test_no_module_outside_the_registry_compares_an_engine_kind():
    found = [f"{path.relative_to(ROOT)}:{line}" for folder in FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))
             if path.relative_to(ROOT) != REGISTRY for line in kind_comparisons(path.read_text())]
    assert found == []


def test_the_check_catches_a_kind_comparison():
    assert kind_comparisons('vllm = profile.engine == "vllm"\nok = 1\n') == [1]
    assert kind_comparisons("if 'seed' != kind:\n") == [1]
    assert kind_comparisons('caps = capabilities_of(profile)\nname = "vllm"\n') == []
