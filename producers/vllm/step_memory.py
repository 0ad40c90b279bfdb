"""GPU memory a vLLM v1 worker allocates besides the KV cache, as PyTorch's allocator sees it.

Three things a shadow engine needs, each derived from vLLM / PyTorch source (docs/NODE_MEMORY.md
lists every source with its commit):

- ``profile_peak_bytes``: the ``torch_peak_increase`` that ``Worker.determine_available_memory``
  measures around ``GPUModelRunner.profile_run`` (dummy forward at ``max_num_batched_tokens``,
  then the dummy sampler run at ``min(max_num_batched_tokens, max_num_seqs)`` rows);
- ``kv_cache_bytes``: vLLM's formula ``total * utilization - (weights + peak + non_torch)``;
- ``step_plan`` / ``step_allocations``: the ordered alloc/free sequence of one engine step
  (forward + logits + sampler), one decoder layer's pattern repeated ``num_layers`` times.

Sizes are the tensor sizes the code requests; every allocation is rounded up to 512 B the way
the caching allocator's ``round_size`` does. Block splitting and segment sizes are the
allocator twin's job, not this module's. The model is a dense Llama-style decoder run by the
V1 ``GPUModelRunner`` with custom (non-Inductor) ops; docs/NODE_MEMORY.md says what is left out.
vLLM 0.33's default runner (Model Runner V2) is ``model_runner_v2``, built on this module's forward.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

MiB = 1 << 20
GiB = 1 << 30

# c10/cuda/CUDACachingAllocator.cpp round_size(): below kMinBlockSize (512) -> 512, else a
# multiple of 512; allocated_bytes (the stat vLLM reads as torch peak) counts the rounded size.
MIN_BLOCK_BYTES = 512
# aten/src/ATen/cuda/CublasHandlePool.cpp parseChosenWorkspaceSize(): 32 MiB on sm90
# (H100/H200), ":4096:2:16:8" elsewhere; parseCUDABlasLtWorkspaceSize(): 1024 KiB. Both come
# from the caching allocator at the first GEMM on a (handle, stream) and are kept for good.
CUBLAS_WORKSPACE_SM90 = 4096 * 8 * 1024
CUBLAS_WORKSPACE_OTHER = 4096 * 1024 * 2 + 16 * 1024 * 8
CUBLASLT_WORKSPACE = 1024 * 1024
# vllm/model_executor/layers/vocab_parallel_embedding.py DEFAULT_VOCAB_PADDING_SIZE.
VOCAB_PADDING = 64

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}
_PROFILE_SAMPLING = "top_k_top_p"  # _dummy_sampler_run: top_k=vocab-1, top_p=0.9, not greedy
SAMPLING_MODES = ("greedy", "random", "top_k", "top_p", "top_k_top_p")
HIDDEN = "<hidden>"  # placeholder: the tensor currently holding the layer's hidden states
HIDDEN_TAG = "#hidden"  # suffix on the alloc that becomes the hidden states


def round_block(nbytes: int) -> int:
    """Bytes the caching allocator accounts for a request of ``nbytes`` (512-byte rounding)."""
    return MIN_BLOCK_BYTES * max(1, -(-nbytes // MIN_BLOCK_BYTES))


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The config fields that size a Llama-style decoder's activations on one TP rank."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype_bytes: int = 2
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "intermediate_size", "num_heads",
                     "num_kv_heads", "head_dim", "vocab_size", "tensor_parallel_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelShape.{name} must be positive, got {getattr(self, name)}")
        if self.dtype_bytes not in (2, 4):
            raise ValueError(f"dtype_bytes must be 2 or 4, got {self.dtype_bytes}")
        tp = self.tensor_parallel_size
        # llama.py LlamaAttention: heads split evenly; kv heads split or replicated.
        if self.num_heads % tp or (self.num_kv_heads % tp and tp % self.num_kv_heads):
            raise ValueError(f"{self.num_heads} heads / {self.num_kv_heads} kv heads do not "
                             f"shard over tensor_parallel_size={tp}")
        if self.intermediate_size % tp:
            raise ValueError(f"intermediate_size {self.intermediate_size} is not divisible by "
                             f"tensor_parallel_size={tp}")

    @classmethod
    def from_hf_config(cls, config: Mapping, *, tensor_parallel_size: int = 1,
                       dtype: str | None = None) -> ModelShape:
        """From a Hugging Face config.json dict (head_dim falls back as in llama.py)."""
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        dtype_name = dtype or config.get("torch_dtype") or config.get("dtype") or "bfloat16"
        if dtype_name not in _DTYPE_BYTES:
            raise ValueError(f"unknown dtype {dtype_name!r}; use one of {sorted(_DTYPE_BYTES)}")
        return cls(
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab_size=int(config["vocab_size"]),
            dtype_bytes=_DTYPE_BYTES[dtype_name],
            tensor_parallel_size=tensor_parallel_size,
        )

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.tensor_parallel_size

    @property
    def kv_heads_per_rank(self) -> int:
        # llama.py: self.num_kv_heads = max(1, total_num_kv_heads // tp_size)
        return max(1, self.num_kv_heads // self.tensor_parallel_size)

    @property
    def q_size(self) -> int:
        return self.heads_per_rank * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads_per_rank * self.head_dim

    @property
    def intermediate_per_rank(self) -> int:
        return self.intermediate_size // self.tensor_parallel_size

    @property
    def padded_vocab(self) -> int:
        # vocab_parallel_embedding.py pad_vocab_size(vocab, 64); lm_head emits padded columns.
        return _round_up(self.vocab_size, VOCAB_PADDING)


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    """Engine settings that change what one step allocates."""

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    cudagraph_mode: str = "FULL_AND_PIECEWISE"  # vLLM v1 default; or PIECEWISE, FULL, NONE
    max_cudagraph_capture_size: int | None = None  # None: vLLM's default rule
    fa2_split_kv: bool = False  # model FlashAttention-2 decode split-KV buffers (Ampere)
    num_sms: int = 132

    def __post_init__(self) -> None:
        if self.cudagraph_mode not in ("FULL_AND_PIECEWISE", "PIECEWISE", "FULL", "NONE"):
            raise ValueError(f"unknown cudagraph_mode {self.cudagraph_mode!r}")
        if self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")

    @property
    def capture_sizes(self) -> tuple[int, ...]:
        """vllm/config/vllm.py _set_cudagraph_sizes: 1, 2, 4, multiples of 8 below 256, then 16."""
        if self.cudagraph_mode == "NONE":
            return ()
        top = self.max_cudagraph_capture_size
        if top is None:
            top = min(self.max_num_seqs * 2, 512)
        top = min(top, self.max_num_batched_tokens)
        sizes = [s for s in (1, 2, 4) if s <= top]
        if top >= 8:
            sizes += range(8, min(top + 1, 256), 8)
        if top >= 256:
            sizes += range(256, top + 1, 16)
        return tuple(sizes)


@dataclass(frozen=True, slots=True)
class Batch:
    """One scheduled step: tokens and context length per sequence, plus what sampling needs."""

    num_scheduled_tokens: tuple[int, ...]
    context_lens: tuple[int, ...]  # tokens in the sequence once this step's tokens are added
    sampling: str = "greedy"
    top_k: int = 0  # largest top-k in the batch ("top_k" mode)
    num_logprobs: int | None = None
    penalties: bool = False
    prompt_lens: tuple[int, ...] = ()  # needed by penalties and prompt logprobs
    structured_output: bool = False
    prompt_logprobs_tokens: tuple[int, ...] = ()  # prompt logits computed per sequence this step
    # speculative decoding: draft tokens each sequence verifies this step (its scheduled tokens are 1 + drafts,
    # every one a logits row: Model Runner V2's ``num_reqs * (1 + k)`` rows); the V1 plans ignore them
    num_draft_tokens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.num_scheduled_tokens)
        if n == 0 or len(self.context_lens) != n:
            raise ValueError("num_scheduled_tokens and context_lens need one entry per sequence")
        if min(self.num_scheduled_tokens) <= 0:
            raise ValueError("every scheduled sequence needs at least one token")
        if any(c < t for c, t in zip(self.context_lens, self.num_scheduled_tokens)):
            raise ValueError("context_lens[i] must include the tokens scheduled this step")
        if self.sampling not in SAMPLING_MODES:
            raise ValueError(f"sampling must be one of {SAMPLING_MODES}, got {self.sampling!r}")
        for name in ("prompt_lens", "prompt_logprobs_tokens", "num_draft_tokens"):
            if getattr(self, name) and len(getattr(self, name)) != n:
                raise ValueError(f"{name} needs one entry per sequence when given")
        if any(t < 1 + d for t, d in zip(self.num_scheduled_tokens, self.num_draft_tokens)):
            raise ValueError("a sequence verifying d draft tokens schedules at least 1 + d tokens")

    @classmethod
    def uniform(cls, num_seqs: int, tokens_per_seq: int, context_len: int, **kwargs) -> Batch:
        return cls((tokens_per_seq,) * num_seqs, (context_len,) * num_seqs, **kwargs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def num_seqs(self) -> int:
        return len(self.num_scheduled_tokens)

    @property
    def num_draft_tokens_total(self) -> int:
        return sum(self.num_draft_tokens)


class MemOp(NamedTuple):
    """One allocator call. A NamedTuple, not a frozen dataclass: plans build hundreds per step
    and tuple construction is several times cheaper."""

    kind: str  # "alloc" or "free"
    name: str
    nbytes: int  # already rounded to 512 B
    persistent: bool = False  # kept after the step (cuBLAS workspace)


@dataclass(frozen=True, slots=True)
class Allocation:
    name: str
    nbytes: int
    alloc_index: int  # position of the alloc in the step's event order
    free_index: int | None  # position of the free; None when it outlives the step


@dataclass(frozen=True)
class StepPlan:
    """One step in compressed form: ``layer`` replays ``num_layers`` times between the others.

    Invariant: a layer starts and ends with the same live set (residual + hidden), so the peak
    over all layers is the peak of one; ``peak_bytes`` is the most live above the step's start.
    ``ops()`` expands it (names unique per layer) on first use and keeps the result, so a
    cached plan pays for the expansion once; a caller that only needs the peak never does.
    """

    prologue: tuple[MemOp, ...]
    layer: tuple[MemOp, ...]
    num_layers: int
    epilogue: tuple[MemOp, ...]
    peak_bytes: int

    def ops(self) -> tuple[MemOp, ...]:
        flat = self.__dict__.get("_flat")
        if flat is None:
            flat = _expand(self.prologue, self.layer, self.num_layers, self.epilogue)
            object.__setattr__(self, "_flat", flat)
        return flat

    def allocations(self) -> list[Allocation]:
        opened: dict[str, tuple[int, int]] = {}
        done: list[Allocation] = []
        for index, op in enumerate(self.ops()):
            if op.kind == "alloc":
                opened[op.name] = (op.nbytes, index)
            else:
                nbytes, start = opened.pop(op.name)
                done.append(Allocation(op.name, nbytes, start, index))
        done += [Allocation(name, nbytes, start, None) for name, (nbytes, start) in opened.items()]
        done.sort(key=lambda a: a.alloc_index)
        return done


def _expand(prologue, layer, num_layers, epilogue) -> tuple[MemOp, ...]:
    """Resolve the hidden placeholder and prefix layer op names with ``L<i>.``."""
    out: list[MemOp] = []
    hidden = None
    sections = [("", prologue)] + [(f"L{i}.", layer) for i in range(num_layers if layer else 0)]
    for prefix, ops in sections + [("", epilogue)]:
        for op in ops:
            name = op.name
            if name == HIDDEN:
                if hidden is None:
                    raise ValueError("plan frees the hidden states before any tensor holds them")
                out.append(MemOp(op.kind, hidden, op.nbytes, op.persistent))
                continue
            if name.endswith(HIDDEN_TAG):
                name = prefix + name[:-len(HIDDEN_TAG)]
                hidden = name
            elif prefix:
                name = prefix + name
            out.append(op if name == op.name else MemOp(op.kind, name, op.nbytes, op.persistent))
    return tuple(out)


class _Ops:
    """An op list under construction; remembers each name's rounded size for its free."""

    def __init__(self) -> None:
        self.ops: list[MemOp] = []
        self.sizes: dict[str, int] = {}

    def alloc(self, name: str, nbytes: int, *, persistent: bool = False) -> None:
        size = round_block(nbytes)
        self.sizes[name] = size
        self.ops.append(MemOp("alloc", name, size, persistent))

    def free(self, *names: str) -> None:
        for name in names:
            self.ops.append(MemOp("free", name, self.sizes[name]))


# -- forward pass --------------------------------------------------------------------------

def _prologue(o: _Ops, s: ModelShape, n: int, cublas_bytes: int) -> None:
    act = n * s.hidden_size * s.dtype_bytes
    if s.tensor_parallel_size == 1:
        o.alloc("embed", act)  # F.embedding output; becomes the residual (llama.py layer 0)
    else:  # VocabParallelEmbedding: masked lookup, then all-reduce returns a new tensor
        o.alloc("embed_partial", act)
        o.alloc("embed", act)
        o.free("embed_partial")
    o.alloc("input_norm" + HIDDEN_TAG, act)  # layer 0 RMSNorm, no residual: torch.empty_like
    if cublas_bytes:
        o.alloc("cublas_workspace", cublas_bytes, persistent=True)  # first GEMM (qkv_proj)


def _row_parallel(o: _Ops, s: ModelShape, name: str, nbytes: int, tag: str = "") -> str:
    """RowParallelLinear output; with TP the all-reduce returns a new tensor (out-of-place)."""
    if s.tensor_parallel_size == 1:
        o.alloc(name + tag, nbytes)
        return name + tag
    o.alloc(name, nbytes)
    o.alloc(name + "_allreduce" + tag, nbytes)
    o.free(name)
    return name + "_allreduce" + tag


def _attention_kernel(o: _Ops, s: ModelShape, n: int, decode_splits: int | None) -> None:
    """FlashAttention's own tensors (vllm-project/flash-attention csrc/flash_attn/flash_api.cpp)."""
    # mha_varlen_fwd: softmax_lse = torch::empty({num_heads, total_q}, fp32); decode with GQA
    # swaps heads but keeps heads*tokens elements.
    names = []
    if decode_splits is not None:  # seqlenq_ngroups_swapped with out_ given: temp empty_like(q)
        o.alloc("attn_out_tmp", n * s.q_size * s.dtype_bytes)
        names.append("attn_out_tmp")
    o.alloc("attn_lse", s.heads_per_rank * n * 4)
    names.append("attn_lse")
    if decode_splits and decode_splits > 1:  # set_params_splitkv accumulators, fp32
        head_rounded = _round_up(_round_up(s.head_dim, 8), 32)
        o.alloc("attn_lse_accum", decode_splits * s.heads_per_rank * n * 4)
        o.alloc("attn_out_accum", decode_splits * s.heads_per_rank * n * head_rounded * 4)
        names += ["attn_lse_accum", "attn_out_accum"]
    o.free(*reversed(names))


def _layer(o: _Ops, s: ModelShape, n: int, attention: str, decode_splits: int | None, kernel=None) -> None:
    """One LlamaDecoderLayer with vLLM custom ops (llama.py, activation.py, layernorm.py).

    Enters with residual + hidden live (layer >0: the input norm is fused and in place) and
    leaves with residual + the MLP output, which becomes the next layer's hidden. ``kernel``,
    when given, allocates the attention kernel's own tensors instead of ``_attention_kernel``
    (the model-runner-v2 plans size them from the batch's context, ``model_runner_v2``).
    """
    b = s.dtype_bytes
    o.alloc("qkv", n * (s.q_size + 2 * s.kv_size) * b)  # QKVParallelLinear
    o.alloc("attn_out", n * s.q_size * b)  # Attention.forward: torch.empty((tokens, heads*hd))
    if attention == "kernel":  # profile/warm-up runs have attn_metadata None: output.fill_(0)
        if kernel is not None:
            kernel(o)
        else:
            _attention_kernel(o, s, n, decode_splits)
    attn = _row_parallel(o, s, "o_proj", n * s.hidden_size * b)
    o.free("qkv", "attn_out")  # LlamaAttention.forward returns
    o.free(HIDDEN)  # decoder rebinds hidden_states; post-attention norm is fused, in place
    o.alloc("gate_up", n * 2 * s.intermediate_per_rank * b)  # MergedColumnParallelLinear
    o.alloc("act", n * s.intermediate_per_rank * b)  # SiluAndMul: torch.empty(tokens, d)
    o.free("gate_up")  # LlamaMLP.forward rebinds x
    _row_parallel(o, s, "mlp_down", n * s.hidden_size * b, HIDDEN_TAG)  # next layer's hidden
    o.free("act")
    o.free(attn)  # decoder rebinds hidden_states to the MLP output


def _forward(s: ModelShape, n: int, attention: str, decode_splits: int | None,
             cublas_bytes: int, kernel=None) -> tuple[_Ops, _Ops, _Ops]:
    pro, lay, epi = _Ops(), _Ops(), _Ops()
    _prologue(pro, s, n, cublas_bytes)
    lay.sizes[HIDDEN] = round_block(n * s.hidden_size * s.dtype_bytes)
    _layer(lay, s, n, attention, decode_splits, kernel)
    epi.sizes.update(pro.sizes)
    epi.free("embed")  # LlamaModel.forward returns: the residual dies; final norm was in place
    return pro, lay, epi


# -- logits and sampler --------------------------------------------------------------------

def _logits(o: _Ops, s: ModelShape, rows: int, name: str = "logits") -> None:
    """LogitsProcessor._get_logits: lm_head matmul, gather over TP, slice off vocab padding."""
    b = s.dtype_bytes
    tp = s.tensor_parallel_size
    if tp == 1:
        o.alloc(name, rows * s.padded_vocab * b)
    else:
        o.alloc(name + "_partial", rows * (s.padded_vocab // tp) * b)
        o.alloc(name, rows * s.padded_vocab * b)
        o.free(name + "_partial")


def _sort(o: _Ops, rows: int, vocab: int) -> None:
    """logits.sort(dim=-1) on [rows, vocab] fp32: ATen/native/cuda/SortStable.cu."""
    elems = rows * vocab
    o.alloc("sort_values", elems * 4)
    o.alloc("sort_indices", elems * 8)  # int64
    if rows >= 128:  # segmented_sort_pairs: reverse_indices int64, then cub SortPairs temp
        scratch = [("sort_reverse_indices", elems * 8)]
    elif rows > 1:  # segmented_sort_pairs_by_full_sort: two int2 arrays
        scratch = [("sort_index_segment", elems * 8), ("sort_index_segment2", elems * 8)]
    else:  # segmented_sort_large_segments: one int64 index array of vocab entries
        scratch = [("sort_indices_init", vocab * 8)]
    # cub's non-DoubleBuffer SortPairs keeps alternate key (4 B) and value (8 B) buffers in its
    # temp storage (CUB_WRAPPER in ATen/cuda/cub.cuh allocates it from the caching allocator).
    scratch.append(("sort_cub_temp", elems * 12))
    for name, nbytes in scratch:
        o.alloc(name, nbytes)
    o.free(*(name for name, _ in reversed(scratch)))


def _sampler(o: _Ops, s: ModelShape, rows: int, batch_kind: str, top_k: int,
             num_logprobs: int | None, penalty_cols: tuple[int, int] | None) -> None:
    """vllm/v1/sample/sampler.py Sampler.forward with the native top-k/top-p path."""
    vocab = s.vocab_size
    elems = rows * vocab
    if s.dtype_bytes != 4:
        o.alloc("logits_f32", elems * 4)  # logits.to(torch.float32)
    f32 = "logits_f32" if s.dtype_bytes != 4 else None
    held = []
    if num_logprobs is not None:
        o.alloc("raw_logprobs", elems * 4)  # compute_logprobs: log_softmax(dtype=float32)
        held.append("raw_logprobs")
    if penalty_cols is not None:  # model_executor/layers/utils.py apply_penalties
        prompt_cols, output_cols = penalty_cols
        o.alloc("output_token_ids", rows * output_cols * 8)  # make_tensor_with_pad, int64
        for side, cols in (("prompt", prompt_cols), ("output", output_cols)):
            o.alloc(f"{side}_bin_counts", rows * (vocab + 1) * 8)  # torch.zeros(long)
            o.alloc(f"{side}_ones", rows * cols * 8)  # torch.ones_like(tokens) for scatter_add_
            o.free(f"{side}_ones")
            o.alloc(f"{side}_mask", elems)  # bin_counts > 0 (bool)
        for term in ("frequency_term", "presence_term"):  # penalty * counts/mask -> fp32
            o.alloc(term, elems * 4)
            o.free(term)
        o.free("output_token_ids", "prompt_bin_counts", "prompt_mask",
               "output_bin_counts", "output_mask")
    if batch_kind != "random":
        o.alloc("greedy_ids", rows * 8)  # argmax (int64)
        held.append("greedy_ids")
    if batch_kind != "greedy":
        # ops/topk_topp_sampler.py forward_native: apply_top_k_top_p, softmax, random_sample
        scratch = []
        if batch_kind in ("top_p", "top_k_top_p"):
            _sort(o, rows, vocab)
            if batch_kind == "top_k_top_p":
                o.alloc("top_k_mask", elems)  # logits_sort < kth value (bool), held to return
            o.alloc("probs_sort", elems * 4)  # logits_sort.softmax; cumsum writes in place
            o.alloc("top_p_mask", elems)
            o.alloc("topkp_logits", elems * 4)  # logits_sort.scatter(...) -> new tensor
            o.free("sort_values", "sort_indices", "probs_sort", "top_p_mask")
            if batch_kind == "top_k_top_p":
                o.free("top_k_mask")
            scratch.append("topkp_logits")
        elif batch_kind == "top_k":  # apply_top_k_only: topk values/indices, then a bool mask
            k = max(1, top_k)
            o.alloc("topk_values", rows * k * 4)
            o.alloc("topk_indices", rows * k * 8)
            o.alloc("top_k_mask", elems)
            o.free("top_k_mask", "topk_indices", "topk_values")
        o.alloc("probs", elems * 4)  # softmax(dtype=float32)
        o.alloc("exp_noise", elems * 4)  # random_sample: q = torch.empty_like(probs)
        o.alloc("random_ids", rows * 8)
        o.free("exp_noise", "probs", *scratch)
        held.append("random_ids")
    o.alloc("sampled_ids", rows * 4)  # sampled.to(torch.int32)
    if num_logprobs is not None:  # gather_logprobs: top-k plus the sampled token
        k = max(1, num_logprobs)
        o.alloc("logprob_values", rows * (k + 1) * 4)
        o.alloc("logprob_ids", rows * (k + 1) * 4)
    o.free(*held)
    if f32:
        o.free(f32)


def prompt_logprobs_row_bytes(vocab_size: int, dtype_bytes: int) -> int:
    """What one prompt position of a request asking for prompt logprobs allocates outside the profiled
    peak (``_prompt_logprobs``): its logits row (vocab padded as the lm_head pads it, model dtype) and
    its float32 log-softmax row, plus its token id."""
    return _round_up(vocab_size, VOCAB_PADDING) * dtype_bytes + vocab_size * 4 + 8


def prompt_logprobs_bytes_per_token(s: ModelShape) -> int:
    return prompt_logprobs_row_bytes(s.vocab_size, s.dtype_bytes)


LOGPROBS_GUARD_MIN_TOKENS = 16  # the logprob guard never stops a prefill: at least this many tokens per step


def logprobs_step_cap(headroom_bytes: int, row_bytes: int, margin_bytes: int) -> int:
    """kvguard's logprob guard (the shadow engine and the plugin): the most tokens one step may schedule
    while a prompt-logprob request prefills, so that its logits rows fit ``headroom_bytes`` (what the
    caching allocator can still get) less ``margin_bytes``. Two requests' rows can be live at once (the
    rebind in ``_prompt_logprobs``): half the headroom. vLLM's workaround for these OOMs (vllm#5424:
    bound the tokens per batch), per step."""
    return max(LOGPROBS_GUARD_MIN_TOKENS, (headroom_bytes - margin_bytes) // (2 * row_bytes))


def _prompt_logprobs(o: _Ops, s: ModelShape, prompt_lens, logits_counts) -> None:
    """gpu_model_runner._get_prompt_logprobs_dict: per request, logits and log_softmax."""
    previous: list[str] = []
    for j, (plen, count) in enumerate(zip(prompt_lens, logits_counts)):
        if count <= 0:
            continue
        current = [f"pl_token_ids.{j}", f"pl_logits.{j}", f"pl_logprobs.{j}"]
        o.alloc(current[0], plen * 8)  # torch.tensor(prompt_token_ids).to(device)
        o.alloc(current[1], count * s.padded_vocab * s.dtype_bytes)
        o.alloc(current[2], count * s.vocab_size * 4)
        o.free(*previous)  # the loop rebinds its locals only after the new tensors exist
        previous = current
    o.free(*previous)


# -- plans ---------------------------------------------------------------------------------

def _plan(pro: _Ops, lay: _Ops, num_layers: int, epi: _Ops) -> StepPlan:
    live = peak = net = 0
    sections = [(pro.ops, 1), (lay.ops, 1 if lay.ops else 0), (epi.ops, 1)]
    for ops, times in sections:
        for _ in range(times):
            for op in ops:
                delta = op.nbytes if op.kind == "alloc" else -op.nbytes
                live += delta
                peak = max(peak, live)
                if ops is lay.ops:
                    net += delta
    if net:
        raise AssertionError(f"a decoder layer must end with the live set it started with ({net})")
    return StepPlan(tuple(pro.ops), tuple(lay.ops), num_layers, tuple(epi.ops), peak)


def _region(runner: RunnerConfig, num_tokens: int, uniform_decode: bool) -> tuple[str, int]:
    """Which CUDA-graph region runs the forward, and the token count it runs with."""
    sizes = runner.capture_sizes
    if sizes and num_tokens <= sizes[-1]:
        padded = next(x for x in sizes if x >= num_tokens)  # pad_for_cudagraph
        if runner.cudagraph_mode == "FULL" or (
                runner.cudagraph_mode == "FULL_AND_PIECEWISE" and uniform_decode):
            return "full", padded
        return "piecewise", padded
    return "eager", num_tokens


def fa2_num_splits(shape: ModelShape, num_seqs: int, max_context: int, num_sms: int) -> int:
    """flash_api.cpp num_splits_heuristic for a GQA decode batch (seqlen_q swapped to ngroups)."""
    ngroups = shape.heads_per_rank // shape.kv_heads_per_rank
    block_n = 256 if shape.head_dim <= 64 else (128 if shape.head_dim <= 128 else 64)
    n_blocks = -(-max_context // block_n)
    work = num_seqs * shape.kv_heads_per_rank * -(-ngroups // 64)
    sms = 2 * num_sms
    if work >= 0.8 * sms:
        return 1
    max_splits = min(128, sms, n_blocks)
    eff = []
    for splits in range(1, max_splits + 1):
        eligible = splits == 1 or -(-n_blocks // splits) != -(-n_blocks // (splits - 1))
        waves = work * splits / sms
        eff.append(waves / math.ceil(waves) if eligible else 0.0)
    best = max(eff, default=0.0)
    return next((i + 1 for i, e in enumerate(eff) if e and e >= 0.85 * best), 1)


@lru_cache(maxsize=4096)
def step_plan(shape: ModelShape, runner: RunnerConfig, num_tokens: int, num_seqs: int,
              uniform_decode: bool = False, decode_splits: int = 1, sampling: str = "greedy",
              top_k: int = 0, num_logprobs: int | None = None,
              penalty_cols: tuple[int, int] | None = None,
              structured_output: bool = False) -> StepPlan:
    """The cached plan of one step; sizes depend only on these arguments."""
    region = _region(runner, num_tokens, uniform_decode)[0]  # padding only shapes graph pools
    splits = decode_splits if (runner.fa2_split_kv and uniform_decode
                               and shape.heads_per_rank > shape.kv_heads_per_rank) else None
    if region == "eager":
        pro, lay, epi = _forward(shape, num_tokens, "kernel", splits, 0)
    else:  # graph replay: activations live in the graph's private pool
        pro, lay, epi = _Ops(), _Ops(), _Ops()
        if region == "piecewise":  # attention runs eagerly between the captured pieces
            _attention_kernel(lay, shape, num_tokens, splits)
    epi.alloc("sample_hidden", num_seqs * shape.hidden_size * shape.dtype_bytes)
    _logits(epi, shape, num_seqs)
    if structured_output:  # structured_output/utils.py apply_grammar_bitmask: ceil(V/32) int32
        epi.alloc("grammar_bitmask", num_seqs * -(-shape.vocab_size // 32) * 4)
        epi.free("grammar_bitmask")
    _sampler(epi, shape, num_seqs, sampling, top_k, num_logprobs, penalty_cols)
    epi.free("sampled_ids", "logits", "sample_hidden")
    if num_logprobs is not None:
        epi.free("logprob_values", "logprob_ids")
    if region == "eager":
        epi.ops.append(MemOp("free", HIDDEN, round_block(num_tokens * shape.hidden_size
                                                        * shape.dtype_bytes)))
    return _plan(pro, lay, shape.num_layers, epi)


def step_allocations(shape: ModelShape, batch: Batch,
                     runner: RunnerConfig = RunnerConfig()) -> list[Allocation]:
    """Every tensor of one forward + sample, in the order the allocator sees it."""
    return step_plan_for(shape, batch, runner).allocations()


def step_plan_for(shape: ModelShape, batch: Batch,
                  runner: RunnerConfig = RunnerConfig()) -> StepPlan:
    """The plan for ``batch``: the cached part plus prompt-logprob work, when any."""
    uniform_decode = max(batch.num_scheduled_tokens) == 1
    splits = fa2_num_splits(shape, batch.num_seqs, max(batch.context_lens), runner.num_sms) \
        if runner.fa2_split_kv and uniform_decode else 1
    penalty_cols = None
    if batch.penalties:
        prompts = batch.prompt_lens or batch.context_lens
        outputs = [c - p for c, p in zip(batch.context_lens, prompts)]
        penalty_cols = (max(1, max(prompts)), max(1, max(outputs)))
    plan = step_plan(shape, runner, batch.num_tokens, batch.num_seqs, uniform_decode, splits,
                     batch.sampling, batch.top_k, batch.num_logprobs, penalty_cols,
                     batch.structured_output)
    if not any(batch.prompt_logprobs_tokens):
        return plan
    extra = _Ops()
    _prompt_logprobs(extra, shape, batch.prompt_lens or batch.context_lens,
                     batch.prompt_logprobs_tokens)
    # Prompt logprobs run after sampling while logits and the hidden states are still held,
    # so they go just before those frees at the end of the epilogue.
    tail = _tail_start(plan.epilogue)
    epilogue = plan.epilogue[:tail] + tuple(extra.ops) + plan.epilogue[tail:]
    pro, lay, epi = _Ops(), _Ops(), _Ops()
    pro.ops, lay.ops, epi.ops = list(plan.prologue), list(plan.layer), list(epilogue)
    return _plan(pro, lay, plan.num_layers, epi)


def _tail_start(epilogue: tuple[MemOp, ...]) -> int:
    for i, op in enumerate(epilogue):
        if op.kind == "free" and op.name == "sampled_ids":
            return i
    return len(epilogue)


# -- start-up ------------------------------------------------------------------------------

def profile_plan(shape: ModelShape, max_num_batched_tokens: int, max_num_seqs: int,
                 cublas_workspace_bytes: int = CUBLAS_WORKSPACE_SM90 + CUBLASLT_WORKSPACE
                 ) -> StepPlan:
    """GPUModelRunner.profile_run: dummy forward, then the dummy sampler run.

    The forward runs without attention metadata (FlashAttention returns ``output.fill_(0)``),
    and ``hidden_states`` stays alive while the sampler runs on ``last_hidden_states``.
    """
    n = max_num_batched_tokens
    rows = min(n, max_num_seqs)  # _dummy_run: num_reqs = min(num_tokens, max_num_seqs)
    pro, lay, epi = _forward(shape, n, "profile", None, cublas_workspace_bytes)
    b = shape.dtype_bytes
    epi.alloc("logit_indices", rows * 8)  # torch.from_numpy(np.cumsum(...) - 1).to(device)
    epi.alloc("last_hidden", rows * shape.hidden_size * b)  # hidden_states[logit_indices]
    epi.alloc("rand_hidden", rows * shape.hidden_size * b)  # torch.rand_like(hidden_states)
    _logits(epi, shape, rows)
    _sampler(epi, shape, rows, _PROFILE_SAMPLING, 0, None, None)
    epi.free("sampled_ids", "logits", "rand_hidden", "last_hidden", "logit_indices")
    epi.ops.append(MemOp("free", HIDDEN, round_block(n * shape.hidden_size * b)))
    return _plan(pro, lay, shape.num_layers, epi)


def profile_peak_bytes(shape: ModelShape, max_num_batched_tokens: int, max_num_seqs: int,
                       cublas_workspace_bytes: int = CUBLAS_WORKSPACE_SM90 + CUBLASLT_WORKSPACE
                       ) -> int:
    """The ``torch_peak_increase`` vLLM measures: peak allocated bytes of ``profile_run``."""
    return profile_plan(shape, max_num_batched_tokens, max_num_seqs,
                        cublas_workspace_bytes).peak_bytes


def warmup_plan(shape: ModelShape, max_num_batched_tokens: int, max_num_seqs: int) -> StepPlan:
    """compile_or_warm_up_model's sampler warm-up, run after the KV cache and graph capture.

    vLLM runs it last on purpose so the sampler's freed blocks stay cached in the allocator
    (gpu_worker.py: "preallocate memory buffer for logits ... to avoid memory fragmentation").
    """
    n = min(max_num_seqs, max_num_batched_tokens)
    pro, lay, epi = _forward(shape, n, "profile", None, 0)
    b = shape.dtype_bytes
    epi.alloc("logit_indices", n * 8)
    epi.alloc("last_hidden", n * shape.hidden_size * b)
    epi.alloc("rand_hidden", n * shape.hidden_size * b)
    _logits(epi, shape, n)
    _sampler(epi, shape, n, _PROFILE_SAMPLING, 0, None, None)
    epi.free("sampled_ids", "logits", "rand_hidden", "last_hidden", "logit_indices")
    epi.ops.append(MemOp("free", HIDDEN, round_block(n * shape.hidden_size * b)))
    return _plan(pro, lay, shape.num_layers, epi)


def kv_cache_bytes(total_bytes: int, gpu_memory_utilization: float, weights_bytes: int,
                   non_torch_bytes: int, profile_peak_bytes: int,
                   cudagraph_estimate_bytes: int = 0) -> int:
    """vLLM's KV budget: ``int(total * util - (weights + peak + non_torch [+ graphs]))``.

    gpu_worker.py determine_available_memory: requested_memory - non_kv_cache_memory, with
    non_kv_cache_memory = non_torch_increase + torch_peak_increase + weights_memory
    (utils/mem_utils.py memory_profiling). ``cudagraph_estimate_bytes`` is the estimate newer
    releases subtract when CUDA-graph memory profiling is on (default since v0.21 per its log).
    """
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    requested = total_bytes * gpu_memory_utilization
    return int(requested - (non_torch_bytes + profile_peak_bytes + weights_bytes
                            + cudagraph_estimate_bytes))


def persistent_buffer_bytes(shape: ModelShape, max_num_batched_tokens: int,
                            max_num_seqs: int) -> int:
    """GPUModelRunner.__init__ persistent GPU buffers (the CpuGpuBuffer device halves).

    Allocated after the start-up snapshot and outside load_model, so vLLM's KV formula counts
    them nowhere: they sit on top of the requested budget.
    """
    t, r = max_num_batched_tokens, max_num_seqs
    parts = [t * 4,  # input_ids int32
             t * 8,  # positions int64
             (r + 1) * 4,  # query_start_loc
             r * 4,  # seq_lens
             t * shape.hidden_size * shape.dtype_bytes,  # inputs_embeds
             t,  # is_token_ids bool
             r * 8, r * 4, r * 8]  # discard_request_indices, num_decode_draft, num_accepted
    return sum(round_block(p) for p in parts)
