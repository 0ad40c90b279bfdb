"""The vLLM-v1 block pool and KV cache manager (producers.sim.vllm.kv_blocks): prefix hits, lazy eviction order,
ref counts, the full-sequence gate, the watermark, and a property test of the pool's invariants.

Profiles: ``ci`` (default) and ``thorough``; pick with KVGUARD_HYPOTHESIS_PROFILE.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvguard.producers.sim.vllm.kv_blocks import (
    NO_HIT,
    ROOT_HASH,
    BlockPool,
    BlockPoolExhausted,
    KVCacheManager,
    chain_hash,
    prompt_block_keys,
    token_block_key,
)

BS = 4  # block size in these tests: small, so a few tokens make several blocks


@dataclass
class Seq:
    """The minimal SequenceView: tokens known, hashes of full blocks kept up to date."""

    request_id: int
    token_ids: list[int]
    num_computed_tokens: int = 0
    waiting: bool = True
    block_hashes: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.rehash()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_waiting(self) -> bool:
        return self.waiting

    def rehash(self) -> None:
        parent = self.block_hashes[-1] if self.block_hashes else ROOT_HASH
        for k in range(len(self.block_hashes), self.num_tokens // BS):
            parent = chain_hash(parent, token_block_key(self.token_ids[k * BS:(k + 1) * BS]))
            self.block_hashes.append(parent)


def admit(kv: KVCacheManager, seq: Seq, num_new_tokens: int | None = None, **kw) -> list[int] | None:
    """What the scheduler does for a waiting request: hit, allocate, mark computed."""
    hit = kv.get_computed_blocks(seq)
    n = seq.num_tokens - hit.num_tokens if num_new_tokens is None else num_new_tokens
    new = kv.allocate_slots(seq, n, hit, **kw)
    if new is not None:
        seq.num_computed_tokens = hit.num_tokens + n
        seq.waiting = False
    return new


def manager(num_blocks: int = 11, **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size=BS, max_model_len=kw.pop("max_model_len", 64), **kw)


def test_usage_is_used_over_usable_blocks_with_the_null_block_left_out():
    kv = manager(11)  # 10 usable
    assert kv.pool.null_block.block_id == 0 and kv.num_free_blocks == 10 and kv.usage == 0.0
    admit(kv, Seq(1, list(range(10))))  # 3 blocks
    assert kv.num_free_blocks == 7 and kv.usage == pytest.approx(0.3)
    assert BlockPool(1).usage == 0.0


def test_prefix_hit_reuses_cached_blocks_but_always_recomputes_the_last_token():
    kv = manager()
    a = Seq(1, list(range(12)))
    admit(kv, a)
    table_a = kv.block_ids(1)
    same = Seq(2, list(range(12)))  # 12 tokens = 3 full blocks, but the hit stops at 11 tokens
    assert kv.get_computed_blocks(same).num_tokens == 8
    longer = Seq(3, list(range(13)))
    hit = kv.get_computed_blocks(longer)
    assert hit.num_tokens == 12 and tuple(b.block_id for b in hit.blocks) == table_a
    other = Seq(4, [99] + list(range(1, 13)))  # first block differs: the chain breaks at once
    assert kv.get_computed_blocks(other) is NO_HIT


def test_shared_blocks_count_references_and_return_to_the_free_queue_with_the_last_one():
    kv = manager()
    a, b = Seq(1, list(range(9))), Seq(2, list(range(9)))
    admit(kv, a)
    admit(kv, b)  # hits a's 2 full blocks, allocates 1 more
    shared = kv.pool.blocks[kv.block_ids(1)[0]]
    assert shared.ref_count == 2 and kv.block_ids(1)[:2] == kv.block_ids(2)[:2]
    kv.free(1)
    assert shared.ref_count == 1 and shared not in list(kv.pool.free_queue)
    kv.free(2)
    assert shared.ref_count == 0 and shared in list(kv.pool.free_queue)


def test_freed_blocks_go_uncached_to_the_head_and_cached_to_the_tail_tail_block_first():
    kv = manager(11)
    a = Seq(1, list(range(10)))  # blocks 1, 2 full (cached), block 3 partial (uncached)
    admit(kv, a)
    assert kv.block_ids(1) == (1, 2, 3)
    kv.free(1)
    order = [b.block_id for b in kv.pool.free_queue]
    assert order[0] == 3  # the uncached partial block is reused first
    assert order[-2:] == [2, 1]  # cached blocks at the tail, the request's last block evicted first


def test_cached_free_blocks_are_evicted_lazily_least_recently_freed_first():
    kv = manager(7)  # 6 usable
    a = Seq(1, list(range(8)))  # 2 full blocks, both cached
    admit(kv, a)
    kv.free(1)
    assert kv.get_computed_blocks(Seq(9, list(range(9)))).num_tokens == 8  # still hit-able while free
    admit(kv, Seq(2, [50 + i for i in range(16)]))  # takes the 4 never-used blocks first
    assert kv.pool.num_evicted_blocks == 0 and kv.get_computed_blocks(Seq(9, list(range(9)))).num_tokens == 8
    admit(kv, Seq(3, [80, 81, 82]))  # one more block: evicts a's tail block (freed first)
    assert kv.pool.num_evicted_blocks == 1
    assert kv.get_computed_blocks(Seq(9, list(range(9)))).num_tokens == 4


def test_a_hit_on_a_free_cached_block_counts_against_the_free_blocks():
    kv = manager(5)  # 4 usable
    admit(kv, Seq(1, list(range(8))))
    kv.free(1)  # 4 free, 2 of them cached
    b = Seq(2, list(range(8)) + [7] * 9)  # 17 tokens: hit 2 blocks, need 5 blocks in all
    assert admit(kv, b) is None  # 3 new + 2 evictable hits > 4 free
    assert kv.num_free_blocks == 4 and 2 not in kv.req_to_blocks


def test_full_sequence_gate_refuses_a_first_chunk_that_would_fit_and_changes_nothing():
    kv = manager(6)  # 5 usable blocks = 20 tokens
    seq = Seq(1, list(range(24)))  # 6 blocks in all
    assert admit(kv, seq, 8, full_sequence_must_fit=True) is None
    assert kv.num_free_blocks == 5 and kv.req_to_blocks.get(1) is None
    assert admit(kv, seq, 8) is not None  # without the gate the first chunk goes in
    assert len(kv.block_ids(1)) == 2


def test_watermark_holds_back_blocks_only_for_waiting_requests_with_others_scheduled():
    kv = manager(21, watermark=0.2)  # 20 usable, watermark int(0.2 * 21) = 4 blocks
    assert kv.watermark_blocks == 4
    admit(kv, Seq(1, list(range(40))))  # 10 blocks, 10 free left
    big = Seq(2, [100 + i for i in range(28)])  # 7 blocks: 7 + 4 > 10
    assert admit(kv, big, has_scheduled_reqs=True) is None
    assert admit(kv, big, has_scheduled_reqs=False) is not None  # nothing else scheduled: no watermark
    running = Seq(3, [200 + i for i in range(8)], waiting=False)
    assert kv.allocate_slots(running, 8) is not None  # a running request ignores the watermark (3 free -> 1)


def test_lookahead_slots_are_allocated_but_not_cached():
    kv = manager()
    seq = Seq(1, list(range(4)))
    assert admit(kv, seq, num_lookahead_tokens=4) == [1, 2]
    assert kv.num_cached_block[1] == 1 and kv.pool.blocks[2].block_hash is None


def test_blocks_with_equal_hashes_are_all_kept_and_the_first_is_found():
    pool = BlockPool(5)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [77], 0, 1)
    pool.cache_full_blocks([b], [77], 0, 1)
    assert pool.get_cached_block(77) is a
    pool.free_blocks([a, b])  # both cached: appended in order, a evicted first
    pool.get_new_blocks(2)  # the 2 never-used blocks
    pool.get_new_blocks(1)  # a
    assert pool.get_cached_block(77) is b and a.block_hash is None


def test_taking_more_blocks_than_are_free_is_a_specific_error():
    pool = BlockPool(3)
    with pytest.raises(BlockPoolExhausted, match="2 free"):
        pool.get_new_blocks(3)


def test_prompt_block_keys_split_or_merge_the_workload_hash_blocks():
    keys = prompt_block_keys((10, 11), hash_block_tokens=64, block_size=16)
    assert len(keys) == 8 and len(set(keys)) == 8
    assert prompt_block_keys((10, 11, 12, 13), hash_block_tokens=64, block_size=128) == (11, 13)
    with pytest.raises(ValueError, match="divide"):
        prompt_block_keys((10,), hash_block_tokens=64, block_size=48)


# ---------------------------------------------------------------- property test

settings.register_profile("ci", max_examples=60, stateful_step_count=50, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=400, stateful_step_count=80, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
PROFILE = settings.get_profile(os.environ.get("KVGUARD_HYPOTHESIS_PROFILE", "ci"))

# few distinct prefixes, so requests share blocks and hit cached ones
PROMPTS = st.lists(st.sampled_from([0, 1]), min_size=1, max_size=4).map(
    lambda parts: [t for p in parts for t in ([p] * BS)]).flatmap(
    lambda head: st.lists(st.integers(0, 3), max_size=6).map(lambda tail: head + tail))


class BlockPoolMachine(RuleBasedStateMachine):
    """Random admissions, chunks, decode tokens, frees and preemptions over a 13-block pool."""

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(13, block_size=BS, max_model_len=40, watermark=0.1)
        self.seqs: dict[int, Seq] = {}
        self.next_id = 0

    @rule(tokens=PROMPTS, chunk=st.integers(1, 12), gate=st.booleans())
    def admit(self, tokens, chunk, gate):
        seq = Seq(self.next_id, list(tokens))
        self.next_id += 1
        hit = self.kv.get_computed_blocks(seq)
        n = min(chunk, seq.num_tokens - hit.num_tokens)
        free_before = self.kv.num_free_blocks
        new = self.kv.allocate_slots(seq, n, hit, full_sequence_must_fit=gate, has_scheduled_reqs=bool(self.seqs))
        if new is None:
            assert self.kv.num_free_blocks == free_before and seq.request_id not in self.kv.req_to_blocks
            return
        seq.num_computed_tokens, seq.waiting = hit.num_tokens + n, False
        self.seqs[seq.request_id] = seq

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), token=st.integers(0, 3))
    def step(self, data, token):
        seq = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]
        if seq.num_computed_tokens == seq.num_tokens:  # decode: the sampled token joins the sequence
            seq.token_ids.append(token)
            seq.rehash()
        n = min(seq.num_tokens - seq.num_computed_tokens, data.draw(st.integers(1, 8)))
        if seq.num_computed_tokens + n >= self.kv.max_model_len:
            return
        if self.kv.allocate_slots(seq, n) is not None:
            seq.num_computed_tokens += n

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.kv.free(rid)
        del self.seqs[rid]

    @invariant()
    def each_block_is_free_xor_held_and_ref_counts_match_the_tables(self):
        pool = self.kv.pool
        queued = list(pool.free_queue)
        assert len(queued) == len(set(map(id, queued))) == pool.num_free_blocks
        holders = {b.block_id: 0 for b in pool.blocks}
        for table in self.kv.req_to_blocks.values():
            for b in table:
                holders[b.block_id] += 1
        queued_ids = {b.block_id for b in queued}
        for b in pool.blocks[1:]:
            assert (b.block_id in queued_ids) == (b.ref_count == 0)
            assert b.ref_count == holders[b.block_id]
        assert pool.null_block.block_id not in queued_ids and pool.null_block.is_null

    @invariant()
    def the_cache_map_holds_exactly_the_hashed_blocks(self):
        pool = self.kv.pool
        mapped = set()
        for block_hash, entry in pool.cached.items():
            blocks = [entry] if not isinstance(entry, dict) else list(entry.values())
            assert blocks
            for b in blocks:
                assert b.block_hash == block_hash
                mapped.add(b.block_id)
        assert mapped == {b.block_id for b in pool.blocks if b.block_hash is not None}

    @invariant()
    def cached_blocks_name_the_prefix_they_hold(self):
        for rid, table in self.kv.req_to_blocks.items():
            seq = self.seqs[rid]
            for k, b in enumerate(table[:self.kv.num_cached_block.get(rid, 0)]):
                assert b.block_hash == seq.block_hashes[k]

    @invariant()
    def usage_is_one_minus_free_over_usable(self):
        pool = self.kv.pool
        assert self.kv.usage == pytest.approx(1.0 - pool.num_free_blocks / (pool.num_blocks - 1))


BlockPoolMachine.TestCase.settings = PROFILE
TestBlockPoolMachine = BlockPoolMachine.TestCase
