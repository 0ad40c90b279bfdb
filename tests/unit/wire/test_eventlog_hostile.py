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
    # a replay names the bad batch and goes on with the rest (issue 25), as the stream worker dead-letters it
    for command in (["rca", "--events", str(path), "--no-lstm"], ["metrics", "--events", str(path)]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 0, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
        assert f"{path}:3:" in result.output and f"unknown event kind {kind}" in result.output
        assert "skipped" in result.output and "Traceback" not in result.output


def test_a_page_run_outside_the_node_region_is_an_error_naming_the_line(recorded, tmp_path):
    def outside(d):
        kinds = d["cols"]["kind"]
        row = next(i for i, k in enumerate(kinds) if k in (5, 7))  # an ALLOC or FREE row
        d["cols"]["offset"][row] = 10**9

    path = _log_with(tmp_path, recorded, outside, line=4)
    _, batches = read_event_log(path)
    with pytest.raises(EventLogError, match=r":4: .*offset 1000000000 .*D = \d+ units"):
        list(batches)


def _log_with_line(path, line: str, batches=()) -> None:
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        fh.write(json.dumps({"type": "header", "schema": "1.0", "meta": {}}) + "\n")
        fh.write(line + "\n")


def test_a_line_past_the_bound_is_refused(tmp_path, monkeypatch):
    # issue 28: a 400 MB line of whitespace was read whole (863 MB RSS); the reader takes at most
    # MAX_LINE_CHARS of a line (readline's limit), here made small so the test writes little
    from kvguard.wire import eventlog

    monkeypatch.setattr(eventlog, "MAX_LINE_CHARS", 1000)
    path = tmp_path / "wide.jsonl.gz"
    _log_with_line(path, " " * 50_000)
    _, batches = read_event_log(path)
    with pytest.raises(EventLogError, match=r":2: expected a line of at most 1000 characters"):
        list(batches)
    _log_with_line(path, " " * 999)  # a blank line within the bound is skipped, as before
    _, batches = read_event_log(path)
    assert list(batches) == []


def test_a_header_past_its_bound_is_refused(tmp_path, monkeypatch):
    from kvguard.wire import eventlog

    monkeypatch.setattr(eventlog, "MAX_HEADER_CHARS", 100)
    path = tmp_path / "header.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        fh.write(json.dumps({"type": "header", "schema": "1.0", "meta": {"x": "y" * 500}}) + "\n")
    with pytest.raises(EventLogError, match=r":1: expected a header line of at most 100 characters"):
        read_event_log(path)


def test_the_writer_refuses_a_line_the_reader_would_refuse(tmp_path, monkeypatch):
    from kvguard.wire import eventlog
    from tests.unit.streams.test_stream_hostile import two_node_stream

    monkeypatch.setattr(eventlog, "MAX_LINE_CHARS", 200)
    with pytest.raises(ValueError, match="over the event log's 200"):
        write_event_log(tmp_path / "w.jsonl.gz", two_node_stream()[:1])


def test_a_batch_line_naming_a_hostile_node_is_refused_with_its_line(tmp_path):
    from kvguard.wire.eventlog import batch_to_dict
    from tests.unit.streams.test_stream_hostile import two_node_stream

    line = batch_to_dict(two_node_stream()[0]) | {"node": "sim-0/gpu0\u202e" + "x" * 10_000}
    path = tmp_path / "node.jsonl.gz"
    _log_with_line(path, json.dumps(line))
    _, batches = read_event_log(path)
    with pytest.raises(EventLogError, match=r":2: expected a batch of a node id \(its node id is 10011 characters"):
        list(batches)


def test_kvguard_metrics_refuses_a_log_with_a_line_past_the_bound_in_one_line(tmp_path, monkeypatch):
    from kvguard.wire import eventlog

    monkeypatch.setattr(eventlog, "MAX_LINE_CHARS", 1000)
    path = tmp_path / "wide.jsonl.gz"
    _log_with_line(path, "\t" * 20_000)
    result = CliRunner().invoke(app, ["metrics", "--events", str(path)])
    assert result.exit_code == 2 and "expected a line of at most 1000 characters" in result.output
    assert "Traceback" not in result.output
