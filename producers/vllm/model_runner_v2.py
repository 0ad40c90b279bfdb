"""What vLLM 0.33's default GPU model runner (Model Runner V2) allocates besides the KV cache.

``step_memory`` models the V1 ``GPUModelRunner``; 0.33 runs ``vllm/v1/worker/gpu/model_runner.py``
unless ``VLLM_USE_V2_MODEL_RUNNER=0`` (``config/vllm.py use_v2_model_runner``). What differs, each
from the installed 0.33 source (paths under ``vllm/``):

- **Profile run** (``v1/worker/gpu/model_runner.py profile_run``): ``_dummy_run(max_num_batched_tokens,
  skip_attn=True)`` — attention is *skipped*, so no attention kernel tensor is ever profiled —
  then ``_dummy_sampler_run`` on ``min(tokens, max_num_seqs)`` rows, twice: default parameters
  (model-dtype logits, ``gumbel_sample``), then ``SamplingParams.for_sampler_warmup()`` (temperature
  0.9, top-p 0.9, top-k 50, min-p, penalties, ``logprobs=5``): the fp32 copy of the logits
  (``sample/sampler.py apply_sampling_params``) and FlashInfer's top-k-first sampler
  (``flashinfer/sampling.py top_k_top_p_sampling_from_logits``: ``top_k_mask_logits`` then
  ``softmax``, both fp32 ``[rows, vocab]``). With a speculator the dummy batch has ``num_reqs =
  min(num_reqs, tokens // num_query_per_req)`` and the drafter's dummy propose runs too.
- **Sampler** (serving): no fp32 copy unless a request needs processing (temperature not 0 or 1,
  top-k/top-p/min-p set: ``sample/states.py add_request``); top-k/top-p through FlashInfer
  (``VLLM_USE_FLASHINFER_SAMPLER`` defaults on; CUDA with more than 16 SMs): top-p only or top-k
  only is ``softmax(fp32)`` (``v1/sample/ops/topk_topp_sampler.py flashinfer_sample``), both is the
  top-k-first pair above; greedy is ``gumbel_sample``'s ``[rows, cdiv(V, 1024)]`` partials.
  Logprobs never materialise ``[rows, V]`` (``sample/logprob.py compute_token_logprobs``).
- **Prompt logprobs** in chunks of ``CHUNK_SIZE = 1024`` positions (``sample/prompt_logprob.py``):
  one ``[1024, V]`` logits chunk at a time, model dtype.
- **Speculative decoding** (``spec_decode/rejection_sampler.py``): the target's logits for every
  scheduled position, ``num_reqs * (1 + k)`` rows in the model dtype, then verification in
  request chunks whose fp32 copy stays within ``MAX_CHUNK_BYTES = 2**30`` (``get_max_chunk_logits``:
  ``2**30 // (V * 4)`` rows, never splitting a request). Before that chunking (vllm PR#48641) the
  copy covered every row: ``rows * V * 4`` bytes. The drafter (``standalone_ar``) runs the draft model
  over the step's tokens, then ``k - 1`` single-token steps, each with its own logits.
- **Persistent buffers** made at runner init, after the start-up snapshot, so 0.33's accounting
  counts them (``InputBuffers``, ``RequestState``, the penalties state's
  ``output_bin_counts [max_num_seqs, V] int32`` — "can be very large, taking up GBs", its own
  comment — and ``prompt_bin_mask``), and the block tables made with the KV cache, after it.
- **Warm-up** after the KV cache (``v1/worker/gpu/warmup.py _warmup_kernels``): ``num_reqs =
  min(max_num_seqs, max_num_batched_tokens // (decode_query_len + 1))`` requests (fewer if the KV
  cache cannot hold them) prefill ``decode_query_len + 1`` tokens and sample with the warm-up
  parameters, then decode ``decode_query_len`` tokens each: with a speculator that step verifies
  ``num_reqs * decode_query_len`` logits rows — the allocation that OOMed in vllm PR#48641.
- **Attention kernels** (not profiled): FlashAttention's ``softmax_lse`` — ``{heads, total_q}`` fp32
  in vLLM's ``vllm-flash-attn`` (``csrc/flash_attn/flash_api.cpp`` at ``04325b67``, the unpadded
  layout of Dao-AILab/flash-attention PR#970), ``{num_seqs, heads, max_seqlen}`` in FlashAttention-2
  before it (Dao-AILab/flash-attention#1011), which noonghunna/club-3090 ``docs/CLIFFS.md`` ("Cliff 1")
  found sized by the ``max_seq_len`` vLLM passes — and the split-KV accumulators
  ``out_accum {splits, heads, total_q, head_dim}`` and ``softmax_lse_accum {splits, heads, total_q}``,
  fp32, whose split count grows with the context: FlashAttention-3 (Hopper) chooses it with
  ``num_splits_heuristic`` (``hopper/heuristics.h``) over ``ceil(max_seqlen_k / kBlockN)`` key blocks
  (``hopper/flash_api.cpp get_num_splits``, varlen batches counted as one sequence; kBlockM = kBlockN
  = 128 for head_dim <= 128 with a paged cache, ``hopper/tile_size.h``); vLLM lets it choose outside
  full CUDA graphs (``v1/attention/backends/flash_attn.py``: ``max_num_splits = 0``, "Setting
  num_splits > 1 may increase the memory usage").

Allocations a failure class owns carry a tag (``TAGS``) in their name, so an OOM in one of them is
attributed to its class (``producers/sim/vllm/memory.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from kvguard.producers.vllm.step_memory import (
    HIDDEN,
    MemOp,
    ModelShape,
    RunnerConfig,
    StepPlan,
    _forward,
    _logits,
    _Ops,
    _plan,
    _region,
    round_block,
)

MAX_CHUNK_BYTES = 1 << 30  # spec_decode/rejection_sampler.py
PROMPT_LOGPROBS_CHUNK = 1024  # sample/prompt_logprob.py CHUNK_SIZE
GUMBEL_BLOCK = 1024  # sample/gumbel.py BLOCK_SIZE
FLASHINFER_ROW_STATES = 1 << 20  # flashinfer sampling.py: a 1 MB cached row_states buffer
WARMUP_LOGPROBS = 5  # SamplingParams.for_sampler_warmup(): logprobs=5
LSE_LAYOUTS = ("total_q", "max_seqlen_q", "max_seq_len")
TAG_LONG_CONTEXT = "lctx:"  # attention buffers sized by the context length (class C3)
TAG_SPEC = "spec:"  # speculative decoding's own tensors (class C8)
TAG_PROMPT_LOGPROBS = "pl_"  # prompt-logprob logits (class C2; step_memory's names)
TAGS = {TAG_LONG_CONTEXT: "long_context", TAG_SPEC: "spec_decode", TAG_PROMPT_LOGPROBS: "prompt_logprobs"}
_SAMPLER_MODES = ("greedy", "random", "top_k", "top_p", "top_k_top_p")


@dataclass(frozen=True, slots=True)
class AttentionKernel:
    """The FlashAttention build a GPU runs: version 3 on Hopper, 2 elsewhere (``fa_utils.py``); the
    LSE layout (``LSE_LAYOUTS``: ``total_q`` is vLLM 0.33's); SMs for the split heuristics."""

    version: int = 3
    num_sms: int = 132
    lse_rows: str = "total_q"

    def __post_init__(self) -> None:
        if self.version not in (2, 3):
            raise ValueError(f"FlashAttention version must be 2 or 3, got {self.version}")
        if self.lse_rows not in LSE_LAYOUTS:
            raise ValueError(f"lse layout must be one of {LSE_LAYOUTS}, got {self.lse_rows!r}")


def fa3_num_splits(shape: ModelShape, max_seqlen_q: int, max_seqlen_k: int, num_sms: int) -> int:
    """``get_num_splits`` + ``num_splits_heuristic`` (FlashAttention-3, causal, paged KV, bf16)."""
    k_block_m = k_block_n = 128 if shape.head_dim <= 128 else 80
    q_per_kv = shape.heads_per_rank // shape.kv_heads_per_rank
    num_m_blocks = -(-max_seqlen_q * q_per_kv // k_block_m)
    num_n_blocks = -(-max_seqlen_k // k_block_n)
    total_mblocks = shape.kv_heads_per_rank * num_m_blocks  # varlen: "pretending that batch = 1"
    if total_mblocks >= 0.8 * num_sms:
        return 1  # causal: no L2-sized split
    if num_n_blocks <= 4 or (num_n_blocks <= 8 and total_mblocks >= 32):
        return 1
    max_splits = min(128, num_sms, num_n_blocks)
    efficiency = []
    for splits in range(1, max_splits + 1):
        waves = total_mblocks * splits / num_sms
        eff = waves / math.ceil(waves)
        if num_n_blocks / splits < 4:
            eff *= 0.85
        efficiency.append(eff)
    best = max(efficiency)
    return next(i + 1 for i, e in enumerate(efficiency) if e >= 0.95 * best)


def attention_key(shape: ModelShape, kernel: AttentionKernel, num_tokens: int, num_seqs: int, max_query_len: int,
                  max_seq_len: int) -> tuple[int, int]:
    """(LSE rows, split count) of one eager attention call; the step plan's cache key for it."""
    if kernel.lse_rows == "total_q":
        lse_rows = num_tokens
    else:
        lse_rows = num_seqs * (max_query_len if kernel.lse_rows == "max_seqlen_q" else max_seq_len)
    splits = fa3_num_splits(shape, max_query_len, max_seq_len, kernel.num_sms) if kernel.version == 3 else 1
    return lse_rows, splits


def _attention_ops(shape: ModelShape, num_tokens: int, lse_rows: int, splits: int, padded: bool):
    """The kernel's tensors, tagged long-context where the context sizes them."""
    def kernel(o: _Ops) -> None:
        lse = (TAG_LONG_CONTEXT if padded else "") + "attn_lse"
        o.alloc(lse, shape.heads_per_rank * lse_rows * 4)
        names = [lse]
        if splits > 1:
            o.alloc(TAG_LONG_CONTEXT + "attn_lse_accum", splits * shape.heads_per_rank * num_tokens * 4)
            o.alloc(TAG_LONG_CONTEXT + "attn_out_accum",
                    splits * shape.heads_per_rank * num_tokens * shape.head_dim * 4)
            names += [TAG_LONG_CONTEXT + "attn_lse_accum", TAG_LONG_CONTEXT + "attn_out_accum"]
        o.free(*reversed(names))
    return kernel


# -- sampler ------------------------------------------------------------------------------

def _gumbel(o: _Ops, rows: int, vocab: int, prefix: str = "") -> None:
    nb = -(-vocab // GUMBEL_BLOCK)
    o.alloc(prefix + "gumbel_argmax", rows * nb * 8)
    o.alloc(prefix + "gumbel_max", rows * nb * 4)
    o.alloc(prefix + "sampled", rows * 8)
    o.free(prefix + "gumbel_max", prefix + "gumbel_argmax")


def sampler_v2(o: _Ops, s: ModelShape, rows: int, mode: str, *, logprobs: int = 0, prefix: str = "") -> None:
    """``Sampler.__call__`` on ``[rows, V]`` logits already allocated as ``prefix + 'logits'``; leaves
    ``prefix + 'sampled'`` live."""
    if mode not in _SAMPLER_MODES:
        raise ValueError(f"sampling must be one of {_SAMPLER_MODES}, got {mode!r}")
    elems, vocab = rows * s.vocab_size, s.vocab_size
    copy = mode != "greedy" and s.dtype_bytes != 4  # needs_logits_processing -> fp32 copy
    if copy:
        o.alloc(prefix + "logits_f32", elems * 4)
    if mode in ("top_k", "top_p"):  # flashinfer_sample: probs = softmax(float32)
        o.alloc(prefix + "fi_probs", elems * 4)
        o.alloc(prefix + "sampled32", rows * 4)
        o.free(prefix + "fi_probs")
        o.alloc(prefix + "sampled", rows * 8)
        o.free(prefix + "sampled32")
    elif mode == "top_k_top_p":  # top_k_mask_logits, then softmax, both fp32
        o.alloc(prefix + "fi_masked", elems * 4)
        o.alloc(prefix + "fi_probs", elems * 4)
        o.alloc(prefix + "sampled32", rows * 4)
        o.free(prefix + "fi_probs", prefix + "fi_masked")
        o.alloc(prefix + "sampled", rows * 8)
        o.free(prefix + "sampled32")
    else:
        _gumbel(o, rows, vocab, prefix)
    if logprobs:  # compute_topk_scores on the raw logits: topk ids, cat, per-row scores, ranks
        o.alloc(prefix + "lp_topk", rows * logprobs * 8)
        o.alloc(prefix + "lp_ids", rows * (logprobs + 1) * 8)
        o.free(prefix + "lp_topk")
        o.alloc(prefix + "lp_scores", rows * (logprobs + 1) * 4)
        o.alloc(prefix + "lp_ranks", rows * 8)
        o.free(prefix + "lp_ranks", prefix + "lp_scores", prefix + "lp_ids")
    if copy:
        o.free(prefix + "logits_f32")


def _rejection(o: _Ops, s: ModelShape, num_logits: int, rows_per_request: int, chunk_bytes: int | None,
               needs_processing: bool) -> None:
    """``RejectionSampler.__call__``: per request chunk, the fp32 copy of its target logits."""
    if needs_processing and s.dtype_bytes != 4:
        if chunk_bytes is None:
            chunk = num_logits
        else:
            limit = max(1, chunk_bytes // (s.vocab_size * 4))
            chunk = max(rows_per_request, limit // rows_per_request * rows_per_request)
        chunk = min(chunk, num_logits)
        o.alloc(TAG_SPEC + "verify_f32", chunk * s.vocab_size * 4)
        o.free(TAG_SPEC + "verify_f32")
    o.alloc(TAG_SPEC + "sampled", num_logits * 4)


def _drafter(o: _Ops, draft: ModelShape, num_tokens: int, num_seqs: int, steps: int, attention: str) -> None:
    """``StandaloneARSpeculator.propose``: the draft model over the step's tokens, then ``steps - 1``
    single-token passes, each with its logits and greedy draft ids. A draft forward is one block of
    its own peak (``draft_forward_peak``): the bytes are exact, the placement of its per-layer tensors
    is not modelled."""
    for j, n in enumerate([num_tokens] + [num_seqs] * max(0, steps - 1)):
        o.alloc(f"{TAG_SPEC}draft_forward.{j}", draft_forward_peak(draft, n, attention))
        o.free(f"{TAG_SPEC}draft_forward.{j}")
        o.alloc(f"{TAG_SPEC}draft_hidden.{j}", num_seqs * draft.hidden_size * draft.dtype_bytes)
        _logits(o, draft, num_seqs, f"{TAG_SPEC}draft_logits.{j}")
        _gumbel(o, num_seqs, draft.vocab_size, f"{TAG_SPEC}draft.{j}.")
        o.free(f"{TAG_SPEC}draft.{j}.sampled", f"{TAG_SPEC}draft_logits.{j}", f"{TAG_SPEC}draft_hidden.{j}")


@lru_cache(maxsize=1024)
def draft_forward_peak(draft: ModelShape, num_tokens: int, attention: str = "kernel") -> int:
    """Peak bytes of the draft model's eager forward over ``num_tokens`` (``step_memory._forward``)."""
    pro, lay, epi = _forward(draft, num_tokens, attention, None, 0)
    epi.ops.append(MemOp("free", HIDDEN, round_block(num_tokens * draft.hidden_size * draft.dtype_bytes)))
    return _plan(pro, lay, draft.num_layers, epi).peak_bytes


# -- plans --------------------------------------------------------------------------------

@lru_cache(maxsize=4096)
def step_plan_v2(shape: ModelShape, runner: RunnerConfig, kernel: AttentionKernel, num_tokens: int, num_seqs: int,
                 uniform_decode: bool, sampling: str, attn: tuple[int, int] = (0, 1), num_logits: int = 0,
                 draft: ModelShape | None = None, num_speculative_tokens: int = 0,
                 chunk_bytes: int | None = MAX_CHUNK_BYTES) -> StepPlan:
    """One serving step under Model Runner V2 (module docstring). ``attn``: ``attention_key``;
    ``num_logits``: target logits rows when speculating (0: one per sequence)."""
    region = _region(runner, num_tokens, uniform_decode)[0]
    lse_rows, splits = attn if attn != (0, 1) else (num_tokens, 1)
    padded = kernel.lse_rows != "total_q"
    attention = _attention_ops(shape, num_tokens, lse_rows, splits, padded)
    if region == "eager":
        pro, lay, epi = _forward(shape, num_tokens, "kernel", None, 0, attention)
    else:
        pro, lay, epi = _Ops(), _Ops(), _Ops()
        if region == "piecewise":
            attention(lay)
    spec = num_speculative_tokens > 0 and num_logits > num_seqs
    rows = num_logits if spec else num_seqs
    epi.alloc(TAG_SPEC + "sample_hidden" if spec else "sample_hidden", rows * shape.hidden_size * shape.dtype_bytes)
    logits = TAG_SPEC + "logits" if spec else "logits"
    _logits(epi, shape, rows, logits)
    if spec:
        _rejection(epi, shape, rows, 1 + num_speculative_tokens, chunk_bytes, sampling != "greedy")
        epi.free(TAG_SPEC + "sampled")
    else:
        sampler_v2(epi, shape, rows, sampling)
        epi.free("sampled")
    epi.free(logits, TAG_SPEC + "sample_hidden" if spec else "sample_hidden")
    if draft is not None and num_speculative_tokens > 0:
        _drafter(epi, draft, num_tokens, num_seqs, num_speculative_tokens, "kernel")
    if region == "eager":
        epi.ops.append(MemOp("free", HIDDEN, round_block(num_tokens * shape.hidden_size * shape.dtype_bytes)))
    return _plan(pro, lay, shape.num_layers, epi)


def profile_plan_v2(shape: ModelShape, max_num_batched_tokens: int, max_num_seqs: int,
                    draft: ModelShape | None = None) -> StepPlan:
    """``profile_run``: the skip-attention dummy forward, the drafter's dummy propose, the two sampler
    passes (module docstring). The FlashInfer row-states buffer it creates stays allocated."""
    n, rows = max_num_batched_tokens, min(max_num_batched_tokens, max_num_seqs)
    if draft is not None:  # StandaloneAR: num_query_per_req 1, one extra query per request
        n = min(n, max_num_batched_tokens - rows)
    pro, lay, epi = _forward(shape, n, "profile", None, 0)
    b = shape.dtype_bytes
    if draft is not None:
        _drafter(epi, draft, n, rows, 1, "profile")
    epi.alloc("sample_hidden", rows * shape.hidden_size * b)  # hidden_states[logits_indices]
    _logits(epi, shape, rows)
    _gumbel(epi, rows, shape.vocab_size)  # pass 1: default SamplingParams, no processing
    epi.free("sampled")
    epi.alloc("logits_f32", rows * shape.vocab_size * 4)  # pass 2: for_sampler_warmup
    epi.alloc("fi_masked", rows * shape.vocab_size * 4)
    epi.alloc("fi_probs", rows * shape.vocab_size * 4)
    epi.alloc("flashinfer_row_states", FLASHINFER_ROW_STATES, persistent=True)
    epi.alloc("sampled32", rows * 4)
    epi.free("fi_probs", "fi_masked")
    epi.alloc("sampled", rows * 8)
    epi.free("sampled32")
    epi.alloc("lp_topk", rows * WARMUP_LOGPROBS * 8)
    epi.alloc("lp_ids", rows * (WARMUP_LOGPROBS + 1) * 8)
    epi.free("lp_topk")
    epi.alloc("lp_scores", rows * (WARMUP_LOGPROBS + 1) * 4)
    epi.free("lp_scores", "lp_ids", "logits_f32", "sampled", "logits", "sample_hidden")
    epi.ops.append(MemOp("free", HIDDEN, round_block(n * shape.hidden_size * b)))
    return _plan(pro, lay, shape.num_layers, epi)


def warmup_num_reqs(max_num_seqs: int, max_num_batched_tokens: int, decode_query_len: int, num_blocks: int,
                    block_size: int, num_lookahead_tokens: int, max_model_len: int, speculating: bool) -> int:
    """``_warmup_kernels``: how many dummy requests the post-KV warm-up runs."""
    prompt_len = decode_query_len + 1
    steps = 5 if speculating else 3
    decode_len = prompt_len + steps * decode_query_len
    blocks = -(-min(decode_len + num_lookahead_tokens, max_model_len) // block_size)
    n = min(max_num_seqs, max_num_batched_tokens // max(prompt_len, decode_query_len))
    return min(n, max(1, (num_blocks - 1) // blocks))


def warmup_plans_v2(shape: ModelShape, runner: RunnerConfig, kernel: AttentionKernel, num_reqs: int,
                    decode_query_len: int, draft: ModelShape | None = None, num_speculative_tokens: int = 0,
                    chunk_bytes: int | None = MAX_CHUNK_BYTES) -> tuple[StepPlan, StepPlan]:
    """``warmup_kernels``: the prefill step (forward, warm-up-parameter sampling with the structured-output
    bitmask), then the decode step in which every request computes ``decode_query_len`` tokens (with a
    speculator: verifies that many rows, then drafts). Both run eagerly: no graph is captured yet."""
    eager = RunnerConfig(max_num_batched_tokens=runner.max_num_batched_tokens, max_num_seqs=runner.max_num_seqs,
                         cudagraph_mode="NONE", num_sms=runner.num_sms)
    prefill = num_reqs * (decode_query_len + 1)
    pro, lay, epi = _forward(shape, prefill, "kernel", None, 0,
                             _attention_ops(shape, prefill, prefill, 1, False))
    b, vocab = shape.dtype_bytes, shape.vocab_size
    epi.alloc("sample_hidden", num_reqs * shape.hidden_size * b)
    _logits(epi, shape, num_reqs)
    epi.alloc("grammar_bitmask", num_reqs * decode_query_len * -(-vocab // 32) * 4)
    sampler_v2(epi, shape, num_reqs, "top_k_top_p", logprobs=WARMUP_LOGPROBS)
    epi.free("sampled", "grammar_bitmask", "logits", "sample_hidden")
    if draft is not None and num_speculative_tokens:
        _drafter(epi, draft, prefill, num_reqs, num_speculative_tokens, "kernel")
    epi.ops.append(MemOp("free", HIDDEN, round_block(prefill * shape.hidden_size * b)))
    rows = num_reqs * decode_query_len
    decode = step_plan_v2(shape, eager, kernel, rows, num_reqs, rows == num_reqs, "top_k_top_p", (0, 1),
                          rows if num_speculative_tokens else 0, draft, num_speculative_tokens, chunk_bytes)
    return _plan(pro, lay, shape.num_layers, epi), decode


def prompt_logprobs_ops(o: _Ops, s: ModelShape, positions: int) -> None:
    """``compute_prompt_logprobs_with_chunking``: ``[1024, V]`` logits per chunk (model dtype)."""
    done = 0
    while done < positions:
        n = min(PROMPT_LOGPROBS_CHUNK, positions - done)
        _logits(o, s, n, TAG_PROMPT_LOGPROBS + "logits")
        o.alloc(TAG_PROMPT_LOGPROBS + "scores", n * 4 * 2)
        o.free(TAG_PROMPT_LOGPROBS + "scores", TAG_PROMPT_LOGPROBS + "logits")
        done += n


def persistent_buffer_bytes_v2(shape: ModelShape, max_num_batched_tokens: int, max_num_seqs: int,
                               num_speculative_tokens: int = 0) -> list[tuple[str, int]]:
    """The runner's GPU buffers made at init (module docstring), by name."""
    t, r, v = max_num_batched_tokens, max_num_seqs, shape.vocab_size
    return [("input_ids", t * 4), ("positions", t * 8), ("is_padding", t), ("query_start_loc", (r + 1) * 4),
            ("seq_lens", r * 4), ("dcp_local_seq_lens", r * 4), ("total_len", r * 4),
            ("num_computed_tokens", r * 4), ("last_sampled_tokens", r * 8),
            ("draft_tokens", r * max(0, num_speculative_tokens) * 8), ("next_prefill_tokens", r * 4),
            ("prompt_bin_mask", r * -(-v // 32) * 4), ("output_bin_counts", r * v * 4)]


def block_table_bytes_v2(max_num_seqs: int, max_model_len: int, block_size: int,
                         max_num_batched_tokens: int) -> list[tuple[str, int]]:
    """``BlockTables`` (made with the KV cache): the staged and the input block table, the slot mapping."""
    blocks = -(-max_model_len // block_size)
    return [("block_table", max_num_seqs * blocks * 4), ("input_block_table", max_num_seqs * blocks * 4),
            ("slot_mappings", max_num_batched_tokens * 8)]

