"""`kvguard rca` names each failure class the node side models (issue 27): one small run per class, its
OOM explained with the right cause, the allocator's figures, the crashing step's requests and what would
have prevented it; and the incidents that are not OOMs (a preemption storm, refusals while the engine
restarts). The direct-engine cases drive the tiny vLLM-faithful engine of the engine tests; the others
are the failure-class runs of tests/unit/producers/sim/vllm/test_failure_classes.py with an event log."""

from __future__ import annotations

import numpy as np
import pytest

from kvguard.contracts.events import F_PROMPT_LOGPROBS, EventBatch, EventKind, OomStepRow
from kvguard.contracts.units import NS_PER_S
from kvguard.ops import rca
from kvguard.producers.sim.torch_allocator.caching_allocator import OutOfMemoryError
from kvguard.producers.sim.workloads import Request
from kvguard.runtime.bootstrap import bootstrap
from kvguard.wire.eventlog import read_event_log
from tests.unit.producers.sim.vllm.test_vllm_engine import _engine, _fragment, tiny_vllm_profile

MiB = 1 << 20


def _replay(batches):
    core = bootstrap(predictor=None).stream_core(with_predictor=False)
    rep = rca.replay(batches, core)
    return rep, rca.analyse(rep)


def _engine_batches(e) -> list[EventBatch]:
    rows = e.take_events()
    return [EventBatch(node=e.node, seq=0, events=rows, geometry=e.profile.geometry)], rows


def _only(reports):
    assert len(reports) == 1, [r.cause_key for r in reports]
    return reports[0], reports[0].explanation


def test_a_fragmentation_oom_is_explained_as_such_with_expandable_segments():
    e = _engine(restart_s=20.0)
    for i in range(32):
        e.submit(Request(i, 0, 16, 1000))
    e.advance(NS_PER_S // 100)
    _fragment(e)
    e.advance(NS_PER_S)
    batches, rows = _engine_batches(e)
    r, ex = _only(_replay(batches)[1])
    assert r.cause_key == "allocator:fragmentation" and ex["allocator_reason"] == "fragmentation"
    assert ex["reserved_unallocated_bytes"] >= ex["requested_bytes"] > 0
    log = e.oom_log[0]
    assert ex["device_free_bytes"] == log["device_free_bytes"] and ex["reserved_bytes"] == log["reserved_bytes"]
    assert ex["allocated_bytes"] == log["allocated_bytes"]
    assert ex["step_sequences"] == 32 and ex["step_tokens"] == 32  # a decode step of the 32 running requests
    assert sorted(q["req"] for q in ex["requests"]) == list(range(32))
    assert any("expandable_segments:True" in p for p in ex["prevention"])
    assert "largest free run" not in rca.markdown([r], rca.summary(_replay(batches)[0], [r]), {}, "x")


def test_a_peak_oom_says_what_the_device_lacked_and_a_utilization_that_fits():
    e = _engine(restart_s=20.0)
    for i in range(32):
        e.submit(Request(i, 0, 16, 1000))
    e.advance(NS_PER_S // 100)
    twin, device = e.memory.twin, e.memory.driver.memory
    device.reserve_external(device.free_bytes - 2 * MiB)  # the device full, the cache pinned: no room at all
    with pytest.raises(OutOfMemoryError):
        while True:
            twin.malloc(1 * MiB)
    e.advance(NS_PER_S)
    batches, _ = _engine_batches(e)
    r, ex = _only(_replay(batches)[1])
    assert r.cause_key == "allocator:peak" and ex["allocator_reason"] == "peak"
    assert ex["reserved_unallocated_bytes"] < ex["requested_bytes"]
    assert ex["device_free_bytes"] < ex["requested_bytes"]
    util = [p for p in ex["prevention"] if p.startswith("--gpu-memory-utilization")]
    assert util and float(util[0].split()[1]) < 0.9
    assert not any("expandable_segments" in p for p in ex["prevention"])


def test_a_prompt_logprob_oom_names_the_request_that_asked_and_the_guard_that_would_have_capped_the_step():
    e = _engine(tiny_vllm_profile(vocab=128256), prompt_logprobs_frac=1.0, restart_s=30.0)
    for i in range(3):
        e.submit(Request(i, 0, 2000, 50))
    e.advance(10 * NS_PER_S)
    batches, rows = _engine_batches(e)
    r, ex = _only(_replay(batches)[1])
    assert r.cause_key == "allocator:prompt_logprobs"
    asked = {int(q) for q in rows["req"][(rows["kind"] == EventKind.ARRIVE) & (rows["flags"] & F_PROMPT_LOGPROBS > 0)]}
    in_step = [q for q in ex["requests"] if q["tokens"]]
    assert in_step and all(q["prompt_logprobs"] == (q["req"] in asked) for q in in_step)
    assert ex["step_prompt_logprob_positions"] > 0 and ex["step_tokens"] == sum(q["tokens"] for q in ex["requests"])
    assert ex["startup_headroom_bytes"] > 0
    assert any("--logprobs-guard" in p for p in ex["prevention"])
    assert any("asking for prompt logprobs: request" in d for d in ex["details"])


def test_without_oom_step_rows_the_step_is_reconstructed_from_the_lifecycle_rows():
    """A log from a producer that writes no OOM_STEP rows (the plugin's, an older shadow engine's): the
    requests running at the crash, with their ARRIVE shapes; the allocator picture from the allocator rows."""
    e = _engine(tiny_vllm_profile(vocab=128256), prompt_logprobs_frac=1.0, restart_s=30.0)
    for i in range(3):
        e.submit(Request(i, 0, 2000, 50))
    e.advance(10 * NS_PER_S)
    batches, rows = _engine_batches(e)
    stripped = rows[rows["kind"] != EventKind.OOM_STEP]
    assert len(stripped) < len(rows)
    r, ex = _only(_replay([EventBatch(node=e.node, seq=0, events=stripped, geometry=e.profile.geometry)])[1])
    assert r.cause_key == "allocator:prompt_logprobs"
    assert ex["step_source"].startswith("reconstructed") and ex["step_tokens"] is None
    assert ex["requests"] and all(q["prompt_tokens"] == 2000 and q["prompt_logprobs"] for q in ex["requests"])
    assert ex["reserved_bytes"] is not None and ex["device_free_bytes"] is not None
    assert "allocator rows" in ex["picture_source"]


# -- the failure classes that need a workload (tests/unit/producers/sim/vllm/test_failure_classes.py) --------

def _sim(tmp_path, **kw):
    from kvguard.runtime.simulation import run_simulation

    path = tmp_path / "run.jsonl.gz"
    out = run_simulation("random", events_out=path, **kw)
    _, batches = read_event_log(path)
    return out, _replay(list(batches))


def test_long_context_oom(tmp_path):
    from tests.unit.producers.sim.vllm.test_failure_classes import C3_TRAFFIC, LLAMA
    from kvguard.producers.sim.engine_args import EngineArgs

    args = EngineArgs(LLAMA, gpu="h100-80gb", gpu_memory_utilization=0.97, attention_lse="max_seq_len")
    out, (_, reports) = _sim(tmp_path, engine_args=args, long_context_frac=0.02, long_context_len=100_000, **C3_TRAFFIC)
    assert out["ooms_by_cause"] == {"allocator:long_context": 1}
    r, ex = _only(reports)
    assert r.cause_key == "allocator:long_context"
    assert max(q["context_tokens"] or 0 for q in ex["requests"]) >= 50_000
    assert any("longest context in the step" in d for d in ex["details"])
    assert any("--max-model-len" in p for p in ex["prevention"])


def test_speculative_decoding_oom(tmp_path):
    from tests.unit.producers.sim.vllm.test_failure_classes import QWEN06, QWEN8, bench
    from kvguard.producers.sim.engine_args import EngineArgs

    args = EngineArgs(QWEN8, gpu="h100-80gb", gpu_memory_utilization=0.97, speculative_model_config=QWEN06,
                      num_speculative_tokens=7)
    out, (_, reports) = _sim(tmp_path, bench=bench(1200, 200, 400, 0.2), engine_args=args)
    assert out["ooms_by_cause"] == {"allocator:spec_decode": 1}
    r, ex = _only(reports)
    assert r.cause_key == "allocator:spec_decode"
    assert sum(q["spec_tokens"] or 0 for q in ex["requests"]) > 0
    assert any("--num-speculative-tokens" in p for p in ex["prevention"])


def test_neighbour_oom(tmp_path):
    from tests.unit.producers.sim.vllm.test_failure_classes import C4_ARGS, C4_TRAFFIC
    from kvguard.producers.sim.vllm.external import GiB, Neighbour

    out, (_, reports) = _sim(tmp_path, engine_args=C4_ARGS, neighbour=Neighbour.parse("0.2GiB:+2GiB/min"),
                             **C4_TRAFFIC)
    assert out["ooms_by_cause"] == {"allocator:neighbour": 1}
    r, ex = _only(reports)
    assert r.cause_key == "allocator:neighbour"
    assert ex["neighbour_bytes"] - ex["neighbour_start_bytes"] > 1 * GiB
    assert any("another process holds" in d for d in ex["details"])


def test_leak_oom(tmp_path):
    from tests.unit.producers.sim.vllm.test_failure_classes import C4_ARGS, bench
    from kvguard.producers.sim.vllm.external import GiB, Leak

    out, (_, reports) = _sim(tmp_path, engine_args=C4_ARGS, leak=Leak.parse("8MiB/req"),
                             bench=bench(900, 1500, 300, 0.9, rate=4.0))
    assert set(out["ooms_by_cause"]) == {"allocator:leak"}
    assert len(reports) == out["ooms"] >= 2 and {r.cause_key for r in reports} == {"allocator:leak"}
    assert all(r.explanation["leaked_bytes"] > 1 * GiB for r in reports)
    assert all(any("restart" in p for p in r.explanation["prevention"]) for r in reports)


# -- incidents that are not OOMs ---------------------------------------------------------------------

def test_a_preemption_storm_is_an_incident_of_kv_pressure():
    e = _engine()
    for i in range(40):  # far beyond the tiny engine's KV: vLLM preempts (the engine test's run)
        e.submit(Request(i, i * NS_PER_S // 10, 1500, 1500))
    e.advance(200 * NS_PER_S)
    batches, rows = _engine_batches(e)
    rep, reports = _replay(batches)
    assert not reports
    found = rca.incidents(rep, min_queue_s=30.0)
    storms = [i for i in found if i.kind == "preemption_storm"]
    assert storms and all(i.cause == "kv_pressure" for i in storms)
    assert sum(i.count for i in storms) <= int((rows["kind"] == EventKind.PREEMPT).sum())
    assert sum(i.count for i in storms) >= 5
    queueing = [i for i in found if i.kind == "queueing"]
    assert [i.cause for i in queueing] == ["kv_full"]  # U_kv at 95-98 % while 7-29 requests wait
    assert not [i for i in rca.incidents(rep) if i.kind == "queueing"]  # 40 s: under the default 60 s


def test_refusals_while_the_engine_restarts_are_explained_by_the_oom_before_them():
    e = _engine(tiny_vllm_profile(vocab=128256), prompt_logprobs_frac=1.0, restart_s=30.0)
    for i in range(3):
        e.submit(Request(i, 0, 2000, 50))
    for i in range(3, 9):  # arrive while the GPU restarts: rejected
        e.submit(Request(i, 3 * NS_PER_S + i, 100, 10))
    e.advance(10 * NS_PER_S)
    batches, rows = _engine_batches(e)
    rep, reports = _replay(batches)
    assert len(reports) == 1
    refusals = [i for i in rca.incidents(rep) if i.kind == "refusals"]
    assert len(refusals) == 1 and refusals[0].cause == "restarting" and refusals[0].count == 6
    assert np.all(rows["aux"][(rows["kind"] == EventKind.FINISH) & (rows["flags"] == 2)] == 1)  # Refusal.RESTARTING


def test_oom_step_rows_describe_the_step_in_the_table_of_events():
    assert int(EventKind.OOM_STEP) == 30 and [int(c) for c in OomStepRow] == [0, 1, 2, 3]


# -- the prevention it names, applied, removes the OOMs ------------------------------------------------

def _vllm_fleet(util: float, *, guard: bool = False, seconds: int = 60):
    from kvguard.producers.sim.fleet import Fleet
    from kvguard.producers.sim.profiles import EngineKnobs, load_profile, prompt_cap_tokens
    from kvguard.producers.sim.vllm.engine import VllmEngineConfig
    from kvguard.producers.sim.workloads import load_workload

    profile = load_profile(None, knobs=EngineKnobs(gpu_memory_utilization=util, model_runner="v1"))
    fleet = Fleet(2, profile, seed=0, config=VllmEngineConfig(prompt_logprobs_frac=0.3, logprobs_guard=guard))
    fleet.submit_workload(load_workload("azure-conv", window=seconds, seed=0,
                                        max_prompt_tokens=prompt_cap_tokens(profile)))
    batches = []
    for _, step in fleet.steps(seconds * NS_PER_S, step_ns=10 * NS_PER_S):
        batches.extend(step)
    return batches


def _ooms(batches) -> int:
    return sum(int((b.events["kind"] == EventKind.OOM).sum()) for b in batches)


def test_the_utilization_and_the_guard_rca_names_remove_the_runs_ooms():
    """Issue 27's run (prompt logprobs at --gpu-memory-utilization 0.95, the V1 runner), compressed: rca's
    lowest utilization over the OOMs, and the logprob guard it names, each re-run: no OOM left."""
    batches = _vllm_fleet(0.95)
    rep, reports = _replay(batches)
    assert len(reports) == _ooms(batches) >= 2
    pv = rca.prevention_summary(reports)
    assert pv["ooms_with_a_utilization"] == len(reports) and pv["gpu_memory_utilization"] < 0.95
    assert _ooms(_vllm_fleet(pv["gpu_memory_utilization"])) == 0
    assert _ooms(_vllm_fleet(0.95, guard=True)) == 0
    assert rca.summary(rep, reports)["prevention"] == pv


def test_governor_and_admission_rows_are_read_by_number_when_a_log_has_them():
    """EventKind.GOVERN = 28 and ADMISSION = 29 come from other branches: rca counts them in an incident's
    span by their numbers, and a log without them gives no such decisions."""
    from kvguard.contracts.events import empty_events
    from kvguard.ops.rca_incidents import find_incidents

    e = _engine()
    for i in range(40):
        e.submit(Request(i, i * NS_PER_S // 10, 1500, 1500))
    e.advance(200 * NS_PER_S)
    batches, rows = _engine_batches(e)
    rep, _ = _replay(batches)
    nr = rep.nodes[e.node]
    assert nr.policy_rows == []
    assert all("governor rows" not in i.decisions for i in find_incidents(rep))
    extra = empty_events(3)
    extra["kind"] = [28, 29, 28]
    extra["ts_ns"] = [10 * NS_PER_S, 11 * NS_PER_S, 500 * NS_PER_S]  # the last one after every incident
    rca._scan_incident_rows(nr, extra, 0)
    storm = next(i for i in find_incidents(rep) if i.kind == "preemption_storm")
    assert storm.decisions.get("governor rows") == 1 and storm.decisions.get("admission rows") == 1
