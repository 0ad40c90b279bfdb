"""The installed distribution exposes one import name, ``kvguard`` (docs/ARCHITECTURE.md, "Layers"), and
leaves torch, scikit-learn and matplotlib to its extras: the services run without them, and a command
that needs one names the extra."""

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_installs_only_the_kvguard_namespace_with_its_data(tmp_path):
    # built from a copy of the sources: a build/ folder left in the checkout would leak stale files into the wheel
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for folder in ("kvguard", "producers", "streams", "policy", "actuators"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(source),
                    "-w", str(tmp_path)], check=True, capture_output=True, cwd=tmp_path)
    wheel = next(tmp_path.glob("kvguard-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"kvguard", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1]
                                                 + ".dist-info"}
    for module in ("kvguard/policy/engine.py", "kvguard/producers/sim/seed/pool.py", "kvguard/streams/core.py",
                   "kvguard/actuators/actuator.py", "kvguard/producers/sim/profiles.json",
                   "kvguard/producers/vllm/plugin.py", "kvguard/producers/sim/vllm/engine.py",
                   "kvguard/streams/models/oom_lstm.pt", "kvguard/streams/models/oom_trees.npz",
                   "kvguard/streams/models/oom_trees.json", "kvguard/producers/sim/data/azure_llm_2023_conv.csv.gz",
                   "kvguard/producers/sim/data/vllm_model/config.json"):
        assert module in names, module
    # every package of the tree is in the wheel (pyproject.toml lists packages by hand)
    for folder in ("kvguard", "producers", "streams", "policy", "actuators"):
        for init in (ROOT / folder).rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            rel = init.relative_to(ROOT).as_posix()
            installed = rel if folder == "kvguard" else f"kvguard/{rel}"
            assert installed in names, f"{rel}: add its package to [tool.setuptools] packages in pyproject.toml"


# ---- the heavy dependencies are extras ----------------------------------------------------------------

HEAVY = ("torch", "sklearn", "matplotlib")
# makes the heavy packages look not installed (they are, in this venv): importing one fails as it would
BLOCKER = f"""
import sys
class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {HEAVY!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, NotInstalled())
"""


def run_without_heavy(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER + code, *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


def test_the_worker_the_policy_and_the_node_run_without_torch_sklearn_or_matplotlib():
    code = """
import asyncio
from kvguard.config.settings import Settings
from kvguard.runtime.bootstrap import bootstrap
from kvguard.runtime.embedded import demo_workload, run_embedded
import kvguard.cli, kvguard.ops.export_service, kvguard.policy.service, kvguard.runtime.node
from kvguard.streams.app import build_app

settings = Settings.load("deploy/kvguard.toml", env={})
graph = bootstrap(settings)  # the worker's graph: the shipped predictor
assert graph.predictor is not None, graph.predictor_note
build_app(settings, config=graph.core_config(), predictor=graph.predictor)
workload = demo_workload(graph.profile, workload="mixed", rate_scale=1.0, duration_s=60.0, seed=0)
result = asyncio.run(run_embedded(graph, workload, n_gpus=1, duration_s=60.0, seed=0, guarded=True))
assert result.summary["kvguard"]["policy"]["ticks"] > 0
print(sorted(m for m in sys.modules if m.split(".")[0] in %r))
""" % (HEAVY,)
    result = run_without_heavy(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_the_blocker_does_block():
    result = run_without_heavy("import sklearn")
    assert result.returncode == 1 and "No module named 'sklearn'" in result.stderr


@pytest.mark.parametrize("args, extra", [
    (("train", "--preset", "tiny"), "pip install 'kvguard[ml]'"),
    (("train", "--preset", "tiny", "--model", "boosting"), "pip install 'kvguard[ml]'"),
    (("eval", "--workload", "mixed"), "pip install 'kvguard[ml]'"),
    (("demo", "--quick"), "pip install 'kvguard[reports]'"),
])
def test_a_command_that_needs_an_extra_says_which_in_one_line(args, extra):
    result = run_without_heavy("from kvguard.cli import main; sys.argv[0] = 'kvguard'; main()", *args)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and extra in result.stderr
    assert result.stderr.startswith(f"error: kvguard {args[0]} needs ")


def test_the_base_install_and_the_images_leave_the_heavy_dependencies_to_extras():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {"torch", "scikit-learn", "matplotlib"}

    def distributions(requirements):
        return {re.split(r"[<>=!\[; ]", r, maxsplit=1)[0] for r in requirements}

    extras = project["optional-dependencies"]
    assert not distributions(project["dependencies"]) & names
    assert distributions(extras["ml"]) == {"torch", "scikit-learn"} and distributions(extras["reports"]) == {
        "matplotlib"}
    assert "kvguard[ml,reports]" in extras["dev"]  # the tests need both
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    installs = [line for line in dockerfile.splitlines() if line.startswith("RUN") and "pip install" in line]
    assert installs and not any("torch" in line or "[" in line for line in installs), installs
    makefile = (ROOT / "Makefile").read_text()
    assert makefile.index("$(MAKE) --no-print-directory torch") < makefile.index('pip install --quiet -e ".[dev')
