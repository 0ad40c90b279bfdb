"""Which optional extra of the distribution installs each heavy dependency (pyproject.toml's
``[project.optional-dependencies]``). The stream worker, the policy, the exporter and the node
install none of them; a command that needs one says which extra to install, in one line."""

from __future__ import annotations

import importlib.util

# import name -> (distribution name, extra)
HEAVY = {"torch": ("torch", "ml"), "sklearn": ("scikit-learn", "ml"), "matplotlib": ("matplotlib", "reports"),
         "vllm": ("vllm", "vllm")}


def missing_extra(err: ImportError) -> str | None:
    """What to install when ``err`` is a heavy dependency that is not installed, else None."""
    name = (err.name or "").split(".")[0]
    if name not in HEAVY:
        return None
    distribution, extra = HEAVY[name]
    return f"needs {distribution}, which is not installed: pip install 'kvguard[{extra}]'"


def require(name: str) -> None:
    """``ModuleNotFoundError`` (``missing_extra`` reads it) when the heavy dependency ``name`` cannot
    be imported: a command checks before its long run, not at the end of it."""
    if importlib.util.find_spec(name) is None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
