"""A user's config.json read as vLLM 0.33 reads a dense decoder: weights per TP rank, derived length,
dtype, and a clear refusal naming what an unsupported architecture has (producers.sim.model_config)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvguard.producers.sim.model_config import (
    ModelConfigError,
    UnsupportedArchitecture,
    load_model_config,
    model_config_from_dict,
)

GiB = 1 << 30
CONFIGS = Path(__file__).resolve().parents[3] / "data" / "model_configs"


def cfg(name: str):
    return load_model_config(CONFIGS / f"{name}.json")


def test_llama_weights_are_the_parameters_plus_the_rotary_cache_as_vllm_logs_them():
    # "Model loading took 14.99 GiB" (llm-d, Llama-3.1-8B, 131,072 positions) and 14.96 GiB (vLLM
    # PR#10511, Meta-Llama-3-8B, 8,192 positions): 8.03e9 parameters in bf16 plus cos_sin_cache
    assert cfg("llama-3.1-8b-instruct").num_parameters() == 8_030_261_248
    assert round(cfg("llama-3.1-8b-instruct").weights_bytes() / GiB, 2) == 14.99
    assert round(cfg("meta-llama-3-8b").weights_bytes() / GiB, 2) == 14.96


def test_tensor_parallel_ranks_hold_their_shard_and_replicate_norms():
    llama = cfg("llama-3.1-8b-instruct")
    one, two = llama.weights_bytes(), llama.weights_bytes(tensor_parallel_size=2)
    assert one / 2 < two < one / 2 + 40 * (1 << 20)  # norms and the rotary cache are replicated
    shape = llama.shape(tensor_parallel_size=2)
    assert (shape.heads_per_rank, shape.kv_heads_per_rank, shape.intermediate_per_rank) == (16, 4, 7168)
    with pytest.raises(ValueError, match=r"Total number of attention heads \(32\) must be divisible"):
        llama.shape(tensor_parallel_size=3)


def test_tied_embeddings_are_loaded_once():
    qwen = cfg("qwen3-0.6b")
    untied = model_config_from_dict({**qwen.hf_config, "tie_word_embeddings": False})
    assert untied.weights_bytes() - qwen.weights_bytes() == pytest.approx(151936 * 1024 * 2, abs=1024)


def test_derived_max_model_len_follows_vllm_rope_rules():
    # llama3 RoPE: max_position_embeddings is already scaled
    assert cfg("llama-3.1-8b-instruct").derived_max_model_len == (131072, "max_position_embeddings")
    scaled = model_config_from_dict({**cfg("meta-llama-3-8b").hf_config,
                                     "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert scaled.derived_max_model_len[0] == 16384


def test_dtype_auto_keeps_bf16_and_turns_fp32_into_bf16():
    llama = cfg("llama-3.1-8b-instruct")
    assert llama.dtype_name() == "bfloat16" and llama.dtype_name("half") == "float16"
    fp32 = model_config_from_dict({**llama.hf_config, "torch_dtype": "float32"})
    assert fp32.dtype_name("auto") == "bfloat16" and fp32.dtype_name("float32") == "float32"
    with pytest.raises(ValueError, match="Unknown dtype: 'fp8'"):
        llama.dtype_name("fp8")


@pytest.mark.parametrize("name, says", [
    ("deepseek-v3-fields", ["mixture of experts", "multi-head latent attention", "n_routed_experts", "kv_lora_rank"]),
    ("qwen3-next-fields", ["mixture of experts", "linear-attention", "linear_num_value_heads"]),
])
def test_unsupported_architectures_say_what_they_have_that_is_not_modelled(name, says):
    with pytest.raises(UnsupportedArchitecture) as info:
        cfg(name)
    for text in says:
        assert text in str(info.value)


def test_sliding_window_and_quantised_checkpoints_are_refused(tmp_path):
    mistral = {**cfg("meta-llama-3-8b").hf_config, "architectures": ["MistralForCausalLM"], "sliding_window": 4096}
    with pytest.raises(UnsupportedArchitecture, match="sliding-window"):
        model_config_from_dict(mistral)
    qwen_window_off = {**cfg("qwen3-8b").hf_config, "sliding_window": 4096, "use_sliding_window": False}
    assert model_config_from_dict(qwen_window_off).architecture == "Qwen3ForCausalLM"
    with pytest.raises(UnsupportedArchitecture, match="quantised"):
        model_config_from_dict({**cfg("qwen3-8b").hf_config, "quantization_config": {"quant_method": "fp8"}})


def test_bad_files_name_the_field(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ModelConfigError, match="JSON"):
        load_model_config(tmp_path)  # a directory holding config.json
    bad.write_text(json.dumps({**cfg("qwen3-8b").hf_config, "hidden_size": "big"}))
    with pytest.raises(ModelConfigError, match="'hidden_size'"):
        load_model_config(bad)
    with pytest.raises(ModelConfigError, match="readable"):
        load_model_config(tmp_path / "missing.json")
