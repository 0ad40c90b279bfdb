"""The README is the door: short, with the test command CI runs, and every path it names exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_the_readme_stays_a_door():
    assert len(README.splitlines()) < 200, "figures go to docs/RESULTS.md, details to docs/"


def test_ci_runs_the_readmes_test_command():
    assert "make test" in README
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_every_file_the_readme_names_exists():
    named = set(re.findall(r"`((?:docs|deploy|tests|scripts|producers|streams|policy|actuators|kvguard)/[\w./-]+)`",
                           README))
    assert "docs/RESULTS.md" in named or "docs/RESULTS.md" in README
    missing = [p for p in sorted(named) if not (ROOT / p).exists()]
    assert missing == []
