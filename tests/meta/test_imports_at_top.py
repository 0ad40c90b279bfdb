"""Imports sit at the top of a module, so its dependencies can be read at a glance; an import
inside a function must say why (start-up cost of torch/faust/matplotlib/vllm, an optional
dependency, an import cycle) in a comment above the function's first local import. CLI command
modules are exempt as a whole: kvguard/cli/app.py states their reason once (`kvguard --help` must
not load the system)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("kvguard", "producers", "streams", "policy", "actuators")


def unexplained(source: str) -> list[int]:
    """Lines of function-local imports in functions whose first local import has no comment."""
    lines = source.split("\n")
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        imports = sorted((n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))),
                         key=lambda n: n.lineno)
        own = [n for n in imports if _innermost(node, n) is node]
        if not own:
            continue
        first = own[0].lineno
        explained = "#" in lines[first - 1] or lines[first - 2].strip().startswith("#")
        if not explained:
            out += [n.lineno for n in own]
    return out


def _innermost(func, target):
    """The innermost function of ``func`` (itself included) that contains ``target``."""
    for child in ast.walk(func):
        if child is not func and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                n is target for n in ast.walk(child)):
            return _innermost(child, target)
    return func


def modules():
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel.parts[:2] != ("kvguard", "cli"):
                yield rel


@pytest.mark.parametrize("rel", list(modules()), ids=str)
def test_function_local_imports_say_why(rel):
    assert unexplained((ROOT / rel).read_text()) == []


def test_the_check_catches_an_unexplained_local_import():
    bad = "def f():\n    import json\n    return json\n"
    good = "def f():\n    # json is slow to import here, for the sake of the example\n    import json\n    return json\n"
    assert unexplained(bad) == [2] and unexplained(good) == []
