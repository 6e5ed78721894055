"""The sampler's own model forward: config loading, the slot KV cache and the Llama-family decoder."""

from opentinker.sampler_server.model.config import (
    SUPPORTED_MODEL_TYPES,
    ModelConfig,
    load_config,
    parse_config,
    resolve_model_dir,
)
from opentinker.sampler_server.model.kv_cache import KVCache
from opentinker.sampler_server.model.llama import ForwardBatch, LlamaForCausalLM, LoraHook

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "ForwardBatch",
    "KVCache",
    "LlamaForCausalLM",
    "LoraHook",
    "ModelConfig",
    "load_config",
    "parse_config",
    "resolve_model_dir",
]
