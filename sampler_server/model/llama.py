"""The sampler's own forward for Llama-family decoders (llama, mistral, qwen2, qwen3), over a paged KV cache.

One `forward` serves any mix of sequences: whole-prompt prefill, a prefill chunk on top of a cached prefix,
and single-token decode. Projections run on the flat [N, d] tokens of all sequences (no padding); only
attention groups them (decodes in one call, prefills in another, or the Triton kernel on CUDA: `attention`). After every
q/k/v/o/gate/up/down projection the engine's `LoraHook` may add each token's LoRA delta, and after the LM head
(`lm_head`) each logit row's.

Numerics follow transformers' modeling_llama/qwen2/qwen3/mistral (RMSNorm in float32, rotate-half RoPE with
cos/sin cast to the model dtype, residual adds in the model dtype), so fp32 logits agree to ~1e-6.

The pieces live beside it: `weights` (checkpoint -> tensors), `linear` (x @ W^T, oneDNN packing), `batch`
(`ForwardBatch`), `attention` (the per-batch plan and the per-layer attention).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F

from opentinker.sampler_server.model.attention import AttentionPlan, attention
from opentinker.sampler_server.model.batch import ForwardBatch, check_batch
from opentinker.sampler_server.model.kv_cache import KVCache
from opentinker.sampler_server.model.linear import linear, onednn_packing_works, pack_onednn
from opentinker.sampler_server.model.weights import LayerWeights, Linear, linear_shapes, load_weights
from opentinker.weights.base_model import UNEMBED_MODULE
from opentinker.weights.model_config import ModelConfig
from opentinker.weights.rope import inverse_frequencies


class LoraHook(Protocol):
    def __call__(self, module: str, x: torch.Tensor, y: torch.Tensor, /) -> torch.Tensor:
        """module: HF path ("model.layers.0.self_attn.q_proj"); x: [N, d_in]; y: [N, d_out] base output. For
        "lm_head" the rows are the batch's M logit rows (`ForwardBatch.logits_indices`): x [M, hidden], y [M, vocab].

        Returns y plus each token's LoRA delta. Positional-only, so any plain `Callable[[str, Tensor, Tensor],
        Tensor]` is a LoraHook.
        """
        ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., d] -> [..., d]; statistics in float32, scale applied in the input dtype (as transformers does)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    # x: [..., head_dim]; (x1, x2) -> (-x2, x1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [N, heads, head_dim]; cos, sin: [N, head_dim]
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def project(module: str, weights: Linear, x: torch.Tensor, lora: LoraHook | None) -> torch.Tensor:
    """One projection of a layer plus, when the engine hooks it, each token's LoRA delta."""
    y = linear(x, weights.weight, weights.bias)  # x: [N, d_in] -> y: [N, d_out]
    return y if lora is None else lora(module, x, y)


class LlamaForCausalLM:
    """Frozen base weights as plain tensors plus the forward over a `KVCache`."""

    def __init__(
        self,
        config: ModelConfig,
        embed: torch.Tensor,  # [vocab, hidden]
        layers: list[LayerWeights],
        norm: torch.Tensor,  # [hidden]
        lm_head: torch.Tensor,  # [vocab, hidden]
    ) -> None:
        self.config = config
        self.embed = embed
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head
        self.device = embed.device
        self.dtype = embed.dtype
        # inv_freq: [head_dim / 2], computed on the CPU in float32 exactly like transformers' rotary embedding;
        # rope_scale multiplies cos and sin (yarn's attention factor, 1 otherwise).
        inv_freq, self.rope_scale = inverse_frequencies(config.rope, config.head_dim, config.max_position_embeddings)
        self.inv_freq = inv_freq.to(self.device)
        self.batch_prefills = True  # several prefill segments of a step in one attention call (torch path)

    @classmethod
    def from_pretrained(cls, model_dir: Path, *, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
        w = load_weights(Path(model_dir), device=device, dtype=dtype)
        return cls(w.config, w.embed, w.layers, w.norm, w.lm_head)

    def pack_for_cpu(self) -> bool:
        """Float32 on the CPU: every projection and the LM head become oneDNN-packed weights (the dense copies are
        dropped; a tied LM head gets its own packed copy, the embedding stays dense). Returns whether it did."""
        if self.device.type != "cpu" or self.dtype != torch.float32 or not onednn_packing_works():
            return False

        def packed(weights: Linear) -> Linear:
            return Linear(pack_onednn(weights.weight), weights.bias)

        def packed_layer(layer: LayerWeights) -> LayerWeights:
            return dataclasses.replace(
                layer,
                q_proj=packed(layer.q_proj),
                k_proj=packed(layer.k_proj),
                v_proj=packed(layer.v_proj),
                o_proj=packed(layer.o_proj),
                gate_proj=packed(layer.gate_proj),
                up_proj=packed(layer.up_proj),
                down_proj=packed(layer.down_proj),
            )

        self.layers = [packed_layer(layer) for layer in self.layers]
        self.lm_head = pack_onednn(self.lm_head)
        return True

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """HF module path of every LoRA-targetable projection -> (d_in, d_out)."""
        return linear_shapes(self.config)

    def forward(self, batch: ForwardBatch, cache: KVCache, lora: LoraHook | None = None) -> torch.Tensor:
        """Append the batch's tokens to their cache blocks and return float32 logits [M, vocab]."""
        check_batch(batch, cache)
        with torch.inference_mode():
            return self._forward(batch, cache, lora)

    def _token_inv_freq(self, batch: ForwardBatch) -> torch.Tensor:
        """[1, head_dim / 2] frequencies for every token, or [N, head_dim / 2] for dynamic NTK past the context
        length: each sequence's new tokens use the frequencies of its length after them, as transformers
        computes them for one sequence (its keys cached earlier keep the rotation they were stored with)."""
        c = self.config
        if c.rope.rope_type != "dynamic":
            return self.inv_freq[None, :]
        ends = torch.tensor(batch.new_lens, dtype=torch.int64).cumsum(0) - 1  # [S] last new token of each
        lengths = (batch.positions[ends] + 1).tolist()  # [S]
        if max(lengths) <= c.max_position_embeddings:
            return self.inv_freq[None, :]
        per_length = {n: inverse_frequencies(c.rope, c.head_dim, c.max_position_embeddings, n)[0] for n in lengths}
        per_seq = torch.stack([per_length[n] for n in lengths])  # [S, head_dim / 2]
        counts = torch.tensor(batch.new_lens, dtype=torch.int64)
        return torch.repeat_interleave(per_seq, counts, dim=0).to(self.device)  # [N, head_dim / 2]

    def _forward(self, batch: ForwardBatch, cache: KVCache, lora: LoraHook | None) -> torch.Tensor:
        c, dev = self.config, self.device
        tokens = batch.tokens.to(dev)  # [N]
        positions = batch.positions.to(dev)  # [N]
        n = tokens.shape[0]
        size = cache.block_size
        token_rows = batch.token_rows(size).to(dev)  # [N]: where each new token's K/V goes in the flat cache
        freqs = positions.to(torch.float32)[:, None] * self._token_inv_freq(batch)  # [N, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [N, head_dim]
        cos, sin = (emb.cos() * self.rope_scale).to(self.dtype), (emb.sin() * self.rope_scale).to(self.dtype)
        plan = AttentionPlan(batch, positions, dev, c.sliding_window, size, batch_prefills=self.batch_prefills)

        h = F.embedding(tokens, self.embed)  # [N, hidden]
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}"
            x = rms_norm(h, layer.input_norm, c.rms_norm_eps)  # [N, hidden]
            q = project(f"{p}.self_attn.q_proj", layer.q_proj, x, lora).view(n, c.num_heads, c.head_dim)
            k = project(f"{p}.self_attn.k_proj", layer.k_proj, x, lora).view(n, c.num_kv_heads, c.head_dim)
            v = project(f"{p}.self_attn.v_proj", layer.v_proj, x, lora).view(n, c.num_kv_heads, c.head_dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                q = rms_norm(q, layer.q_norm, c.rms_norm_eps)
                k = rms_norm(k, layer.k_norm, c.rms_norm_eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            # cache.k[i]: [blocks, block_size, kv_heads, hd] viewed as rows [blocks * block_size, kv_heads, hd]
            k_rows = cache.k[i].view(-1, c.num_kv_heads, c.head_dim)
            v_rows = cache.v[i].view(-1, c.num_kv_heads, c.head_dim)
            k_rows[token_rows], v_rows[token_rows] = k, v
            attn = attention(c, q, k_rows, v_rows, plan)  # [N, heads * head_dim]
            h = h + project(f"{p}.self_attn.o_proj", layer.o_proj, attn, lora)

            x = rms_norm(h, layer.post_norm, c.rms_norm_eps)
            gate = project(f"{p}.mlp.gate_proj", layer.gate_proj, x, lora)  # [N, intermediate]
            up = project(f"{p}.mlp.up_proj", layer.up_proj, x, lora)  # [N, intermediate]
            h = h + project(f"{p}.mlp.down_proj", layer.down_proj, F.silu(gate) * up, lora)

        rows = h[batch.logits_indices.to(dev)]  # [M, hidden]
        # The unembedding's hook sees the M logit rows, not the N tokens: the engine maps them to their slots.
        logits = project(UNEMBED_MODULE, Linear(self.lm_head, None), rms_norm(rows, self.norm, c.rms_norm_eps), lora)
        return logits.float()  # [M, vocab]
