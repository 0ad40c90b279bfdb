"""One vLLM worker's GPU memory: the start-up ledger and every engine step through the allocator twin.

The ledger follows ``Worker`` in vLLM 0.33's ``vllm/v1/worker/gpu_worker.py`` and
``vllm/utils/mem_utils.py`` (docs/NODE_MEMORY.md, section 1, names the commits read), in this order:

1. ``init_device``: the CUDA context and NCCL's buffers (``context_bytes``) are taken first, outside
   the caching allocator and outside vLLM's budget (they are in the start-up baseline).
2. ``GPUModelRunner.__init__``: the persistent input buffers are allocated through the allocator
   (``step_memory.persistent_buffer_bytes``); they outlive every step (BLK_ALLOC rows).
3. ``load_model``: the weights (held outside the allocator's free capacity: ``reserve_external``).
4. ``determine_available_memory``: peak stats reset, ``profile_run`` replayed through the twin
   (``step_memory.profile_plan``: dummy forward at ``max_num_batched_tokens``, dummy sampler at
   ``min(max_num_batched_tokens, max_num_seqs)`` rows; the cuBLAS workspace its first GEMM creates
   stays allocated), then ``empty_cache``. ``torch_peak_increase`` is the twin's measured peak of
   allocated bytes above what was allocated before, exactly the statistic vLLM reads; the non-torch
   growth during profiling is the profile's ``non_torch_increase_bytes``.
   ``available_kv_cache_memory = int(total * utilization - (weights + peak + non_torch increase +
   CUDA-graph estimate))`` (``step_memory.kv_cache_bytes``), ``num_gpu_blocks = available //
   block_bytes`` with ``block_bytes = block_size * 2 * layers * kv_heads_per_rank * head_dim * dtype``
   (vLLM's page size per layer times the layers of the one KV cache group).
5. ``initialize_from_config``: the KV cache tensor (``num_gpu_blocks * block_bytes``, held outside).
6. ``capture_model``: the CUDA-graph pool (``cudagraph_bytes``, held outside; the same figure is the
   estimate step 4 subtracts, as releases since v0.21 do by default).
7. the sampler warm-up (``step_memory.warmup_plan``), last on purpose, so serving starts with the
   sampler's blocks cached.

Then every engine step replays ``step_memory.step_plan`` for the batch (forward, logits, sampler) as
mallocs and frees in order. A ``OutOfMemoryError`` from the twin is a CUDA OOM (``StepOOM``).

Events (``kvguard.contracts.events``, allocator rows): SEG_ALLOC / SEG_FREE at every cudaMalloc /
cudaFree the twin makes (seen through a recording ``Driver``, in order), BLK_ALLOC / BLK_FREE for the
blocks that outlive the step that made them (the persistent buffers and the cuBLAS workspace), and
ALLOC_RETRY for each release-cached-blocks-and-retry. Blocks made and freed within one step give no row.

Speed, with exactness kept (tests/unit/producers/sim/vllm/test_vllm_engine_memory.py checks both against plain replay):

* A step that made no driver call frees everything it allocated, so the twin is back in the state it
  started from (the blocks of a segment are the maximal free gaps between its allocated blocks, and
  the allocated blocks are the same). Such a (state epoch, plan) pair is remembered and later replays
  of it are skipped: the state epoch changes whenever a driver call happens.
* Inside a step, the decoder layers repeat one op pattern. After layer ``i`` the twin's state is fixed
  by its segments and its allocated blocks, which are the ones from before the layers plus the layer's
  output (the next hidden states). When a later layer ends with that output at the same address and
  block size, with no driver call in between, the layers from there on repeat with that period; the
  rest of the period multiples are skipped (peak statistics are unchanged by construction).
* What the skipping leaves out: the twin's cumulative counters (``allocation.*.allocated`` / ``freed``
  counts) and its trace do not count the skipped ops; ``memory_stats`` *current* and *peak* values,
  segments, retries and OOMs are exact. Off with ``fast=False``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from kvguard.contracts.events import SEG_MAPPED, EventKind, OomCause, Pool
from kvguard.producers.sim.torch_allocator.caching_allocator import (
    AllocatorConfig,
    CachingAllocator,
    DeviceMemory,
    OutOfMemoryError,
)
from kvguard.producers.sim.torch_allocator.config import K_SMALL_BUFFER, K_SMALL_SIZE
from kvguard.producers.sim.vllm.external import LEAK_GRANULE, NEIGHBOUR_GRANULE
from kvguard.producers.vllm import model_runner_v2 as v2
from kvguard.producers.vllm.step_memory import (
    CUBLAS_WORKSPACE_OTHER,
    CUBLASLT_WORKSPACE,
    HIDDEN,
    HIDDEN_TAG,
    Batch,
    RunnerConfig,
    StepPlan,
    _Ops,
    _plan,
    _region,
    kv_cache_bytes,
    profile_plan,
    step_plan,
    step_plan_for,
    warmup_plan,
)

_SEG_ALLOC, _SEG_FREE = int(EventKind.SEG_ALLOC), int(EventKind.SEG_FREE)
_BLK_ALLOC, _BLK_FREE, _RETRY = int(EventKind.BLK_ALLOC), int(EventKind.BLK_FREE), int(EventKind.ALLOC_RETRY)
_PERSISTENT_NAMES = ("input_ids", "positions", "query_start_loc", "seq_lens", "inputs_embeds", "is_token_ids",
                     "discard_request_indices", "num_decode_draft_tokens", "num_accepted_tokens")
OOM_CAUSES = {"peak": OomCause.PEAK, "fragmentation": OomCause.FRAGMENTATION}
CLASS_CAUSES = {"long_context": OomCause.LONG_CONTEXT, "spec_decode": OomCause.SPEC_DECODE,
                "prompt_logprobs": OomCause.PROMPT_LOGPROBS, "neighbour": OomCause.NEIGHBOUR, "leak": OomCause.LEAK}
GiB = 1 << 30


def format_gib(nbytes: int) -> str:
    """vllm/utils/mem_utils.py format_gib: GiB rounded to 2 decimals, as vLLM's messages print them."""
    return f"{round(nbytes / GiB, 2)}"


def tag_of(name: str) -> str | None:
    """The failure class an allocation belongs to (``model_runner_v2.TAGS``), or None."""
    for prefix, cls in v2.TAGS.items():
        if name.startswith(prefix):
            return cls
    return None


class StartupRefused(ValueError):
    """The worker would not start with these numbers (vLLM raises at start-up in each case).
    ``vllm_message``: vLLM 0.33's own text for the refusal, verbatim, where it has one."""

    def __init__(self, field: str, expected: str, vllm_message: str | None = None):
        self.field, self.expected, self.vllm_message = field, expected, vllm_message
        super().__init__(vllm_message or f"{field}: expected {expected}")


class StepOOM(MemoryError):
    """The twin raised OutOfMemoryError during a step: a CUDA OOM. ``error`` carries PyTorch's fields;
    ``cause`` the failure class the bytes are attributed to (``WorkerMemory._attribute``), else
    peak/fragmentation; ``allocation`` the tensor that failed."""

    def __init__(self, error: OutOfMemoryError, cause: OomCause | None = None, allocation: str = ""):
        self.error = error
        self.allocation = allocation
        self.cause = cause if cause is not None else OOM_CAUSES.get(error.cause, OomCause.OTHER)
        super().__init__(str(error))


@dataclass(slots=True, frozen=True)
class MemoryLedger:
    """The measured start-up split of one GPU (bytes)."""

    total_bytes: int
    context_bytes: int
    weights_bytes: int
    persistent_bytes: int
    profile_peak_bytes: int  # torch_peak_increase (V2: the transient peak above what stays allocated)
    non_torch_increase_bytes: int
    cudagraph_bytes: int  # the CUDA-graph pool; the estimate subtracted is the same figure
    kv_cache_bytes: int  # available_kv_cache_memory
    kv_bytes_per_token: int
    block_bytes: int
    num_gpu_blocks: int
    requested_bytes: int = 0  # V2: ceil(total * gpu_memory_utilization); V1: int(total * utilization)
    init_free_bytes: int = 0  # free at the start-up snapshot
    total_consumed_bytes: int = 0  # V2: init free - free after profiling (weights, buffers, non-torch)
    max_model_len: int = 0
    warmup_reqs: int = 0  # requests of the post-KV warm-up (warmup_kernels)
    kv_cache_memory_fixed: bool = False  # --kv-cache-memory-bytes: the formula was skipped
    gpu_memory_utilization: float = 0.0
    model_runner: str = "v1"  # whose accounting measured it: "v2" (vLLM 0.33) or "v1" (vLLM 0.11's worker)

    @property
    def kv_tensor_bytes(self) -> int:
        return self.num_gpu_blocks * self.block_bytes

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__} | {"kv_tensor_bytes": self.kv_tensor_bytes,
                                                                       "kv_token_capacity": self.kv_token_capacity}

    @property
    def block_size(self) -> int:
        return self.block_bytes // self.kv_bytes_per_token

    @property
    def max_concurrency(self) -> float:
        """``get_max_concurrency_for_kv_cache_config``: blocks over blocks one max_model_len request needs."""
        return self.num_gpu_blocks / -(-self.max_model_len // self.block_size) if self.max_model_len else 0.0

    @property
    def kv_token_capacity(self) -> int:
        """vLLM's "GPU KV cache size: N tokens" (``kv_cache_utils.py``): ``int(max_concurrency * max_model_len)``."""
        return int(self.max_concurrency * self.max_model_len) if self.max_model_len else \
            self.num_gpu_blocks * self.block_size

    @property
    def peak_activation_bytes(self) -> int:
        """The "peak activation" vLLM 0.33 logs: the transient peak plus the CUDA-graph estimate it subtracted
        (``gpu_worker.py``: ``peak_activation_memory = transient_peak_headroom + cudagraph_memory_estimate_applied``,
        the sum vllm#57936 reports as double-counted in the suggestion); the V1 accounting logs the peak alone."""
        graphs = 0 if self.kv_cache_memory_fixed else self.cudagraph_bytes
        return self.profile_peak_bytes + graphs if self.model_runner == "v2" else self.profile_peak_bytes

    def log_lines(self) -> list[str]:
        """What vLLM logs at start-up for these numbers, in its order: 0.33's format strings (``gpu_worker.py``,
        ``kv_cache_utils.py``) for the V2 accounting, 0.10/0.11's for the V1 one (the "for weight" line of vllm
        PR#21489 as PR#25683 prints it, and "GPU KV cache size" and "Maximum concurrency" on two lines)."""
        lines = [f"Model loading took {format_gib(self.weights_bytes)} GiB memory"]
        if self.kv_cache_memory_fixed:
            lines.append(f"Initial free memory {format_gib(self.init_free_bytes)} GiB, reserved "
                         f"{format_gib(self.kv_cache_bytes)} GiB memory for KV Cache as specified by "
                         f"kv_cache_memory_bytes config and skipped memory profiling. This does not respect the "
                         f"gpu_memory_utilization config. Only use kv_cache_memory_bytes config when you want manual "
                         f"control of KV cache memory size. If OOM'ed, check the difference of initial free memory "
                         f"between the current run and the previous run where kv_cache_memory_bytes is suggested and "
                         f"update it correspondingly.")
        else:
            lines.append(f"Available KV cache memory: {format_gib(self.kv_cache_bytes)} GiB")
        v2 = self.model_runner == "v2"
        if v2 and self.cudagraph_bytes and not self.kv_cache_memory_fixed:
            u, delta = self.gpu_memory_utilization, self.cudagraph_bytes / self.total_bytes
            lines.append(f"CUDA graph memory profiling is enabled (default since v0.21.0). The current "
                         f"--gpu-memory-utilization={u:.4f} is equivalent to --gpu-memory-utilization="
                         f"{round(u - delta, 4):.4f} without CUDA graph memory profiling. To maintain the same effective "
                         f"KV cache size as before, increase --gpu-memory-utilization to {min(round(u + delta, 4), 1.0):.4f}."
                         f" To disable, set VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0.")
        capacity = f"{self.kv_token_capacity:,}"
        concurrency = (f"Maximum concurrency for {self.max_model_len:,} tokens per request: "
                       f"{self.max_concurrency:.2f}x")
        if v2:
            lines.append(f"GPU KV cache size: {capacity} tokens, {concurrency}")
        else:
            lines += [f"GPU KV cache size: {capacity} tokens", concurrency]
        if v2 and self.cudagraph_bytes and not self.kv_cache_memory_fixed:
            g = format_gib(self.cudagraph_bytes)
            lines.append(f"CUDA graph pool memory: {g} GiB (actual), {g} GiB (estimated), difference: 0.0 GiB (0.0%).")
        if not self.kv_cache_memory_fixed:
            lines.append(self._budget_line())
        return lines

    def _budget_line(self) -> str:
        """``compile_or_warm_up_model``'s summary line; its two suggestions leave vLLM's 150 MiB redundancy."""
        redundancy = 150 << 20
        if self.model_runner == "v2":
            used = self.total_consumed_bytes + self.peak_activation_bytes + self.cudagraph_bytes
            usage = (f"{format_gib(self.total_consumed_bytes)} GiB for consumed memory (weights + non-torch), "
                     f"{format_gib(self.peak_activation_bytes)} GiB for peak activation, and "
                     f"{format_gib(self.cudagraph_bytes)} GiB for CUDAGraph memory")
        else:
            used = (self.weights_bytes + self.profile_peak_bytes + self.non_torch_increase_bytes
                    + self.cudagraph_bytes)
            usage = (f"{format_gib(self.weights_bytes)} GiB for weight, {format_gib(self.profile_peak_bytes)} GiB for "
                     f"peak activation, {format_gib(self.non_torch_increase_bytes)} GiB for non-torch memory, and "
                     f"{format_gib(self.cudagraph_bytes)} GiB for CUDAGraph memory")
        fit = int(self.requested_bytes - used - redundancy)
        full = int(self.init_free_bytes - used - redundancy)
        return (f"Free memory on device ({format_gib(self.init_free_bytes)}/{format_gib(self.total_bytes)} GiB) on "
                f"startup. Desired GPU memory utilization is ({self.gpu_memory_utilization}, "
                f"{format_gib(self.requested_bytes)} GiB). Actual usage is {usage}. Replace gpu_memory_utilization "
                f"config with `--kv-cache-memory={fit}` ({format_gib(fit)} GiB) to fit into requested memory, or "
                f"`--kv-cache-memory={full}` ({format_gib(full)} GiB) to fully utilize gpu memory. Current kv cache "
                f"memory in use is {format_gib(self.kv_cache_bytes)} GiB.")


class RecordingDriver:
    """A ``Driver`` over ``DeviceMemory`` that logs what the allocator asks of it, in order:
    ``(op, address, size, requested)`` with op "alloc", "free", "fail", "map", "unmap". ``calls``
    counts every call that changes device memory (the state epoch of the twin)."""

    def __init__(self, memory: DeviceMemory):
        self.memory = memory
        self.log: list[tuple[str, int, int, int]] = []
        self.calls = 0
        self.requested = 0  # bytes of the malloc being served (set by the caller before each malloc)

    def cuda_malloc(self, size: int) -> int | None:
        address = self.memory.cuda_malloc(size)
        if address is None:
            self.log.append(("fail", 0, size, self.requested))
        else:
            self.calls += 1
            self.log.append(("alloc", address, size, self.requested))
        return address

    def cuda_free(self, address: int, size: int) -> None:
        self.calls += 1
        self.memory.cuda_free(address, size)
        self.log.append(("free", address, size, 0))

    def reserve_address_space(self, size: int) -> int:
        return self.memory.reserve_address_space(size)

    def release_address_space(self, address: int, size: int) -> None:
        self.memory.release_address_space(address, size)

    def map_pages(self, address: int, size: int) -> bool:
        ok = self.memory.map_pages(address, size)
        if ok:
            self.calls += 1
            self.log.append(("map", address, size, self.requested))
        else:
            self.log.append(("fail", 0, size, self.requested))
        return ok

    def unmap_pages(self, address: int, size: int) -> None:
        self.calls += 1
        self.memory.unmap_pages(address, size)
        self.log.append(("unmap", address, size, 0))

    def mem_get_info(self) -> tuple[int, int]:
        return self.memory.mem_get_info()


def _segment_pool(size: int) -> int:
    # small-pool segments are exactly kSmallBuffer; large ones are 20 MiB or >= 10 MiB rounded to 2 MiB.
    # Expandable segments map pages of 2 MiB (small) or 20 MiB (large): a mapping is called small when
    # its size is not a multiple of 20 MiB (an inference: the driver call does not name the pool).
    return int(Pool.SMALL) if size == K_SMALL_BUFFER or size % (20 << 20) else int(Pool.LARGE)


@lru_cache(maxsize=1 << 16)
def _attention_key(shape, kernel, num_tokens: int, num_seqs: int, max_query_len: int, max_seq_len: int):
    return v2.attention_key(shape, kernel, num_tokens, num_seqs, max_query_len, max_seq_len)


def auto_fit_max_model_len(available: int, block_bytes: int, block_size: int, max_model_len: int) -> int:
    """``--max-model-len -1`` (``kv_cache_planning._auto_fit_max_model_len``): the longest length whose
    blocks fit the memory left after the null block, at most the derived one."""
    fitted = min(max_model_len, max(0, available - block_bytes) // block_bytes * block_size)
    if fitted < 1:
        raise StartupRefused("max_model_len", "room for one token", (
            "Cannot auto-fit max_model_len: not enough GPU memory available to serve even a single token. Try "
            "increasing `gpu_memory_utilization`."))
    return fitted


def _free_memory_refusal(free: int, total: int, utilization: float, requested: float) -> str:
    """``v1/worker/utils.py request_memory``'s refusal, verbatim."""
    return (f"Free memory on device cuda:0 ({format_gib(free)}/{format_gib(total)} GiB) on startup is less than "
            f"desired GPU memory utilization ({utilization}, {format_gib(requested)} GiB). Decrease GPU memory "
            f"utilization or reduce GPU memory used by other processes.")


def check_kv_fits(available: int, block_bytes: int, block_size: int, max_model_len: int) -> None:
    """``kv_cache_planning.get_kv_cache_configs``: one block is held back for the null block, then
    ``_check_enough_kv_cache_memory`` refuses with vLLM's messages (verbatim)."""
    check = available - block_bytes
    if check <= 0:
        raise StartupRefused("gpu_memory_utilization", "memory left for the KV cache", (
            "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing "
            "the engine (this flag also controls CPU memory reservation on the CPU backend, despite its name). "
            "See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."))
    needed = -(-max_model_len // block_size) * block_bytes
    if needed > check:
        estimated = check // block_bytes * block_size
        hint = f"Based on the available memory, the estimated maximum model length is {estimated}. " \
            if estimated else ""
        raise StartupRefused("max_model_len", f"a KV cache that holds one request of max_model_len={max_model_len}", (
            f"To serve at least one request with the model's max seq len ({max_model_len}), ({format_gib(needed)} "
            f"GiB KV cache is needed, which is larger than the available KV cache memory ({format_gib(check)} GiB). "
            f"{hint}Try increasing `gpu_memory_utilization` (which also controls CPU memory on the CPU backend) or "
            f"decreasing `max_model_len` when initializing the engine. See "
            f"https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."))


def kv_bytes_per_token(shape) -> int:
    """K and V of every layer for one token on one TP rank (vLLM's page size per layer / block_size)."""
    return 2 * shape.num_layers * shape.kv_heads_per_rank * shape.head_dim * shape.dtype_bytes


def _compile(ops) -> tuple:
    """MemOps as (is_alloc, name, bytes, role) with role 1 = frees the current hidden states,
    2 = becomes the next hidden states, 3 = persistent."""
    out = []
    for op in ops:
        role = 0
        if op.name == HIDDEN:
            role = 1
        elif op.name.endswith(HIDDEN_TAG):
            role = 2
        elif op.persistent:
            role = 3
        out.append((op.kind == "alloc", op.name, op.nbytes, role))
    return tuple(out)


class WorkerMemory:
    """The twin of one worker process, started as vLLM starts (module docstring), serving steps.

    ``emit(kind, ts_ns, cls, flags, offset, size, tokens, aux)`` records allocator rows.
    """

    def __init__(self, spec, *, total_bytes: int, weights_bytes: int, context_bytes: int,
                 gpu_memory_utilization: float, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int, emit=None, now_ns: int = 0, fast: bool = True, record_history: bool = False,
                 neighbour=None, leak=None):
        self.spec = spec
        self.shape = spec.shape
        self.emit = emit
        self.fast = fast
        self.v2 = getattr(spec, "model_runner", "v1") == "v2"
        self.runner = RunnerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                   cudagraph_mode="NONE" if getattr(spec, "enforce_eager", False)
                                   else spec.cudagraph_mode,
                                   fa2_split_kv=not self.v2 and getattr(spec, "attention_version", 3) == 2,
                                   num_sms=getattr(spec, "num_sms", 132))
        self.kernel = v2.AttentionKernel(getattr(spec, "attention_version", 3), getattr(spec, "num_sms", 132),
                                         getattr(spec, "attention_lse", "total_q"))
        self.neighbour, self.leak = neighbour, leak
        sizes = self.runner.capture_sizes
        self.largest_graph = sizes[-1] if sizes else 0  # steps with more tokens run eagerly
        self.neighbour_bytes = self.neighbour_start_bytes = 0
        self.leaked: list[int] = []  # addresses of blocks never freed (C7)
        self.leaked_bytes = 0
        self._leak_debt = 0.0
        self._leak_clock_ns = now_ns
        self.driver = RecordingDriver(DeviceMemory(total_bytes))
        self.config = AllocatorConfig.from_string(spec.allocator_conf)
        self.twin = CachingAllocator(driver=self.driver, config=self.config, record_history=record_history)
        self._can_skip_layers = fast and not (self.config.garbage_collection_threshold > 0.0
                                              and self.config.per_process_memory_fraction < 1.0)
        self._noop: set = set()
        self._compiled: dict[int, tuple] = {}
        self.persistent: dict[str, tuple[int, int, int, int]] = {}  # name -> (address, block, requested, segment)
        self.retries_seen = 0
        start = self._start_v2 if self.v2 else self._start
        self.ledger = start(total_bytes, weights_bytes, context_bytes, gpu_memory_utilization,
                            max_num_batched_tokens, max_num_seqs, max_model_len, now_ns)

    # ---------------------------------------------------------------- start-up (gpu_worker.py order)
    def _start(self, total, weights, context, utilization, max_tokens, max_seqs, max_model_len, now) -> MemoryLedger:
        spec, shape, device = self.spec, self.shape, self.driver.memory
        if total * utilization > total - context:
            raise StartupRefused("gpu_memory_utilization", f"at most {(total - context) / total:.4f}: free memory "
                                 f"after the CUDA context is less than the desired utilization (vLLM refuses)",
                                 _free_memory_refusal(total - context, total, utilization, total * utilization))
        device.reserve_external(context)
        n, r, b = max_tokens, max_seqs, shape.dtype_bytes
        sizes = (n * 4, n * 8, (r + 1) * 4, r * 4, n * shape.hidden_size * b, n, r * 8, r * 4, r * 8)
        for name, size in zip(_PERSISTENT_NAMES, sizes):
            self._persistent_malloc(name, size, now)
        persistent = sum(block for _, block, _, _ in self.persistent.values())
        if weights + spec.cudagraph_bytes > device.free_bytes:
            raise StartupRefused("weights_bytes", "weights that fit the GPU (vLLM's model loading fails)")
        device.reserve_external(weights)
        self.twin.reset_peak_stats()
        before = self.twin.allocated_bytes
        cublas = spec.cublas_workspace_bytes or CUBLAS_WORKSPACE_OTHER + CUBLASLT_WORKSPACE
        try:
            self._replay(profile_plan(shape, max_tokens, max_seqs, cublas), now, persistent_ok=True)
        except StepOOM as e:
            raise StartupRefused("total_bytes", f"room for the profiling run ({e.error})") from None
        peak = self.twin.memory_stats()["allocated_bytes.all.peak"] - before
        self.twin.empty_cache(now_ns=now)
        self._flush(now)
        fixed = getattr(spec, "kv_cache_memory_bytes", 0)  # vLLM PR#21489 (0.10.1): skips the formula
        available = fixed or kv_cache_bytes(total, utilization, weights, spec.non_torch_increase_bytes, peak,
                                            spec.cudagraph_bytes)
        per_token = kv_bytes_per_token(shape)
        block_bytes = spec.block_size * per_token
        check_kv_fits(available, block_bytes, spec.block_size, max_model_len)  # the null block, then one request
        num_blocks = available // block_bytes
        external = spec.non_torch_increase_bytes + num_blocks * block_bytes + spec.cudagraph_bytes
        if external > device.free_bytes:
            raise StartupRefused("total_bytes", "room for the KV cache and the CUDA graphs after profiling")
        device.reserve_external(external)
        try:
            self._replay(warmup_plan(shape, max_tokens, max_seqs), now)
        except StepOOM as e:
            raise StartupRefused("total_bytes", f"room for the sampler warm-up ({e.error})") from None
        self.twin.reset_peak_stats()
        return MemoryLedger(total, context, weights, persistent, peak, spec.non_torch_increase_bytes,
                            spec.cudagraph_bytes, available, per_token, block_bytes, num_blocks,
                            requested_bytes=int(total * utilization), init_free_bytes=total - context,
                            total_consumed_bytes=weights + spec.non_torch_increase_bytes, max_model_len=max_model_len,
                            kv_cache_memory_fixed=bool(fixed), gpu_memory_utilization=utilization)

    def _start_v2(self, total, weights, context, utilization, max_tokens, max_seqs, max_model_len, now) -> MemoryLedger:
        """vLLM 0.33's ``Worker`` with Model Runner V2 (``gpu_worker.py init_device`` and
        ``determine_available_memory``, ``utils/mem_utils.py memory_profiling``, ``v1/worker/utils.py
        request_memory``, ``v1/core/kv_cache_planning.py``), in order:

        1. context + NCCL (``context_bytes``) and a neighbour already on the GPU are taken; the cuBLAS
           handles are made *before* the snapshot (their workspaces are baseline, outside the budget);
        2. the snapshot: ``requested = ceil(total * utilization)``; free below it is refused;
        3. the runner's persistent buffers, then the weights (target and draft);
        4. the profile run (``model_runner_v2.profile_plan_v2``), ``empty_cache``;
           ``available = requested - (init_free - free_after) - (peak - allocated_after) - graph estimate``,
           or ``--kv-cache-memory-bytes`` as given (the profile still runs);
        5. blocks of every layer's pages (target and draft layers share one group); vLLM's refusals;
        6. the KV tensor, the block tables, the warm-up (``warmup_plan_v2``, skipped with
           ``--enforce-eager``), the CUDA-graph pool."""
        spec, shape, device = self.spec, self.shape, self.driver.memory
        device.reserve_external(context)
        if self.neighbour is not None and self.neighbour.start_bytes:
            if self.neighbour.start_bytes > device.free_bytes:
                raise StartupRefused("neighbour", "a neighbour that fits the GPU")
            device.reserve_external(self.neighbour.start_bytes)
            self.neighbour_bytes = self.neighbour_start_bytes = self.neighbour.start_bytes
        cublas = spec.cublas_workspace_bytes or CUBLAS_WORKSPACE_OTHER + CUBLASLT_WORKSPACE
        self._persistent_malloc("cublas_workspace", cublas, now)
        self.twin.empty_cache(now_ns=now)
        self._flush(now)
        init_free = device.free_bytes
        requested = math.ceil(total * utilization)
        if init_free < requested:
            raise StartupRefused("gpu_memory_utilization", f"free memory >= {requested} bytes at start-up",
                                 _free_memory_refusal(init_free, total, utilization, requested))
        k = getattr(spec, "num_speculative_tokens", 0)
        for name, size in v2.persistent_buffer_bytes_v2(shape, max_tokens, max_seqs, k):
            if size:
                self._persistent_malloc(name, size, now)
        draft = getattr(spec, "draft_shape", None)
        loaded = weights + getattr(spec, "draft_weights_bytes", 0)
        if loaded + spec.cudagraph_bytes > device.free_bytes:
            raise StartupRefused("weights_bytes", "weights that fit the GPU (vLLM's model loading fails)")
        device.reserve_external(loaded)
        self.twin.reset_peak_stats()
        try:
            self._replay(v2.profile_plan_v2(shape, max_tokens, max_seqs, draft), now, persistent_ok=True)
        except StepOOM as e:
            raise StartupRefused("total_bytes", f"room for the profiling run ({e.error})", str(e.error)) from None
        peak_allocated = self.twin.memory_stats()["allocated_bytes.all.peak"]
        self.twin.empty_cache(now_ns=now)
        self._flush(now)
        device.reserve_external(spec.non_torch_increase_bytes)
        allocated_after = self.twin.allocated_bytes
        total_consumed = init_free - device.free_bytes
        transient = peak_allocated - allocated_after
        graphs = 0 if self.runner.cudagraph_mode == "NONE" else spec.cudagraph_bytes
        fixed = getattr(spec, "kv_cache_memory_bytes", 0)
        available = fixed if fixed else requested - (total_consumed + transient) - graphs
        per_token = kv_bytes_per_token(shape) + (kv_bytes_per_token(draft) if draft is not None else 0)
        block_bytes = spec.block_size * per_token
        if getattr(spec, "auto_fit_max_model_len", False):
            max_model_len = auto_fit_max_model_len(available, block_bytes, spec.block_size, max_model_len)
        check_kv_fits(available, block_bytes, spec.block_size, max_model_len)
        num_blocks = available // block_bytes
        kv_tensor = num_blocks * block_bytes
        if kv_tensor + graphs > device.free_bytes:
            raise StartupRefused("kv_cache_memory_bytes", "a KV cache that fits the free memory", (
                f"CUDA out of memory. Tried to allocate {format_gib(kv_tensor)} GiB for the KV cache with "
                f"{format_gib(device.free_bytes)} GiB free (initialize_kv_cache)"))
        device.reserve_external(kv_tensor)
        for name, size in v2.block_table_bytes_v2(max_seqs, max_model_len, spec.block_size, max_tokens):
            self._persistent_malloc(name, size, now)
        warm = 0
        if self.runner.cudagraph_mode != "NONE":  # enforce_eager disables the JIT kernel warm-up too
            dql = 1 + k
            warm = v2.warmup_num_reqs(max_seqs, max_tokens, dql, num_blocks, spec.block_size, k, max_model_len, k > 0)
            chunk = getattr(spec, "rejection_chunk_bytes", v2.MAX_CHUNK_BYTES) or None
            try:
                for plan in v2.warmup_plans_v2(shape, self.runner, self.kernel, warm, dql, draft, k, chunk):
                    self._replay(plan, now)
            except StepOOM as e:
                raise StartupRefused("total_bytes", f"room for the kernel warm-up ({e.error})", str(e.error)) from None
        if graphs > device.free_bytes:  # the graph pool's mallocs release the cached blocks, then retry
            self.twin.empty_cache(now_ns=now)
            self._flush(now)
        if graphs > device.free_bytes:  # capture_model raises torch.OutOfMemoryError: the engine never starts
            raise StartupRefused("gpu_memory_utilization", "room for the CUDA graphs after the KV cache", (
                f"CUDA out of memory while capturing CUDA graphs: the graph pool needs {format_gib(graphs)} GiB and "
                f"{format_gib(device.free_bytes)} GiB is free after the KV cache (capture_model; the estimate "
                f"subtracted from the KV cache left too little for what the warm-up and the pool hold)"))
        device.reserve_external(graphs)
        self.twin.reset_peak_stats()
        persistent = sum(block for _, block, _, _ in self.persistent.values())
        return MemoryLedger(total, context, weights, persistent, transient, spec.non_torch_increase_bytes, graphs,
                            available, per_token, block_bytes, num_blocks, requested_bytes=requested,
                            init_free_bytes=init_free, total_consumed_bytes=total_consumed,
                            max_model_len=max_model_len, warmup_reqs=warm, kv_cache_memory_fixed=bool(fixed),
                            gpu_memory_utilization=utilization, model_runner="v2")

    def _persistent_malloc(self, name: str, size: int, now: int) -> int:
        self.driver.requested = size
        before = self.twin.allocated_bytes
        address = self.twin.malloc(size, now_ns=now)
        self._flush(now)
        block = self.twin.allocated_bytes - before
        segment = self._segment_of(address)
        self.persistent[name] = (address, block, size, segment)
        if self.emit is not None:
            self.emit(_BLK_ALLOC, now, self._block_pool(size), 0, address, block, size, segment)
        return address

    def _block_pool(self, requested: int) -> int:
        return int(Pool.SMALL) if self.config.round_size(requested) <= K_SMALL_SIZE else int(Pool.LARGE)

    def _segment_of(self, address: int) -> int:
        for segment in self.twin.snapshot()["segments"]:
            if segment["address"] <= address < segment["address"] + segment["total_size"]:
                return segment["address"]
        raise AssertionError(f"address {address:#x} is in no segment of the twin")

    # ---------------------------------------------------------------- serving
    def plan_for(self, num_tokens: int, num_seqs: int, batch: Batch | None = None) -> StepPlan:
        if batch is not None:
            return step_plan_for(self.shape, batch, self.runner)
        return step_plan(self.shape, self.runner, num_tokens, num_seqs, num_tokens == num_seqs, 1, self.spec.sampling)

    def step_plan(self, num_tokens: int, num_seqs: int, batch: Batch | None = None, *, max_query_len: int = 0,
                  max_seq_len: int = 0, num_logits: int = 0) -> StepPlan:
        """The plan ``run_step`` replays for this step (its ``peak_bytes``: the tensors' own peak)."""
        if self.v2:
            return self._plan_v2(num_tokens, num_seqs, batch, max_query_len, max_seq_len, num_logits)[0]
        return self.plan_for(num_tokens, num_seqs, batch)

    def run_step(self, num_tokens: int, num_seqs: int, now_ns: int, batch: Batch | None = None, *,
                 max_query_len: int = 0, max_seq_len: int = 0, num_logits: int = 0) -> None:
        """The step's non-KV allocations, in order; raises StepOOM. ``batch`` is needed only for
        what the cached plans leave out (prompt logprobs). Model Runner V2 profiles also take the
        batch's longest query and sequence (attention buffers, C3) and the logits rows when
        speculating (C8). Memory outside vLLM (neighbour, leak) moves first, at ``now_ns``."""
        if self.neighbour is not None or self.leak is not None:
            self._external(now_ns)
        if self.v2:
            plan, cacheable = self._plan_v2(num_tokens, num_seqs, batch, max_query_len, max_seq_len, num_logits)
            extra = (plan,) if cacheable else None
        else:
            plan, extra = None, ()
        key = None
        if extra is not None and batch is None and self.fast:
            key = (self.driver.calls, num_tokens, num_seqs) + extra
            if key in self._noop:
                return
        calls = self.driver.calls
        self._replay(plan if plan is not None else self.plan_for(num_tokens, num_seqs, batch), now_ns)
        if key is not None and self.driver.calls == calls:
            self._noop.add(key)
        elif self.driver.calls != calls:
            self._noop.clear()

    def _plan_v2(self, num_tokens, num_seqs, batch, max_query_len, max_seq_len, num_logits):
        """The cached Model Runner V2 plan for this step, and whether it may be memoised (prompt
        logprobs are appended per step and are not)."""
        spec = self.spec
        uniform = num_tokens == num_seqs if not num_logits else num_tokens == num_logits
        attn = (0, 1)
        if self.kernel.lse_rows != "total_q" or self.kernel.version == 3:
            region = _region(self.runner, num_tokens, uniform)[0]
            if region != "full":
                attn = _attention_key(self.shape, self.kernel, num_tokens, num_seqs, max_query_len or 1,
                                      max(max_seq_len, max_query_len, 1))
        k = getattr(spec, "num_speculative_tokens", 0)
        plan = v2.step_plan_v2(self.shape, self.runner, self.kernel, num_tokens, num_seqs, uniform, spec.sampling,
                               attn, num_logits, getattr(spec, "draft_shape", None), k,
                               getattr(spec, "rejection_chunk_bytes", v2.MAX_CHUNK_BYTES) or None)
        positions = [c for c in (batch.prompt_logprobs_tokens if batch is not None else ()) if c > 0]
        if not positions:
            return plan, True
        extra = _Ops()
        for count in positions:
            v2.prompt_logprobs_ops(extra, self.shape, count)
        tail = len(plan.epilogue) - (1 if plan.epilogue and plan.epilogue[-1].name == HIDDEN else 0)
        pro, lay, epi = _Ops(), _Ops(), _Ops()
        pro.ops, lay.ops = list(plan.prologue), list(plan.layer)
        epi.ops = list(plan.epilogue[:tail]) + extra.ops + list(plan.epilogue[tail:])
        return _plan(pro, lay, plan.num_layers, epi), False

    # ---------------------------------------------------------------- memory outside vLLM (C4, C7)
    def _external(self, now_ns: int) -> None:
        """Move the neighbour to its schedule and materialise the leak owed since the last step."""
        changed = False
        device = self.driver.memory
        if self.neighbour is not None:
            want = self.neighbour.bytes_at(now_ns / 1e9)
            delta = want - self.neighbour_bytes
            if delta > 0:  # it can only take what is free on the device
                take = min(delta, device.free_bytes) // NEIGHBOUR_GRANULE * NEIGHBOUR_GRANULE
                if take:
                    device.reserve_external(take)
                    self.neighbour_bytes += take
                    changed = True
            elif delta < 0:
                device.release_external(-delta)
                self.neighbour_bytes += delta
                changed = True
        if self.leak is not None and self.leak.active:
            elapsed_s = max(0, now_ns - self._leak_clock_ns) / 1e9
            self._leak_debt += self.leak.bytes_per_s * elapsed_s + self.leak.bytes_per_step
            self._leak_clock_ns = now_ns
            while self._leak_debt >= LEAK_GRANULE:
                self._leak_debt -= LEAK_GRANULE
                try:
                    self._persistent_malloc(f"leak.{len(self.leaked)}", LEAK_GRANULE, now_ns)
                except OutOfMemoryError as e:
                    self._flush(now_ns)
                    raise StepOOM(e, OomCause.LEAK, "leak") from None
                self.leaked.append(self.persistent[f"leak.{len(self.leaked)}"][0])
                self.leaked_bytes += LEAK_GRANULE
                changed = True
        if changed:
            self.driver.calls += 1  # a new state epoch: memoised replays no longer apply
            self._noop.clear()

    def leak_request(self) -> None:
        """A request finished: its share of the leak, held from the next step on."""
        if self.leak is not None and self.leak.bytes_per_request:
            self._leak_debt += self.leak.bytes_per_request

    def _attribute(self, error: OutOfMemoryError, failed: str, failed_bytes: int,
                   live: dict[str, int]) -> OomCause | None:
        """The failure class whose bytes alone cover the shortfall (the largest if several do), or None:
        tagged tensors live at the failure (``model_runner_v2.TAGS``), the neighbour's growth since
        start-up, the leaked bytes."""
        shortfall = error.tried_to_allocate_bytes - error.device_free_bytes
        bytes_by: dict[str, int] = {}
        for name, nbytes in [(failed, failed_bytes), *live.items()]:
            cls = tag_of(name)
            if cls is not None:
                bytes_by[cls] = bytes_by.get(cls, 0) + nbytes
        if self.neighbour_bytes > self.neighbour_start_bytes:
            bytes_by["neighbour"] = self.neighbour_bytes - self.neighbour_start_bytes
        if self.leaked_bytes:
            bytes_by["leak"] = self.leaked_bytes
        covering = [cls for cls, nbytes in bytes_by.items() if nbytes >= shortfall]
        if not covering:
            return None
        return CLASS_CAUSES[max(covering, key=bytes_by.__getitem__)]

    def _replay(self, plan: StepPlan, now: int, persistent_ok: bool = False) -> None:
        compiled = self._compiled.get(id(plan))
        if compiled is None or compiled[0] is not plan:
            compiled = (plan, _compile(plan.prologue), _compile(plan.layer), _compile(plan.epilogue))
            if len(self._compiled) > 4096:
                self._compiled.clear()
            self._compiled[id(plan)] = compiled
        _, prologue, layer, epilogue = compiled
        self.twin.now_ns = now
        live: dict[str, int] = {}
        self._failed = ("", 0)
        try:
            hidden = self._section(prologue, live, None, persistent_ok)
            if layer:
                hidden = self._layers(layer, plan.num_layers, hidden)
            self._section(epilogue, live, hidden, persistent_ok)
        except OutOfMemoryError as e:
            self._flush(now)
            sizes = {name: nbytes for ops in (prologue, epilogue) for is_alloc, name, nbytes, _ in ops if is_alloc}
            name, nbytes = self._failed
            cause = self._attribute(e, name, nbytes, {n: sizes.get(n, 0) for n in live})
            raise StepOOM(e, cause, name) from None
        if self.driver.log:
            self._flush(now)

    def _section(self, ops, live: dict, hidden, persistent_ok: bool):
        """Replay a prologue or epilogue; returns the hidden states' address (what it became)."""
        twin, driver = self.twin, self.driver
        for is_alloc, name, nbytes, role in ops:
            if is_alloc:
                driver.requested = nbytes
                try:
                    address = twin.malloc(nbytes)
                except OutOfMemoryError:
                    self._failed = (name, nbytes)
                    raise
                if role == 2:
                    hidden = address
                elif role == 3:
                    if not persistent_ok:
                        raise AssertionError(f"step plan allocates persistent {name!r} outside start-up")
                    self._note_persistent(name, address, nbytes)
                else:
                    live[name] = address
            elif role == 1:
                twin.free(hidden)
                hidden = None
            else:
                twin.free(live.pop(name))
        return hidden

    def _note_persistent(self, name: str, address: int, nbytes: int) -> None:
        now = self.twin.now_ns
        self._flush(now)
        segment = self._segment_of(address)
        block = next(b["size"] for s in self.twin.snapshot()["segments"] for b in s["blocks"] if b["address"] == address)
        self.persistent[name] = (address, block, nbytes, segment)
        if self.emit is not None:
            self.emit(_BLK_ALLOC, now, self._block_pool(nbytes), 0, address, block, nbytes, segment)

    def _layers(self, layer, num_layers: int, hidden: int) -> int:
        """Replay ``num_layers`` repetitions of ``layer``, skipping whole periods once the state repeats."""
        twin, driver = self.twin, self.driver
        history: list[tuple[int, int]] = []  # (hidden address, its block size) after each layer
        calls = driver.calls
        i = 0
        while i < num_layers:
            live: dict[str, int] = {}
            new_hidden, new_block = hidden, 0
            try:
                for is_alloc, name, nbytes, role in layer:
                    if is_alloc:
                        driver.requested = nbytes
                        if role == 2:
                            before = twin.allocated_bytes
                            new_hidden = twin.malloc(nbytes)
                            new_block = twin.allocated_bytes - before
                        else:
                            live[name] = twin.malloc(nbytes)
                    elif role == 1:
                        twin.free(hidden)
                    else:
                        twin.free(live.pop(name))
            except OutOfMemoryError:
                self._failed = (name, nbytes)
                raise
            hidden = new_hidden
            i += 1
            if not self._can_skip_layers:
                continue
            if driver.calls != calls:
                history.clear()
                calls = driver.calls
            state = (hidden, new_block)
            if state in history:
                period = len(history) - history.index(state)
                i += (num_layers - i) // period * period
                history.clear()
            else:
                history.append(state)
        return hidden

    # ---------------------------------------------------------------- rows and shutdown
    def _flush(self, now: int) -> None:
        """Allocator rows for what the driver did since the last flush."""
        log = self.driver.log
        if not log:
            return
        self.driver.log = []
        emit = self.emit
        if emit is None:
            return
        retries = 0
        if any(op == "fail" for op, _, _, _ in log):
            total = self.twin.memory_stats()["num_alloc_retries"]
            retries, self.retries_seen = total - self.retries_seen, total
        failed = None
        for op, address, size, requested in log:
            if op == "fail":
                failed = requested
                continue
            if failed is not None and retries > 0:
                emit(_RETRY, now, 0, 0, 0, failed, 0, 0)
                retries -= 1
            failed = None
            mapped = SEG_MAPPED if op in ("map", "unmap") else 0  # pages of an expandable segment
            if op in ("alloc", "map"):
                emit(_SEG_ALLOC, now, _segment_pool(size), 0, address, size, 0, mapped)
            else:
                emit(_SEG_FREE, now, _segment_pool(size), 0, address, size, 0, mapped)

    def empty_cache(self, now_ns: int) -> int:
        """``torch.cuda.empty_cache()`` between steps: cached segments with no allocation go back to the
        device (SEG_FREE rows). Returns the bytes released."""
        before = self.twin.reserved_bytes
        self.twin.empty_cache(now_ns=now_ns)
        self._flush(now_ns)
        return before - self.twin.reserved_bytes

    def shutdown(self, now_ns: int) -> None:
        """The process exits: rows that release every persistent block and segment (the twin is dropped)."""
        self._flush(now_ns)
        if self.emit is None:
            return
        for address, block, requested, segment in self.persistent.values():
            self.emit(_BLK_FREE, now_ns, self._block_pool(requested), 0, address, block, 0, segment)
        for segment in self.twin.snapshot()["segments"]:
            size = segment["total_size"]
            self.emit(_SEG_FREE, now_ns, int(Pool.SMALL) if segment["segment_type"] == "small" else int(Pool.LARGE),
                      0, segment["address"], size, 0, 0)
        self.persistent = {}

    def stats(self) -> dict:
        s = self.twin.memory_stats()
        return {"reserved_bytes": s["reserved_bytes.all.current"], "allocated_bytes": s["allocated_bytes.all.current"],
                "peak_reserved_bytes": s["reserved_bytes.all.peak"], "peak_allocated_bytes": s["allocated_bytes.all.peak"],
                "inactive_split_bytes": s["inactive_split_bytes.all.current"],
                "num_alloc_retries": s["num_alloc_retries"], "num_ooms": s["num_ooms"],
                "device_free_bytes": self.driver.memory.free_bytes}


@lru_cache(maxsize=64)
def measure_ledger(spec, *, total_bytes: int, weights_bytes: int, context_bytes: int, gpu_memory_utilization: float,
                   max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> MemoryLedger:
    """The ledger a worker with these numbers measures at start-up (the same run the engine makes)."""
    return WorkerMemory(spec, total_bytes=total_bytes, weights_bytes=weights_bytes, context_bytes=context_bytes,
                        gpu_memory_utilization=gpu_memory_utilization, max_num_batched_tokens=max_num_batched_tokens,
                        max_num_seqs=max_num_seqs, max_model_len=max_model_len).ledger
