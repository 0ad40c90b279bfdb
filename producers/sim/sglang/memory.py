"""SGLang's start-up memory budget: how ``--mem-fraction-static`` sizes the KV pool.

Follows SGLang 0.5.23 for a plain multi-head-attention model on one GPU (no speculative decoding,
no sliding window, no Mamba, no multimodal reservation):

- ``distributed/bootstrap.py`` ``measure_pre_model_load_memory``: the free device memory before the
  weights load (here ``total - context``: the CUDA context and NCCL are taken first);
- ``mem_cache/kv_cache_configurator.py`` ``_profile_available_bytes``: after the weights load,
  ``rest = free_now - pre_model_load_free x (1 - mem_fraction_static)``; the slack
  ``pre_model_load_free x (1 - mem_fraction_static)`` is what activations, CUDA graphs and the
  sampler have for the life of the server; ``rest <= 0`` is a start-up error ("Loaded weights
  leave no GPU memory for the KV cache ... Raise --mem-fraction-static above ...");
- ``model_executor/pool_configurator.py`` (``_compute_cell_size``, MHA branch; the
  ``DefaultPoolConfigurator`` has no fixed overhead then): a token's cell is
  ``kv_heads_per_rank x (head_dim + v_head_dim) x layers x dtype_bytes`` and
  ``max_total_num_tokens = rest // cell // page_size x page_size``, capped by ``--max-total-tokens``
  (``_apply_token_constraints``);
- ``resolve_max_num_reqs``: ``--max-running-requests`` if given (at most half the pool's tokens),
  else ``min(clamp(pool / context_len x 512, 2048, 4096), pool // 2)``;
- ``arg_groups/memory_hook.py``: the default ``--chunked-prefill-size`` by device memory (2048 under
  20 GiB, 4096 under 60, 8192 under 160, else 16384) and, when ``--mem-fraction-static`` is not given,
  ``round((gpu_mb - reserved_mb) / gpu_mb, 3)`` with ``reserved_mb = 512 + 1.5 x max(chunk, 2048) +
  tp x pp / 8 x 1024 + the CUDA-graph reserve`` (at least 10 GiB on GPUs over 60 GiB); the graph
  reserve depends on the capture sizes and is taken from the profile (``cuda_graph_reserve_mb``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvguard.producers.vllm.step_memory import ModelShape

MIB = 1 << 20
GIB = 1 << 30


class StartupRefused(ValueError):
    """SGLang would not start with these settings; ``field`` names the profile field to change."""

    def __init__(self, field: str, expected: str):
        self.field, self.expected = field, expected
        super().__init__(f"{field}: {expected}")


def default_chunked_prefill_size(total_bytes: int) -> int:
    mib = total_bytes / MIB
    for limit_gib, size in ((20, 2048), (35, 4096), (60, 4096), (90, 8192), (160, 8192)):
        if mib < limit_gib * 1024:
            return size
    return 16384


def default_mem_fraction_static(total_bytes: int, chunked_prefill_size: int, *, tensor_parallel_size: int = 1,
                                cuda_graph_reserve_mb: float = 0.0) -> float:
    gpu_mb = total_bytes / MIB
    reserved = 512 + max(chunked_prefill_size, 2048) * 1.5 + tensor_parallel_size / 8 * 1024 + cuda_graph_reserve_mb
    if gpu_mb > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((gpu_mb - reserved) / gpu_mb, 3)


def cell_bytes(shape: ModelShape) -> int:
    """One token's KV across every layer on this rank (K and V of equal head_dim)."""
    return shape.kv_heads_per_rank * (shape.head_dim * 2) * shape.num_layers * shape.dtype_bytes


@dataclass(slots=True, frozen=True)
class SglangLedger:
    """The start-up budget, in bytes and tokens (what SGLang logs as ``max_total_num_tokens=...,
    available_gpu_mem=...``)."""

    total_bytes: int
    weights_bytes: int
    context_bytes: int
    mem_fraction_static: float
    pre_model_load_free_bytes: int
    slack_bytes: int  # activations, CUDA graphs, sampler: pre_model_load_free x (1 - mem_fraction_static)
    kv_cache_bytes: int  # max_total_num_tokens x cell
    cell_bytes: int
    max_total_num_tokens: int
    max_running_requests: int
    chunked_prefill_size: int | None
    page_size: int

    @property
    def num_gpu_blocks(self) -> int:
        """Pages of the pool (the ``kv_blocks`` of ``kvguard simulate``, as vLLM's block count is)."""
        return self.max_total_num_tokens // self.page_size

    @property
    def kv_token_capacity(self) -> int:
        """Tokens the pool holds (``max_total_num_tokens``), the summary's ``kv_token_capacity``."""
        return self.max_total_num_tokens

    def log_lines(self) -> list[str]:
        """The figures of the scheduler's start-up line (``max_total_num_tokens=…, chunked_prefill_size=…,
        max_running_requests=…, available_gpu_mem=… GB``), in SGLang's terms; the budget behind them
        as kvguard computes it."""
        gb = 1 << 30
        return [f"max_total_num_tokens={self.max_total_num_tokens}, chunked_prefill_size={self.chunked_prefill_size}, "
                f"max_running_requests={self.max_running_requests}, page_size={self.page_size}, "
                f"available_gpu_mem={self.slack_bytes / gb:.2f} GB",
                f"mem_fraction_static={self.mem_fraction_static}: weights {self.weights_bytes / gb:.2f} GiB, "
                f"KV cache {self.kv_cache_bytes / gb:.2f} GiB ({self.cell_bytes} bytes per token)"]

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__slots__}


def size_pool(shape: ModelShape, *, total_bytes: int, weights_bytes: int, context_bytes: int, page_size: int,
              context_len: int, mem_fraction_static: float | None = None, max_total_tokens: int | None = None,
              max_running_requests: int | None = None, chunked_prefill_size: int | None | str = "auto",
              cuda_graph_reserve_mb: float = 0.0) -> SglangLedger:
    """The ledger SGLang's start-up computes; raises ``StartupRefused`` where SGLang refuses to start.
    ``chunked_prefill_size``: "auto" for SGLang's default by device memory, None for chunking off."""
    chunk = default_chunked_prefill_size(total_bytes) if chunked_prefill_size == "auto" else chunked_prefill_size
    mfs = mem_fraction_static
    if mfs is None:
        mfs = default_mem_fraction_static(total_bytes, chunk or 16384, tensor_parallel_size=shape.tensor_parallel_size,
                                          cuda_graph_reserve_mb=cuda_graph_reserve_mb)
    if not 0 < mfs < 1:
        raise StartupRefused("sglang.mem_fraction_static", f"a fraction in (0, 1), got {mfs}")
    pre_load = total_bytes - context_bytes
    free_now = pre_load - weights_bytes
    slack = int(pre_load * (1 - mfs))
    rest = free_now - slack
    if rest <= 0:
        minimum = 1 - free_now / pre_load
        raise StartupRefused("sglang.mem_fraction_static",
                             f"above {minimum:.4f}: the loaded weights leave no GPU memory for the KV cache")
    cell = cell_bytes(shape)
    tokens = rest // cell // page_size * page_size
    if max_total_tokens is not None:
        tokens = min(tokens, max_total_tokens // page_size * page_size)
    if tokens < page_size:
        raise StartupRefused("sglang.mem_fraction_static", "a KV pool of at least one page")
    if max_running_requests is not None:
        reqs = min(max(1, max_running_requests), tokens // 2)
    else:
        reqs = min(max(min(int(tokens / context_len * 512), 4096), 2048), tokens // 2)
    return SglangLedger(total_bytes=total_bytes, weights_bytes=weights_bytes, context_bytes=context_bytes,
                        mem_fraction_static=mfs, pre_model_load_free_bytes=pre_load, slack_bytes=slack,
                        kv_cache_bytes=tokens * cell, cell_bytes=cell, max_total_num_tokens=tokens,
                        max_running_requests=max(1, reqs), chunked_prefill_size=chunk, page_size=page_size)
