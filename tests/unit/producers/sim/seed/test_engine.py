import numpy as np
import pytest

from kvguard.contracts.events import F_PRIORITY_DEFAULTED, EventBatch, EventKind, Handling, Outcome
from kvguard.contracts.units import NS_PER_S
from kvguard.producers.sim.profiles import profile_from_dict
from kvguard.producers.sim.run import SeqState
from kvguard.producers.sim.seed.engine import Engine, SeedEngineConfig
from kvguard.producers.sim.seed.pool import PagedPool
from kvguard.producers.sim.workloads import Request, load_workload
from kvguard.wire.eventlog import write_event_log

SUMMARY_FIELDS = ["requests", "completed", "failed", "rejected", "unfinished", "ooms", "preemptions", "ttft_p50_s", "ttft_p99_s",
                  "tpot_p50_s", "tpot_p99_s", "goodput_tokens_per_s", "downtime_s", "sim_seconds", "events",
                  "slo_met", "slo_attainment", "slo_goodput_tokens_per_s", "ttft_p99_all_s", "refused", "slo",
                  "slo_attainment_by_priority"]


def tiny_profile(dynamic_units=2000, *, page_class_tokens=(4, 64), activation_bytes_per_token=1024,
                 max_batched_tokens=256, max_num_seqs=64):
    unit_bytes = 4 * 1024
    overhead = 1 << 20
    return profile_from_dict("tiny", {
        "total_bytes": dynamic_units * unit_bytes + 2 * overhead, "weights_bytes": overhead,
        "context_bytes": overhead, "gpu_memory_utilization": 1.0, "unit_tokens": 4,
        "page_class_tokens": list(page_class_tokens), "kv_bytes_per_token": 1024,
        "activation_bytes_per_token": activation_bytes_per_token, "max_batched_tokens": max_batched_tokens,
        "max_num_seqs": max_num_seqs, "max_model_len": 8192, "step_base_s": 0.01, "step_prefill_token_s": 0.0001,
        "step_decode_seq_s": 0.0002, "swap_capacity_bytes": 4000 * unit_bytes,
        "host_bandwidth_bytes_per_s": 1e10,
    })


def make_engine(profile=None, config=None, **pool_kw):
    profile = profile or tiny_profile()
    pool = PagedPool(profile.geometry, node="t/gpu0", swap_capacity_units=profile.swap_capacity_units,
                     retain_ttl_ns=pool_kw.pop("retain_ttl_ns", 600 * NS_PER_S), **pool_kw)
    return Engine(pool, profile, node="t/gpu0", config=config)


def req(i, t_s, prompt, out, priority=None, hashes=()):
    return Request(i, int(t_s * NS_PER_S), prompt, out, priority, hashes)


def drain(engine, until_s=600):
    engine.advance(int(until_s * NS_PER_S))
    return engine.take_events()


def test_light_load_completes_everything_with_latency_figures():
    e = make_engine()
    for i in range(20):
        e.submit(req(i, i * 0.5, 100 + 10 * i, 20 + i, priority=5))
    ev = drain(e)
    s = e.summary()
    assert list(s.to_dict()) == SUMMARY_FIELDS
    assert (s.requests, s.completed, s.failed, s.rejected, s.unfinished) == (20, 20, 0, 0, 0)
    assert (s.ooms, s.preemptions) == (0, 0)
    assert 0 < s.ttft_p50_s <= s.ttft_p99_s and 0 < s.tpot_p50_s <= s.tpot_p99_s
    assert s.ttft_p99_all_s == pytest.approx(s.ttft_p99_s, rel=0.2)  # nothing missed: all requests were served
    assert s.slo_met == len(e.served) == 20 and s.slo_attainment == 1.0  # light load meets 2 s / 100 ms
    assert s.goodput_tokens_per_s > 0 and s.events == len(ev)
    finishes = ev[ev["kind"] == EventKind.FINISH]
    assert len(finishes) == 20 and np.all(finishes["flags"] == Outcome.COMPLETED)
    assert sorted(finishes["tokens"]) == sorted(20 + i for i in range(20))
    assert np.all(np.diff(ev["ts_ns"]) >= 0), "rows of one node are in time order"
    assert e.pool.metrics().live_units == 0


def _run_once(tmp_path, name):
    e = make_engine(tiny_profile(600))
    for r in load_workload("mixed", window=120, seed=4).requests:
        e.submit(r)
    e.advance(400 * NS_PER_S)
    ev = e.take_events()
    path = tmp_path / name
    write_event_log(path, [EventBatch("t/gpu0", 0, ev)], {"seed": 4})
    return ev, e.summary(), path.read_bytes()


def test_same_workload_profile_and_seed_give_byte_identical_event_logs(tmp_path):
    ev_a, sum_a, bytes_a = _run_once(tmp_path, "a.gz")
    ev_b, sum_b, bytes_b = _run_once(tmp_path, "b.gz")
    assert len(ev_a) > 1000
    # the run crashes and refuses arrivals while down, so those paths are covered too
    assert sum_a.ooms >= 1 and sum_a.rejected >= 1 and sum_a.failed >= 1
    assert ev_a.tobytes() == ev_b.tobytes()
    assert bytes_a == bytes_b
    assert sum_a == sum_b


def test_missing_priority_defaults_to_5_and_is_counted():
    e = make_engine()
    e.submit(req(0, 0, 50, 5, priority=None))
    e.submit(req(1, 0, 50, 5, priority=9))
    e.submit(req(2, 0, 50, 5, priority=42))  # clamped into 0-10
    ev = drain(e, 30)
    arrive = ev[ev["kind"] == EventKind.ARRIVE]
    assert list(arrive["cls"]) == [5, 9, 10]
    assert list(arrive["flags"]) == [F_PRIORITY_DEFAULTED, 0, 0]
    assert e.priority_defaulted == 1


def test_kv_pressure_preempts_lowest_priority_first_and_recomputes_it_later():
    e = make_engine(tiny_profile(300, max_batched_tokens=128))
    for i, prio in enumerate([9, 1, 5]):
        e.submit(req(i, 0, 200, 400, priority=prio))
    ev = drain(e, 2000)
    pre = ev[ev["kind"] == EventKind.PREEMPT]
    assert len(pre) >= 1 and pre["req"][0] == 1
    assert pre["tokens"][0] > 200  # prompt + generated tokens to recompute
    s = e.summary()
    assert s.preemptions == len(pre)
    assert s.completed + s.failed + s.rejected + s.unfinished == 3
    # the victim went back to the queue and was admitted again to recompute
    assert ((ev["kind"] == EventKind.ADMIT) & (ev["req"] == 1)).sum() >= 2


def _fragment(pool, holes_of=9):
    """Fill D with small workspace buffers and free every other one: plenty of free units,
    no free run longer than ``holes_of``."""
    offsets = []
    while pool.largest_free_run >= holes_of:
        offsets.append(pool.alloc_workspace(holes_of, 0))
    for off in offsets[::2]:
        pool.free_workspace(off, 0)
    pool.take_events()


def _crash_setup(max_num_seqs=64):
    profile = tiny_profile(1000, activation_bytes_per_token=4096, max_batched_tokens=32, max_num_seqs=max_num_seqs)
    e = make_engine(profile, SeedEngineConfig(restart_s=60.0))
    _fragment(e.pool)
    m = e.pool.metrics()
    assert m.free_units > 400 and m.largest_free_run < 20
    return e


def _finish_flags(ev):
    fin = ev[ev["kind"] == EventKind.FINISH]
    return {int(r): Outcome(int(f)) for r, f in zip(fin["req"], fin["flags"])}


def test_workspace_that_finds_no_contiguous_run_crashes_the_engine_and_restarts_it():
    e = _crash_setup()
    e.submit(req(0, 1, 20, 10, priority=5))  # 20 batched tokens -> a 20-unit workspace
    e.submit(req(1, 100, 20, 10, priority=5))  # arrives after the restart
    ev = drain(e, 200)
    kinds = list(ev["kind"])
    oom_at = kinds.index(EventKind.OOM)
    assert kinds[oom_at + 1] == EventKind.FINISH and ev["flags"][oom_at + 1] == Outcome.FAILED_OOM
    assert EventKind.RESET in kinds[oom_at:]
    assert ev["size"][oom_at] == 20 and ev["aux"][oom_at] < 20
    s = e.summary()
    assert (s.ooms, s.failed, s.rejected, s.completed, s.unfinished) == (1, 1, 0, 1, 0)
    assert s.downtime_s == pytest.approx(60.0, abs=1e-6)
    assert e.oom_log[0]["fragmentation"] and e.oom_log[0]["what"] == "workspace"
    # the restarted engine starts from a reset pool and serves request 1
    admit1 = ev[(ev["kind"] == EventKind.ADMIT) & (ev["req"] == 1)]
    assert admit1["ts_ns"][0] >= ev["ts_ns"][oom_at] + 60 * NS_PER_S


def test_an_oom_fails_the_whole_queue_and_arrivals_while_down_are_rejected():
    e = _crash_setup(max_num_seqs=1)
    e.submit(req(0, 1, 20, 10, priority=5))  # runs, and its step's workspace finds no run
    e.submit(req(1, 1, 20, 10, priority=5))  # queued behind it (max_num_seqs=1)
    e.submit(req(2, 30, 20, 10, priority=None))  # arrives while the GPU restarts
    e.submit(req(3, 61.5, 20, 10, priority=5))  # arrives after the restart
    ev = drain(e, 200)
    assert _finish_flags(ev) == {0: Outcome.FAILED_OOM, 1: Outcome.FAILED_OOM, 2: Outcome.REJECTED,
                                 3: Outcome.COMPLETED}
    oom = ev[ev["kind"] == EventKind.OOM]
    assert len(oom) == 1
    assert e.oom_log[0]["running"] == 1 and e.oom_log[0]["waiting"] == 1
    # both queued requests fail at the crash; the refused one is recorded when it arrives
    fin = ev[ev["kind"] == EventKind.FINISH]
    assert list(fin["ts_ns"][:2]) == [oom["ts_ns"][0]] * 2
    arrive2 = ev[(ev["kind"] == EventKind.ARRIVE) & (ev["req"] == 2)]
    assert len(arrive2) == 1 and fin["ts_ns"][2] == arrive2["ts_ns"][0] == 30 * NS_PER_S
    assert not ((ev["kind"] == EventKind.ADMIT) & (ev["req"] == 2)).any()
    s = e.summary()
    assert (s.requests, s.completed, s.failed, s.rejected, s.unfinished, s.ooms) == (4, 1, 2, 1, 0, 1)
    assert e.priority_defaulted == 1  # the refused request still counts as an arrival
    assert e.outstanding_tokens() == 0
    assert np.all(np.diff(ev["ts_ns"]) >= 0)


def test_is_up_is_false_during_the_restart_only():
    e = _crash_setup()
    assert e.is_up(0)
    e.submit(req(0, 1, 20, 10, priority=5))
    e.advance(2 * NS_PER_S)
    assert e.ooms == 1 and e.down_until_ns > 60 * NS_PER_S
    assert not e.is_up(30 * NS_PER_S) and e.is_up(e.down_until_ns)


def test_requests_still_queued_at_the_end_are_unfinished():
    e = make_engine()
    for i in range(5):
        e.submit(req(i, 0, 200, 5000, priority=5))
    e.advance(1 * NS_PER_S)
    s = e.summary()
    assert (s.requests, s.completed, s.unfinished) == (5, 0, 5)


def _running(e, rid):
    return any(v.req == rid for v in e.running_requests())


@pytest.mark.parametrize("handling", [Handling.RECOMPUTE, Handling.SWAP, Handling.CHECKPOINT, Handling.RETAIN])
def test_request_eviction_parks_the_request_and_it_still_completes(handling, tmp_path):
    e = make_engine(checkpoint_dir=tmp_path)
    e.submit(req(0, 0, 300, 200, priority=5))
    e.advance(1 * NS_PER_S)
    assert _running(e, 0)
    units_before = e.pool.metrics().live_units
    result = e.evict_request(0, e.now_ns, granularity="request", handling=handling)
    assert result.pages > 0 and not _running(e, 0)
    m = e.pool.metrics()
    if handling is Handling.RETAIN:
        assert m.retained_units == units_before
    else:
        assert m.live_units == 0
    expected_queue = "swapped" if handling in (Handling.SWAP, Handling.CHECKPOINT) else "waiting"
    assert e.queue_lengths()[expected_queue] == 1
    ev = drain(e, 120)
    assert e.summary().completed == 1
    if handling is Handling.SWAP or handling is Handling.CHECKPOINT:
        assert (ev["kind"] == EventKind.SWAP_IN).any()
    if handling is Handling.RETAIN:
        assert (ev["kind"] == EventKind.REMAP).any()


def test_block_eviction_keeps_the_prefix_and_recomputes_only_the_tail():
    e = make_engine()
    e.submit(req(0, 0, 300, 200, priority=5))
    e.advance(1 * NS_PER_S)
    before = e.pool.request_tokens(0)
    result = e.evict_request(0, e.now_ns, granularity="block", handling=Handling.RECOMPUTE, pages=2)
    assert result.pages == 2 and result.tokens > 0
    assert e.pool.request_tokens(0) == before - result.tokens
    drain(e, 120)
    assert e.summary().completed == 1


def test_evicting_a_finished_or_unknown_request_is_a_no_op():
    e = make_engine()
    e.submit(req(0, 0, 50, 5, priority=5))
    drain(e, 30)
    for rid in (0, 12345):
        r = e.evict_request(rid, e.now_ns, granularity="request", handling=Handling.SWAP)
        assert (r.pages, r.units_freed) == (0, 0)
    with pytest.raises(ValueError, match="granularity"):
        e.evict_request(0, e.now_ns, granularity="page")


def test_running_views_and_compact():
    e = make_engine()
    for i in range(4):
        e.submit(req(i, 0, 200, 300, priority=i))
    e.advance(2 * NS_PER_S)
    views = e.running_requests()
    assert {v.req for v in views} == {0, 1, 2, 3}
    assert all(v.units > 0 and v.state is SeqState.RUNNING and v.prompt_tokens == 200 for v in views)
    assert isinstance(e.compact(e.now_ns, 8), int)


def test_prompt_that_can_never_fit_is_rejected_not_crashed():
    e = make_engine(tiny_profile(300))
    e.submit(req(0, 0, 5000, 10))
    ev = drain(e, 10)
    fin = ev[ev["kind"] == EventKind.FINISH]
    assert list(fin["flags"]) == [Outcome.REJECTED]
    s = e.summary()
    assert (s.ooms, s.rejected, s.failed) == (0, 1, 0)


def test_shipped_profiles_match_their_documented_sources():
    from kvguard.producers.sim.profiles import default_profile_name, load_profile, profile_names

    assert default_profile_name() == "llama3-8b-24gb-vllm"  # the vLLM-faithful engine (issue 11)
    assert load_profile().engine == "vllm" and load_profile().unit_tokens == 16
    assert {"llama3-8b-24gb", "llama3-8b-24gb-p16", "llama3-70b-tp8-80gb"} <= set(profile_names())
    p8 = load_profile("llama3-8b-24gb")
    assert p8.geometry.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    assert p8.geometry.page_classes == (1, 16) and p8.unit_tokens == 4
    assert 40_000 < p8.capacity_tokens < 50_000  # ~6 GB of KV left on a 24 GB card
    p70 = load_profile("llama3-70b-tp8-80gb")
    assert p70.geometry.kv_bytes_per_token == 2 * 80 * 1 * 128 * 2  # one KV head per GPU at TP8
    assert p70.step_seconds(0, 10) == pytest.approx(p70.step_base_s + 10 * p70.step_decode_seq_s)
    assert p8.workspace_units(2048) == 512


def test_bad_profiles_name_the_field():
    from kvguard.producers.sim.profiles import ProfileError, load_profile

    with pytest.raises(ProfileError, match="page_class_tokens"):
        tiny_profile(page_class_tokens=(4, 24))
    with pytest.raises(ProfileError, match="'name'"):
        load_profile("no-such-gpu")


def test_admission_headroom_adds_to_the_watermark_and_releases_exactly():
    from kvguard.producers.sim.profiles import load_profile
    from kvguard.producers.sim.seed.engine import Engine
    from kvguard.producers.sim.seed.pool import PagedPool

    profile = load_profile()
    engine = Engine(PagedPool(profile.geometry, node="n0", swap_capacity_units=0), profile, node="n0", seed=0)
    base = engine.watermark_units
    engine.set_admission_headroom(500)
    assert engine.watermark_units == base + 500
    engine.set_admission_headroom(0)
    assert engine.watermark_units == base
    with pytest.raises(ValueError, match="headroom"):
        engine.set_admission_headroom(-1)
