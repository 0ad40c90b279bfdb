"""`kvguard replay`: a recorded log through streams and policy (nothing executed), a what-if with
another policy on the log's own requests, and an offline HTML timeline."""

import json

import numpy as np
from typer.testing import CliRunner

from kvguard.cli import app
from kvguard.contracts.events import EventKind
from kvguard.contracts.units import NS_PER_S
from kvguard.producers.sim.fleet import Fleet
from kvguard.producers.sim.profiles import load_profile
from kvguard.producers.sim.workloads import load_workload
from kvguard.runtime.replay import workload_from_log
from kvguard.wire.eventlog import read_event_log, write_event_log

runner = CliRunner()


def stressed_log(path, seconds=420):
    fleet = Fleet(2, load_profile(), seed=0)
    fleet.submit_workload(load_workload("mixed", rate_scale=2.25, window=seconds, seed=0))
    batches = []
    for t in range(10, seconds + 10, 10):
        fleet.advance(t * NS_PER_S)
        batches += fleet.take_batches(t * NS_PER_S)
    write_event_log(path, batches, {"test": "replay"})
    return batches


def test_replay_dry_run_what_if_and_offline_report(tmp_path):
    log = tmp_path / "run.jsonl.gz"
    batches = stressed_log(log)
    ooms = sum(int(np.count_nonzero(b.events["kind"] == int(EventKind.OOM))) for b in batches)
    arrivals = sum(int(np.count_nonzero(b.events["kind"] == int(EventKind.ARRIVE))) for b in batches)
    policy = tmp_path / "policy.toml"
    policy.write_text("[policy]\npreset = \"emergency\"\n")
    result = runner.invoke(app, ["replay", str(log), "--no-lstm", "--policy", str(policy),
                                 "--report", str(tmp_path / "rep"), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    dry = out["dry_run"]
    assert dry["nodes"] == 2 and dry["ooms"] == ooms and dry["batches"] == len(batches)
    assert dry["commands"] == sum(dry["commands_by_action"].values())
    assert out["what_if"]["requests"] == arrivals
    assert {"without_policy", "with_policy"} <= set(out["what_if"])
    page = (tmp_path / "rep" / "index.html").read_text()
    assert page.count("data:image/png;base64,") == 1 + dry["nodes"] and "http" not in page.replace(
        "http-equiv", "")


def test_workload_from_log_keeps_arrival_sizes_and_priorities(tmp_path):
    log = tmp_path / "run.jsonl.gz"
    stressed_log(log, seconds=120)
    wl = workload_from_log(read_event_log(log)[1])
    original = load_workload("mixed", rate_scale=2.25, window=120, seed=0)
    assert sorted(r.req_id for r in wl.requests) == sorted(r.req_id for r in original.requests)
    by_id = {r.req_id: r for r in original.requests}
    # the log stamps an arrival when the engine takes it in, at most a few steps after the trace's time
    assert all(r.prompt_tokens == by_id[r.req_id].prompt_tokens and r.max_output_tokens == by_id[r.req_id].max_output_tokens
               and 0 <= r.arrival_ns - by_id[r.req_id].arrival_ns < 5 * NS_PER_S for r in wl.requests)
