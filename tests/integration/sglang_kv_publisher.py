"""SGLang 0.5.23's own KV-event publisher, fed by its own radix cache, for kvguard's ingest tests.

Run as a subprocess (SGLang is imported only here). Builds a paged ``RadixCache`` with
``enable_kv_cache_events`` over a CPU ``MHATokenToKVPool`` and ``PagedTokenToKVPoolAllocator``, and
SGLang's publisher from a ``--kv-events-config`` JSON (``EventPublisherFactory.create``: a
``ZmqEventPublisher`` with its PUB and ROUTER replay sockets). Commands on stdin, one JSON per line:
``{"insert": n}`` inserts n new 3-page prompts (sharing their first page) and publishes the tree's
events as one ``KVEventBatch``; ``{"evict": tokens}`` evicts and publishes; ``{"quit": true}``.
After each command it prints ``{"seq": last seq published, "stored_pages": distinct page hashes
stored so far, "removed_pages": ...}``.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> int:
    # the stand-ins must be in place before SGLang is imported (producers/sim/sglang/cpu_imports.py)
    from kvguard.producers.sim.sglang import cpu_imports

    cpu_imports.install()
    config = sys.argv[1]
    from array import array

    import torch
    from sglang.srt.disaggregation.kv_events import EventPublisherFactory, KVEventBatch
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    page = 4
    kv = MHATokenToKVPool(size=4096, page_size=page, dtype=torch.float16, head_num=1, head_dim=4, layer_num=1,
                          device="cpu", enable_memory_saver=False)
    alloc = PagedTokenToKVPoolAllocator(size=4096, page_size=page, dtype=torch.float16, device="cpu", kvcache=kv,
                                        need_sort=False)
    tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
                                      page_size=page, enable_kv_cache_events=True))
    publisher = EventPublisherFactory.create(config, attn_dp_rank=0)
    seq, stored, removed, prompt = -1, set(), set(), 0
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        for _ in range(cmd.get("insert", 0)):
            tokens = array("q", [1, 2, 3, 4] + [100 + prompt * 8 + i for i in range(8)])
            tree.insert(InsertParams(key=RadixKey(tokens), value=alloc.alloc(12)))
            prompt += 1
        if cmd.get("evict"):
            tree.evict(EvictParams(num_tokens=cmd["evict"]))
        events = tree.take_events()
        for ev in events:
            name = type(ev).__name__
            if name == "BlockStored":
                stored.update(ev.block_hashes)
            elif name == "BlockRemoved":
                removed.update(ev.block_hashes)
        publisher.publish(KVEventBatch(ts=time.time(), events=events, attn_dp_rank=0))
        seq += 1
        time.sleep(0.05)  # the publisher thread sends
        print(json.dumps({"seq": seq, "stored_pages": len(stored), "removed_pages": len(removed)}), flush=True)
    publisher.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
