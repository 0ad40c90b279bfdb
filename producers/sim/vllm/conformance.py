"""Differential test: kvguard's scheduler against vLLM's own v1 ``Scheduler``, step by step.

Both sides get the same requests, arriving at the same steps, and the same sampled tokens:

- the vLLM side is vLLM 0.33.0's real ``Scheduler``/``KVCacheManager`` built on CPU from a weightless
  Llama-style ``config.json`` (``data/vllm_model``), ``DeviceConfig("cpu")``, a ``KVCacheConfig`` of
  ``num_gpu_blocks`` blocks for one full-attention group, sha256 block hashing as vLLM's engine core
  sets it up (``init_none_hash`` + ``get_request_block_hasher``), the synchronous scheduler
  (``async_scheduling=False``; the engine core runs ``AsyncScheduler`` when that resolves to True,
  see the differences listed in ``producers.sim.vllm.scheduler``), and vLLM's arrival check
  ``InputProcessor._validate_prompt_len``;
- the kvguard side is ``producers.sim.vllm.scheduler.Scheduler`` with the same settings.

Arrivals: a fixed step duration (``step_duration_s``, default 25 ms, a decode step of a mid-size
model): a request arriving at ``t`` is added before step ``floor(t / step_duration_s)``, in arrival
order; when both sides are idle the clock jumps to the next arrival (idle steps are not counted).

Token ids (so prefix sharing is identical on both sides): prompt block k (``block_size`` tokens) with
a workload prefix key (``kv_blocks.prompt_block_keys`` from ``Request.block_hashes``) gets tokens
``mix_hash(key, i) % VOCAB_SIZE``; every other prompt position p gets ``mix_hash(salt, p)``, unique
to the request; the fake model step samples ``mix_hash(salt, 2**40 + position)`` for each request
that is not in the middle of its prefill (the model runner samples nothing for a partial prefill
chunk, as vLLM's own scheduler tests feed it). kvguard hashes the same token ids (``hashing="tokens"``)
or, as the simulator will, only the prefix keys and the salt (``hashing="keys"``).

Compared at every step: the scheduled request ids with their token counts, in order; the preempted
ids; the block ids handed out (whole tables for admitted requests, new blocks for running ones); the
free block count and ``usage``. vLLM is imported inside functions only: it is an optional, heavy
dependency (2 GB with its import chain, ~8 s to import) that only this harness needs.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from kvguard.contracts.units import NS_PER_S
from kvguard.producers.sim.vllm.kv_blocks import prompt_block_keys
from kvguard.producers.sim.vllm.scheduler import VLLM_VERSION_FOLLOWED, Scheduler, SchedulerConfig
from kvguard.producers.sim.workloads import HASH_BLOCK_TOKENS, Request, mix_hash

MODEL_DIR = Path(__file__).resolve().parents[1] / "data" / "vllm_model"
VOCAB_SIZE = 32000
HASHINGS = ("tokens", "keys")
DEFAULT_MAX_MODEL_LEN = 32768
_OUTPUT_POSITION_OFFSET = 1 << 40


@dataclass(slots=True, frozen=True)
class ConformanceRequest:
    """One request as both sides see it."""

    request_id: str
    arrival_ns: int
    arrival_step: int
    priority: int
    max_tokens: int
    salt: int
    prompt_token_ids: list[int]
    prompt_block_keys: tuple[int, ...]


@dataclass(slots=True, frozen=True)
class StepView:
    """What one side did in one step, in comparable form."""

    scheduled: tuple[tuple[str, int], ...]
    preempted: frozenset[str]
    block_ids: dict[str, tuple[int, ...]]
    prefix_hit_tokens: int
    num_free_blocks: int
    usage: float


def output_token_id(salt: int, position: int) -> int:
    return mix_hash(salt, _OUTPUT_POSITION_OFFSET + position) % VOCAB_SIZE


def synth_prompt_token_ids(num_prompt_tokens: int, keys: tuple[int, ...], salt: int, block_size: int) -> list[int]:
    keyed = min(len(keys) * block_size, num_prompt_tokens)
    ids = [mix_hash(keys[p // block_size], p % block_size) % VOCAB_SIZE for p in range(keyed)]
    ids += [mix_hash(salt, p) % VOCAB_SIZE for p in range(keyed, num_prompt_tokens)]
    return ids


def conformance_requests(requests: Iterable[Request], *, block_size: int, step_duration_s: float,
                         ) -> list[ConformanceRequest]:
    step_ns = int(step_duration_s * NS_PER_S)
    if step_ns <= 0:
        raise ValueError(f"step_duration_s: expected > 0, got {step_duration_s}")
    out = []
    for index, r in enumerate(sorted(requests, key=lambda r: (r.arrival_ns, r.req_id))):
        salt = mix_hash(index, 0xC0FFEE)
        keys = prompt_block_keys(r.block_hashes, HASH_BLOCK_TOKENS, block_size) if r.block_hashes else ()
        out.append(ConformanceRequest(f"{index:08d}", r.arrival_ns, r.arrival_ns // step_ns,
                                      0 if r.priority is None else r.priority, r.max_output_tokens, salt,
                                      synth_prompt_token_ids(r.prompt_tokens, keys, salt, block_size), keys))
    return out


# ---------------------------------------------------------------- the two sides


class KvguardSide:
    def __init__(self, config: SchedulerConfig, hashing: str):
        self.scheduler = Scheduler(config)
        self.hashing = hashing
        self.salts: dict[str, int] = {}
        self._running_before: set[str] = set()
        self.wall_s = 0.0

    def add(self, req: ConformanceRequest) -> bool:
        t0 = time.perf_counter()
        by_tokens = self.hashing == "tokens"
        reason = self.scheduler.add_request(
            req.request_id, num_prompt_tokens=len(req.prompt_token_ids), max_tokens=req.max_tokens,
            arrival_ns=req.arrival_ns, priority=req.priority,
            prompt_token_ids=list(req.prompt_token_ids) if by_tokens else None,
            prompt_block_keys=() if by_tokens else req.prompt_block_keys, salt=req.salt)
        self.salts[req.request_id] = req.salt
        self.wall_s += time.perf_counter() - t0
        return reason is None

    def step(self) -> StepView:
        t0 = time.perf_counter()
        s = self.scheduler
        out = s.schedule()
        hits = sum(s.requests[rid].num_computed_tokens - n for rid, n in out.num_scheduled_tokens.items()
                   if rid not in self._running_before)
        view = StepView(tuple(out.num_scheduled_tokens.items()), frozenset(out.preempted_ids), dict(out.block_ids),
                        hits, s.kv.num_free_blocks, s.usage)
        sampled = {rid: output_token_id(self.salts[rid], s.requests[rid].num_tokens) for rid in out.sampling_ids}
        s.update_from_output(out, sampled)
        self._running_before = {q.request_id for q in s.running}
        self.wall_s += time.perf_counter() - t0
        return view

    def unfinished(self) -> int:
        return len(self.scheduler.requests)


class VllmSide:
    """vLLM's real scheduler, driven the way its own tests and the engine core drive it."""

    def __init__(self, config: SchedulerConfig):
        t0 = time.perf_counter()
        v = _import_vllm()
        self.v = v
        model = v.ModelConfig(model=str(MODEL_DIR), tokenizer=str(MODEL_DIR), skip_tokenizer_init=True,
                              max_model_len=config.max_model_len, dtype="bfloat16", seed=0)
        sched = v.SchedulerConfig(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                                  max_model_len=config.max_model_len, is_encoder_decoder=False,
                                  long_prefill_token_threshold=config.long_prefill_token_threshold,
                                  enable_chunked_prefill=config.enable_chunked_prefill, policy=config.policy,
                                  scheduler_reserve_full_isl=config.scheduler_reserve_full_isl,
                                  watermark=config.watermark, async_scheduling=False)
        cache = v.CacheConfig(block_size=config.block_size, enable_prefix_caching=config.enable_prefix_caching)
        cache.num_gpu_blocks = config.num_gpu_blocks
        vllm_config = v.VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache,
                                   device_config=v.DeviceConfig(device="cpu"))
        spec = v.FullAttentionSpec(block_size=config.block_size, num_kv_heads=2, head_size=64, dtype=v.torch.bfloat16)
        kv_config = v.KVCacheConfig(num_blocks=config.num_gpu_blocks, kv_cache_tensors=[],
                                    kv_cache_groups=[v.KVCacheGroupSpec(["model.layers.0.self_attn.attn",
                                                                         "model.layers.1.self_attn.attn"], spec)])
        self.scheduler = v.Scheduler(vllm_config=vllm_config, kv_cache_config=kv_config,
                                     structured_output_manager=v.StructuredOutputManager(vllm_config),
                                     block_size=config.block_size, log_stats=False)
        hash_fn = v.get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        v.init_none_hash(hash_fn)
        self.block_hasher = v.get_request_block_hasher(config.block_size, hash_fn)
        self.prompt_check = SimpleNamespace(model_config=model, skip_prompt_length_check=False,
                                            supports_mm_inputs=False, mm_encoder_cache_size=0)
        self.salts: dict[str, int] = {}
        self._running_before: set[str] = set()
        self.build_s = time.perf_counter() - t0
        self.wall_s = 0.0

    def add(self, req: ConformanceRequest) -> bool:
        t0 = time.perf_counter()
        v = self.v
        try:
            v.InputProcessor._validate_prompt_len(self.prompt_check, len(req.prompt_token_ids), "decoder")
        except v.VLLMValidationError:
            self.wall_s += time.perf_counter() - t0
            return False
        params = v.SamplingParams(max_tokens=req.max_tokens, ignore_eos=True)
        self.scheduler.add_request(v.Request(
            request_id=req.request_id, prompt_token_ids=list(req.prompt_token_ids), sampling_params=params,
            pooling_params=None, arrival_time=req.arrival_ns / NS_PER_S, priority=req.priority,
            block_hasher=self.block_hasher))
        self.salts[req.request_id] = req.salt
        self.wall_s += time.perf_counter() - t0
        return True

    def step(self) -> StepView:
        t0 = time.perf_counter()
        s = self.scheduler
        out = s.schedule()
        block_ids = {n.req_id: tuple(n.block_ids[0]) for n in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        for rid, new in zip(cached.req_ids, cached.new_block_ids):
            block_ids[rid] = tuple(new[0]) if new is not None else ()
        hits = sum(s.requests[rid].num_computed_tokens - n for rid, n in out.num_scheduled_tokens.items()
                   if rid not in self._running_before)
        view = StepView(tuple(out.num_scheduled_tokens.items()), frozenset(out.preempted_req_ids), block_ids, hits,
                        s.kv_cache_manager.block_pool.get_num_free_blocks(), s.get_kv_cache_usage())
        req_ids = list(out.num_scheduled_tokens)
        tokens = [[] if s.requests[rid].is_prefill_chunk
                  else [output_token_id(self.salts[rid], s.requests[rid].num_tokens)] for rid in req_ids]
        s.update_from_output(out, self.v.ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={rid: i for i, rid in enumerate(req_ids)}, sampled_token_ids=tokens))
        self._running_before = {r.request_id for r in s.running}
        self.wall_s += time.perf_counter() - t0
        return view

    def unfinished(self) -> int:
        return self.scheduler.get_num_unfinished_requests()


def _import_vllm() -> SimpleNamespace:
    """vLLM's classes, imported on first use: vllm is an optional dependency (install it with
    ``scripts/install-vllm-cpu.sh``); nothing imports it at module load."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        # vllm is optional and heavy (2 GB, ~8 s to import): imported only when the check runs
        import torch
        import vllm
        from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.exceptions import VLLMValidationError
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.engine.input_processor import InputProcessor
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import Request as VllmRequest
        from vllm.v1.structured_output import StructuredOutputManager
    except ImportError as e:
        raise VllmMissing(e) from e
    return SimpleNamespace(
        torch=torch, version=vllm.__version__, CacheConfig=CacheConfig, DeviceConfig=DeviceConfig,
        ModelConfig=ModelConfig, SchedulerConfig=SchedulerConfig, VllmConfig=VllmConfig,
        VLLMValidationError=VLLMValidationError, SamplingParams=SamplingParams,
        get_hash_fn_by_name=get_hash_fn_by_name, get_request_block_hasher=get_request_block_hasher,
        init_none_hash=init_none_hash, Scheduler=Scheduler, InputProcessor=InputProcessor,
        FullAttentionSpec=FullAttentionSpec, KVCacheConfig=KVCacheConfig, KVCacheGroupSpec=KVCacheGroupSpec,
        ModelRunnerOutput=ModelRunnerOutput, Request=VllmRequest, StructuredOutputManager=StructuredOutputManager)


class VllmMissing(ImportError):
    def __init__(self, cause: ImportError):
        super().__init__(f"the vLLM conformance check needs vllm=={VLLM_VERSION_FOLLOWED} and its scheduler's import "
                         f"chain ({cause}); install them with scripts/install-vllm-cpu.sh .venv")


# ---------------------------------------------------------------- the run


def run_conformance(requests: Iterable[Request], *, num_gpu_blocks: int, block_size: int = 16, max_num_seqs: int = 64,
                    max_num_batched_tokens: int = 2048, max_model_len: int | None = None, max_steps: int = 20_000,
                    step_duration_s: float = 0.025, policy: str = "fcfs", watermark: float = 0.0,
                    long_prefill_token_threshold: int = 0, scheduler_reserve_full_isl: bool = True,
                    enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                    hashing: str = "tokens", max_concurrency: int | None = None) -> dict:
    """Drive vLLM's scheduler and kvguard's in lockstep over ``requests`` (a workload's requests) and
    compare every step. Returns counts, the largest differences, and the first mismatching step.
    ``max_model_len`` defaults to the longest a pool of ``num_gpu_blocks`` can hold, at most 32,768.
    ``max_concurrency``: a closed-loop client (``vllm bench serve --max-concurrency``): a request is
    added, in order, only while fewer than that many are unfinished on the vLLM side (both sides must
    agree on it, or the step comparison fails first)."""
    if hashing not in HASHINGS:
        raise ValueError(f"hashing: expected one of {HASHINGS}, got {hashing!r}")
    if max_model_len is None:
        max_model_len = min(DEFAULT_MAX_MODEL_LEN, (num_gpu_blocks - 1) * block_size)
    config = SchedulerConfig(num_gpu_blocks=num_gpu_blocks, max_model_len=max_model_len, block_size=block_size,
                             max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             long_prefill_token_threshold=long_prefill_token_threshold, policy=policy,
                             scheduler_reserve_full_isl=scheduler_reserve_full_isl, watermark=watermark,
                             enable_prefix_caching=enable_prefix_caching, enable_chunked_prefill=enable_chunked_prefill)
    reqs = conformance_requests(requests, block_size=block_size, step_duration_s=step_duration_s)
    vllm_side, kvguard_side = VllmSide(config), KvguardSide(config, hashing)
    tally = _Tally()
    pending = deque(reqs)
    clock = 0
    while tally.steps < max_steps:
        if pending and not vllm_side.unfinished() and not kvguard_side.unfinished():
            clock = max(clock, pending[0].arrival_step)
        while pending and pending[0].arrival_step <= clock and (
                max_concurrency is None or vllm_side.unfinished() < max_concurrency):
            req = pending.popleft()
            tally.arrival(vllm_side.add(req), kvguard_side.add(req))
        if not pending and not vllm_side.unfinished() and not kvguard_side.unfinished():
            break
        tally.compare(vllm_side.step(), kvguard_side.step())
        clock += 1
    return tally.report(config, hashing, len(reqs), vllm_side, kvguard_side, drained=not pending and not (
        vllm_side.unfinished() or kvguard_side.unfinished()), max_concurrency=max_concurrency)


class _Tally:
    def __init__(self):
        self.steps = 0
        self.scheduled_mismatch = self.preempt_mismatch = self.block_ids_mismatch = self.free_blocks_mismatch = 0
        self.usage_max_abs_diff = 0.0
        self.usage_max = {"vllm": 0.0, "kvguard": 0.0}
        self.preemptions = {"vllm": 0, "kvguard": 0}
        self.admitted = {"vllm": 0, "kvguard": 0}
        self.rejected = {"vllm": 0, "kvguard": 0}
        self.rejection_mismatch = 0
        self.prefix_hit_tokens = {"vllm": 0, "kvguard": 0}
        self.scheduled_tokens = {"vllm": 0, "kvguard": 0}
        self.first_mismatch: dict | None = None

    def arrival(self, vllm_ok: bool, kvguard_ok: bool) -> None:
        for side, ok in (("vllm", vllm_ok), ("kvguard", kvguard_ok)):
            (self.admitted if ok else self.rejected)[side] += 1
        self.rejection_mismatch += vllm_ok != kvguard_ok

    def compare(self, v: StepView, k: StepView) -> None:
        self.steps += 1
        differs = []
        if v.scheduled != k.scheduled:
            self.scheduled_mismatch += 1
            differs.append("scheduled")
        if v.preempted != k.preempted:
            self.preempt_mismatch += 1
            differs.append("preempted")
        if v.block_ids != k.block_ids:
            self.block_ids_mismatch += 1
            differs.append("block_ids")
        if v.num_free_blocks != k.num_free_blocks:
            self.free_blocks_mismatch += 1
            differs.append("num_free_blocks")
        self.usage_max_abs_diff = max(self.usage_max_abs_diff, abs(v.usage - k.usage))
        for side, view in (("vllm", v), ("kvguard", k)):
            self.usage_max[side] = max(self.usage_max[side], view.usage)
            self.preemptions[side] += len(view.preempted)
            self.prefix_hit_tokens[side] += view.prefix_hit_tokens
            self.scheduled_tokens[side] += sum(n for _, n in view.scheduled)
        if differs and self.first_mismatch is None:
            self.first_mismatch = {"step": self.steps, "differs": differs,
                                   "vllm": _describe(v, k), "kvguard": _describe(k, v)}

    def report(self, config: SchedulerConfig, hashing: str, num_requests: int, vllm_side: VllmSide,
               kvguard_side: KvguardSide, drained: bool, max_concurrency: int | None = None) -> dict:
        steps = max(self.steps, 1)
        return {
            "vllm_version": vllm_side.v.version, "kvguard_follows": VLLM_VERSION_FOLLOWED, "hashing": hashing,
            "config": {"num_gpu_blocks": config.num_gpu_blocks, "block_size": config.block_size,
                       "max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
                       "max_model_len": config.max_model_len, "policy": config.policy,
                       "watermark": config.watermark, "long_prefill_token_threshold": config.long_prefill_token_threshold,
                       "scheduler_reserve_full_isl": config.scheduler_reserve_full_isl,
                       "enable_prefix_caching": config.enable_prefix_caching,
                       "enable_chunked_prefill": config.enable_chunked_prefill, "max_concurrency": max_concurrency},
            "steps": self.steps, "requests": num_requests, "drained": drained,
            "admitted": self.admitted, "rejected": self.rejected, "rejection_mismatches": self.rejection_mismatch,
            "scheduled_mismatch_frac": self.scheduled_mismatch / steps,
            "preempted_mismatch_steps": self.preempt_mismatch, "block_ids_mismatch_steps": self.block_ids_mismatch,
            "free_blocks_mismatch_steps": self.free_blocks_mismatch,
            "usage_max_abs_diff": self.usage_max_abs_diff, "usage_max": self.usage_max,
            "preemptions": self.preemptions, "prefix_hit_tokens": self.prefix_hit_tokens,
            "scheduled_tokens": self.scheduled_tokens, "first_mismatch": self.first_mismatch,
            "wall_s": {"vllm_build": round(vllm_side.build_s, 3), "vllm": round(vllm_side.wall_s, 3),
                       "kvguard": round(kvguard_side.wall_s, 3)},
        }


def _describe(view: StepView, other: StepView, limit: int = 8) -> dict:
    """This side's part of a mismatch: what it has that the other side has not (at most ``limit``)."""
    return {
        "scheduled_only_here": [x for x in view.scheduled if x not in set(other.scheduled)][:limit],
        "scheduled_order": [rid for rid, _ in view.scheduled][:limit],
        "preempted_only_here": sorted(view.preempted - other.preempted)[:limit],
        "block_ids_differ": dict([(rid, ids) for rid, ids in view.block_ids.items()
                                  if other.block_ids.get(rid) != ids][:limit]),
        "num_free_blocks": view.num_free_blocks, "usage": view.usage,
    }
