"""Attention over the slot KV cache: `AttentionPlan` sorts one batch's sequences once per forward (single-token
ones gathered into one batched call with one mask, the rest one by one); `attention` runs it per layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from opentinker.sampler_server.model.batch import ForwardBatch
from opentinker.weights.model_config import ModelConfig


def attention_mask(q_pos: torch.Tensor, length: int, sliding_window: int | None) -> torch.Tensor:
    # q_pos: [M] -> bool [M, length]: True where the query at q_pos may attend to the key at that position
    k_pos = torch.arange(length, device=q_pos.device)[None, :]
    mask = k_pos <= q_pos[:, None]
    if sliding_window is not None:
        mask &= k_pos > q_pos[:, None] - sliding_window
    return mask


class AttentionPlan:
    """How one batch's sequences meet attention: single-token ones gathered together (with one mask for every
    layer), the rest one by one."""

    def __init__(
        self, batch: ForwardBatch, positions: torch.Tensor, device: torch.device, sliding_window: int | None
    ) -> None:
        self.positions = positions  # [N]
        decode_rows: list[int] = []
        decode_slots: list[int] = []
        self.decode_len = 0
        self.prefills: list[tuple[int, int, int, int]] = []  # (first token, new tokens, slot, context length)
        for start, slot, length, context in batch.segments():
            if length == 1:
                decode_rows.append(start)
                decode_slots.append(slot)
                self.decode_len = max(self.decode_len, context)
            else:
                self.prefills.append((start, length, slot, context))
        self.decode_rows = torch.tensor(decode_rows, dtype=torch.int64, device=device) if decode_rows else None
        self.decode_slots = torch.tensor(decode_slots, dtype=torch.int64, device=device)
        self.decode_only = not self.prefills  # then decode row i is token i
        self.decode_mask: torch.Tensor | None = None  # [B, 1, 1, T] bool
        if self.decode_rows is not None:
            mask = attention_mask(positions[self.decode_rows], self.decode_len, sliding_window)
            self.decode_mask = mask[:, None, None, :]


def attention(
    c: ModelConfig, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan
) -> torch.Tensor:
    # q: [N, heads, head_dim]; k_cache, v_cache: [slots, kv_heads, max_len, head_dim] -> [N, heads * head_dim]
    n, group = q.shape[0], c.num_heads // c.num_kv_heads
    out = q.new_empty(n, c.num_heads, c.head_dim)
    if plan.decode_rows is not None:
        # All single-token sequences at once; the `group` query heads sharing a kv head become that head's
        # query rows, so no K/V is repeated: q [B, kv_heads, group, hd] against k, v [B, kv_heads, T, hd].
        rows, slots, t = plan.decode_rows, plan.decode_slots, plan.decode_len
        qd = (q if plan.decode_only else q[rows]).view(-1, c.num_kv_heads, group, c.head_dim)
        kd, vd = k_cache[slots, :, :t], v_cache[slots, :, :t]
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=plan.decode_mask)  # [B, kv_heads, group, hd]
        if plan.decode_only:  # rows are all N tokens in order: no scatter
            return od.reshape(n, c.num_heads * c.head_dim)
        out[rows] = od.reshape(-1, c.num_heads, c.head_dim)
    for start, length, slot, context in plan.prefills:
        qs = q[start : start + length].transpose(0, 1)[None]  # [1, heads, L, hd]
        ks, vs = k_cache[slot, :, :context][None], v_cache[slot, :, :context][None]  # [1, kv_heads, ctx, hd]
        if context == length and c.sliding_window is None:  # whole prompt: plain causal
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        else:  # continuation of a cached prefix: query at position p sees keys at positions <= p
            mask = attention_mask(plan.positions[start : start + length], context, c.sliding_window)
            mask = mask[None, None]  # [1, 1, L, ctx]
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
        out[start : start + length] = o[0].transpose(0, 1)  # [L, heads, hd]
    return out.view(n, c.num_heads * c.head_dim)
