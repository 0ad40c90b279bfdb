"""The stream's allocator layer over expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True):
mapped pages merge into runs and unmapped pages split them, as PyTorch's snapshot shows them. Before, a
block carved from a run that had grown was "outside its segment" and the node's stream was rejected."""

from __future__ import annotations

import numpy as np
import pytest

from kvguard.actuators.executor import Executor
from kvguard.contracts.commands import Command, EmptyCachePayload, Mode
from kvguard.contracts.events import EVENT_DTYPE, SEG_MAPPED, EventKind
from kvguard.contracts.units import NS_PER_S
from kvguard.producers.sim.fleet import Fleet
from kvguard.producers.sim.profiles import EngineKnobs, load_profile
from kvguard.producers.sim.vllm.engine import VllmEngineConfig
from kvguard.producers.sim.workloads import load_workload
from kvguard.streams.allocator_layer import AllocatorLayer, AllocatorLayerError
from kvguard.streams.core import StreamConfig, StreamCore

MB = 1 << 20
BASE = 0x7F00_0000_0000


def rows(*items) -> np.ndarray:
    out = np.zeros(len(items), dtype=EVENT_DTYPE)
    for i, (kind, offset, size, aux) in enumerate(items):
        out[i]["kind"], out[i]["offset"], out[i]["size"], out[i]["aux"] = int(kind), offset, size, aux
    return out


SEG_ALLOC, SEG_FREE, BLK_ALLOC, BLK_FREE = EventKind.SEG_ALLOC, EventKind.SEG_FREE, EventKind.BLK_ALLOC, EventKind.BLK_FREE


def test_maps_merge_into_one_run_and_a_block_of_the_grown_run_is_inside_it():
    layer = AllocatorLayer()
    layer.apply(rows((SEG_ALLOC, BASE, 20 * MB, SEG_MAPPED), (SEG_ALLOC, BASE + 20 * MB, 40 * MB, SEG_MAPPED),
                     (BLK_ALLOC, BASE + 48 * MB, 9 * MB, BASE)))
    m = layer.metrics()
    assert (m.segments, m.reserved_bytes, m.allocated_bytes) == (1, 60 * MB, 9 * MB)
    assert sorted(layer.free_blocks(BASE)) == [3 * MB, 48 * MB]


def test_an_unmap_splits_the_run_and_refuses_pages_that_hold_a_block():
    layer = AllocatorLayer()
    layer.apply(rows((SEG_ALLOC, BASE, 60 * MB, SEG_MAPPED), (BLK_ALLOC, BASE, 4 * MB, BASE),
                     (BLK_ALLOC, BASE + 50 * MB, 4 * MB, BASE)))
    layer.apply(rows((SEG_FREE, BASE + 20 * MB, 20 * MB, SEG_MAPPED)))
    assert sorted(layer.segment_size.items()) == [(BASE, 20 * MB), (BASE + 40 * MB, 20 * MB)]
    assert layer.block_segment[BASE + 50 * MB] == BASE + 40 * MB
    with pytest.raises(AllocatorLayerError, match="allocated blocks"):
        layer.apply(rows((SEG_FREE, BASE, 20 * MB, SEG_MAPPED)))
    layer.apply(rows((BLK_FREE, BASE + 50 * MB, 4 * MB, BASE + 40 * MB)))
    layer.apply(rows((SEG_ALLOC, BASE + 20 * MB, 20 * MB, SEG_MAPPED)))  # mapped again: one run once more
    assert sorted(layer.segment_size.items()) == [(BASE, 60 * MB)]
    back = AllocatorLayer.from_dict(layer.to_dict())  # the stream's checkpoint keeps which runs grow
    back.apply(rows((SEG_ALLOC, BASE + 60 * MB, 2 * MB, SEG_MAPPED)))
    assert sorted(back.segment_size.items()) == [(BASE, 62 * MB)]


def test_plain_segments_next_to_each_other_never_merge():
    layer = AllocatorLayer()
    layer.apply(rows((SEG_ALLOC, BASE, 20 * MB, 0), (SEG_ALLOC, BASE + 20 * MB, 20 * MB, 0)))
    assert layer.metrics().segments == 2


def test_the_mirror_follows_an_engine_with_expandable_segments_through_empty_cache():
    profile = load_profile("llama3-8b-24gb-vllm", knobs=EngineKnobs(gpu_memory_utilization=0.95,
                                                                    allocator_conf="expandable_segments:True"))
    fleet = Fleet(1, profile, seed=0, config=VllmEngineConfig(prompt_logprobs_frac=0.1))
    fleet.submit_workload(load_workload("azure-conv", rate_scale=1.0, window=240, seed=0))
    core = StreamCore(StreamConfig())
    engine = fleet.engines[0]
    empty = Command(id="e", node=engine.node, payload=EmptyCachePayload(), reason="t", mode=Mode.DEFAULT,
                    variant="v", issued_at_ns=0, ttl_ns=NS_PER_S)
    unmapped = 0
    for now in range(1, 241):
        fleet.advance(now * NS_PER_S)
        if now % 60 == 0:
            Executor(engine).execute(empty, engine.now_ns)  # unmaps the free pages of the expandable runs
        batches = fleet.take_batches(now * NS_PER_S)
        for b in batches:
            ev = b.events
            unmapped += int(((ev["kind"] == int(SEG_FREE)) & (ev["aux"] == SEG_MAPPED)).sum())
        core.process_many(batches)
    assert core.counters.batches_failed == core.counters.batches_rejected == 0
    layer = core.nodes[engine.node].mirror.allocator
    stats = engine.memory.stats()
    assert unmapped > 0
    assert layer.metrics().reserved_bytes == stats["reserved_bytes"]
    assert layer.metrics().allocated_bytes == sum(block for _, block, _, _ in engine.memory.persistent.values()) > 0
    assert layer.metrics().segments == len(engine.memory.twin.snapshot()["segments"])


def _from_scratch(layer: AllocatorLayer) -> tuple[int, int, int]:
    """Reserved bytes, largest free block and inactive split bytes by a walk of every segment."""
    largest = split = 0
    for segment, blocks in layer.blocks_of.items():
        gaps = layer.free_blocks(segment)
        if gaps:
            largest = max(largest, max(gaps))
            split += sum(gaps) if blocks else 0
    return sum(layer.segment_size.values()), largest, split


def test_incremental_figures_equal_a_walk_of_every_segment_through_maps_unmaps_and_blocks():
    """Random maps, unmaps, plain segments and blocks (refused rows included): after every row the
    layer's kept figures equal a from-scratch walk, asked for after each row or only now and then."""
    import random

    for seed in range(6):
        rng = random.Random(seed)
        eager, lazy = AllocatorLayer(), AllocatorLayer()
        for i in range(400):
            kind = rng.choice([EventKind.SEG_ALLOC, EventKind.SEG_FREE, EventKind.BLK_ALLOC, EventKind.BLK_ALLOC,
                               EventKind.BLK_FREE])
            mapped = rng.random() < 0.5
            address = BASE + rng.randrange(0, 64) * MB
            size = rng.randrange(1, 8) * MB
            segment = rng.choice(sorted(eager.segment_size) or [BASE])
            if kind == EventKind.BLK_FREE and eager.block_size:
                address = rng.choice(sorted(eager.block_size))
            if kind == EventKind.BLK_ALLOC:
                address, size = segment + rng.randrange(0, 4) * MB, rng.randrange(1, 3) * MB
            aux = SEG_MAPPED if mapped and kind in (EventKind.SEG_ALLOC, EventKind.SEG_FREE) else segment
            for layer in (eager, lazy):
                try:
                    layer.apply(rows((kind, address, size, aux)))
                except AllocatorLayerError:
                    pass
            m = eager.metrics()
            assert (m.reserved_bytes, m.largest_free_block_bytes, m.inactive_split_bytes) == _from_scratch(eager)
            if i % 37 == 0:
                m = lazy.metrics()
                assert (m.reserved_bytes, m.largest_free_block_bytes, m.inactive_split_bytes) == _from_scratch(lazy)
        assert eager.metrics() == lazy.metrics()
        assert len(eager.segment_size) > 0 and eager.block_size
