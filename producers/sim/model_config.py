"""A Hugging Face ``config.json`` read the way vLLM 0.33 reads a dense decoder (``--model``).

What the shadow engine needs from a model, and where vLLM takes it from:

- the shape that sizes activations and the KV cache (``step_memory.ModelShape``): layers, hidden and
  intermediate sizes, heads, KV heads, ``head_dim`` (or ``hidden_size / heads``), vocabulary;
- the weights one tensor-parallel rank loads (``weights_bytes``), parameter by parameter as vLLM's
  layers shard them: ``VocabParallelEmbedding`` / ``ParallelLMHead`` hold ``pad_vocab_size(V, 64) / tp``
  rows (``vocab_parallel_embedding.py``), ``QKVParallelLinear`` ``heads/tp`` query heads and
  ``max(1, kv_heads/tp)`` KV heads (replicated when ``tp > kv_heads``, ``linear.py``), the MLP's
  column/row-parallel halves ``intermediate/tp``, norms replicated; biases where the model file puts
  them (Qwen2: QKV; Llama: ``attention_bias`` on QKV and ``o_proj``, ``mlp_bias``); Qwen3's per-head
  ``q_norm``/``k_norm``; the rotary ``cos_sin_cache`` buffer ``[max_position_embeddings, rotary_dim]``
  in the model dtype, one per model (``rotary_embedding/base.py``; ``get_rope`` caches it), which is
  why Llama-3.1-8B's "Model loading took" is 14.99 GiB (131,072 positions) and Llama-3-8B's 14.96
  (8,192);
- the longest context it derives (``config/model.py _get_and_verify_max_len``): the smallest of the
  length keys, times the RoPE ``factor`` unless the RoPE type is one of vLLM's pre-scaled ones
  (``llama3``, ``yarn``, ``longrope`` …);
- its dtype: ``torch_dtype`` (or ``dtype``), with ``--dtype auto`` keeping bf16/fp16 and turning fp32
  into bf16 on CUDA (``platforms/cuda.py``).

Architectures modelled: dense decoders of the Llama family as vLLM runs them with ``llama.py``,
``qwen2.py``, ``qwen3.py`` (Llama, Mistral without a sliding window, Qwen2/2.5, Qwen3). Everything
else is refused with the fields that show what is missing (``UnsupportedArchitecture``): a mixture
of experts, multi-head latent attention, linear-attention / Mamba hybrids, sliding-window or
interleaved local attention, multimodal towers, encoder-decoders, and quantised checkpoints.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvguard.producers.vllm.step_memory import VOCAB_PADDING, ModelShape

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM"}
# config/model.py _get_and_verify_max_len: RoPE types whose max_position_embeddings is already scaled
_PRESCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")
# model_arch_config_convertor.py derive_max_model_len_and_key: the smallest of these keys wins
_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}
DTYPE_CHOICES = ("auto", "half", "float16", "bfloat16", "float", "float32")  # config/model.py ModelDType

# Each entry: (what the architecture has, the config fields that show it). Checked in order.
_MECHANISMS = (
    ("a mixture of experts (router and expert weights, fused_moe workspaces)",
     ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok")),
    ("multi-head latent attention (compressed KV of kv_lora_rank, MLA backends)", ("kv_lora_rank", "q_lora_rank")),
    ("linear-attention / state-space layers (GDN or Mamba state, not a paged KV cache)",
     ("linear_num_value_heads", "linear_key_head_dim", "mamba_d_state", "ssm_cfg", "state_size", "layers_block_type",
      "hybrid_override_pattern")),
    ("a vision or audio tower (encoder activations and the encoder cache)",
     ("vision_config", "audio_config", "text_config")),
    ("an encoder-decoder (cross-attention KV)", ("is_encoder_decoder", "decoder_start_token_id")),
    ("quantised weights (per-format weight sizes and GEMM workspaces)", ("quantization_config",)),
)


class UnsupportedArchitecture(ValueError):
    """The config describes a model the shadow engine does not model; says what it lacks."""

    def __init__(self, path: str, what: str, fields: tuple[str, ...] = ()):
        self.path, self.what, self.fields = str(path), what, fields
        shown = f" (config fields: {', '.join(fields)})" if fields else ""
        super().__init__(f"{path}: not modelled: {what}{shown}; the shadow engine models dense decoders run by "
                         f"vLLM's {', '.join(SUPPORTED_ARCHITECTURES)}")


class ModelConfigError(ValueError):
    """A config.json that cannot be read or misses a field every decoder has."""

    def __init__(self, path: str, field: str, expected: str):
        self.path, self.field, self.expected = str(path), field, expected
        super().__init__(f"{path}: field {field!r}: expected {expected}")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """One dense decoder's config.json as vLLM reads it (fields in the module docstring)."""

    path: str
    architecture: str
    hf_config: dict
    config_dtype: str  # torch_dtype as published

    @property
    def derived_max_model_len(self) -> tuple[int, str]:
        """(length, key) as ``_get_and_verify_max_len`` derives it when ``--max-model-len`` is not given."""
        c = self.hf_config
        found = [(int(c[k]), k) for k in _LENGTH_KEYS if isinstance(c.get(k), (int, float))]
        if not found:
            return 2048, "default"  # vLLM warns and assumes 2048
        length, key = min(found)
        if "model_max_length" in c and isinstance(c["model_max_length"], (int, float)):
            length, key = int(c["model_max_length"]), "model_max_length"
        rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
        if isinstance(rope, Mapping):
            rope_type = rope.get("rope_type") or rope.get("type") or "default"
            factor = rope.get("factor")
            if rope_type not in _PRESCALED_ROPE and factor:
                length = int(length * float(factor))
        return length, key

    def dtype_name(self, requested: str = "auto") -> str:
        """``--dtype``: ``auto`` keeps a bf16/fp16 config and makes fp32 bf16 (CUDA, SM >= 80)."""
        if requested not in DTYPE_CHOICES:
            raise ValueError(f"Unknown dtype: {requested!r}")
        if requested != "auto":
            return {"half": "float16", "float": "float32"}.get(requested, requested)
        return "bfloat16" if self.config_dtype in ("float32", "float") else self.config_dtype

    def shape(self, *, tensor_parallel_size: int = 1, dtype: str = "auto") -> ModelShape:
        heads = int(self.hf_config["num_attention_heads"])
        if heads % tensor_parallel_size:
            raise ValueError(f"Total number of attention heads ({heads}) must be divisible by tensor parallel "
                             f"size ({tensor_parallel_size}).")
        return ModelShape.from_hf_config(self.hf_config, tensor_parallel_size=tensor_parallel_size,
                                         dtype=self.dtype_name(dtype))

    def weights_bytes(self, *, tensor_parallel_size: int = 1, dtype: str = "auto") -> int:
        """What one TP rank's ``load_model`` allocates: every parameter (module docstring) and the rotary
        cache, each tensor rounded to the caching allocator's 512 B."""
        s = self.shape(tensor_parallel_size=tensor_parallel_size, dtype=dtype)
        c, b, tp = self.hf_config, s.dtype_bytes, tensor_parallel_size
        rows = -(-s.vocab_size // VOCAB_PADDING) * VOCAB_PADDING // tp
        tensors = [rows * s.hidden_size]  # embed_tokens
        if not c.get("tie_word_embeddings", False):
            tensors.append(rows * s.hidden_size)  # lm_head
        qkv_out = s.q_size + 2 * s.kv_size
        qkv_bias = self.architecture == "Qwen2ForCausalLM" or bool(c.get("attention_bias") or c.get("qkv_bias"))
        o_bias = self.architecture in ("LlamaForCausalLM", "MistralForCausalLM") and bool(c.get("attention_bias"))
        mlp_bias = bool(c.get("mlp_bias"))
        layer = [s.hidden_size * qkv_out, s.q_size * s.hidden_size, s.hidden_size * 2 * s.intermediate_per_rank,
                 s.intermediate_per_rank * s.hidden_size, s.hidden_size, s.hidden_size]
        if qkv_bias:
            layer.append(qkv_out)
        if o_bias:
            layer.append(s.hidden_size)
        if mlp_bias:
            layer += [2 * s.intermediate_per_rank, s.hidden_size]
        if self.architecture == "Qwen3ForCausalLM":
            layer += [s.head_dim, s.head_dim]  # q_norm, k_norm
        tensors += layer * s.num_layers
        tensors.append(s.hidden_size)  # final norm
        rotary_dim = int(s.head_dim * float(c.get("partial_rotary_factor", 1.0)))
        positions = int(c.get("max_position_embeddings") or self.derived_max_model_len[0])
        tensors.append(positions * rotary_dim)  # cos_sin_cache: cat(cos, sin) of rotary_dim/2 each
        return sum(_round512(n * b) for n in tensors)

    def num_parameters(self) -> int:
        """Parameters of the whole model (TP 1, no rotary cache), for the log line and checks."""
        s = self.shape()
        rope = int(s.head_dim * float(self.hf_config.get("partial_rotary_factor", 1.0))) * \
            int(self.hf_config.get("max_position_embeddings") or self.derived_max_model_len[0])
        return (self.weights_bytes() - _round512(rope * s.dtype_bytes)) // s.dtype_bytes

    def describe(self) -> dict:
        length, key = self.derived_max_model_len
        return {"path": self.path, "architecture": self.architecture, "max_model_len_derived": length,
                "max_model_len_key": key, "dtype": self.config_dtype}


def _round512(n: int) -> int:
    return 512 * max(1, math.ceil(n / 512))


def _architecture(path: str, c: Mapping) -> str:
    missing = [(what, tuple(f for f in fields if c.get(f) not in (None, False, 0, [], {})))
               for what, fields in _MECHANISMS]
    missing = [(what, present) for what, present in missing if present]
    if missing:
        raise UnsupportedArchitecture(path, "; ".join(what for what, _ in missing),
                                      tuple(f for _, present in missing for f in present))
    archs = c.get("architectures") or []
    arch = archs[0] if archs else _MODEL_TYPES.get(str(c.get("model_type")), "")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitecture(path, f"architecture {arch or c.get('model_type')!r}")
    layer_types = c.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        kinds = sorted(set(layer_types) - {"full_attention"})
        raise UnsupportedArchitecture(path, f"layers other than full attention ({', '.join(kinds)})", ("layer_types",))
    window = c.get("sliding_window")
    uses_window = c.get("use_sliding_window", arch in ("MistralForCausalLM", "LlamaForCausalLM"))
    if window and uses_window:
        raise UnsupportedArchitecture(path, f"sliding-window attention of {window} tokens (a sliding-window KV "
                                      "cache group)", ("sliding_window",))
    return arch


def model_config_from_dict(config: Mapping, path: str = "<config>") -> ModelConfig:
    if not isinstance(config, Mapping):
        raise ModelConfigError(path, "<root>", "a JSON object (a Hugging Face config.json)")
    arch = _architecture(path, config)
    for field in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        value = config.get(field)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelConfigError(path, field, f"a positive integer, got {value!r}")
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    if dtype not in DTYPE_BYTES:
        raise ModelConfigError(path, "torch_dtype", f"one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    try:
        ModelShape.from_hf_config(config, dtype=dtype)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelConfigError(path, "<shape>", f"fields that size a decoder ({e})") from None
    return ModelConfig(path=path, architecture=arch, hf_config=dict(config), config_dtype=dtype)


def load_model_config(path: str | Path) -> ModelConfig:
    """A config.json file, or a directory holding one (a downloaded model)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        config = json.loads(p.read_text())
    except OSError as e:
        raise ModelConfigError(str(p), "<file>", f"a readable config.json ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise ModelConfigError(str(p), "<file>", f"JSON ({e.msg} at line {e.lineno})") from None
    return model_config_from_dict(config, str(p))
