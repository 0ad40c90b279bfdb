"""KV cache blocks as vLLM v1 manages them: the block pool and the KV cache manager (vLLM 0.33.0).

Followed: ``vllm/v1/core/kv_cache_utils.py`` (``KVCacheBlock``, ``FreeKVCacheBlockQueue``),
``vllm/v1/core/block_pool.py`` (``BlockPool``, ``BlockHashToBlockMap``),
``vllm/v1/core/single_type_kv_cache_manager.py`` (``FullAttentionManager``), the unitary path of
``vllm/v1/core/kv_cache_coordinator.py`` and ``vllm/v1/core/kv_cache_manager.py``
(``KVCacheManager``), for one KV cache group of full attention with prefix caching, no KV
connector, no speculative decoding and no sliding window. Written from reading that code, not
copied; ``producers.sim.vllm.conformance`` runs vLLM's own classes beside these and compares every step.

The model, in one paragraph: ``num_blocks`` blocks of ``block_size`` token slots; block 0 is the
*null block* (taken out of the free queue at start and never handed out, so ``usage`` counts
``num_blocks - 1`` blocks). A block is either in the *free queue* with ``ref_count == 0`` or held
by ``ref_count > 0`` requests, never both. A full block of a request gets a *block hash* (a chain
hash of its parent's hash and its own content) and enters the *prefix cache map* hash → block.
Freeing a cached block keeps its hash and appends it to the free queue's tail (LRU); an uncached
block goes to the head (reused first). Cached blocks in the free queue are evicted lazily: only
when ``get_new_blocks`` pops them does their hash leave the map. A prefix hit ``touch``es cached
blocks, taking free ones back out of the queue (O(1): a doubly linked list threaded through the
blocks).

Hashes are kvguard's own (vLLM hashes ``(parent, token ids, extra keys)`` with sha256 and cbor):
``chain_hash(parent, content)`` with ``content`` either ``token_block_key(token ids)`` or, when a
workload only names its prefix blocks, a key derived from the workload's block hashes
(``prompt_block_keys``). Two blocks share a hash exactly when vLLM's would (up to 63-bit
collisions), so prefix hits and evictions match.

Pure: standard library only, apart from the workloads' ``mix_hash``; no clock.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvguard.producers.sim.workloads import mix_hash

ROOT_HASH = 0  # the parent hash of a request's first block (vLLM: NONE_HASH)
_MASK63 = 0x7FFF_FFFF_FFFF_FFFF


# ---------------------------------------------------------------- hashing (kv_cache_utils.hash_block_tokens)


def chain_hash(parent_hash: int, content_key: int) -> int:
    """The hash of a full block: its parent's hash chained with its own content, so a hash names
    the whole prefix up to and including the block (``hash_block_tokens``)."""
    return mix_hash(parent_hash, content_key)


def token_block_key(token_ids: Sequence[int]) -> int:
    """The content key of a block of token ids. ``hash`` of a tuple of ints is deterministic across
    processes (only str/bytes hashing is salted) and runs in C."""
    return hash(tuple(token_ids)) & _MASK63


def prompt_block_keys(prefix_hashes: Sequence[int], hash_block_tokens: int, block_size: int) -> tuple[int, ...]:
    """Content keys per ``block_size`` block from a workload's chained hashes per ``hash_block_tokens``
    block (``Request.block_hashes``): sub-blocks of a hash block get ``mix_hash(hash, index)``; a
    block spanning several hash blocks takes the hash of its last one (it names the whole prefix)."""
    if hash_block_tokens % block_size == 0:
        sub = hash_block_tokens // block_size
        return tuple(mix_hash(h, i) for h in prefix_hashes for i in range(sub))
    if block_size % hash_block_tokens == 0:
        span = block_size // hash_block_tokens
        return tuple(prefix_hashes[k * span + span - 1] for k in range(len(prefix_hashes) // span))
    raise ValueError(f"block_size {block_size} and the workload's hash block of {hash_block_tokens} tokens: "
                     "one must divide the other")


# ---------------------------------------------------------------- blocks and the free queue (kv_cache_utils)


@dataclass(slots=True, eq=False)
class KVBlock:
    """One block's metadata (``KVCacheBlock``). ``prev_free``/``next_free`` belong to the free queue."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set while the block is in the prefix cache map
    prev_free: KVBlock | None = None
    next_free: KVBlock | None = None
    is_null: bool = False

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref_count={self.ref_count}, block_hash={self.block_hash})"


class FreeBlockQueue:
    """The free blocks in eviction order (``FreeKVCacheBlockQueue``): a doubly linked list threaded
    through the blocks between two sentinels, so removal from the middle (a prefix hit on a free
    cached block) is O(1) and allocates nothing. Invariant: a block is linked iff it is in the queue;
    ``len`` is the number of linked blocks. Initially in block-id order."""

    def __init__(self, blocks: list[KVBlock]):
        self.head = KVBlock(-1)
        self.tail = KVBlock(-1)
        prev = self.head
        for block in blocks:
            prev.next_free, block.prev_free = block, prev
            prev = block
        prev.next_free, self.tail.prev_free = self.tail, prev
        self.num_free_blocks = len(blocks)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft_n(self, n: int) -> list[KVBlock]:
        if n > self.num_free_blocks:
            raise BlockPoolExhausted(requested_blocks=n, free_blocks=self.num_free_blocks)
        out = []
        block = self.head.next_free
        for _ in range(n):
            out.append(block)
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        self.head.next_free, block.prev_free = block, self.head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append_n(self, blocks: list[KVBlock]) -> None:
        """Link ``blocks`` at the tail, in order (reused last)."""
        if blocks:
            self._link_after(self.tail.prev_free, blocks, self.tail)

    def prepend_n(self, blocks: list[KVBlock]) -> None:
        """Link ``blocks`` at the head, in order: ``blocks[0]`` becomes the next one reused."""
        if blocks:
            self._link_after(self.head, blocks, self.head.next_free)

    def _link_after(self, prev: KVBlock, blocks: list[KVBlock], nxt: KVBlock) -> None:
        for block in blocks:
            prev.next_free, block.prev_free = block, prev
            prev = block
        prev.next_free, nxt.prev_free = nxt, prev
        self.num_free_blocks += len(blocks)

    def __iter__(self):
        """Head (reused first) to tail: for tests and diagnostics, O(n)."""
        block = self.head.next_free
        while block is not self.tail:
            yield block
            block = block.next_free


class BlockPoolExhausted(RuntimeError):
    """More blocks were requested than are free. The KV cache manager checks before it allocates,
    so this means a caller skipped ``allocate_slots``'s check."""

    def __init__(self, requested_blocks: int, free_blocks: int):
        self.requested_blocks, self.free_blocks = requested_blocks, free_blocks
        super().__init__(f"block pool: {requested_blocks} blocks requested, {free_blocks} free; "
                         "allocate through KVCacheManager.allocate_slots, which checks first")


# ---------------------------------------------------------------- the block pool (block_pool.py)


class BlockPool:
    """Blocks, the free queue and the prefix cache map (``BlockPool``).

    ``cached`` maps a block hash to the block holding that prefix or, when several blocks hold the
    same prefix (two requests computed it before either cached it; vLLM does not deduplicate, so
    block tables stay append-only), to a dict block_id → block in insertion order; a lookup returns
    the first (``BlockHashToBlockMap``). Invariants: a block with ``block_hash`` set is in the map
    under that hash, and only those are; free ⇔ ``ref_count == 0`` ⇔ linked in ``free_queue``
    (the null block is neither: it is held forever and its ref count is not kept).
    """

    def __init__(self, num_blocks: int, *, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks: expected >= 1 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVBlock | dict[int, KVBlock]] = {}
        self.null_block = self.free_queue.popleft_n(1)[0]
        self.null_block.is_null = True
        self.num_evicted_blocks = 0  # cached blocks whose hash was dropped on reuse

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """``1 - free / (num_blocks - 1)``: the null block is never counted (``BlockPool.get_usage``).
        Cached blocks with ``ref_count == 0`` count as free, as in vLLM's ``kv_cache_usage_perc``."""
        usable = self.num_blocks - 1
        return 1.0 - self.free_queue.num_free_blocks / usable if usable else 0.0

    def get_cached_block(self, block_hash: int) -> KVBlock | None:
        hit = self.cached.get(block_hash)
        if hit is None or isinstance(hit, KVBlock):
            return hit
        return next(iter(hit.values()))

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Pop ``num_blocks`` from the head of the free queue, evicting the hash of any cached one
        (lazy eviction), each with ``ref_count`` 1."""
        blocks = self.free_queue.popleft_n(num_blocks)
        for block in blocks:
            if block.block_hash is not None:
                self._uncache(block)
                self.num_evicted_blocks += 1
            block.ref_count = 1
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """A prefix hit takes a reference; a free cached block leaves the free queue first."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference per block, ``ordered_blocks`` first-evicted first. Blocks reaching 0
        refs: uncached ones go to the head of the free queue (reused first, LIFO), cached ones to the
        tail (LRU), each group keeping the given order (``BlockPool.free_blocks``)."""
        to_head, to_tail = [], []
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_count -= 1
            if block.ref_count == 0:
                (to_tail if block.block_hash is not None and self.enable_caching else to_head).append(block)
        self.free_queue.prepend_n(to_head)
        self.free_queue.append_n(to_tail)

    def cache_full_blocks(self, blocks: list[KVBlock], block_hashes: Sequence[int], num_cached_blocks: int,
                          num_full_blocks: int) -> None:
        """Give ``blocks[num_cached_blocks:num_full_blocks]`` their hashes and enter them in the map."""
        for index in range(num_cached_blocks, num_full_blocks):
            block = blocks[index]
            if block.is_null or block.block_hash is not None:
                continue
            block_hash = block_hashes[index]
            block.block_hash = block_hash
            other = self.cached.get(block_hash)
            if other is None:
                self.cached[block_hash] = block
            elif isinstance(other, KVBlock):
                self.cached[block_hash] = {other.block_id: other, block.block_id: block}
            else:
                other[block.block_id] = block

    def _uncache(self, block: KVBlock) -> None:
        block_hash = block.block_hash
        entry = self.cached.get(block_hash)
        if entry is block:
            del self.cached[block_hash]
        elif isinstance(entry, dict):
            entry.pop(block.block_id, None)
            if not entry:
                del self.cached[block_hash]
        block.block_hash = None


# ---------------------------------------------------------------- the KV cache manager (kv_cache_manager.py)


class SequenceView(Protocol):
    """What the manager reads of a request (``vllm/v1/request.py`` ``Request``)."""

    request_id: Hashable
    num_tokens: int  # prompt + output tokens so far
    num_computed_tokens: int
    block_hashes: list[int]

    @property
    def is_waiting(self) -> bool:
        """WAITING or PREEMPTED: the watermark applies (``allocate_slots``)."""
        ...


@dataclass(slots=True, frozen=True)
class ComputedBlocks:
    """A prefix-cache hit (``KVCacheBlocks`` for one group): full blocks, ``num_tokens`` tokens."""

    blocks: tuple[KVBlock, ...] = ()
    num_tokens: int = 0


NO_HIT = ComputedBlocks()


class KVCacheManager:
    """Block tables per request over one ``BlockPool`` (``KVCacheManager`` + ``FullAttentionManager``).

    ``req_to_blocks[rid]`` is the request's block table, append-only until ``free``.
    ``num_cached_block[rid]`` counts its leading blocks already in the prefix cache; a request is in
    it from its first prefix hit or its first cached full block until ``free`` (vLLM uses that
    membership to tell a running request from a new one, and so does ``_blocks_to_allocate``).
    ``watermark_blocks = int(watermark * num_blocks)`` stay free when admitting a waiting or
    preempted request while another request is scheduled.

    Prefix-cache statistics follow vLLM's ``PrefixCacheStats`` as recorded at admission:
    ``prefix_query_tokens`` (the admitted requests' ``num_tokens``) and ``prefix_hit_tokens``.
    """

    def __init__(self, num_blocks: int, *, block_size: int = 16, max_model_len: int, enable_caching: bool = True,
                 watermark: float = 0.0):
        if block_size < 1:
            raise ValueError(f"block_size: expected >= 1, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark: expected a fraction in [0, 1), got {watermark}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_caching)
        self.watermark_blocks = int(watermark * num_blocks)
        self.req_to_blocks: dict[Hashable, list[KVBlock]] = {}
        self.num_cached_block: dict[Hashable, int] = {}
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def usage(self) -> float:
        """vLLM's ``KVCacheManager.usage`` (``vllm:kv_cache_usage_perc``)."""
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_ids(self, request_id: Hashable) -> tuple[int, ...]:
        return tuple(b.block_id for b in self.req_to_blocks.get(request_id, ()))

    def get_computed_blocks(self, seq: SequenceView) -> ComputedBlocks:
        """The longest run of cached full blocks from the start, capped at ``num_tokens - 1`` tokens
        so the last prompt token is always computed (its logits are needed)
        (``KVCacheManager.get_computed_blocks`` → ``FullAttentionManager.find_longest_cache_hit``)."""
        if not self.enable_caching:
            return NO_HIT
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hit = []
        get = self.pool.get_cached_block
        for block_hash in seq.block_hashes[:max_blocks]:
            block = get(block_hash)
            if block is None:
                break
            hit.append(block)
        return ComputedBlocks(tuple(hit), len(hit) * self.block_size) if hit else NO_HIT

    def allocate_slots(self, seq: SequenceView, num_new_tokens: int, computed: ComputedBlocks = NO_HIT, *,
                       num_lookahead_tokens: int = 0, full_sequence_must_fit: bool = False,
                       has_scheduled_reqs: bool = True) -> list[int] | None:
        """Slots for ``num_new_tokens`` more tokens (plus lookahead) after the computed ones; the ids of
        the newly allocated blocks, or None, leaving everything unchanged, when they do not fit
        (``KVCacheManager.allocate_slots``). Check, then act:

        1. with ``full_sequence_must_fit`` (the scheduler's ``scheduler_reserve_full_isl`` gate for
           waiting requests), refuse unless the blocks for all ``num_tokens`` fit;
        2. refuse unless the blocks for this step fit, keeping ``watermark_blocks`` free when ``seq``
           is waiting/preempted and ``has_scheduled_reqs``. A hit block that sits free in the queue
           counts as needed: touching it takes it out of the free count;
        3. touch the hit blocks, pop new ones, and cache the blocks that are full after this step.
        """
        if num_new_tokens <= 0 and computed.num_tokens == 0:
            raise ValueError("num_new_tokens must be > 0 when there are no computed tokens to adopt")
        rid = seq.request_id
        held = self.req_to_blocks.get(rid)
        if held is not None and not computed.blocks and not full_sequence_must_fit:
            return self._extend(seq, held, num_new_tokens, num_lookahead_tokens, has_scheduled_reqs)
        num_local_computed = seq.num_computed_tokens + computed.num_tokens
        total_computed = min(num_local_computed, self.max_model_len)
        watermark = self.watermark_blocks if has_scheduled_reqs and seq.is_waiting else 0
        free = self.pool.num_free_blocks
        if full_sequence_must_fit:
            full_tokens = min(seq.num_tokens, self.max_model_len)
            if self._blocks_to_allocate(rid, full_tokens, computed.blocks) + watermark > free:
                return None
        num_tokens_need_slot = min(total_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        if self._blocks_to_allocate(rid, num_tokens_need_slot, computed.blocks) + watermark > free:
            return None

        req_blocks = self.req_to_blocks.setdefault(rid, [])
        if computed.blocks and rid not in self.num_cached_block:
            self.pool.touch(computed.blocks)
            req_blocks.extend(computed.blocks)
            self.num_cached_block[rid] = len(req_blocks)
        num_new_blocks = -(-num_tokens_need_slot // self.block_size) - len(req_blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        req_blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_blocks(seq, min(total_computed + num_new_tokens, seq.num_tokens))
        return [b.block_id for b in new_blocks]

    def _extend(self, seq: SequenceView, held: list[KVBlock], num_new_tokens: int, num_lookahead_tokens: int,
                has_scheduled_reqs: bool) -> list[int] | None:
        """``allocate_slots`` for a request that already holds blocks and brings no new hit (every
        running request, every step): without a hit, both cases of ``_blocks_to_allocate`` come to
        ``ceil(slots / block_size) - held`` blocks, so only that is checked; blocks that became full
        are cached as in the general path."""
        bs, max_len = self.block_size, self.max_model_len
        total_computed = min(seq.num_computed_tokens, max_len)
        need_slots = min(total_computed + num_new_tokens + num_lookahead_tokens, max_len)
        num_new_blocks = -(-need_slots // bs) - len(held)
        new_ids: list[int] = []
        if num_new_blocks > 0:
            watermark = self.watermark_blocks if has_scheduled_reqs and seq.is_waiting else 0
            if num_new_blocks + watermark > self.pool.free_queue.num_free_blocks:
                return None
            new_blocks = self.pool.get_new_blocks(num_new_blocks)
            held.extend(new_blocks)
            new_ids = [b.block_id for b in new_blocks]
        if self.enable_caching and len(seq.block_hashes) > self.num_cached_block.get(seq.request_id, 0):
            self._cache_blocks(seq, min(total_computed + num_new_tokens, seq.num_tokens))
        return new_ids

    def _blocks_to_allocate(self, rid: Hashable, num_tokens: int, hit: tuple[KVBlock, ...]) -> int:
        """``SingleTypeKVCacheManager.get_num_blocks_to_allocate`` for full attention."""
        num_required = -(-num_tokens // self.block_size)
        num_held = len(self.req_to_blocks.get(rid, ()))
        if rid in self.num_cached_block:
            return max(num_required - num_held, 0)
        num_evictable = sum(1 for b in hit if b.ref_count == 0 and not b.is_null)
        return max(num_required - num_held - len(hit), 0) + num_evictable

    def _cache_blocks(self, seq: SequenceView, num_tokens: int) -> None:
        """Enter the request's blocks that are full within ``num_tokens`` into the prefix cache."""
        rid = seq.request_id
        num_cached = self.num_cached_block.get(rid, 0)
        num_full = min(num_tokens, len(seq.block_hashes) * self.block_size) // self.block_size
        if num_cached >= num_full:
            return
        self.pool.cache_full_blocks(self.req_to_blocks[rid], seq.block_hashes, num_cached, num_full)
        self.num_cached_block[rid] = num_full

    def record_prefix_lookup(self, seq: SequenceView, num_hit_tokens: int) -> None:
        """Count an admitted request's prefix-cache lookup (``record_prefix_cache_stats``)."""
        if self.enable_caching:
            self.prefix_query_tokens += seq.num_tokens
            self.prefix_hit_tokens += num_hit_tokens

    def free(self, request_id: Hashable) -> None:
        """Return a request's blocks, tail first, so its last blocks are evicted first
        (``SingleTypeKVCacheManager.free``). Unknown ids are a no-op, as in vLLM (abort before alloc)."""
        blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))
