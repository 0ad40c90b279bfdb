"""SGLang's KV-cache events (``--kv-events-config``), read with the same decoder and gap handling as vLLM's.

SGLang 0.5.23's ``sglang/srt/disaggregation/kv_events.py`` took its publisher from vLLM's: the same
ZMQ PUB message of three frames ``(topic, seq, payload)``, ``seq`` 8 bytes big-endian from 0, the
payload a msgpack ``KVEventBatch`` (``array_like``: ``[ts, events, attn_dp_rank]``) of tagged maps,
and the same ROUTER replay (send the first seq wanted; get ``(b"", topic, seq, payload)`` per
buffered batch, then seq -1). So ``producers.vllm.kv_events`` decodes it and fills gaps from the
replay socket unchanged; this module states what differs and what the events carry.

What an SGLang batch carries:

- ``BlockStored``: one hash per *page* (``block_size`` = ``--page-size``; each hash the first 8
  bytes of a SHA-256 chain over the page's tokens and its parent's hash, as a signed int64,
  ``mem_cache/utils.py``), ``parent_block_hash``, ``token_ids``, ``medium`` ("GPU", or
  ``CPU_PINNED``/``DISK`` for HiCache tiers), ``lora_id``, and, when set, ``cache_salt``,
  ``session_id``, ``lora_name``; no ``group_idx`` (vLLM's KV-cache group);
- ``BlockRemoved`` (a radix node evicted), ``AllBlocksCleared`` (the tree reset: start-up or
  ``/flush_cache``);
- the third field is the attention data-parallel rank; each DP rank publishes on its own port
  (the endpoint's port plus the rank), and only attention TP/PP/CP rank 0 publishes.

Cadence: SGLang drains the tree's events into one batch at every prefill-stats report, every 40th
decode step, when idle and on pause, so a batch may hold 40 steps of changes (empty batches are not
sent). With ``"format": "dynamo"`` the hashes are namespaced by extra key / cache salt.

What they lack, as vLLM's do: physical page ids, request ids, lock counts, free pages. So they give
the prefix cache's content (pages and tokens per medium, stores, reuses, removals) and nothing of
U_kv, F_ext, F_int or victims; ``kvguard scrape --engine sglang`` gives U_kv, the node plugin
(``producers.sglang.plugin``) everything.
"""

from __future__ import annotations

from kvguard.producers.vllm.kv_events import (
    CLEARED,
    REMOVED,
    STORED,
    GapCounters,
    KvBatch,
    KvEvent,
    KvEventsError,
    KvEventsSubscriber,
    PrefixCacheState,
    decode_frames,
    decode_payload,
)

SGLANG_KV_EVENTS_FOLLOWED = "0.5.23"
# SGLang's --kv-events-config defaults (KVEventsConfig, disaggregation/kv_events.py)
DEFAULT_ENDPOINT = "tcp://*:5557"
DEFAULT_BUFFER_STEPS = 10000

__all__ = ["CLEARED", "DEFAULT_BUFFER_STEPS", "DEFAULT_ENDPOINT", "REMOVED", "SGLANG_KV_EVENTS_FOLLOWED", "STORED",
           "GapCounters", "KvBatch", "KvEvent", "KvEventsError", "KvEventsSubscriber", "PrefixCacheState",
           "decode_frames", "decode_payload"]
