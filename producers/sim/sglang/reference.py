"""SGLang's own scheduler parts, driven step by step on CPU: the reference side of the conformance check.

Run as a subprocess (``python -m kvguard.producers.sim.sglang.reference``) by
``producers.sim.sglang.conformance``: importing SGLang patches transformers and publishes process-wide
configuration, which must not leak into kvguard's process. Reads one JSON object on stdin (the
config and the requests, each with its arrival step) and writes one JSON line per engine step.

What is SGLang's (0.5.23, installed ``--no-deps`` by ``scripts/install-sglang-cpu.sh``): the KV pool
(``MHATokenToKVPool`` on CPU tensors), the allocators (``TokenToKVPoolAllocator`` /
``PagedTokenToKVPoolAllocator``, ``need_sort=False``), ``ReqToTokenPool``, the radix cache
(``RadixCache``, or ``UnifiedRadixCache`` with its Rust tree core when ``tree`` is "unified", what
``mem_cache/registry.py`` builds for a plain model), ``Req`` and ``SamplingParams``, ``PrefillAdder``,
``ScheduleBatch`` (``prepare_for_extend``, ``prepare_for_decode``, ``check_decode_mem``,
``retract_decode``, ``filter_batch``, ``merge_batch``), ``NewTokenRatioTracker``,
``checkpoint_kv_cache``, ``release_kv_cache``, ``validate_input_length`` and the allocator's
``max_new_tokens_for_memory``; configuration goes through ``runtime_context.override_server_args``
(a real ``ServerArgs``).

What is ours: the loop that calls them, in the order ``Scheduler.get_next_batch_to_run``,
``_get_new_batch_prefill_raw``, ``update_running_batch``, ``process_batch_result_*`` and ``on_idle``
call them (``managers/scheduler.py``, checked against its source); ``Scheduler`` itself needs a model
worker to construct. The model step is fake: each request that is not in the middle of a chunked
prefill samples ``scheduler.output_token`` (never EOS).
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
import zlib


def _free_list_crc(allocator) -> int:
    pages = allocator.free_pages.tolist()
    return zlib.crc32(json.dumps(pages).encode())


def main() -> int:
    # SGLang may only be imported after the stand-ins are in place, and only in this subprocess
    from kvguard.producers.sim.sglang import cpu_imports

    stood_in = cpu_imports.install()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    spec = json.load(sys.stdin)
    c = spec["config"]
    page, pool_tokens = c["page_size"], c["max_total_num_tokens"]
    chunked = c["chunked_prefill_size"]

    from array import array
    from types import SimpleNamespace

    import torch

    from sglang.srt.runtime_context import get_context

    get_context().override_server_args(
        page_size=page, schedule_policy="fcfs", device="cpu", schedule_conservativeness=c["schedule_conservativeness"],
        chunked_prefill_size=chunked if chunked is not None else -1, max_prefill_tokens=c["max_prefill_tokens"],
        max_running_requests=c["max_running_requests"]).install()

    from sglang import __version__ as sglang_version
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder, SchedulePolicy
    from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import NewTokenRatioTracker
    from sglang.srt.managers.utils import validate_input_length
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from kvguard.producers.sim.sglang.scheduler import output_token

    kv = MHATokenToKVPool(size=pool_tokens, page_size=page, dtype=torch.float16, head_num=1, head_dim=4, layer_num=1,
                          device="cpu", enable_memory_saver=False)
    if page == 1:
        alloc = TokenToKVPoolAllocator(size=pool_tokens, dtype=torch.float16, device="cpu", kvcache=kv, need_sort=False)
    else:
        alloc = PagedTokenToKVPoolAllocator(size=pool_tokens, page_size=page, dtype=torch.float16, device="cpu",
                                            kvcache=kv, need_sort=False)
    max_running = c["max_running_requests"]
    rows = ReqToTokenPool(size=max_running, max_context_len=c["context_len"] + 4, device="cpu",
                          enable_memory_saver=False)
    if spec.get("tree", "radix") == "unified":
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        tree = UnifiedRadixCache(CacheInitParams(disable=False, req_to_token_pool=rows, token_to_kv_pool_allocator=alloc,
                                                 page_size=page, tree_components=(ComponentType.FULL,)))
    else:
        from sglang.srt.mem_cache.radix_cache import RadixCache

        tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=rows, token_to_kv_pool_allocator=alloc,
                                          page_size=page))
    policy = SchedulePolicy("fcfs", tree, enable_hierarchical_cache=False, enable_priority_scheduling=False,
                            schedule_low_priority_values_first=False)
    ratio = NewTokenRatioTracker.from_config()
    model_config = SimpleNamespace(vocab_size=32000, is_encoder_decoder=False, context_len=c["context_len"],
                                   is_multimodal=False, hf_config=None)
    max_req_len = min(c["context_len"] - 1, pool_tokens - 1)
    max_req_input_len = max_req_len - 5

    def new_batch(reqs, chunked_req=None):
        return ScheduleBatch.init_new(reqs, rows, alloc, tree, model_config, False, SpeculativeAlgorithm.NONE,
                                      chunked_req=chunked_req)

    print(json.dumps({"type": "start", "sglang_version": sglang_version, "tree": type(tree).__name__,
                      "stood_in": stood_in, "ratio": [ratio.init, ratio.min, ratio.decay]}), flush=True)
    state = SimpleNamespace(waiting=[], running=new_batch([]), last=None, chunked=None)
    pending = list(spec["requests"])
    by_rid = {}

    def add(r) -> bool:
        n = len(r["tokens"])
        max_new = max(0, min(r["max_new_tokens"], max_req_len - n - 1))
        max_new = alloc.max_new_tokens_for_memory(n, max_new, token_capacity=pool_tokens, sliding_window_size=None,
                                                  chunk_size=chunked)
        params = SamplingParams(max_new_tokens=max(0, max_new if max_new is not None else 0), ignore_eos=False)
        params.normalize(None)
        req = Req(str(r["rid"]), "", array("q", r["tokens"]), params, vocab_size=32000, eos_token_ids={2})
        if validate_input_length(req, max_req_input_len, False):
            return False
        by_rid[req.rid] = req
        state.waiting.append(req)
        return True

    def allocatable(running_bs: int, held: int = 0) -> int:
        return min(max_running - running_bs, max(rows.available_size() + held, 0))

    def prefill(running):
        if running.is_empty():
            running.batch_is_full = False
        if (running.batch_is_full or not state.waiting) and state.chunked is None:
            return None
        running_bs = len(running.reqs)
        if allocatable(running_bs) <= 0 and state.chunked is None:
            running.batch_is_full = True
            return None
        policy.calc_priority(state.waiting, running)
        adder = PrefillAdder(page, tree, alloc, running, ratio.current, c["max_prefill_tokens"], chunked,
                             max_running_requests=max_running)
        if state.chunked is not None:
            state.chunked.init_next_round_input()
            state.chunked = adder.add_chunked_req(state.chunked)
        for req in state.waiting:
            if adder.budget_state() == AddReqResult.OTHER:
                break
            held = sum(r.kv.holds_kv for r in adder.can_run_list)
            if len(adder.can_run_list) >= allocatable(len(running.reqs), held):
                running.batch_is_full = True
            if running.batch_is_full:
                break
            req.init_next_round_input(tree)
            res = adder.add_one_req(req, has_chunked_req=state.chunked is not None, truncation_align_size=None)
            if res != AddReqResult.CONTINUE:
                if res == AddReqResult.NO_TOKEN:
                    running.batch_is_full = len(adder.can_run_list) > 0 or not running.is_empty()
                break
        can_run = adder.can_run_list
        if not can_run:
            return None
        chosen = set(can_run)
        state.waiting = [r for r in state.waiting if r not in chosen]
        if adder.new_chunked_req is not None:
            state.chunked = adder.new_chunked_req
        return can_run

    def finish_or_checkpoint(req, out):
        req.update_finish_state()
        if req.finished():
            release_kv_cache(req, tree, checkpoint=True)
            out["finished"].append(int(req.rid))
            by_rid.pop(req.rid, None)
        else:
            checkpoint_kv_cache(req, tree)

    def step() -> dict:
        out = {"kind": "idle", "prefill": [], "decode": [], "retracted": [], "aborted": [], "finished": []}
        if state.chunked is not None and state.chunked.extend_end > state.chunked.prefix_len:
            checkpoint_kv_cache(state.chunked, tree)
        running = state.running
        if state.last is not None:
            last = state.last
            last_bs = last.batch_size()
            last.filter_batch(reqs_to_exclude=[state.chunked] if state.chunked is not None else [])
            if last.batch_size() < last_bs:
                running.batch_is_full = False
            if not last.is_empty():
                if running.is_empty():
                    running = last
                else:
                    running.merge_batch(last)
            state.last = None
        bs = running.batch_size()
        running.filter_batch()
        if running.batch_size() < bs:
            running.batch_is_full = False
        can_run = prefill(running)
        if can_run is not None:
            out["kind"] = "prefill"
            out["prefill"] = [[int(r.rid), r.prefix_len, r.extend_end - r.prefix_len] for r in can_run]
            batch = new_batch(can_run, state.chunked)
            batch.prepare_for_extend()
            for req in batch.reqs:
                if req is state.chunked:
                    continue
                req.output_ids.append(output_token(int(req.rid), len(req.origin_input_ids) + len(req.output_ids)))
                finish_or_checkpoint(req, out)
            state.last = batch
        elif not running.is_empty():
            out["kind"] = "decode"
            initial = running.batch_size()
            if not running.check_decode_mem():
                retracted, new_ratio, aborted = running.retract_decode()
                ratio.current = new_ratio
                out["retracted"] = [int(r.rid) for r in retracted]
                out["aborted"] = [int(r.rid) for r in aborted]
                for r in aborted:
                    by_rid.pop(r.rid, None)
                state.waiting.extend(retracted)
            else:
                ratio.decay_step()
            if running.batch_size() < initial:
                running.batch_is_full = False
            if not running.is_empty():
                running.prepare_for_decode()
                for req in running.reqs:
                    out["decode"].append(int(req.rid))
                    req.output_ids.append(output_token(int(req.rid), len(req.origin_input_ids) + len(req.output_ids)))
                    req.update_finish_state(1)
                    if req.finished():
                        release_kv_cache(req, tree, checkpoint=True)
                        out["finished"].append(int(req.rid))
                        by_rid.pop(req.rid, None)
        elif not state.waiting and state.chunked is None:
            ratio.reset()
        state.running = running
        out.update(available=alloc.available_size(), evictable=tree.evictable_size(),
                   protected=tree.protected_size(), ratio=ratio.current, free_crc=_free_list_crc(alloc))
        return out

    clock = 0
    steps = 0
    max_steps = spec["max_steps"]
    while steps < max_steps:
        if pending and not by_rid:
            clock = max(clock, pending[0]["arrival_step"])
        arrivals = []
        while pending and pending[0]["arrival_step"] <= clock:
            r = pending.pop(0)
            arrivals.append([r["rid"], add(r)])
        if not pending and not by_rid:
            break
        record = step()
        record["type"] = "step"
        record["arrivals"] = arrivals
        print(json.dumps(record), flush=True)
        steps += 1
        clock += 1
    print(json.dumps({"type": "end", "steps": steps, "unfinished": len(by_rid)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
