"""Event logs with impossible contents fail with the line named; a log fed twice is analysed once (issue 15)."""

from __future__ import annotations

import gzip
import json

import pytest
from typer.testing import CliRunner

from kvguard.cli import app
from kvguard.ops import rca
from kvguard.runtime.bootstrap import bootstrap
from kvguard.wire.eventlog import EventLogError, read_event_log, write_event_log
from tests.unit.ops.test_rca import _record


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    path = tmp_path_factory.mktemp("log") / "once.jsonl.gz"
    _record(path, rate_scale=3.0, duration_s=240.0)
    return path


def analysed(path) -> dict:
    core = bootstrap(predictor=None).stream_core(with_predictor=False)
    _, batches = read_event_log(path)
    rep = rca.replay(batches, core)
    reports = rca.analyse(rep)
    return {"summary": rca.summary(rep, reports), "nodes": rca.node_summaries(rep, reports),
            "ooms": [r.to_dict() for r in reports]}


def test_a_log_fed_twice_gives_the_rca_of_the_log_once(recorded, tmp_path):
    meta, batches = read_event_log(recorded)
    batches = list(batches)
    twice = tmp_path / "twice.jsonl.gz"
    write_event_log(twice, batches + batches, meta)
    once = analysed(recorded)
    assert once["summary"]["ooms"] > 0
    assert analysed(twice) == once
    runner = CliRunner()
    outs = [json.loads(runner.invoke(app, ["rca", "--events", str(p), "--no-lstm", "--json"]).stdout)
            for p in (recorded, twice)]
    for out in outs:
        out.pop("events")
    assert outs[0] == outs[1]


def test_a_log_with_each_batch_written_twice_gives_the_rca_of_the_log_once(recorded, tmp_path):
    _, batches = read_event_log(recorded)
    doubled = [b for batch in batches for b in (batch, batch)]
    path = tmp_path / "doubled.jsonl.gz"
    write_event_log(path, doubled)
    assert analysed(path) == analysed(recorded)


def _log_with(tmp_path, recorded, mutate, line: int = 3):
    with gzip.open(recorded, "rt") as fh:
        lines = fh.read().splitlines()
    d = json.loads(lines[line - 1])
    mutate(d)
    lines[line - 1] = json.dumps(d)
    path = tmp_path / "bad.jsonl.gz"
    with gzip.open(path, "wt") as fh:
        fh.write("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("kind", [99, 200])
def test_an_unknown_event_kind_is_an_error_naming_the_line(recorded, tmp_path, kind):
    path = _log_with(tmp_path, recorded, lambda d: d["cols"]["kind"].__setitem__(0, kind))
    _, batches = read_event_log(path)
    with pytest.raises(EventLogError) as err:
        list(batches)
    assert err.value.line_no == 3 and f"unknown event kind {kind}" in str(err.value)
    for command in (["rca", "--events", str(path), "--no-lstm"], ["metrics", "--events", str(path)]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 2, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
        assert f"{path}:3:" in result.output and "Traceback" not in result.output


def test_a_page_run_outside_the_node_region_is_an_error_naming_the_line(recorded, tmp_path):
    def outside(d):
        kinds = d["cols"]["kind"]
        row = next(i for i, k in enumerate(kinds) if k in (5, 7))  # an ALLOC or FREE row
        d["cols"]["offset"][row] = 10**9

    path = _log_with(tmp_path, recorded, outside, line=4)
    _, batches = read_event_log(path)
    with pytest.raises(EventLogError, match=r":4: .*offset 1000000000 .*D = \d+ units"):
        list(batches)
