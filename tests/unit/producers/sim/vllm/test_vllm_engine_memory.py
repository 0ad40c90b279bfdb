"""One vLLM worker's memory: the start-up ledger vLLM measures, the allocator rows, and the exact shortcuts."""

import numpy as np
import pytest

from kvguard.contracts.events import EventKind, OomCause
from kvguard.producers.sim.profiles import VllmSpec
from kvguard.producers.sim.vllm.kv import EventRecorder
from kvguard.producers.sim.vllm.memory import StepOOM, WorkerMemory, measure_ledger
from kvguard.producers.vllm.step_memory import ModelShape, profile_peak_bytes

GiB, MiB = 1 << 30, 1 << 20
LLAMA3_8B = ModelShape(num_layers=32, hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=8,
                       head_dim=128, vocab_size=128256)
TINY = ModelShape(num_layers=4, hidden_size=512, intermediate_size=1408, num_heads=8, num_kv_heads=8, head_dim=64,
                  vocab_size=32000)
# a mix of eager prefills (> 64 tokens: capture sizes stop at 2 * max_num_seqs), piecewise steps and
# repeated decode steps of several batch sizes
STEPS = [(300, 20), (40, 20), (20, 20), (20, 20), (19, 19), (400, 31), (20, 20), (31, 31), (31, 31), (200, 3),
         (500, 32), (500, 32), (32, 32), (3, 3), (19, 19)]


def _worker(spec=None, *, fast=True, recorder=None, total=1 * GiB, **kw):
    args = {"total_bytes": total, "weights_bytes": 600 * MiB, "context_bytes": 30 * MiB, "gpu_memory_utilization": 0.9,
            "max_num_batched_tokens": 512, "max_num_seqs": 32, "max_model_len": 4096}
    args.update(kw)
    return WorkerMemory(spec or VllmSpec(shape=TINY, model_runner="v1"), fast=fast,
                        emit=recorder.allocator_row if recorder is not None else None, **args)


def test_llama_8b_on_h100_gives_the_activation_peak_and_kv_cache_vllm_logs():
    # llm-d-benchmark, vLLM 0.11 on H100 (79.18 GiB): peak 4.76 GiB, non-torch 0.13, KV 51.38 GiB
    spec = VllmSpec(shape=LLAMA3_8B, non_torch_increase_bytes=int(0.13 * GiB), cublas_workspace_bytes=33 * MiB,
                    model_runner="v1")
    ledger = measure_ledger(spec, total_bytes=int(79.18 * GiB), weights_bytes=int(14.99 * GiB),
                            context_bytes=int(0.61 * GiB), gpu_memory_utilization=0.9, max_num_batched_tokens=8192,
                            max_num_seqs=1024, max_model_len=16000)
    assert ledger.profile_peak_bytes / GiB == pytest.approx(4.76, abs=0.005)
    assert ledger.kv_cache_bytes / GiB == pytest.approx(51.38, abs=0.005)


def test_the_twin_measures_the_profile_peak_from_the_same_plan_step_memory_sizes():
    worker = _worker()
    plan_peak = profile_peak_bytes(TINY, 512, 32, 4096 * 1024 * 2 + 16 * 1024 * 8 + 1024 * 1024)
    # blocks the allocator does not split are counted whole, as torch's allocated_bytes does
    assert plan_peak <= worker.ledger.profile_peak_bytes < plan_peak + 4 * MiB


def test_fast_replays_leave_the_allocator_exactly_as_full_replays_do():
    recs = [EventRecorder(), EventRecorder()]
    slow, fast = _worker(fast=False, recorder=recs[0]), _worker(fast=True, recorder=recs[1])
    for t, (n, r) in enumerate(STEPS):
        slow.run_step(n, r, t)
        fast.run_step(n, r, t)
        a, b = slow.twin.memory_stats(), fast.twin.memory_stats()
        for key in a:
            if key.endswith((".current", ".peak")) or key.startswith("num_"):
                assert a[key] == b[key], (t, key)
    assert slow.twin.snapshot()["segments"] == fast.twin.snapshot()["segments"]
    # and the fast one skipped most of the work: repeated steps and repeated decoder layers
    assert fast.twin.memory_stats()["allocation.all.allocated"] < 0.8 * slow.twin.memory_stats()["allocation.all.allocated"]
    ra, rb = recs[0].take(), recs[1].take()
    assert np.array_equal(ra, rb) and len(ra) > 0


def test_allocator_rows_rebuild_the_segments_and_the_persistent_blocks():
    rec = EventRecorder()
    worker = _worker(recorder=rec)
    for t, (n, r) in enumerate(STEPS):
        worker.run_step(n, r, t)
    rows = rec.take()
    segments, blocks = {}, {}
    for row in rows:
        kind, address, size = int(row["kind"]), int(row["offset"]), int(row["size"])
        if kind == EventKind.SEG_ALLOC:
            segments[address] = size
        elif kind == EventKind.SEG_FREE:
            assert segments.pop(address) == size
        elif kind == EventKind.BLK_ALLOC:
            blocks[address] = (size, int(row["aux"]))
        elif kind == EventKind.BLK_FREE:
            del blocks[address]
    snap = worker.twin.snapshot()["segments"]
    assert segments == {s["address"]: s["total_size"] for s in snap}
    live = {b["address"]: (b["size"], s["address"]) for s in snap for b in s["blocks"]
            if b["state"] == "active_allocated"}
    assert blocks == live and len(blocks) == 10  # 9 persistent input buffers + the cuBLAS workspace
    worker.shutdown(99)
    ends = rec.take()
    assert len(ends[ends["kind"] == EventKind.SEG_FREE]) == len(snap)
    assert len(ends[ends["kind"] == EventKind.BLK_FREE]) == 10


def test_a_step_beyond_the_headroom_raises_a_cuda_oom_with_its_cause():
    from kvguard.producers.vllm.step_memory import Batch

    big_vocab = ModelShape(**{**{f: getattr(TINY, f) for f in TINY.__slots__}, "vocab_size": 128256})
    worker = _worker(VllmSpec(shape=big_vocab, model_runner="v1"))
    worker.run_step(512, 1, 0)  # the same chunk without prompt logprobs fits the profiled peak
    # its 512 prompt positions with prompt logprobs: logits and an fp32 log-softmax over 128k (vLLM #5907)
    batch = Batch((512,), (512,), sampling="top_p", prompt_lens=(2000,), prompt_logprobs_tokens=(512,))
    with pytest.raises(StepOOM) as info:
        worker.run_step(512, 1, 1, batch=batch)
    assert info.value.cause is OomCause.PROMPT_LOGPROBS and info.value.error.cause == "peak"
    error = info.value.error
    assert error.reserved_unallocated_bytes < error.rounded_bytes
