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
from kvguard.producers.vllm.step_memory import (
    CUBLAS_WORKSPACE_OTHER,
    CUBLASLT_WORKSPACE,
    HIDDEN,
    HIDDEN_TAG,
    Batch,
    RunnerConfig,
    StepPlan,
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


class StartupRefused(ValueError):
    """The worker would not start with these numbers (vLLM raises at start-up in each case)."""

    def __init__(self, field: str, expected: str):
        self.field, self.expected = field, expected
        super().__init__(f"{field}: expected {expected}")


class StepOOM(MemoryError):
    """The twin raised OutOfMemoryError during a step: a CUDA OOM. ``error`` carries PyTorch's fields."""

    def __init__(self, error: OutOfMemoryError):
        self.error = error
        self.cause = OOM_CAUSES.get(error.cause, OomCause.OTHER)
        super().__init__(str(error))


@dataclass(slots=True, frozen=True)
class MemoryLedger:
    """The measured start-up split of one GPU (bytes)."""

    total_bytes: int
    context_bytes: int
    weights_bytes: int
    persistent_bytes: int
    profile_peak_bytes: int  # torch_peak_increase, as the twin measured it
    non_torch_increase_bytes: int
    cudagraph_bytes: int
    kv_cache_bytes: int  # available_kv_cache_memory
    kv_bytes_per_token: int
    block_bytes: int
    num_gpu_blocks: int

    @property
    def kv_tensor_bytes(self) -> int:
        return self.num_gpu_blocks * self.block_bytes

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__} | {"kv_tensor_bytes": self.kv_tensor_bytes}


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
                 max_model_len: int, emit=None, now_ns: int = 0, fast: bool = True, record_history: bool = False):
        self.spec = spec
        self.shape = spec.shape
        self.emit = emit
        self.fast = fast
        self.runner = RunnerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                   cudagraph_mode=spec.cudagraph_mode)
        self.driver = RecordingDriver(DeviceMemory(total_bytes))
        self.config = AllocatorConfig.from_string(spec.allocator_conf)
        self.twin = CachingAllocator(driver=self.driver, config=self.config, record_history=record_history)
        self._can_skip_layers = fast and not (self.config.garbage_collection_threshold > 0.0
                                              and self.config.per_process_memory_fraction < 1.0)
        self._noop: set = set()
        self._compiled: dict[int, tuple] = {}
        self.persistent: dict[str, tuple[int, int, int, int]] = {}  # name -> (address, block, requested, segment)
        self.retries_seen = 0
        self.ledger = self._start(total_bytes, weights_bytes, context_bytes, gpu_memory_utilization,
                                  max_num_batched_tokens, max_num_seqs, max_model_len, now_ns)

    # ---------------------------------------------------------------- start-up (gpu_worker.py order)
    def _start(self, total, weights, context, utilization, max_tokens, max_seqs, max_model_len, now) -> MemoryLedger:
        spec, shape, device = self.spec, self.shape, self.driver.memory
        if total * utilization > total - context:
            raise StartupRefused("gpu_memory_utilization", f"at most {(total - context) / total:.4f}: free memory "
                                 f"after the CUDA context is less than the desired utilization (vLLM refuses)")
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
        available = kv_cache_bytes(total, utilization, weights, spec.non_torch_increase_bytes, peak,
                                   spec.cudagraph_bytes)
        per_token = kv_bytes_per_token(shape)
        block_bytes = spec.block_size * per_token
        num_blocks = max(0, available) // block_bytes
        need = -(-max_model_len // spec.block_size) + 1  # + the null block
        if num_blocks < need:
            raise StartupRefused("max_model_len", f"a KV cache that holds one request of max_model_len="
                                 f"{max_model_len}: {need} blocks of {spec.block_size} tokens, but only "
                                 f"{num_blocks} fit ({available} bytes); vLLM refuses to start")
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
                            spec.cudagraph_bytes, available, per_token, block_bytes, num_blocks)

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

    def run_step(self, num_tokens: int, num_seqs: int, now_ns: int, batch: Batch | None = None) -> None:
        """The step's non-KV allocations, in order; raises StepOOM. ``batch`` is needed only for
        what the cached plans leave out (prompt logprobs)."""
        key = None
        if batch is None and self.fast:
            key = (self.driver.calls, num_tokens, num_seqs)
            if key in self._noop:
                return
        calls = self.driver.calls
        self._replay(self.plan_for(num_tokens, num_seqs, batch), now_ns)
        if key is not None and self.driver.calls == calls:
            self._noop.add(key)
        elif self.driver.calls != calls:
            self._noop.clear()

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
        try:
            hidden = self._section(prologue, live, None, persistent_ok)
            if layer:
                hidden = self._layers(layer, plan.num_layers, hidden)
            self._section(epilogue, live, hidden, persistent_ok)
        except OutOfMemoryError as e:
            self._flush(now)
            raise StepOOM(e) from None
        if self.driver.log:
            self._flush(now)

    def _section(self, ops, live: dict, hidden, persistent_ok: bool):
        """Replay a prologue or epilogue; returns the hidden states' address (what it became)."""
        twin, driver = self.twin, self.driver
        for is_alloc, name, nbytes, role in ops:
            if is_alloc:
                driver.requested = nbytes
                address = twin.malloc(nbytes)
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
