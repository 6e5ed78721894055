"""Triton paged attention: queries of every sequence of a batch (decode: one each; prefill or a chunk continuing a
cached prefix: several) against K/V read through each sequence's block table, with no gathered copy.

Imported only by `paged_attention_ops` on first use, so importing the sampler never needs triton.
TRITON_INTERPRET=1 must be set before this module is imported for the kernel to run on CPU.

One program = one sequence x one query head x BLOCK_M of its new tokens. It walks the key positions its queries
may see (from the sliding window's start of the first query to the last query's position) BLOCK_N at a time:
key position p lives in cache row `table[p // block_size] * block_size + p % block_size`, the block id loaded as
an int from the [S, max_blocks] block-table tensor (no pointer arrays). Online softmax in float32 (running max
m, sum l, accumulator acc), one division at the end. GQA: query head h reads kv head h // GROUP.

`USE_DOT` picks tl.dot (every block dim >= 16) or a broadcast multiply + tl.sum (any block size; what the
interpreter tests use on tiny shapes). Float32 dots use "ieee" precision so results match torch, not TF32.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit  # type: ignore[untyped-decorator]
def paged_attention_kernel(
    q_ptr: tl.tensor,  # [N, heads, hd] the batch's new tokens
    k_ptr: tl.tensor,  # [num_blocks * block_size, kv_heads, hd] the flat cache of one layer
    v_ptr: tl.tensor,  # [num_blocks * block_size, kv_heads, hd]
    o_ptr: tl.tensor,  # [N, heads, hd] written for every real query
    tables_ptr: tl.tensor,  # [S, max_blocks] int32 block ids of each sequence, in position order
    q_start_ptr: tl.tensor,  # [S] int32 first token index of each sequence in the N tokens
    q_len_ptr: tl.tensor,  # [S] int32 new tokens per sequence
    context_ptr: tl.tensor,  # [S] int32 keys per sequence (cached prefix + new tokens)
    scale: tl.tensor,  # 1 / sqrt(hd)
    block_size: tl.tensor,
    window: tl.tensor,  # sliding window; a value >= every context when there is none
    head_dim: tl.tensor,
    stride_qn: tl.tensor,
    stride_qh: tl.tensor,
    stride_kr: tl.tensor,
    stride_kh: tl.tensor,
    stride_vr: tl.tensor,
    stride_vh: tl.tensor,
    stride_on: tl.tensor,
    stride_oh: tl.tensor,
    stride_ts: tl.tensor,
    GROUP: tl.constexpr,  # query heads per kv head
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,  # >= head_dim, a power of 2
    USE_DOT: tl.constexpr,
) -> None:
    # grid: (S, heads, cdiv(max new tokens, BLOCK_M))
    seq = tl.program_id(0)
    head = tl.program_id(1)
    pid_m = tl.program_id(2)
    q_len = tl.load(q_len_ptr + seq)
    if pid_m * BLOCK_M >= q_len:
        return
    q_start = tl.load(q_start_ptr + seq)
    context = tl.load(context_ptr + seq)
    kv_head = head // GROUP

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] new-token index within the sequence
    mask_m = offs_m < q_len
    q_pos = context - q_len + offs_m  # [BM] absolute positions of the queries
    offs_d = tl.arange(0, BLOCK_D)  # [BD]
    mask_d = offs_d < head_dim
    tokens = (q_start + offs_m).to(tl.int64)  # [BM]
    q = tl.load(
        q_ptr + tokens[:, None] * stride_qn + head * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )  # [BM, BD]

    first_pos = context - q_len + pid_m * BLOCK_M
    last_pos = tl.minimum(first_pos + BLOCK_M, context) - 1  # the tile's last real query
    lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N  # keys before lo are outside every window
    hi = last_pos + 1  # causal: no query of the tile sees past its own position

    m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)  # finite, so an all-masked tile gives no NaN
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    table = tables_ptr + seq.to(tl.int64) * stride_ts
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)  # [BN] key positions
        mask_n = offs_n < hi
        blocks = tl.load(table + offs_n // block_size, mask=mask_n, other=0)  # [BN] block id of each key
        rows = blocks.to(tl.int64) * block_size + offs_n % block_size  # [BN] rows of the flat cache
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_ptr + rows[:, None] * stride_kr + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + rows[:, None] * stride_vr + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        if USE_DOT:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BM, BN] float32
        else:
            qk = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # [BM, BN]
        qk = qk * scale
        visible = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] > q_pos[:, None] - window)
        visible = visible & mask_n[None, :] & mask_m[:, None]
        qk = tl.where(visible, qk, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))  # [BM]
        alpha = tl.exp(m_i - m_new)
        p = tl.where(visible, tl.exp(qk - m_new[:, None]), 0.0)  # [BM, BN]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if USE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # [BM, BD]
    o_ptrs = o_ptr + tokens[:, None] * stride_on + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])
