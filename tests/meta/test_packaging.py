"""The installed distribution exposes one import name, ``kvguard`` (docs/ARCHITECTURE.md, "Layers")."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

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
