"""Triton shrink/expand kernels for the multi-LoRA delta (SGMV-style: one program = a row block of ONE slot).

Imported only by `triton_ops` on first use, so `import opentinker.sampler_server.kernels` never needs triton.
TRITON_INTERPRET=1 must be set before this module is imported for the kernels to run on CPU.

Both kernels take the batch's segment metadata (rows stably sorted by slot, per-slot counts and offsets) and
a grid whose last axis walks slots 1..S-1 (slot 0, "no adapter", is never launched). A program whose row
block lies past its slot's count returns at once, so the grid needs no host-side knowledge of the segments.
The weights are ONE stacked tensor per module indexed as base + slot * stride (no pointer arrays).

`USE_DOT` picks tl.dot (needs every block dim >= 16) or a broadcast multiply + tl.sum (any block size; the
form the interpreter tests use on tiny shapes). Accumulation is always float32; float32 dots use "ieee"
precision so results match the torch reference rather than TF32.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit  # type: ignore[untyped-decorator]
def lora_shrink_kernel(
    x_ptr: tl.tensor,  # [N, d_in]
    a_ptr: tl.tensor,  # [S, R, d_in]
    h_ptr: tl.tensor,  # [N, R] float32, written for rows of slots >= 1
    sorted_rows_ptr: tl.tensor,  # [N] row indices stably sorted by slot
    counts_ptr: tl.tensor,  # [S] rows per slot
    offsets_ptr: tl.tensor,  # [S] first position of each slot in sorted_rows
    d_in: tl.tensor,
    rank: tl.tensor,
    stride_xm: tl.tensor,
    stride_xk: tl.tensor,
    stride_as: tl.tensor,
    stride_ar: tl.tensor,
    stride_ak: tl.tensor,
    stride_hm: tl.tensor,
    stride_hr: tl.tensor,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
) -> None:
    # grid: (cdiv(N, BLOCK_M), cdiv(R, BLOCK_R), S - 1)
    pid_m = tl.program_id(0)
    pid_r = tl.program_id(1)
    slot = tl.program_id(2) + 1
    count = tl.load(counts_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    start = tl.load(offsets_ptr + slot)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] positions inside this slot's segment
    mask_m = offs_m < count
    rows = tl.load(sorted_rows_ptr + start + offs_m, mask=mask_m, other=0)  # [BM] batch row indices
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    mask_r = offs_r < rank
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    a_base = a_ptr + slot.to(tl.int64) * stride_as

    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)  # [BM, BR]
    for k0 in range(0, d_in, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < d_in
        x_tile = tl.load(
            x_ptr + rows[:, None] * stride_xm + k[None, :] * stride_xk,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )  # [BM, BK]
        a_tile = tl.load(
            a_base + offs_r[:, None] * stride_ar + k[None, :] * stride_ak,
            mask=mask_r[:, None] & mask_k[None, :],
            other=0.0,
        )  # [BR, BK]
        if USE_DOT:
            acc = tl.dot(x_tile, tl.trans(a_tile.to(x_tile.dtype)), acc, input_precision="ieee")
        else:
            prod = x_tile.to(tl.float32)[:, None, :] * a_tile.to(tl.float32)[None, :, :]  # [BM, BR, BK]
            acc += tl.sum(prod, axis=2)

    h_ptrs = h_ptr + rows[:, None] * stride_hm + offs_r[None, :] * stride_hr
    tl.store(h_ptrs, acc, mask=mask_m[:, None] & mask_r[None, :])


@triton.jit  # type: ignore[untyped-decorator]
def lora_expand_kernel(
    h_ptr: tl.tensor,  # [N, R] float32
    b_ptr: tl.tensor,  # [S, d_out, R]
    scaling_ptr: tl.tensor,  # [S] float32
    y_ptr: tl.tensor,  # [N, d_out], updated in place
    sorted_rows_ptr: tl.tensor,  # [N]
    counts_ptr: tl.tensor,  # [S]
    offsets_ptr: tl.tensor,  # [S]
    d_out: tl.tensor,
    rank: tl.tensor,
    stride_hm: tl.tensor,
    stride_hr: tl.tensor,
    stride_bs: tl.tensor,
    stride_bn: tl.tensor,
    stride_br: tl.tensor,
    stride_ym: tl.tensor,
    stride_yn: tl.tensor,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    USE_DOT: tl.constexpr,
) -> None:
    # grid: (cdiv(N, BLOCK_M), cdiv(d_out, BLOCK_N), S - 1)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.program_id(2) + 1
    count = tl.load(counts_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    start = tl.load(offsets_ptr + slot)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    mask_m = offs_m < count
    rows = tl.load(sorted_rows_ptr + start + offs_m, mask=mask_m, other=0)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    mask_n = offs_n < d_out
    offs_r = tl.arange(0, BLOCK_R)  # [BR]
    b_base = b_ptr + slot.to(tl.int64) * stride_bs

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # [BM, BN]
    for r0 in range(0, rank, BLOCK_R):
        r = r0 + offs_r
        mask_r = r < rank
        h_tile = tl.load(
            h_ptr + rows[:, None] * stride_hm + r[None, :] * stride_hr,
            mask=mask_m[:, None] & mask_r[None, :],
            other=0.0,
        )  # [BM, BR] float32
        b_tile = tl.load(
            b_base + offs_n[:, None] * stride_bn + r[None, :] * stride_br,
            mask=mask_n[:, None] & mask_r[None, :],
            other=0.0,
        ).to(tl.float32)  # [BN, BR]
        if USE_DOT:
            acc = tl.dot(h_tile, tl.trans(b_tile), acc, input_precision="ieee")
        else:
            acc += tl.sum(h_tile[:, None, :] * b_tile[None, :, :], axis=2)

    scale = tl.load(scaling_ptr + slot).to(tl.float32)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :] * stride_yn  # [BM, BN]
    mask = mask_m[:, None] & mask_n[None, :]
    y_tile = tl.load(y_ptrs, mask=mask, other=0.0)
    out = y_tile.to(tl.float32) + (acc * scale).to(y_tile.dtype).to(tl.float32)  # delta cast to y's dtype, then add
    tl.store(y_ptrs, out.to(y_tile.dtype), mask=mask)
