"""kvguard's SGLang plugin (producers.sglang.plugin) loaded by SGLang 0.5.23's own plugin loader and run
inside SGLang's own scheduler parts on CPU (tests/integration/sglang_plugin_drive.py, a subprocess).

Checked: SGLang's ``load_plugins()`` finds kvguard's ``sglang.srt.plugins`` entry point and its
``HookRegistry`` wraps the four methods kvguard hooks (``Scheduler.__init__``,
``get_next_batch_to_run``, ``get_prefill_adder_class``, ``ScheduleBatch.retract_decode``); at every
SNAPSHOT the plugin writes, kvguard's mirror holds exactly the pages SGLang counts as used
(``pool - available - evictable``), cached (its evictable tokens) and free; SGLang's own retractions
and kvguard's become PREEMPT rows; an eviction through the engine-port adapter retracts the request
with SGLang's ``release_req`` and re-queues it; a hold keeps long prompts out of prefill and a
release lets them in. What cannot run on CPU: ``Scheduler.__init__`` itself (it builds a model
worker), so the plugin is attached to a facade over the real parts, and the hooked
``get_next_batch_to_run`` is stood for by calling the plugin's ``before_step``/``after_step`` around
each step; ``abort`` (``Scheduler.abort_request``) and ``empty_cache`` (CUDA) are checked against
SGLang's source only. Needs sglang (``make venv``); not skipped without it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run() -> dict:
    proc = subprocess.run([sys.executable, "-m", "tests.integration.sglang_plugin_drive"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_sglangs_plugin_loader_applies_kvguards_hooks(run):
    assert run["hooked"] == {"__init__": True, "get_next_batch_to_run": True, "get_prefill_adder_class": True,
                             "retract_decode": True}


def test_the_mirror_holds_sglangs_own_page_counts_at_every_snapshot(run):
    snapshots = run["snapshots"]
    assert len(snapshots) > 100 and run["synced"]
    for s in snapshots:
        assert (s["mirror_live"], s["mirror_cached"], s["mirror_free"]) == (
            s["sglang_used"], s["sglang_evictable"], s["sglang_available"]), s
    assert max(s["sglang_evictable"] for s in snapshots) > 0 and max(s["sglang_used"] for s in snapshots) > 3000


def test_retractions_and_lifecycle_become_rows(run):
    kinds = run["kinds"]
    assert kinds["PREEMPT"] == run["retracted_by_sglang"] + 1  # SGLang's own, and kvguard's eviction
    assert run["retracted_by_sglang"] >= 1 and kinds["ARRIVE"] == 60 and kinds["STEP"] == run["steps"]
    assert kinds["ADMIT"] > kinds["FINISH"] > 0


def test_the_adapter_retracts_holds_and_releases_on_sglangs_own_structures(run):
    a = run["actions"]
    assert a["evict"]["units_freed"] > 0 and a["evict"]["requeued"]
    assert run["held_seen"] > 0 and a["long_admitted_while_held"] == 0 and a["release"] is True
