"""Attention over the paged KV cache: `AttentionPlan` sorts one batch's sequences once per forward and `attention`
runs it per layer.

Two backends compute the same thing (`resolve_attention` picks one per device, like `kernels.resolve_kernel`):

- "torch" (CPU, and CUDA without triton): gathers each sequence's key rows from the flat cache, then SDPA.
  Single-token sequences (decode) form one batched call with one mask; the multi-token ones (prefills, and
  chunks continuing a cached prefix) another: queries padded to [S, heads, Lmax, hd], keys to
  [S, kv_heads, Cmax, hd], one [S, 1, Lmax, Cmax] mask by position (padded keys sit past every query, so the
  causal mask hides them), results scattered back. One prefill alone keeps its own call (no padding at all),
  and so do segments whose padding would be most of the padded call (`MIN_PAD_FILL`).
- "triton" (CUDA with triton): `kernels.paged_attention_ops`, which reads K/V through the block table itself (no
  gathered copy), every sequence of the batch, decode and prefill, in one launch.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from opentinker.sampler_server.kernels.paged_attention_ops import PagedAttentionMeta, paged_attention
from opentinker.sampler_server.kernels.triton_ops import TRITON_AVAILABLE
from opentinker.sampler_server.model.batch import ForwardBatch, context_rows
from opentinker.weights.model_config import ModelConfig

AttentionBackend = Literal["torch", "triton"]


def resolve_attention(device_type: str, *, triton_available: bool | None = None) -> AttentionBackend:
    """The attention backend for a cache on a device of `device_type`: triton on CUDA when installed, else torch."""
    installed = TRITON_AVAILABLE if triton_available is None else triton_available
    return "triton" if device_type == "cuda" and installed else "torch"


def attention_mask(q_pos: torch.Tensor, length: int, sliding_window: int | None) -> torch.Tensor:
    # q_pos: [..., M] -> bool [..., M, length]: True where the query at q_pos may attend to the key at that position
    k_pos = torch.arange(length, device=q_pos.device)
    mask = k_pos <= q_pos[..., None]
    if sliding_window is not None:
        mask &= k_pos > q_pos[..., None] - sliding_window
    return mask


# Padding costs: one padded call does S x Lmax x Cmax of score work where the segments need sum(L x C). On the
# 2-core CPU (bench/prefill_attention.py, tiny model) the padded call took 0.3x the per-segment calls for 32
# prompts of 24 tokens (call overhead), 0.9x for 8 of 200, 1.0x at a fill of 0.61 and 2.4x at 0.37; below 0.6
# the segments keep their own calls.
MIN_PAD_FILL = 0.6


def padding_fill(prefills: list[tuple[int, int, torch.Tensor]]) -> float:
    """sum(L x C) / (S x Lmax x Cmax) of the segments (first token, new tokens L, key rows [C])."""
    needed = sum(length * keys.numel() for _, length, keys in prefills)
    padded = len(prefills) * max(length for _, length, _ in prefills) * max(keys.numel() for _, _, keys in prefills)
    return needed / padded


class PrefillBatch:
    """S multi-token segments padded into one SDPA call. Padded query slots repeat the segment's first token
    (their output is dropped), padded key slots read the segment's first key (masked: they lie past every real
    query)."""

    def __init__(
        self, prefills: list[tuple[int, int, torch.Tensor]], positions: torch.Tensor, sliding_window: int | None
    ) -> None:
        device = positions.device
        s = len(prefills)
        self.max_len = max(length for _, length, _ in prefills)  # Lmax
        self.max_context = max(keys.numel() for _, _, keys in prefills)  # Cmax
        q_index = torch.zeros(s, self.max_len, dtype=torch.int64)  # [S, Lmax] token index into the N tokens
        valid = torch.zeros(s, self.max_len, dtype=torch.bool)  # [S, Lmax]
        keys = torch.zeros(s, self.max_context, dtype=torch.int64)  # [S, Cmax] flat cache rows
        for i, (start, length, rows) in enumerate(prefills):
            q_index[i] = start
            q_index[i, :length] = torch.arange(start, start + length)
            valid[i, :length] = True
            keys[i, : rows.numel()] = rows.cpu()
            keys[i, rows.numel() :] = rows[0]  # its own first key: a stale row may hold NaN (see below)
        self.q_index = q_index.to(device)
        self.keys = keys.to(device)
        self.valid = valid.to(device)
        self.rows = self.q_index[self.valid]  # [sum L] the tokens, in segment order
        # Whole prompts of one length without a window: plain causal, no mask and no padding.
        whole = all(length == rows.numel() == self.max_len for _, length, rows in prefills)
        self.mask: torch.Tensor | None = None  # [S, 1, Lmax, Cmax] bool
        if not (whole and sliding_window is None):
            q_pos = torch.where(self.valid, positions[self.q_index], 0)  # a padded query sees key 0: no NaN row
            self.mask = attention_mask(q_pos, self.max_context, sliding_window)[:, None]

    def run(self, q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, out: torch.Tensor) -> None:
        # q: [N, heads, hd]; k_rows, v_rows: [rows, kv_heads, hd]; out: [N, heads, hd], the segments' rows written
        qp = q[self.q_index].transpose(1, 2)  # [S, Lmax, heads, hd] -> [S, heads, Lmax, hd]
        kp, vp = k_rows[self.keys].transpose(1, 2), v_rows[self.keys].transpose(1, 2)  # [S, kv_heads, Cmax, hd]
        if self.mask is None:
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=self.mask, enable_gqa=True)
        out[self.rows] = o.transpose(1, 2)[self.valid]  # [S, Lmax, heads, hd] -> [sum L, heads, hd]


class AttentionPlan:
    """How one batch's sequences meet attention, built once per forward and used by every layer.

    torch: single-token ones gathered together (one mask, one [B, T] table of key rows), multi-token ones in one
    padded call (`PrefillBatch`) or, when alone, their own call. triton: the block tables and per-sequence
    lengths as device tensors for one kernel launch."""

    def __init__(
        self,
        batch: ForwardBatch,
        positions: torch.Tensor,
        device: torch.device,
        sliding_window: int | None,
        block_size: int,
        backend: AttentionBackend | None = None,
        *,
        batch_prefills: bool = True,
        min_pad_fill: float = MIN_PAD_FILL,
    ) -> None:
        self.backend: AttentionBackend = resolve_attention(device.type) if backend is None else backend
        self.positions = positions  # [N]
        self.sliding_window = sliding_window
        self.paged: PagedAttentionMeta | None = None
        self.decode_rows: torch.Tensor | None = None  # [B] token index of each single-token sequence
        self.decode_only = False  # then decode row i is token i
        self.decode_mask: torch.Tensor | None = None  # [B, 1, 1, T] bool
        self.decode_keys: torch.Tensor | None = None  # [B, T] flat cache rows; its position 0's past its end (masked)
        self.prefills: list[tuple[int, int, torch.Tensor]] = []  # (first token, new tokens, key rows [context])
        self.prefill_batch: PrefillBatch | None = None
        if self.backend == "triton":
            self.paged = PagedAttentionMeta.build(
                batch.block_tables, batch.new_lens, batch.context_lens, block_size, sliding_window, device
            )
            return
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []  # the blocks each decoding sequence's context fills
        decode_contexts: list[int] = []
        for start, table, length, context in batch.segments():
            if length == 1:
                decode_rows.append(start)
                decode_tables.append(table[: -(-context // block_size)])
                decode_contexts.append(context)
            else:
                self.prefills.append((start, length, context_rows(table, context, block_size).to(device)))
        if batch_prefills and len(self.prefills) > 1 and padding_fill(self.prefills) >= min_pad_fill:
            self.prefill_batch = PrefillBatch(self.prefills, positions, sliding_window)
        self.decode_only = not self.prefills
        if decode_rows:
            # One [B, T] table of key rows for all decodes, built in a few tensor ops whatever B is (a loop of
            # per-sequence tensors here cost more per step than the LoRA delta of one adapter). Positions past a
            # sequence's context read its own position 0, which it wrote: the mask hides them, but a masked key
            # still enters the score sum, and a stale row of a freed block may hold an earlier occupant's NaN.
            self.decode_rows = torch.tensor(decode_rows, dtype=torch.int64, device=device)
            decode_len = max(decode_contexts)
            width = max(len(table) for table in decode_tables)
            tables = torch.tensor([table + [table[0]] * (width - len(table)) for table in decode_tables])  # [B, W]
            keys = tables[:, :, None] * block_size + torch.arange(block_size, dtype=torch.int64)  # [B, W, bs]
            keys = keys.view(len(decode_rows), -1)[:, :decode_len]  # [B, T]
            past = torch.arange(decode_len) >= torch.tensor(decode_contexts)[:, None]  # [B, T]
            self.decode_keys = torch.where(past, keys[:, :1], keys).to(device)
            mask = attention_mask(positions[self.decode_rows], decode_len, sliding_window)
            self.decode_mask = mask[:, None, None, :]


def attention(
    c: ModelConfig, q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, plan: AttentionPlan
) -> torch.Tensor:
    # q: [N, heads, head_dim]; k_rows, v_rows: [num_blocks * block_size, kv_heads, head_dim] (the flat cache)
    # -> [N, heads * head_dim]
    n, group = q.shape[0], c.num_heads // c.num_kv_heads
    if plan.paged is not None:
        return paged_attention(q, k_rows, v_rows, plan.paged).view(n, c.num_heads * c.head_dim)
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
    if plan.prefill_batch is not None:
        plan.prefill_batch.run(q, k_rows, v_rows, out)
        return out.view(n, c.num_heads * c.head_dim)
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
