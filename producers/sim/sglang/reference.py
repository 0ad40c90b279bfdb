"""SGLang's own scheduler parts, driven step by step on CPU: the reference side of the conformance check.

Run as a subprocess (``python -m kvguard.producers.sim.sglang.reference``) by
``producers.sim.sglang.conformance``: importing SGLang patches transformers and publishes process-wide
configuration, which must not leak into kvguard's process. Reads one JSON object on stdin (the
config and the requests, each with its arrival step; or ``{"cases": [...]}`` of them, run one after
the other with a fresh set of SGLang's objects each, so several checks pay for one import) and
writes one JSON line per engine step.

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
from array import array
from types import SimpleNamespace

from kvguard.producers.sim.sglang.scheduler import output_token


def _free_list_crc(allocator) -> int:
    pages = allocator.free_pages.tolist()
    return zlib.crc32(json.dumps(pages).encode())


class Reference:
    """SGLang's components and the loop over them (module docstring); SGLang must be importable
    (``cpu_imports.install()`` first, on CPU)."""

    def __init__(self, c: dict, tree_kind: str = "radix"):
        # SGLang and torch: importable only in the subprocess, after the stand-ins
        import torch
        from sglang.srt.runtime_context import get_context

        page, pool_tokens = c["page_size"], c["max_total_num_tokens"]
        chunked = c["chunked_prefill_size"]
        get_context().override_server_args(
            page_size=page, schedule_policy="fcfs", device="cpu",
            schedule_conservativeness=c["schedule_conservativeness"],
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

        self.sg = SimpleNamespace(array=array, Req=Req, ScheduleBatch=ScheduleBatch, AddReqResult=AddReqResult,
                                  PrefillAdder=PrefillAdder, validate_input_length=validate_input_length,
                                  checkpoint_kv_cache=checkpoint_kv_cache, release_kv_cache=release_kv_cache,
                                  SamplingParams=SamplingParams, SpeculativeAlgorithm=SpeculativeAlgorithm)
        self.version = sglang_version
        self.c, self.page_size, self.pool_tokens, self.chunked_prefill_size = c, page, pool_tokens, chunked
        self.max_prefill_tokens = c["max_prefill_tokens"]
        kv = MHATokenToKVPool(size=pool_tokens, page_size=page, dtype=torch.float16, head_num=1, head_dim=4,
                              layer_num=1, device="cpu", enable_memory_saver=False)
        if page == 1:
            self.alloc = TokenToKVPoolAllocator(size=pool_tokens, dtype=torch.float16, device="cpu", kvcache=kv,
                                                need_sort=False)
        else:
            self.alloc = PagedTokenToKVPoolAllocator(size=pool_tokens, page_size=page, dtype=torch.float16,
                                                     device="cpu", kvcache=kv, need_sort=False)
        self.max_running = c["max_running_requests"]
        self.rows = ReqToTokenPool(size=self.max_running, max_context_len=c["context_len"] + 4, device="cpu",
                                   enable_memory_saver=False)
        common = {"disable": False, "req_to_token_pool": self.rows, "token_to_kv_pool_allocator": self.alloc,
                  "page_size": page, "enable_kv_cache_events": bool(c.get("kv_events"))}
        if tree_kind == "unified":
            from sglang.srt.mem_cache.unified_cache.components import ComponentType
            from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

            self.tree = UnifiedRadixCache(CacheInitParams(**common, tree_components=(ComponentType.FULL,)))
        else:
            from sglang.srt.mem_cache.radix_cache import RadixCache

            self.tree = RadixCache(CacheInitParams(**common))
        self.adder_class = PrefillAdder  # Scheduler.get_prefill_adder_class()
        self.policy = SchedulePolicy("fcfs", self.tree, enable_hierarchical_cache=False,
                                     enable_priority_scheduling=False, schedule_low_priority_values_first=False)
        self.ratio = NewTokenRatioTracker.from_config()
        self.model_config = SimpleNamespace(vocab_size=32000, is_encoder_decoder=False, context_len=c["context_len"],
                                            is_multimodal=False, hf_config=None)
        self.max_req_len = min(c["context_len"] - 1, pool_tokens - 1)
        self.max_req_input_len = self.max_req_len - 5
        self.waiting: list = []
        self.running = self.new_batch([])
        self.last = None
        self.chunked = None
        self.unfinished: dict = {}

    def new_batch(self, reqs, chunked_req=None):
        return self.sg.ScheduleBatch.init_new(reqs, self.rows, self.alloc, self.tree, self.model_config, False,
                                              self.sg.SpeculativeAlgorithm.NONE, chunked_req=chunked_req)

    def add(self, r: dict) -> bool:
        """``init_req_max_new_tokens`` and ``validate_input_length``, then the queue."""
        sg = self.sg
        n = len(r["tokens"])
        max_new = max(0, min(r["max_new_tokens"], self.max_req_len - n - 1))
        max_new = self.alloc.max_new_tokens_for_memory(n, max_new, token_capacity=self.pool_tokens,
                                                       sliding_window_size=None, chunk_size=self.chunked_prefill_size)
        params = sg.SamplingParams(max_new_tokens=max(0, max_new if max_new is not None else 0), ignore_eos=False)
        params.normalize(None)
        req = sg.Req(str(r["rid"]), "", sg.array("q", r["tokens"]), params, vocab_size=32000, eos_token_ids={2})
        if sg.validate_input_length(req, self.max_req_input_len, False):
            return False
        self.unfinished[req.rid] = req
        self.waiting.append(req)
        return True

    def allocatable(self, running_bs: int, held: int = 0) -> int:
        return min(self.max_running - running_bs, max(self.rows.available_size() + held, 0))

    def prefill(self, running):
        """``_get_new_batch_prefill_raw``: the requests of a prefill batch, or None."""
        sg = self.sg
        if running.is_empty():
            running.batch_is_full = False
        if (running.batch_is_full or not self.waiting) and self.chunked is None:
            return None
        running_bs = len(running.reqs)
        if self.allocatable(running_bs) <= 0 and self.chunked is None:
            running.batch_is_full = True
            return None
        self.policy.calc_priority(self.waiting, running)
        adder = self.adder_class(self.page_size, self.tree, self.alloc, running, self.ratio.current,
                                self.max_prefill_tokens, self.chunked_prefill_size,
                                max_running_requests=self.max_running)
        if self.chunked is not None:
            self.chunked.init_next_round_input()
            self.chunked = adder.add_chunked_req(self.chunked)
        for req in self.waiting:
            if adder.budget_state() == sg.AddReqResult.OTHER:
                break
            held = sum(r.kv.holds_kv for r in adder.can_run_list)
            if len(adder.can_run_list) >= self.allocatable(len(running.reqs), held):
                running.batch_is_full = True
            if running.batch_is_full:
                break
            req.init_next_round_input(self.tree)
            res = adder.add_one_req(req, has_chunked_req=self.chunked is not None, truncation_align_size=None)
            if res != sg.AddReqResult.CONTINUE:
                if res == sg.AddReqResult.NO_TOKEN:
                    running.batch_is_full = len(adder.can_run_list) > 0 or not running.is_empty()
                break
        can_run = adder.can_run_list
        if not can_run:
            return None
        chosen = set(can_run)
        self.waiting = [r for r in self.waiting if r not in chosen]
        if adder.new_chunked_req is not None:
            self.chunked = adder.new_chunked_req
        return can_run

    def _finished(self, req, out: dict) -> None:
        self.sg.release_kv_cache(req, self.tree, checkpoint=True)
        out["finished"].append(int(req.rid))
        self.unfinished.pop(req.rid, None)

    def step(self) -> dict:
        """One pass of ``event_loop_normal`` with a fake model step."""
        sg = self.sg
        out = {"kind": "idle", "prefill": [], "decode": [], "retracted": [], "aborted": [], "finished": []}
        if self.chunked is not None and self.chunked.extend_end > self.chunked.prefix_len:
            sg.checkpoint_kv_cache(self.chunked, self.tree)
        running = self.running
        if self.last is not None:
            last = self.last
            last_bs = last.batch_size()
            last.filter_batch(reqs_to_exclude=[self.chunked] if self.chunked is not None else [])
            if last.batch_size() < last_bs:
                running.batch_is_full = False
            if not last.is_empty():
                if running.is_empty():
                    running = last
                else:
                    running.merge_batch(last)
            self.last = None
        bs = running.batch_size()
        running.filter_batch()
        if running.batch_size() < bs:
            running.batch_is_full = False
        can_run = self.prefill(running)
        if can_run is not None:
            out["kind"] = "prefill"
            out["prefill"] = [[int(r.rid), r.prefix_len, r.extend_end - r.prefix_len] for r in can_run]
            batch = self.new_batch(can_run, self.chunked)
            batch.prepare_for_extend()
            for req in batch.reqs:
                if req is self.chunked:
                    continue
                req.output_ids.append(output_token(int(req.rid), len(req.origin_input_ids) + len(req.output_ids)))
                req.update_finish_state()
                if req.finished():
                    self._finished(req, out)
                else:
                    sg.checkpoint_kv_cache(req, self.tree)
            self.last = batch
        elif not running.is_empty():
            out["kind"] = "decode"
            initial = running.batch_size()
            if not running.check_decode_mem():
                retracted, new_ratio, aborted = running.retract_decode()
                self.ratio.current = new_ratio
                out["retracted"] = [int(r.rid) for r in retracted]
                out["aborted"] = [int(r.rid) for r in aborted]
                for r in aborted:
                    self.unfinished.pop(r.rid, None)
                self.waiting.extend(retracted)
            else:
                self.ratio.decay_step()
            if running.batch_size() < initial:
                running.batch_is_full = False
            if not running.is_empty():
                running.prepare_for_decode()
                for req in running.reqs:
                    out["decode"].append(int(req.rid))
                    req.output_ids.append(output_token(int(req.rid), len(req.origin_input_ids) + len(req.output_ids)))
                    req.update_finish_state(1)
                    if req.finished():
                        self._finished(req, out)
        elif not self.waiting and self.chunked is None:
            self.ratio.reset()
        self.running = running
        out.update(available=self.alloc.available_size(), evictable=self.tree.evictable_size(),
                   protected=self.tree.protected_size(), ratio=self.ratio.current, free_crc=_free_list_crc(self.alloc))
        return out


def run_case(spec: dict, case: int, stood_in: list[str]) -> None:
    """One spec (config, requests, max_steps, tree): its start, step and end records, tagged ``case``."""
    ref = Reference(spec["config"], spec.get("tree", "radix"))

    def emit(record: dict) -> None:
        record["case"] = case
        print(json.dumps(record), flush=True)

    emit({"type": "start", "sglang_version": ref.version, "tree": type(ref.tree).__name__, "stood_in": stood_in,
          "ratio": [ref.ratio.init, ref.ratio.min, ref.ratio.decay]})
    pending = list(spec["requests"])
    clock = steps = 0
    while steps < spec["max_steps"]:
        if pending and not ref.unfinished:
            clock = max(clock, pending[0]["arrival_step"])
        arrivals = []
        while pending and pending[0]["arrival_step"] <= clock:
            r = pending.pop(0)
            arrivals.append([r["rid"], ref.add(r)])
        if not pending and not ref.unfinished:
            break
        record = ref.step()
        record["type"] = "step"
        record["arrivals"] = arrivals
        emit(record)
        steps += 1
        clock += 1
    emit({"type": "end", "steps": steps, "unfinished": len(ref.unfinished)})


def main() -> int:
    # SGLang may only be imported after the stand-ins are in place, and only in this subprocess
    from kvguard.producers.sim.sglang import cpu_imports

    stood_in = cpu_imports.install()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    spec = json.load(sys.stdin)
    for case, one in enumerate(spec["cases"] if "cases" in spec else [spec]):
        run_case(one, case, stood_in)
    return 0


if __name__ == "__main__":
    sys.exit(main())
