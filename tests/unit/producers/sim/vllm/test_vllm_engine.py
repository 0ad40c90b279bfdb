"""The vLLM-faithful engine: KV shortage preempts, CUDA OOMs come from the allocator twin with a cause,
restarts heal, over-long prompts are rejected, the mirror follows its blocks, fusion changes nothing."""

import numpy as np
import pytest

from kvguard.contracts.events import EventKind, OomCause, OomLayer, Outcome, Pool
from kvguard.contracts.units import NS_PER_S
from kvguard.producers.sim.fleet import Fleet
from kvguard.producers.sim.profiles import EngineKnobs, ProfileError, load_profile, profile_from_dict
from kvguard.producers.sim.torch_allocator.caching_allocator import OutOfMemoryError
from kvguard.producers.sim.vllm.engine import VllmEngine, VllmEngineConfig
from kvguard.producers.sim.workloads import Request, load_workload
from kvguard.streams.mirror import AllocatorMirror

MiB = 1 << 20
TINY_MODEL = {"num_hidden_layers": 4, "hidden_size": 512, "intermediate_size": 1408, "num_attention_heads": 8,
              "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 32000, "torch_dtype": "bfloat16"}


def tiny_vllm_profile(*, vocab: int = 32000, total_mib: int = 1024, runner: str = "v1", **over):
    """A 4-layer model on a 1 GiB "GPU": about 2,100 blocks of 16 tokens, so tests fill it quickly. The V1
    model runner unless asked (these tests were calibrated on its sampler and prompt-logprob paths;
    ``VLLM_USE_V2_MODEL_RUNNER=0`` in vLLM 0.33)."""
    d = {"engine": "vllm", "total_bytes": total_mib * MiB, "weights_bytes": 600 * MiB, "context_bytes": 30 * MiB,
         "gpu_memory_utilization": 0.9, "max_batched_tokens": 512, "max_num_seqs": 32, "max_model_len": 4096,
         "step_base_s": 0.01, "step_prefill_token_s": 0.0001, "step_decode_seq_s": 0.0001,
         "host_bandwidth_bytes_per_s": 1e10,
         "vllm": {"hf_config": dict(TINY_MODEL, vocab_size=vocab), "model_runner": runner}}
    d.update(over)
    return profile_from_dict("tiny-vllm", d)


def _engine(profile=None, **config):
    return VllmEngine(profile or tiny_vllm_profile(), node="t/gpu0", config=VllmEngineConfig(**config))


def _kinds(rows, kind):
    return rows[rows["kind"] == kind]


def test_profile_ledger_is_measured_the_way_vllm_sizes_the_kv_cache():
    p = tiny_vllm_profile()
    m = p.memory
    budget = int(p.geometry.total_bytes * 0.9)
    assert m.kv_cache_bytes == budget - m.weights_bytes - m.profile_peak_bytes - m.non_torch_increase_bytes
    assert m.num_gpu_blocks == m.kv_cache_bytes // m.block_bytes
    assert m.block_bytes == 16 * 2 * 4 * 8 * 64 * 2  # block_size x K,V x layers x kv heads x head_dim x bf16
    assert p.geometry.dynamic_units == m.num_gpu_blocks - 1  # block 0 is vLLM's null block
    assert p.geometry.page_classes == (1,) and p.geometry.unit_tokens == 16
    assert p.workspace_units(512) == 0


def test_bundled_vllm_profiles_load_and_name_their_engine():
    small, big = load_profile("llama3-8b-24gb-vllm"), load_profile("llama3-70b-tp8-80gb-vllm")
    assert small.engine == big.engine == "vllm"
    assert load_profile("llama3-8b-24gb").engine == "seed"
    # llm-d-benchmark logs 4.84 GiB of activation peak for Llama-3.3-70B (8192 tokens, 1024 seqs) on the V1
    # runner; 0.33's Model Runner V2 profiles FlashInfer's sampler (no full-vocabulary sort): less
    v1 = load_profile("llama3-70b-tp8-80gb-vllm", knobs=EngineKnobs(model_runner="v1"))
    assert v1.memory.profile_peak_bytes / (1 << 30) == pytest.approx(4.84, abs=0.01)
    assert big.memory.profile_peak_bytes < v1.memory.profile_peak_bytes
    assert big.vllm.model_runner == "v2" and big.geometry.gpu_memory_utilization == 0.92  # vLLM 0.33's defaults
    assert small.capacity_tokens >= small.max_model_len


def test_a_worker_that_cannot_start_is_a_profile_error():
    with pytest.raises(ProfileError, match="max_model_len"):
        tiny_vllm_profile(max_model_len=64000)
    with pytest.raises(ProfileError, match="gpu_memory_utilization"):
        tiny_vllm_profile(context_bytes=200 * MiB)  # the context leaves less than 90 % free


@pytest.mark.parametrize("setting, field", [({"policy": "lifo"}, "policy"), ({"cudagraph_mode": "ALL"}, "cudagraph_mode"),
                                            ({"watermark": 2}, "vllm.watermark"), ({"sampling": "beam"}, "vllm.sampling"),
                                            ({"allocator_conf": "max_split_size_mb:1"}, "max_split_size")])
def test_bad_vllm_settings_are_named(setting, field):
    with pytest.raises(ProfileError, match=field):
        tiny_vllm_profile(vllm={"hf_config": TINY_MODEL, "model_runner": "v1", **setting})


def test_kv_shortage_preempts_and_never_ooms():
    e = _engine()
    for i in range(40):  # 40 x (1500 + 1500) tokens: far beyond ~34k tokens of KV
        e.submit(Request(i, i * NS_PER_S // 10, 1500, 1500))
    e.advance(200 * NS_PER_S)
    rows = e.take_events()
    s = e.summary()
    assert s.preemptions > 0 and s.ooms == 0 and s.failed == 0
    assert len(_kinds(rows, EventKind.PREEMPT)) == s.preemptions
    assert len(_kinds(rows, EventKind.OOM)) == 0


def test_activation_peak_beyond_the_profiled_headroom_ooms_with_the_prompt_logprob_cause():
    # prompt logprobs: 512 prompt positions x 128k vocab of logits and fp32 log-softmax (~394 MB),
    # which the profiling run never measured (vLLM #5907): their bytes alone exceed what was missing,
    # so the OOM is the prompt-logprob class's; the allocator saw a plain peak (no fragmentation)
    e = _engine(tiny_vllm_profile(vocab=128256), prompt_logprobs_frac=1.0, restart_s=30.0)
    for i in range(3):
        e.submit(Request(i, 0, 2000, 50))
    e.submit(Request(9, 3 * NS_PER_S, 100, 10))  # arrives while the GPU restarts
    e.advance(10 * NS_PER_S)
    rows = e.take_events()
    (oom,) = _kinds(rows, EventKind.OOM)
    assert oom["cls"] == OomLayer.ALLOCATOR and oom["flags"] == OomCause.PROMPT_LOGPROBS
    log = e.oom_log[0]
    assert oom["size"] == log["requested_bytes"] > 0 and oom["aux"] == log["reserved_unallocated_bytes"]
    assert log["reserved_unallocated_bytes"] < log["requested_bytes"] and not log["fragmentation"]
    assert log["allocation"].startswith("pl_")
    assert e.ooms_by_cause == {"allocator:prompt_logprobs": 1}
    finish = _kinds(rows, EventKind.FINISH)
    assert sorted(finish["flags"].tolist()) == [Outcome.FAILED_OOM] * 3 + [Outcome.REJECTED]
    assert e.rejected_by_reason == {"engine_restarting": 1}
    assert not e.is_up(10 * NS_PER_S) and e.is_up(31 * NS_PER_S)
    assert rows["kind"].tolist().index(EventKind.RESET) > rows["kind"].tolist().index(EventKind.OOM)


def _fragment(engine) -> None:
    """A long-lived allocation pattern that leaves the cache in 3 MiB holes, with the device full."""
    twin, device = engine.memory.twin, engine.memory.driver.memory
    device.reserve_external(device.free_bytes - 40 * MiB)
    pins = []
    with pytest.raises(OutOfMemoryError):
        while True:
            pins.append(twin.malloc(3 * MiB))
    for address in pins[::2]:
        twin.free(address)


def test_reserved_but_unallocated_memory_that_covers_the_request_is_a_fragmentation_oom_and_restart_heals():
    e = _engine(restart_s=20.0)
    for i in range(32):
        e.submit(Request(i, 0, 16, 1000))
    e.advance(NS_PER_S // 100)  # one step: all 32 prefilled and decoding
    assert e.queue_lengths()["running"] == 32
    _fragment(e)
    e.advance(NS_PER_S)
    rows = e.take_events()
    (oom,) = _kinds(rows, EventKind.OOM)
    assert oom["cls"] == OomLayer.ALLOCATOR and oom["flags"] == OomCause.FRAGMENTATION
    assert oom["aux"] >= oom["size"]  # reserved but unallocated would have covered the request
    assert e.summary().failed == 32 and e.ooms_by_cause == {"allocator:fragmentation": 1}
    retries = _kinds(rows, EventKind.ALLOC_RETRY)
    assert len(retries) >= 1
    # the dying process gives back every segment it held
    segs = {}
    for r in rows[np.isin(rows["kind"], [EventKind.SEG_ALLOC, EventKind.SEG_FREE])]:
        if r["kind"] == EventKind.SEG_ALLOC:
            segs[int(r["offset"])] = int(r["size"])
        else:
            assert segs.pop(int(r["offset"])) == r["size"]
    assert segs == {}
    # the restart heals: a fresh worker serves the same load without an OOM
    for i in range(100, 132):
        e.submit(Request(i, 30 * NS_PER_S, 16, 100))
    e.advance(60 * NS_PER_S)
    s = e.summary()
    assert s.ooms == 1 and s.completed == 32 and e.restarts == 1
    assert e.allocator_summary()["num_alloc_retries"] >= 1


def test_prompts_over_max_model_len_are_rejected_at_arrival_and_counted_not_truncated():
    e = _engine()
    e.submit(Request(1, 0, 5000, 10))  # > max_model_len 4096
    e.submit(Request(2, 0, 4096, 10))  # == max_model_len: no room for an output token
    e.submit(Request(3, 0, 4095, 10))
    e.advance(5 * NS_PER_S)
    rows = e.take_events()
    assert e.rejected_by_reason == {"prompt_longer_than_max_model_len": 1, "prompt_equals_max_model_len": 1}
    assert _kinds(rows, EventKind.ARRIVE)["tokens"].tolist() == [5000, 4096, 4095]
    flags = {int(r["req"]): int(r["flags"]) for r in _kinds(rows, EventKind.FINISH)}
    assert flags == {1: Outcome.REJECTED, 2: Outcome.REJECTED, 3: Outcome.COMPLETED}


def _digest(engine):
    s, kv = engine.scheduler, engine.scheduler.kv
    cached = {h: (v.block_id if not isinstance(v, dict) else tuple(v)) for h, v in kv.pool.cached.items()}
    return (s.step, s.num_finished, s.num_preemptions, [b.block_id for b in kv.pool.free_queue], cached,
            {r: [b.block_id for b in blocks] for r, blocks in kv.req_to_blocks.items()},
            {r: (q.num_computed_tokens, q.num_tokens, tuple(q.block_hashes)) for r, q in s.requests.items()},
            engine.memory.stats())


@pytest.mark.parametrize("workload, rate", [("rag", 1.0), ("mooncake-sample", 2.0)])
def test_fused_decode_gives_the_same_rows_and_state_as_one_scheduler_call_per_step(workload, rate):
    wl = load_workload(workload, window=120, rate_scale=rate)
    runs = []
    for fuse in (False, True):
        e = _engine(fuse_decode=fuse)
        for r in wl.requests:
            e.submit(r)
        rows, digests = [], []
        for t in range(5, 200, 5):
            e.advance(t * NS_PER_S)
            rows.append(e.take_events())
            digests.append(_digest(e))
        runs.append((np.concatenate(rows), digests, e.summary(), e.steps))
    (ra, da, sa, na), (rb, db, sb, nb) = runs
    keep = lambda r: r[~np.isin(r["kind"], [EventKind.FILL, EventKind.STEP])]
    assert np.array_equal(keep(ra), keep(rb))
    assert _kinds(ra, EventKind.FILL)["tokens"].sum() == _kinds(rb, EventKind.FILL)["tokens"].sum()
    assert da == db and na == nb
    assert (sa.completed, sa.preemptions, sa.ttft_p99_s, sa.tpot_p50_s) == (sb.completed, sb.preemptions,
                                                                            sb.ttft_p99_s, sb.tpot_p50_s)
    assert len(_kinds(rb, EventKind.STEP)) < len(_kinds(ra, EventKind.STEP))  # it did fuse
    assert sa.preemptions > 0 or workload == "mooncake-sample"  # the KV pool ran short at least once


def test_mirror_stays_in_sync_with_the_block_pool_at_every_snapshot():
    fleet = Fleet(2, tiny_vllm_profile(), seed=1, snapshot_every_s=7.0)
    fleet.submit_workload(load_workload("rag", window=90, seed=1, rate_scale=3.0))
    mirrors = {n: AllocatorMirror(fleet.profile.geometry) for n in fleet.nodes}
    engines = {e.node: e for e in fleet.engines}
    checked = 0
    for t in range(1, 150):
        fleet.advance(t * NS_PER_S)
        for b in fleet.take_batches(t * NS_PER_S):
            mirrors[b.node].apply(b.events, b.state)
            if b.state is not None:
                m, c = mirrors[b.node].metrics(), engines[b.node].pool.counts()
                assert (m.live_units, m.cached_units, m.free_units, m.tokens_stored) == (
                    c["live_units"], c["cached_units"], c["free_units"], c["tokens_stored"])
                checked += 1
    assert checked > 20
    assert all(m.drift_count == 0 and m.synced for m in mirrors.values())
    assert sum(int(m.kind_counts[EventKind.SHARE]) for m in mirrors.values()) > 0  # prefix hits happened
    assert sum(int(m.kind_counts[EventKind.RECLAIM]) for m in mirrors.values()) > 0  # lazy evictions too
    assert fleet.summary().preemptions > 0


def test_fleet_runs_a_bundled_vllm_profile_end_to_end():
    fleet = Fleet(2, load_profile("llama3-8b-24gb-vllm"), seed=0)
    fleet.submit_workload(load_workload("azure-conv", window=40))
    batches = []
    for t in range(10, 130, 10):
        fleet.advance(t * NS_PER_S)
        batches += fleet.take_batches(t * NS_PER_S)
    assert all(isinstance(e, VllmEngine) for e in fleet.engines)
    s = fleet.summary()
    assert s.requests > 50 and s.completed == s.requests and s.ooms == 0
    assert batches[0].geometry.dynamic_units == fleet.profile.memory.num_gpu_blocks - 1
    rows = np.concatenate([b.events for b in batches])
    blk = _kinds(rows, EventKind.BLK_ALLOC)
    # per GPU (Model Runner V2): the cuBLAS workspace made before the snapshot, 12 runner buffers (inputs,
    # request state, the penalties' bin counts and mask), FlashInfer's row states, 3 block-table tensors
    assert len(blk) == 2 * (1 + 12 + 1 + 3)
    assert set(blk["cls"].tolist()) <= {Pool.SMALL, Pool.LARGE}
    for gpu in fleet.per_gpu():
        assert {"peak_reserved_bytes", "peak_allocated_bytes", "inactive_split_bytes",
                "num_alloc_retries"} <= gpu["allocator"].keys()
        assert gpu["ooms_by_cause"] == {}


def test_actions_without_a_vllm_counterpart_are_explicit_no_ops_and_eviction_is_preemption():
    e = _engine()
    for i in range(4):
        e.submit(Request(i, 0, 100, 500))
    e.advance(NS_PER_S)
    assert e.compact(e.now_ns, 10) == 0 and e.pool.reclaim_cached(10, e.now_ns) == 0
    assert e.evict_request(0, e.now_ns, granularity="block", pages=1).pages == 0
    pages = len(e.pool.request_pages(1))
    result = e.evict_request(1, e.now_ns)
    assert result.pages == pages and result.units_freed == pages and e.evictions == 1
    assert e.preemptions == 0  # a policy eviction is not a preemption for lack of blocks
    assert e.queue_lengths()["waiting"] == 1
    e.set_admission_headroom(5)
    assert e.scheduler.kv.watermark_blocks == 5
    e.advance(30 * NS_PER_S)
    assert e.summary().completed == 4  # the evicted request came back and finished
