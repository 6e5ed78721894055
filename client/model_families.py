"""The public checkpoints teams start from, as their published `config.json` / `generation_config.json` keys, and
scaled-down copies of them for offline tests (`opentinker make-tiny-model --like FAMILY`).

Each family keeps every key as published (hub format: `rope_theta` + `rope_scaling`, eos ids as lists where the
checkpoint has them); `scaled_files` shrinks only the sizes (hidden, heads, layers, vocab, context lengths) and
maps the special token ids onto the tiny tokenizer's, so every code path a real checkpoint takes (RoPE variant,
tied embeddings, head_dim not hidden / heads, biases, q/k norms, sliding-window fields, eos lists) is exercised
by a model of a few hundred KB.
"""

from __future__ import annotations

import copy
from typing import Any

JsonDict = dict[str, Any]

# Llama-3.2-1B-Instruct: llama3 RoPE (factor 32 over 8192 pretrained positions), tied embeddings, head_dim given.
_LLAMA_3_2: JsonDict = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}
_LLAMA_3_2_GENERATION: JsonDict = {
    "bos_token_id": 128000,
    "do_sample": True,
    "eos_token_id": [128001, 128008, 128009],
    "temperature": 0.6,
    "top_p": 0.9,
    "transformers_version": "4.45.0.dev0",
}

# Llama-3.1-8B-Instruct: llama3 RoPE with factor 8, untied, no head_dim key.
_LLAMA_3_1: JsonDict = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.42.3",
    "use_cache": True,
    "vocab_size": 128256,
}

# Qwen2.5-0.5B-Instruct: q/k/v biases, tied embeddings, sliding-window fields present but off.
_QWEN_2_5: JsonDict = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
_QWEN_GENERATION: JsonDict = {
    "bos_token_id": 151643,
    "pad_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "repetition_penalty": 1.1,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "transformers_version": "4.37.0",
}
# Qwen2.5's model card: for contexts past 32768, add YaRN with factor 4 (max_position_embeddings stays).
_YARN_SETTING: JsonDict = {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}

# Qwen3-0.6B / Qwen3-8B: q/k RMSNorm, head_dim 128 whatever hidden / heads is.
_QWEN_3: JsonDict = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
_QWEN_3_8B: JsonDict = {
    **_QWEN_3,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "max_window_layers": 36,
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "tie_word_embeddings": False,
}

# Mistral-7B-Instruct-v0.3: no sliding window (null), untied.
_MISTRAL: JsonDict = {
    "architectures": ["MistralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.42.0.dev0",
    "use_cache": True,
    "vocab_size": 32768,
}
_MISTRAL_GENERATION: JsonDict = {"bos_token_id": 1, "eos_token_id": 2, "transformers_version": "4.42.0.dev0"}

# family -> (the checkpoint it copies, config.json, generation_config.json)
FAMILIES: dict[str, tuple[str, JsonDict, JsonDict]] = {
    "llama3.2": ("meta-llama/Llama-3.2-1B-Instruct", _LLAMA_3_2, _LLAMA_3_2_GENERATION),
    "llama3.1": ("meta-llama/Llama-3.1-8B-Instruct", _LLAMA_3_1, _LLAMA_3_2_GENERATION),
    "qwen2.5": ("Qwen/Qwen2.5-0.5B-Instruct", _QWEN_2_5, _QWEN_GENERATION),
    "qwen2.5-yarn": ("Qwen/Qwen2.5-0.5B-Instruct", {**_QWEN_2_5, "rope_scaling": _YARN_SETTING}, _QWEN_GENERATION),
    "qwen3": ("Qwen/Qwen3-0.6B", _QWEN_3, _QWEN_GENERATION),
    "qwen3-8b": ("Qwen/Qwen3-8B", _QWEN_3_8B, _QWEN_GENERATION),
    "mistral": ("mistralai/Mistral-7B-Instruct-v0.3", _MISTRAL, _MISTRAL_GENERATION),
}

# Context lengths shrink by these factors: the served length stays a few hundred tokens or more while every
# pretrained length a RoPE variant scales from (original_max_position_embeddings) falls below 300 positions, so
# a test of a few hundred tokens exercises the scaled frequencies.
CONTEXT_SHRINK = 64
ORIGINAL_CONTEXT_SHRINK = 256


def _shrink_context(value: int, by: int = CONTEXT_SHRINK) -> int:
    return max(32, value // by)


def _ids(value: Any) -> list[int]:
    """A bos/eos/pad field's ids: null, one id or a list."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _map_ids(value: Any, ids: dict[int, int]) -> Any:
    if value is None:
        return None
    if isinstance(value, list):
        return [ids[v] for v in value]
    return ids[value]


def scaled_files(family: str, *, vocab_size: int, special_ids: list[int]) -> tuple[JsonDict, JsonDict]:
    """(config.json, generation_config.json) of `family` with sizes shrunk: hidden 64, 4 heads (2 for k/v), 2
    layers, the head_dim rule kept (given or hidden / heads), context lengths / CONTEXT_SHRINK. special_ids: the
    tiny tokenizer's special tokens, onto which the checkpoint's bos/eos/pad ids are mapped in order."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    _, published, generation = FAMILIES[family]
    config, gen = copy.deepcopy(published), copy.deepcopy(generation)
    originals = sorted(
        {
            i
            for block in (config, gen)
            for key in ("bos_token_id", "eos_token_id", "pad_token_id")
            for i in _ids(block.get(key))
        }
    )
    if len(originals) > len(special_ids):
        raise ValueError(f"{family} has {len(originals)} special ids, the tokenizer {len(special_ids)}")
    ids = dict(zip(originals, special_ids, strict=False))
    heads = 4
    config.update(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=2,
        vocab_size=vocab_size,
    )
    if "head_dim" in config:  # kept when published: Qwen3's is not hidden / heads (128 vs 1024 / 16)
        config["head_dim"] = (
            32 if published["head_dim"] * published["num_attention_heads"] != published["hidden_size"] else 64 // heads
        )
    config["max_position_embeddings"] = _shrink_context(config["max_position_embeddings"])
    for key in ("sliding_window", "max_window_layers"):
        if isinstance(config.get(key), int):
            config[key] = _shrink_context(config[key]) if key == "sliding_window" else 1
    scaling = config.get("rope_scaling")
    if isinstance(scaling, dict) and "original_max_position_embeddings" in scaling:
        original = scaling["original_max_position_embeddings"]
        scaling["original_max_position_embeddings"] = _shrink_context(original, ORIGINAL_CONTEXT_SHRINK)
    for block in (config, gen):
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if key in block:
                block[key] = _map_ids(block[key], ids)
    return config, gen
