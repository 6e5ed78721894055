"""Attention over the paged KV cache: `AttentionPlan` sorts one batch's sequences once per forward (single-token
ones gathered into one batched call with one mask, the rest one by one) and turns their block tables into the
flat cache rows of their keys; `attention` runs it per layer (torch path: gather the rows, then SDPA)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from opentinker.sampler_server.model.batch import ForwardBatch, context_rows
from opentinker.weights.model_config import ModelConfig


def attention_mask(q_pos: torch.Tensor, length: int, sliding_window: int | None) -> torch.Tensor:
    # q_pos: [M] -> bool [M, length]: True where the query at q_pos may attend to the key at that position
    k_pos = torch.arange(length, device=q_pos.device)[None, :]
    mask = k_pos <= q_pos[:, None]
    if sliding_window is not None:
        mask &= k_pos > q_pos[:, None] - sliding_window
    return mask


class AttentionPlan:
    """How one batch's sequences meet attention: single-token ones gathered together (with one mask and one
    [B, T] table of key rows for every layer), the rest one by one (each with its own key rows)."""

    def __init__(
        self,
        batch: ForwardBatch,
        positions: torch.Tensor,
        device: torch.device,
        sliding_window: int | None,
        block_size: int,
    ) -> None:
        self.positions = positions  # [N]
        decode_rows: list[int] = []
        decode_keys: list[torch.Tensor] = []
        self.decode_len = 0
        self.prefills: list[tuple[int, int, torch.Tensor]] = []  # (first token, new tokens, key rows [context])
        for start, table, length, context in batch.segments():
            keys = context_rows(table, context, block_size)
            if length == 1:
                decode_rows.append(start)
                decode_keys.append(keys)
                self.decode_len = max(self.decode_len, context)
            else:
                self.prefills.append((start, length, keys.to(device)))
        self.decode_rows = torch.tensor(decode_rows, dtype=torch.int64, device=device) if decode_rows else None
        self.decode_only = not self.prefills  # then decode row i is token i
        self.decode_mask: torch.Tensor | None = None  # [B, 1, 1, T] bool
        self.decode_keys: torch.Tensor | None = None  # [B, T] flat cache rows; row 0 past a sequence's end (masked)
        if self.decode_rows is not None:
            padded = torch.zeros(len(decode_keys), self.decode_len, dtype=torch.int64)
            for i, keys in enumerate(decode_keys):
                padded[i, : keys.numel()] = keys
            self.decode_keys = padded.to(device)
            mask = attention_mask(positions[self.decode_rows], self.decode_len, sliding_window)
            self.decode_mask = mask[:, None, None, :]


def attention(
    c: ModelConfig, q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, plan: AttentionPlan
) -> torch.Tensor:
    # q: [N, heads, head_dim]; k_rows, v_rows: [num_blocks * block_size, kv_heads, head_dim] (the flat cache)
    # -> [N, heads * head_dim]
    n, group = q.shape[0], c.num_heads // c.num_kv_heads
    out = q.new_empty(n, c.num_heads, c.head_dim)
    if plan.decode_rows is not None and plan.decode_keys is not None:
        # All single-token sequences at once; the `group` query heads sharing a kv head become that head's
        # query rows, so no K/V is repeated: q [B, kv_heads, group, hd] against k, v [B, kv_heads, T, hd].
        rows, keys = plan.decode_rows, plan.decode_keys
        qd = (q if plan.decode_only else q[rows]).view(-1, c.num_kv_heads, group, c.head_dim)
        kd, vd = k_rows[keys].transpose(1, 2), v_rows[keys].transpose(1, 2)  # [B, T, kv, hd] -> [B, kv, T, hd]
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=plan.decode_mask)  # [B, kv_heads, group, hd]
        if plan.decode_only:  # rows are all N tokens in order: no scatter
            return od.reshape(n, c.num_heads * c.head_dim)
        out[rows] = od.reshape(-1, c.num_heads, c.head_dim)
    for start, length, keys in plan.prefills:
        context = keys.numel()
        qs = q[start : start + length].transpose(0, 1)[None]  # [1, heads, L, hd]
        ks, vs = k_rows[keys].transpose(0, 1)[None], v_rows[keys].transpose(0, 1)[None]  # [1, kv_heads, ctx, hd]
        if context == length and c.sliding_window is None:  # whole prompt: plain causal
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        else:  # continuation of a cached prefix: query at position p sees keys at positions <= p
            mask = attention_mask(plan.positions[start : start + length], context, c.sliding_window)
            mask = mask[None, None]  # [1, 1, L, ctx]
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
        out[start : start + length] = o[0].transpose(0, 1)  # [L, heads, hd]
    return out.view(n, c.num_heads * c.head_dim)
