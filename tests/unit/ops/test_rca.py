"""`kvguard rca` on event logs recorded from the real shadow engine (producers.sim.fleet.Fleet)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvguard.cli import app
from kvguard.contracts.events import EventKind
from kvguard.contracts.units import NS_PER_S
from kvguard.ops import rca
from kvguard.runtime.bootstrap import bootstrap
from kvguard.wire.eventlog import EventLogWriter, read_event_log


def _record(path: Path, *, rate_scale: float, duration_s: float, seed: int = 0) -> list[dict]:
    """Run the mixed workload on one simulated GPU, write its event log; return the engine's OOM log."""
    from kvguard.producers.sim.fleet import Fleet
    from kvguard.producers.sim.profiles import load_profile
    from kvguard.producers.sim.workloads import load_workload

    profile = load_profile("llama3-8b-24gb")  # the seed profile: its arena OOMs are what the RCA tests read
    max_prompt = min(profile.max_model_len - 1024, int(profile.capacity_tokens * 0.6))
    wl = load_workload("mixed", rate_scale=rate_scale, window=duration_s, seed=seed, max_prompt_tokens=max_prompt)
    fleet = Fleet(1, profile, seed=seed)
    fleet.submit_workload(wl)
    with EventLogWriter(path, {"workload": "mixed", "nodes": fleet.nodes}) as w:
        for t in range(NS_PER_S, int(duration_s * NS_PER_S) + NS_PER_S, NS_PER_S):
            fleet.advance(t)
            for b in fleet.take_batches(t):
                w.write(b)
    return list(fleet.engines[0].oom_log)


@pytest.fixture(scope="module")
def oom_log(tmp_path_factory) -> tuple[Path, list[dict]]:
    path = tmp_path_factory.mktemp("rca") / "mixed.jsonl.gz"
    crashes = _record(path, rate_scale=3.0, duration_s=300.0)
    assert crashes, "the recorded run must contain an OOM"
    return path, crashes


@pytest.fixture(scope="module")
def replayed(oom_log):
    path, _ = oom_log
    core = bootstrap(predictor=None).stream_core(with_predictor=False)
    _, batches = read_event_log(path)
    rep = rca.replay(batches, core)
    return rep, rca.analyse(rep, window_s=1800.0)


def _oom_rows(path: Path) -> list[tuple[str, int, int, int]]:
    _, batches = read_event_log(path)
    out = []
    for b in batches:
        ev = b.events[b.events["kind"] == EventKind.OOM]
        out.extend((b.node, int(e["ts_ns"]), int(e["size"]), int(e["aux"])) for e in ev)
    return out


def test_every_oom_row_is_reported_and_classified_from_the_row(oom_log, replayed):
    path, crashes = oom_log
    _, reports = replayed
    rows = _oom_rows(path)
    assert [(r.node, r.ts_ns, r.requested_units, r.largest_free_run) for r in reports] == sorted(rows)
    for r, crash in zip(reports, crashes):
        # free units come from the replayed mirror just before the OOM row; the engine logged its own
        assert r.free_units == crash["free_units"]
        frag = r.free_units >= r.requested_units and r.largest_free_run < r.requested_units
        assert r.fragmentation is frag
        assert r.fragmentation is crash["fragmentation"]
    assert any(r.fragmentation for r in reports)


def test_lead_times_are_consistent_with_the_alerts(replayed):
    rep, reports = replayed
    for r in reports:
        node = rep.nodes[r.node]
        assert set(r.tiers) == {"threshold", "slope"}
        for tier, out in r.tiers.items():
            assert out.lead_s >= 0
            if out.lead_s > 0:
                assert out.rules_firing, f"{tier} has lead {out.lead_s} but no rule firing before the OOM"
                start = r.ts_ns - round(out.lead_s * NS_PER_S)
                earlier = [o.ts_ns for o in node.ooms if o.ts_ns < r.ts_ns]
                fired = [ts for ts, _, t, firing in node.transitions
                         if firing and rca.TIERS[t - 1] == tier and abs(ts - start) <= 1]
                if not fired:
                    # the run began before the previous OOM: the lead is counted from the first tick after it
                    assert earlier, f"{tier}: no alert fired at the start of its lead ({start})"
                    ticks = [t.ts_ns for t in node.ticks]
                    assert start == min(t for t in ticks if t > max(earlier))
                    assert any(s.tier == tier and s.start_ns < start and (s.end_ns is None or s.end_ns > start)
                               for s in rca.alert_spans(node.transitions))
                assert not earlier or start > max(earlier)
            else:
                assert out.rules_firing == []
        assert all(t.ts_ns < r.ts_ns for t in r.last_ticks)
        assert len(r.last_ticks) <= 6
    assert any(o.lead_s > 0 for r in reports for o in r.tiers.values())


def test_admitted_requests_are_from_the_minute_before_with_their_prompts(oom_log, replayed):
    path, _ = oom_log
    _, reports = replayed
    _, batches = read_event_log(path)
    prompts = {}
    for b in batches:
        ev = b.events[b.events["kind"] == EventKind.ARRIVE]
        prompts.update(zip(ev["req"].tolist(), ev["tokens"].tolist()))
    with_admits = [r for r in reports if r.admitted]
    assert with_admits
    for r in with_admits:
        for a in r.admitted:
            assert r.ts_ns - 60 * NS_PER_S <= a.admit_ts_ns <= r.ts_ns
            assert a.prompt_tokens == prompts[a.req]
        assert r.trigger.prompt_tokens == max(a.prompt_tokens for a in r.admitted)


def test_is_fragmentation_and_alert_spans():
    assert rca.is_fragmentation(512, 499, 550)
    assert not rca.is_fragmentation(512, 499, 500)  # not enough free units at all: capacity
    assert not rca.is_fragmentation(512, 600, 900)
    assert not rca.is_fragmentation(512, 100, None)
    spans = rca.alert_spans([(10, "A", 1, True), (20, "B", 2, True), (30, "A", 1, False)])
    assert [(s.rule, s.tier, s.start_ns, s.end_ns) for s in spans] == [("A", "threshold", 10, 30),
                                                                     ("B", "slope", 20, None)]


def test_cli_json_stdout_is_pure_json_and_report_has_one_png_per_oom(oom_log, tmp_path):
    path, crashes = oom_log
    out_dir = tmp_path / "report"
    result = CliRunner().invoke(app, ["rca", "--events", str(path), "--no-lstm", "--json", "--report", str(out_dir)])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert set(doc) >= {"ooms", "nodes", "summary"}
    assert doc["summary"]["ooms"] == len(crashes) == len(doc["ooms"])
    assert doc["summary"]["fragmentation_ooms"] == sum(c["fragmentation"] for c in crashes)
    pngs = sorted(out_dir.glob("oom_*.png"))  # one per OOM; the incidents have their own, one per node
    assert len(pngs) == len(crashes)
    assert len(list(out_dir.glob("*.png"))) == len(crashes) + len(doc["report"]["incident_images"])
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    md = (out_dir / "rca.md").read_text()
    assert md.count("## OOM ") == len(crashes) and pngs[0].name in md


def test_cli_with_shipped_lstm_reports_p_oom_and_lstm_tier(oom_log):
    path, _ = oom_log
    result = CliRunner().invoke(app, ["rca", "--events", str(path), "--json", "--node", "sim-0/gpu0"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["summary"]["lstm"] is True
    ticks = [t for o in doc["ooms"] for t in o["last_ticks"]]
    assert ticks and all(0.0 <= t["p_oom"] <= 1.0 for t in ticks)
    assert all(o["tiers"]["lstm"]["lead_s"] >= 0 for o in doc["ooms"])


def test_cli_rich_summary_and_no_oom_log(tmp_path, oom_log):
    path, _ = oom_log
    result = CliRunner().invoke(app, ["rca", "--events", str(path), "--no-lstm"])
    assert result.exit_code == 0, result.output
    assert "fragmentation OOM" in result.stdout and "lead time" in result.stdout
    quiet = tmp_path / "quiet.jsonl.gz"
    assert _record(quiet, rate_scale=0.2, duration_s=60.0) == []
    result = CliRunner().invoke(app, ["rca", "--events", str(quiet), "--no-lstm"])
    assert result.exit_code == 0, result.output
    assert "No OOM in this log" in result.stdout


def test_cli_unreadable_log_exits_2_naming_file_and_line(tmp_path, oom_log):
    bad = tmp_path / "bad.jsonl.gz"
    with gzip.open(bad, "wt") as fh:
        fh.write('{"type":"header","schema":"1.0","meta":{}}\nnot json\n')
    result = CliRunner().invoke(app, ["rca", "--events", str(bad), "--no-lstm"])
    assert result.exit_code == 2
    assert f"{bad}:2: expected a JSON batch line" in result.stderr
    missing = CliRunner().invoke(app, ["rca", "--events", str(tmp_path / "nope.gz"), "--no-lstm"])
    assert missing.exit_code == 2 and "nope.gz:1" in missing.stderr
    path, _ = oom_log
    other = CliRunner().invoke(app, ["rca", "--events", str(path), "--no-lstm", "--node", "sim-0/gpu9"])
    assert other.exit_code == 2 and "sim-0/gpu9" in other.stderr


def test_a_kv_arena_oom_keeps_the_kv_layers_language(replayed):
    """The seed's arena OOMs are in KV units (largest free run, capacity or fragmentation); the allocator's
    bytes language is for allocator OOMs only (issue 27)."""
    rep, reports = replayed
    assert reports and all(r.cause_key in ("kv_arena:capacity", "kv_arena:fragmentation") for r in reports)
    assert all((r.cause_key == "kv_arena:fragmentation") == r.fragmentation for r in reports)
    md = rca.markdown(reports, rca.summary(rep, reports), {}, "seed.jsonl.gz")
    assert "largest free run" in md and "reserved-but-unallocated" not in md
    assert all(r.to_dict()["unit"] == "kv_units" for r in reports)
