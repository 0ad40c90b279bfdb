"""`kvguard rca` on a log `kvguard record` captured from a real broker (Tansu): a vLLM-faithful run with
allocator OOMs published to the events topic, recorded, and explained exactly as the log written directly
(issue 27 "Real inputs": the same report from a recorded Kafka log)."""

from __future__ import annotations

import asyncio
import json

from typer.testing import CliRunner

from kvguard.cli import app
from kvguard.wire.eventlog import read_event_log, write_event_log
from tests.integration.test_record import publish, record
from tests.unit.streams.vllm_oom_log import ooms, vllm_run

runner = CliRunner()


def _rca(path) -> dict:
    result = runner.invoke(app, ["rca", "--events", str(path), "--no-lstm", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_rca_of_a_recorded_log_equals_the_direct_logs(kafka_settings, tmp_path):
    batches = vllm_run(0)
    assert ooms(batches) >= 2
    asyncio.run(publish(kafka_settings, batches))
    recorded = tmp_path / "recorded.jsonl.gz"
    summary = asyncio.run(record(kafka_settings, recorded))
    assert summary.batches == len(batches) == len(list(read_event_log(recorded)[1]))
    direct = tmp_path / "direct.jsonl.gz"
    write_event_log(direct, batches, {})
    a, b = _rca(direct), _rca(recorded)
    assert len(b["ooms"]) == ooms(batches)
    assert [o["explanation"] for o in b["ooms"]] == [o["explanation"] for o in a["ooms"]]
    assert all(o["explanation"]["step_source"].startswith("the crashing step") for o in b["ooms"])
    assert b["incidents"] == a["incidents"]
