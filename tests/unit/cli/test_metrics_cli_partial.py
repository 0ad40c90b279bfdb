"""`kvguard metrics` emits each node's last, partial tick: an OOM in the log's last seconds is not lost."""

import json

import numpy as np
from typer.testing import CliRunner

from kvguard.cli import app
from kvguard.contracts.events import EventBatch, EventKind, empty_events
from kvguard.contracts.units import NS_PER_S
from kvguard.wire.eventlog import write_event_log
from tests.unit.streams.streams_refpool import small_geometry


def test_an_oom_in_the_last_interval_reaches_a_partial_tick(tmp_path):
    rows = empty_events(3)
    rows[0] = (5 * NS_PER_S, EventKind.STEP, 0, 0, -1, -1, 0, 0, 0)
    rows[1] = (12 * NS_PER_S, EventKind.STEP, 0, 0, -1, -1, 0, 0, 0)
    rows[2] = (18 * NS_PER_S, EventKind.OOM, 0, 0, 7, -1, 64, 0, 3)  # the log ends 2 s before the next boundary
    log = tmp_path / "oom.jsonl.gz"
    write_event_log(log, [EventBatch("n", 0, rows, geometry=small_geometry())], {})
    result = CliRunner().invoke(app, ["metrics", "--events", str(log), "--json"])
    assert result.exit_code == 0, result.output
    ticks = [json.loads(line) for line in result.stdout.splitlines()]
    assert [t["ts_s"] for t in ticks] == [10.0, 20.0]
    assert ticks[-1]["partial"] and ticks[-1]["ooms"] == 1 and not ticks[0]["partial"]
    assert int(np.sum([t["ooms"] for t in ticks])) == 1
