"""Triton path for the multi-LoRA delta: shrink (h = x A_s^T, float32) then expand (y += scale_s * h B_s^T).

Triton is imported lazily, on the first kernel launch: importing this module only checks that the package
exists (`TRITON_AVAILABLE`), so CPU-only processes never pay for or depend on it. To run the kernels on CPU,
set TRITON_INTERPRET=1 in the environment before the first launch (tiny shapes only; no bfloat16).

The segment metadata (`segment_meta`) is pure torch and needs no host sync, so it can be computed once per
batch and shared by every module of every layer.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from types import ModuleType

import torch

from opentinker.sampler_server.kernels.triton_launch import check_launchable, kernel_module


def _triton_installed() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


TRITON_AVAILABLE: bool = _triton_installed()

LORA_KERNELS = "the triton LoRA kernels"


def _load_kernels() -> ModuleType:
    return kernel_module("_triton_kernels", LORA_KERNELS)


@dataclass(frozen=True, slots=True)
class SegmentMeta:
    """Rows of a batch grouped by slot, computed on the device without reading anything back."""

    sorted_rows: torch.Tensor  # [N] int64 row indices, stably sorted by slot
    counts: torch.Tensor  # [S] int64 rows per slot
    offsets: torch.Tensor  # [S] int64 first position of each slot in sorted_rows


def segment_meta(slot_ids: torch.Tensor, num_slots: int) -> SegmentMeta:
    # slot_ids: [N] int, every value in [0, num_slots)
    slot_ids = slot_ids.long()
    sorted_rows = torch.argsort(slot_ids, stable=True)  # [N]
    counts = torch.zeros(num_slots, dtype=torch.long, device=slot_ids.device)  # [S]
    counts.scatter_add_(0, slot_ids, torch.ones_like(slot_ids))  # (bincount would sync on CUDA)
    offsets = torch.cumsum(counts, 0) - counts  # [S]
    return SegmentMeta(sorted_rows, counts, offsets)


@dataclass(frozen=True, slots=True)
class TritonConfig:
    """Block sizes. tl.dot is used only when block_m, block_r and block_k/block_n are all >= 16."""

    block_m: int = 16  # rows of one slot per program
    block_r: int = 16  # rank chunk (shrink: one grid axis; expand: inner loop)
    block_k: int = 64  # d_in chunk of the shrink loop
    block_n: int = 64  # d_out columns per expand program
    num_warps: int = 4

    @staticmethod
    def for_shapes(n: int, max_rank: int) -> TritonConfig:
        """GPU defaults: every block >= 16, so both kernels use tl.dot."""
        block_r = max(16, min(64, _next_power_of_2(max_rank)))
        return TritonConfig(block_m=16 if n <= 64 else 32, block_r=block_r)


def _next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def lora_shrink(
    x: torch.Tensor,  # [N, d_in] float32/float16/bfloat16
    a: torch.Tensor,  # [S, R, d_in]
    meta: SegmentMeta,
    config: TritonConfig,
) -> torch.Tensor:  # h: [N, R] float32 (zeros on slot-0 rows)
    n, d_in = x.shape
    num_slots, max_rank, _ = a.shape
    h = torch.zeros(n, max_rank, dtype=torch.float32, device=x.device)  # [N, R]
    if n == 0 or num_slots <= 1:
        return h
    use_dot = min(config.block_m, config.block_r, config.block_k) >= 16
    grid = (_cdiv(n, config.block_m), _cdiv(max_rank, config.block_r), num_slots - 1)
    _load_kernels().lora_shrink_kernel[grid](
        x,
        a,
        h,
        meta.sorted_rows,
        meta.counts,
        meta.offsets,
        d_in,
        max_rank,
        x.stride(0),
        x.stride(1),
        a.stride(0),
        a.stride(1),
        a.stride(2),
        h.stride(0),
        h.stride(1),
        BLOCK_M=config.block_m,
        BLOCK_R=config.block_r,
        BLOCK_K=config.block_k,
        USE_DOT=use_dot,
        num_warps=config.num_warps,
    )
    return h


def lora_expand(
    y: torch.Tensor,  # [N, d_out]; updated in place
    h: torch.Tensor,  # [N, R] float32
    b: torch.Tensor,  # [S, d_out, R]
    scaling: torch.Tensor,  # [S] float32, contiguous
    meta: SegmentMeta,
    config: TritonConfig,
) -> None:
    n, d_out = y.shape
    num_slots, _, max_rank = b.shape
    if n == 0 or num_slots <= 1:
        return
    use_dot = min(config.block_m, config.block_r, config.block_n) >= 16
    grid = (_cdiv(n, config.block_m), _cdiv(d_out, config.block_n), num_slots - 1)
    _load_kernels().lora_expand_kernel[grid](
        h,
        b,
        scaling,
        y,
        meta.sorted_rows,
        meta.counts,
        meta.offsets,
        d_out,
        max_rank,
        h.stride(0),
        h.stride(1),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        y.stride(0),
        y.stride(1),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_R=config.block_r,
        USE_DOT=use_dot,
        num_warps=config.num_warps,
    )


def add_lora_triton(
    y: torch.Tensor,  # [N, d_out], dtype of x; updated in place
    x: torch.Tensor,  # [N, d_in]
    a: torch.Tensor,  # [S, R, d_in]
    b: torch.Tensor,  # [S, d_out, R]
    scaling: torch.Tensor,  # [S] float32
    slot_ids: torch.Tensor,  # [N] int64, values in [0, S) (not checked: that would sync)
    *,
    meta: SegmentMeta | None = None,  # reuse one per batch across modules and layers
    config: TritonConfig | None = None,
) -> None:
    """y[n] += scaling[s] * (x[n] @ a[s].T) @ b[s].T with s = slot_ids[n]; rows on slot 0 are never touched.

    Multiplies the full padded rank R (zero padding is exact; the real ranks would need a host sync).
    """
    n = x.shape[0]
    if n == 0:
        return
    check_launchable(x, LORA_KERNELS)
    if meta is None:
        meta = segment_meta(slot_ids, a.shape[0])
    if config is None:
        config = TritonConfig.for_shapes(n, a.shape[1])
    h = lora_shrink(x, a, meta, config)  # [N, R] float32
    lora_expand(y, h, b, scaling.contiguous(), meta, config)
