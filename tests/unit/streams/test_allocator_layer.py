"""The stream's allocator layer, fed only StepRecorder's rows, equals the caching-allocator twin at
every step boundary (property test), and refuses rows that contradict it."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.contracts.events import EventKind, empty_events
from kvguard.producers.sim.torch_allocator.caching_allocator import CachingAllocator, OutOfMemoryError
from kvguard.producers.torch_cuda import StepRecorder
from kvguard.streams.allocator_layer import AllocatorLayer, AllocatorLayerError
from kvguard.streams.mirror import AllocatorMirror
from tests.unit.streams.streams_refpool import small_geometry

MiB = 1 << 20
sizes = st.one_of(st.integers(1, 4096), st.integers(4096, 2 * MiB), st.integers(2 * MiB, 40 * MiB))
step = st.lists(st.tuples(sizes, st.booleans()), min_size=1, max_size=12)  # (size, outlives the step?)


def check_equal(layer: AllocatorLayer, twin: CachingAllocator) -> None:
    m = layer.metrics()
    stats = twin.memory_stats()
    assert m.reserved_bytes == twin.reserved_bytes
    assert m.allocated_bytes == twin.allocated_bytes
    assert m.largest_free_block_bytes == twin.largest_free_cached_block()
    assert m.inactive_split_bytes == stats["inactive_split_bytes.all.current"]
    assert m.segments == stats["segment.all.current"]
    assert m.alloc_retries == stats["num_alloc_retries"]


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(step, min_size=1, max_size=8), empty_every=st.integers(0, 3), seed=st.integers(0, 10**6))
def test_layer_rebuilt_from_step_rows_equals_the_twin(steps, empty_every, seed):
    twin = CachingAllocator(256 * MiB)
    recorder, layer = StepRecorder(twin), AllocatorLayer()
    kept: list[int] = []
    rng = np.random.default_rng(seed)
    for i, ops in enumerate(steps):
        transient = []
        for size, outlives in ops:
            try:
                address = twin.malloc(size)
            except OutOfMemoryError:
                break
            (kept if outlives else transient).append(address)
        for address in transient:
            twin.free(address)
        if kept and rng.random() < 0.3:
            twin.free(kept.pop(int(rng.integers(len(kept)))))
        if empty_every and i % empty_every == 0:
            twin.empty_cache()
        layer.apply(recorder.rows(ts_ns=i))
        check_equal(layer, twin)
    # the rows survive the stream's checkpoint
    again = AllocatorLayer.from_dict(layer.to_dict())
    assert again.metrics() == layer.metrics()


def test_a_step_that_frees_what_it_allocated_emits_nothing():
    twin = CachingAllocator(256 * MiB)
    recorder = StepRecorder(twin)
    recorder.rows(0)
    for _ in range(3):
        for a in [twin.malloc(s) for s in (3 * MiB, 512, 12 * MiB)]:
            twin.free(a)
        rows = recorder.rows(1)
    assert len(rows) == 0 and twin.reserved_bytes > 0


def test_contradicting_rows_are_refused():
    layer = AllocatorLayer()
    rows = empty_events(2)
    rows[0] = (0, EventKind.SEG_ALLOC, 1, 0, -1, 1 << 30, 20 * MiB, 0, 0)
    rows[1] = (0, EventKind.BLK_ALLOC, 1, 0, -1, (1 << 30) + 19 * MiB, 2 * MiB, 0, 1 << 30)  # past the segment end
    with pytest.raises(AllocatorLayerError, match="outside segment"):
        layer.apply(rows)


def test_the_mirror_routes_allocator_rows_to_its_layer_and_a_reset_clears_it():
    mirror = AllocatorMirror(small_geometry())
    twin = CachingAllocator(256 * MiB)
    recorder = StepRecorder(twin)
    twin.malloc(5 * MiB)
    mirror.apply(recorder.rows(1))
    assert mirror.allocator.metrics().reserved_bytes == twin.reserved_bytes > 0
    reset = empty_events(1)
    reset[0] = (2, EventKind.RESET, 0, 0, -1, 0, 0, 0, 0)
    mirror.apply(reset)
    assert mirror.allocator.metrics().reserved_bytes == 0


def test_ticks_carry_the_allocator_family_and_uniform_blocks_have_no_kv_fragmentation():
    from kvguard.contracts.events import EventBatch
    from kvguard.contracts.units import NS_PER_S
    from kvguard.streams.core import StreamCore

    twin = CachingAllocator(256 * MiB)
    recorder = StepRecorder(twin)
    kept = twin.malloc(5 * MiB)
    for a in [twin.malloc(s) for s in (30 * MiB, 700)]:
        twin.free(a)
    rows = recorder.rows(1)
    step = empty_events(1)
    step[0] = (11 * NS_PER_S, EventKind.STEP, 0, 0, -1, -1, 0, 0, 0)
    core = StreamCore()
    geometry = small_geometry(classes=(1,))  # one unit per block, no workspace: vLLM's uniform blocks
    ticks, _ = core.process(EventBatch("n", 0, np.concatenate([rows, step]), geometry=geometry))
    tick = ticks[0]
    assert tick.alloc_reserved_bytes == twin.reserved_bytes and tick.alloc_allocated_bytes == twin.allocated_bytes
    assert tick.alloc_largest_free_block_bytes == twin.largest_free_cached_block() > 0
    assert tick.alloc_inactive_split_bytes == twin.memory_stats()["inactive_split_bytes.all.current"] > 0
    assert 0 < tick.alloc_f_ext < 1 and tick.f_ext == 0.0
    assert tick.alloc_segments == twin.memory_stats()["segment.all.current"] == 3
    assert tick.util_reserved_unused == (twin.reserved_bytes - twin.allocated_bytes) / geometry.total_bytes
    twin.free(kept)


def test_a_workspace_alloc_fail_names_no_request_and_counts_no_waiting_one():
    from kvguard.contracts.events import EventBatch
    from kvguard.contracts.units import NS_PER_S
    from kvguard.streams.core import StreamCore

    rows = empty_events(2)
    rows[0] = (NS_PER_S, EventKind.ALLOC_FAIL, 0, 0, -1, 0, 64, 0, 10)  # the step workspace found no run
    rows[1] = (11 * NS_PER_S, EventKind.STEP, 0, 0, -1, -1, 0, 0, 0)
    ticks, _ = StreamCore().process(EventBatch("n", 0, rows, geometry=small_geometry()))
    assert ticks[0].alloc_failures == 1 and ticks[0].requests_waiting == 0
