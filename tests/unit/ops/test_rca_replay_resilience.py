"""Replays that keep going (issues 25 and 27): a log with several epochs (a producer restarted after an
OOM, its clock starting over), a log that ends right after an OOM (the core's ``finish()`` gives that
interval its tick), and a log with one invalid batch (named and left out, as the stream worker
dead-letters it; the other nodes' ticks equal the clean replay's) — through ``kvguard rca``,
``kvguard metrics --events`` and ``kvguard replay`` on vLLM-faithful logs."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from kvguard.cli import app
from kvguard.contracts.events import EventBatch, EventKind
from kvguard.wire.eventlog import write_event_log
from tests.unit.streams.vllm_oom_log import ooms, vllm_oom_log, vllm_run

runner = CliRunner()


@pytest.fixture(scope="module")
def run0() -> list[EventBatch]:
    return vllm_run(0)


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    path = tmp_path_factory.mktemp("restart") / "run.jsonl.gz"
    batches = vllm_oom_log()
    assert len({b.epoch for b in batches}) == 2
    write_event_log(path, batches, {"workload": "azure-conv"})
    return path, batches


def _oom_rows(batches):
    return sorted((b.node, b.epoch, int(t)) for b in batches for t in b.events["ts_ns"][b.events["kind"] == EventKind.OOM])


def test_rca_explains_every_oom_of_a_log_with_several_epochs(restarted):
    path, batches = restarted
    result = runner.invoke(app, ["rca", "--events", str(path), "--no-lstm", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    got = sorted((o["node"], o["epoch"], o["ts_ns"]) for o in out["ooms"])
    assert got == _oom_rows(batches)
    assert {o["epoch"] for o in out["ooms"]} == {0, 1}
    # each OOM's last ticks are its own run's, before it
    for o in out["ooms"]:
        assert all(t["epoch"] == o["epoch"] and t["ts_ns"] < o["ts_ns"] for t in o["last_ticks"])


def _ends_at_first_oom(run0):
    """Each node's batches up to (and with) the one holding its first OOM: the log ends inside that interval."""
    out, done = [], set()
    for b in run0:
        if b.node in done:
            continue
        out.append(b)
        if (b.events["kind"] == EventKind.OOM).any():
            done.add(b.node)
    assert len(done) == 2
    return out


def test_replay_and_rca_end_with_finish_so_the_last_oom_has_its_tick(run0, tmp_path):
    batches = _ends_at_first_oom(run0)
    path = tmp_path / "cut.jsonl.gz"
    write_event_log(path, batches)
    result = runner.invoke(app, ["replay", str(path), "--json", "--no-lstm"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["dry_run"]["ooms"] == ooms(batches) == 2
    result = runner.invoke(app, ["rca", "--events", str(path), "--no-lstm", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    metrics = runner.invoke(app, ["metrics", "--events", str(path), "--json"])
    lines = [json.loads(x) for x in metrics.stdout.splitlines()]
    ticks = [x for x in lines if x["type"] == "tick"]
    assert sum(t["ooms"] for t in ticks) == 2 and ticks[-1]["partial"]
    by_node = {n["node"]: n["ticks"] for n in out["nodes"]}
    assert by_node == {n: sum(t["node"] == n for t in ticks) for n in by_node}


def _poisoned(run0):
    """The same log with one batch of the second node made impossible (an event kind no reader knows)."""
    victim_node = run0[-1].node
    mine = [i for i, b in enumerate(run0) if b.node == victim_node]
    k = mine[len(mine) // 2]
    bad = run0[k].events.copy()
    bad["kind"][len(bad) // 2] = 99
    b = run0[k]
    poisoned = list(run0)
    poisoned[k] = EventBatch(node=b.node, seq=b.seq, epoch=b.epoch, events=bad, geometry=b.geometry, state=b.state)
    return poisoned, b


@pytest.fixture(scope="module")
def logs(run0, tmp_path_factory):
    d = tmp_path_factory.mktemp("poison")
    poisoned, victim = _poisoned(run0)
    write_event_log(d / "clean.jsonl.gz", run0)
    write_event_log(d / "poisoned.jsonl.gz", poisoned)
    return d / "clean.jsonl.gz", d / "poisoned.jsonl.gz", victim


def _metrics(path):
    result = runner.invoke(app, ["metrics", "--events", str(path), "--json"])
    assert result.exit_code == 0, result.output
    return [json.loads(x) for x in result.stdout.splitlines()]


def test_metrics_names_the_poisoned_batch_and_keeps_the_other_nodes_ticks(logs):
    clean, poisoned, victim = logs
    a, b = _metrics(clean), _metrics(poisoned)
    skipped = [x for x in b if x["type"] == "skipped_batch"]
    assert [(s["node"], s["epoch"], s["seq"]) for s in skipped] == [(victim.node, victim.epoch, victim.seq)]
    assert "unknown event kind 99" in skipped[0]["reason"]
    other = lambda lines: [x for x in lines if x["type"] == "tick" and x["node"] != victim.node]  # noqa: E731
    assert other(a) and other(a) == other(b)
    assert not [x for x in a if x["type"] == "skipped_batch"]


def test_rca_and_replay_name_the_poisoned_batch_and_go_on(logs):
    clean, poisoned, victim = logs
    outs = {}
    for name, path in (("clean", clean), ("poisoned", poisoned)):
        result = runner.invoke(app, ["rca", "--events", str(path), "--no-lstm", "--json"])
        assert result.exit_code == 0, result.output
        outs[name] = json.loads(result.stdout)
    skipped = outs["poisoned"]["skipped_batches"]
    assert [(s["node"], s["seq"]) for s in skipped] == [(victim.node, victim.seq)] and skipped[0]["line"] > 1
    assert outs["clean"]["skipped_batches"] == []
    mine = lambda o: [r for r in o["ooms"] if r["node"] != victim.node]  # noqa: E731
    assert mine(outs["clean"]) and mine(outs["clean"]) == mine(outs["poisoned"])
    result = runner.invoke(app, ["replay", str(poisoned), "--json", "--no-lstm"])
    assert result.exit_code == 0, result.output
    dry = json.loads(result.stdout)["dry_run"]
    assert [(s["node"], s["seq"]) for s in dry["skipped_batches"]] == [(victim.node, victim.seq)]
    assert dry["nodes"] == 2 and dry["ticks"] > 0
    assert np.isfinite(dry["events"])
