"""The executor carries commands out on a real shadow engine and paged pool."""

import pytest

from kvguard.actuators.executor import Executor
from kvguard.contracts.commands import (
    AckOutcome,
    Command,
    CompactPayload,
    EvictPayload,
    HeadroomPayload,
    Mode,
    ReclaimPayload,
    Target,
)
from kvguard.contracts.events import EventKind, Handling
from kvguard.contracts.pool_types import PageState
from kvguard.contracts.units import NS_PER_S
from kvguard.policy.strategy import Granularity, HandlingChoice
from kvguard.producers.sim.profiles import profile_from_dict
from kvguard.producers.sim.run import SeqState
from kvguard.producers.sim.seed.engine import Engine
from kvguard.producers.sim.seed.pool import PagedPool
from kvguard.producers.sim.workloads import HASH_BLOCK_TOKENS, Request


def tiny_profile(dynamic_units=2000, swap_units=4000):
    unit_bytes = 4 * 1024
    overhead = 1 << 20
    return profile_from_dict("tiny", {
        "total_bytes": dynamic_units * unit_bytes + 2 * overhead, "weights_bytes": overhead,
        "context_bytes": overhead, "gpu_memory_utilization": 1.0, "unit_tokens": 4,
        "page_class_tokens": [4, 64], "kv_bytes_per_token": 1024, "activation_bytes_per_token": 1024,
        "max_batched_tokens": 256, "max_num_seqs": 64, "max_model_len": 8192, "step_base_s": 0.01,
        "step_prefill_token_s": 0.0001, "step_decode_seq_s": 0.0002,
        "swap_capacity_bytes": swap_units * unit_bytes, "host_bandwidth_bytes_per_s": 1e10,
    })


def make_engine(**kw):
    profile = tiny_profile(**kw)
    pool = PagedPool(profile.geometry, node="t/gpu0", swap_capacity_units=profile.swap_capacity_units,
                     retain_ttl_ns=600 * NS_PER_S)
    return Engine(pool, profile, node="t/gpu0")


def running_engine(n=3, prompt=300, out=400, hashes=()):
    """An engine with ``n`` requests decoding (long outputs keep them running)."""
    e = make_engine()
    for i in range(n):
        e.submit(Request(i, 0, prompt, out, 5, hashes))
    e.advance(int(1.0 * NS_PER_S))
    assert all(v.state is SeqState.RUNNING for v in e.running_requests())
    e.take_events()
    return e


def command(payload) -> Command:
    return Command(id="c1", node="t/gpu0", payload=payload, reason="test", mode=Mode.DEFAULT, variant="v",
                   issued_at_ns=0, ttl_ns=30 * NS_PER_S)


def evict(*targets, granularity=Granularity.REQUEST, handling=HandlingChoice.RECOMPUTE) -> Command:
    return command(EvictPayload(targets, granularity, handling))


def live_units(engine, req):
    return sum(p.size for p in engine.pool.request_pages(req) if p.state is PageState.LIVE)


def test_request_eviction_frees_every_page_and_requeues_the_request():
    e = running_engine()
    held = live_units(e, 1)
    before = e.pool.metrics().free_units
    result = Executor(e).execute(evict(Target(1)), e.now_ns)
    assert result.outcome is AckOutcome.EXECUTED
    assert result.units_freed == held
    assert e.pool.metrics().free_units == before + held
    assert 1 not in {v.req for v in e.running_requests()}
    evicts = (ev := e.take_events())[ev["kind"] == EventKind.EVICT]
    assert len(evicts) and set(evicts["req"]) == {1}


def test_block_eviction_takes_tail_pages_and_keeps_the_shared_prefix():
    hashes = tuple(range(1, 300 // HASH_BLOCK_TOKENS + 1))
    e = running_engine(n=2, prompt=300, hashes=hashes)
    pages = e.pool.request_pages(0)
    shared = [p for p in pages if p.refcount > 1]
    assert shared, "the two requests share their prompt prefix"
    result = Executor(e).execute(evict(Target(0, 8), granularity=Granularity.BLOCK), e.now_ns)
    assert result.outcome is AckOutcome.EXECUTED
    assert 8 <= result.units_freed < sum(p.size for p in pages)
    assert all(p.refcount > 1 for p in e.pool.request_pages(1) if p.offset in {s.offset for s in shared})


def test_token_eviction_takes_the_oldest_private_pages():
    e = running_engine(n=1, prompt=300)
    private = [p for p in e.pool.request_pages(0) if p.state is PageState.LIVE and p.refcount == 1]
    result = Executor(e).execute(evict(Target(0, private[0].size), granularity=Granularity.TOKEN),
                                 e.now_ns)
    assert result.outcome is AckOutcome.EXECUTED and result.units_freed == private[0].size
    evicts = (ev := e.take_events())[ev["kind"] == EventKind.EVICT]
    assert list(evicts["offset"]) == [private[0].offset]


def test_swap_moves_pages_to_host_and_brings_them_back_when_running_again():
    e = running_engine(n=2)
    units = live_units(e, 0)
    result = Executor(e).execute(evict(Target(0), handling=HandlingChoice.SWAP), e.now_ns)
    assert result.outcome is AckOutcome.EXECUTED and result.units_freed == units
    assert e.pool.metrics().swap_used_units == units
    assert e.queue_lengths()["swapped"] == 1
    e.advance(e.now_ns + NS_PER_S)
    assert e.queue_lengths()["swapped"] == 0 and e.pool.metrics().swap_used_units == 0
    ev = e.take_events()
    assert (ev["kind"] == EventKind.SWAP_IN).any()


def test_swap_with_full_host_space_falls_back_to_recompute():
    e = make_engine(swap_units=1)
    e.submit(Request(0, 0, 300, 400, 5, ()))
    e.advance(NS_PER_S)
    result = Executor(e).execute(evict(Target(0), handling=HandlingChoice.SWAP), e.now_ns)
    assert result.outcome is AckOutcome.EXECUTED and result.units_freed > 0
    assert any("swap full" in err for err in result.errors)
    ev = e.take_events()
    assert set(ev[ev["kind"] == EventKind.EVICT]["flags"]) == {int(Handling.RECOMPUTE)}


def test_checkpoint_handling_writes_the_page_set_and_restores_it(tmp_path):
    profile = tiny_profile()
    pool = PagedPool(profile.geometry, node="t/gpu0", swap_capacity_units=profile.swap_capacity_units,
                     checkpoint_dir=tmp_path, retain_ttl_ns=600 * NS_PER_S)
    e = Engine(pool, profile, node="t/gpu0")
    e.submit(Request(0, 0, 300, 400, 5, ()))
    e.advance(NS_PER_S)
    result = Executor(e).execute(evict(Target(0), handling=HandlingChoice.CHECKPOINT), e.now_ns)
    assert result.outcome is AckOutcome.EXECUTED
    e.advance(e.now_ns + NS_PER_S)
    assert (e.take_events()["kind"] == EventKind.SWAP_IN).any()


@pytest.mark.parametrize("granularity", list(Granularity))
def test_finished_or_unknown_request_is_a_noop_not_an_error(granularity):
    e = make_engine()
    e.submit(Request(0, 0, 40, 2, 5, ()))
    e.advance(5 * NS_PER_S)
    assert e.summary().completed == 1
    result = Executor(e).execute(evict(Target(0, 4), Target(999, 4), granularity=granularity),
                                 e.now_ns)
    assert result.outcome is AckOutcome.NOOP and result.targets_noop == 2
    assert len(result.errors) == 2 and all("nothing to free" in e for e in result.errors)  # each says why


def test_one_finished_target_does_not_stop_the_others():
    e = running_engine(n=2)
    result = Executor(e).execute(evict(Target(77), Target(1)), e.now_ns)
    assert result.outcome is AckOutcome.EXECUTED and (result.targets_done, result.targets_noop) == (1, 1)


def test_compaction_coalesces_free_runs_without_evicting_anyone():
    e = running_engine(n=6, prompt=200, out=400)
    for req in (1, 3):  # holes between the survivors
        Executor(e).execute(evict(Target(req)), e.now_ns)
    before = e.pool.metrics()
    assert before.n_free_runs > 1
    running = {v.req for v in e.running_requests()}
    result = Executor(e).execute(command(CompactPayload(max_moves=1000)), e.now_ns)
    after = e.pool.metrics()
    assert result.outcome is AckOutcome.EXECUTED and result.units_moved > 0
    assert after.largest_free_run > before.largest_free_run and after.free_units == before.free_units
    assert {v.req for v in e.running_requests()} == running
    assert (e.take_events()["kind"] == EventKind.MIGRATE).any()


def test_reclaim_drops_cached_prefix_pages():
    hashes = tuple(range(1, 5))
    e = make_engine()
    e.submit(Request(0, 0, 256, 2, 5, hashes))
    e.advance(5 * NS_PER_S)
    cached = e.pool.metrics().cached_units
    assert cached > 0
    result = Executor(e).execute(command(ReclaimPayload(units=cached)), e.now_ns)
    assert result.outcome is AckOutcome.EXECUTED and result.units_freed == cached
    assert e.pool.metrics().cached_units == 0


def test_headroom_holds_space_back_from_admission_and_releases_it():
    e = make_engine()
    base = e.watermark_units
    executor = Executor(e)
    executor.execute(command(HeadroomPayload(units=500)), e.now_ns)
    assert e.watermark_units == base + 500
    executor.execute(command(HeadroomPayload(units=0)), e.now_ns)
    assert e.watermark_units == base


def test_a_headroom_above_the_pool_is_refused_with_the_reason_and_changes_nothing():
    e = make_engine()
    base = e.watermark_units
    result = Executor(e).execute(command(HeadroomPayload(units=e.pool_units + 1)), e.now_ns)
    assert result.outcome is AckOutcome.REJECTED_PAYLOAD
    assert f"exceeds this node's pool of {e.pool_units} units" in result.errors[0]
    assert e.watermark_units == base
    assert Executor(e).execute(command(HeadroomPayload(units=e.pool_units)), e.now_ns).outcome is AckOutcome.EXECUTED


def test_nothing_to_reclaim_or_compact_is_a_noop_that_says_why():
    e = make_engine()
    reclaim = Executor(e).execute(command(ReclaimPayload(units=10)), e.now_ns)
    assert reclaim.outcome is AckOutcome.NOOP and reclaim.errors == ("reclaim: no cached prefix pages to drop",)
    compact = Executor(e).execute(command(CompactPayload(max_moves=10)), e.now_ns)
    assert compact.outcome is AckOutcome.NOOP and compact.errors[0].startswith("compact: nothing moved")
