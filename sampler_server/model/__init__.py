"""The sampler's own model forward: the paged KV cache and the Llama-family decoder (its config is read by
opentinker.weights.model_config, the same reader the trainer uses)."""

from opentinker.sampler_server.model.batch import ForwardBatch
from opentinker.sampler_server.model.kv_cache import KVCache
from opentinker.sampler_server.model.llama import LlamaForCausalLM, LoraHook

__all__ = ["ForwardBatch", "KVCache", "LlamaForCausalLM", "LoraHook"]
