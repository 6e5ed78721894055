"""Launch wrapper for the Triton paged attention kernel (`paged_attention.py`), and the per-batch metadata it reads.

Triton is imported lazily, on the first launch, so CPU-only processes never depend on it. To run the kernel on
the CPU, set TRITON_INTERPRET=1 before the first launch (tiny shapes only; no bfloat16).

`PagedAttentionMeta` is built once per forward from the batch's host-side lists (one copy to the device) and
shared by every layer; the launch reads nothing back, so it never syncs a CUDA stream.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from opentinker.sampler_server.kernels.triton_launch import check_launchable, kernel_module

NO_WINDOW = 1 << 30  # a "window" wider than any context
PAGED_ATTENTION = "the triton paged attention kernel"


def _load_kernel() -> ModuleType:
    return kernel_module("paged_attention", PAGED_ATTENTION)


@dataclass(frozen=True, slots=True)
class PagedAttentionMeta:
    tables: torch.Tensor  # [S, max_blocks] int32, rows padded with block 0 (never read: past the context)
    q_start: torch.Tensor  # [S] int32 first token index of each sequence in the N tokens
    q_len: torch.Tensor  # [S] int32 new tokens per sequence
    context: torch.Tensor  # [S] int32 keys per sequence after this step
    max_q_len: int  # host copy of q_len.max(), for the grid
    block_size: int
    window: int  # the sliding window, or NO_WINDOW

    @staticmethod
    def build(
        block_tables: Sequence[Sequence[int]],
        new_lens: Sequence[int],
        context_lens: Sequence[int],
        block_size: int,
        sliding_window: int | None,
        device: torch.device,
    ) -> PagedAttentionMeta:
        """From a batch's host-side lists (`ForwardBatch.block_tables`, `new_lens`, `context_lens`)."""
        s = len(new_lens)
        width = max(-(-context // block_size) for context in context_lens)  # blocks the longest sequence reads
        host = torch.zeros(s + 3, max(width, 1), dtype=torch.int32)  # tables, then q_start, q_len, context rows
        starts = [0]
        for length in new_lens[:-1]:
            starts.append(starts[-1] + length)
        for i, (table, context) in enumerate(zip(block_tables, context_lens, strict=True)):
            used = table[: -(-context // block_size)]
            host[i, : len(used)] = torch.tensor(used, dtype=torch.int32)
        meta = torch.zeros(3, s, dtype=torch.int32)
        meta[0], meta[1], meta[2] = torch.tensor(starts), torch.tensor(list(new_lens)), torch.tensor(list(context_lens))
        on_device = torch.cat((host[:s].flatten(), meta.flatten())).to(device)  # one copy
        tables = on_device[: s * host.shape[1]].view(s, host.shape[1])
        q_start, q_len, context = on_device[s * host.shape[1] :].view(3, s)
        return PagedAttentionMeta(
            tables=tables,
            q_start=q_start,
            q_len=q_len,
            context=context,
            max_q_len=max(new_lens),
            block_size=block_size,
            window=NO_WINDOW if sliding_window is None else sliding_window,
        )


@dataclass(frozen=True, slots=True)
class PagedAttentionConfig:
    block_m: int  # new tokens per program
    block_n: int  # keys per inner step
    use_dot: bool
    num_warps: int = 4

    @staticmethod
    def for_shapes(max_q_len: int) -> PagedAttentionConfig:
        """GPU defaults: every block >= 16 so both products use tl.dot; 16 query rows for decode-heavy batches."""
        return PagedAttentionConfig(block_m=16 if max_q_len <= 16 else 64, block_n=64, use_dot=True)


def paged_attention(
    q: torch.Tensor,  # [N, heads, hd]
    k_rows: torch.Tensor,  # [num_blocks * block_size, kv_heads, hd] one layer's flat cache
    v_rows: torch.Tensor,  # [num_blocks * block_size, kv_heads, hd]
    meta: PagedAttentionMeta,
    config: PagedAttentionConfig | None = None,
) -> torch.Tensor:  # [N, heads, hd], q's dtype
    """Causal attention of each sequence's new tokens over its cached keys (positions <= its own, inside the
    sliding window), reading K/V through the block tables; the same numbers as the torch path to fp32 rounding."""
    check_launchable(q, PAGED_ATTENTION)
    n, heads, head_dim = q.shape
    kv_heads = k_rows.shape[1]
    if heads % kv_heads or k_rows.shape != v_rows.shape or k_rows.shape[2] != head_dim:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k_rows.shape)}, v {tuple(v_rows.shape)} do not fit")
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty_like(q)  # every real row is written
    if n == 0:
        return out
    if config is None:
        config = PagedAttentionConfig.for_shapes(meta.max_q_len)
    block_d = max(16 if config.use_dot else 1, 1 << (head_dim - 1).bit_length())
    s = meta.q_len.shape[0]
    grid = (s, heads, -(-meta.max_q_len // config.block_m))
    _load_kernel().paged_attention_kernel[grid](
        q,
        k_rows,
        v_rows,
        out,
        meta.tables,
        meta.q_start,
        meta.q_len,
        meta.context,
        1.0 / math.sqrt(head_dim),
        meta.block_size,
        meta.window,
        head_dim,
        q.stride(0),
        q.stride(1),
        k_rows.stride(0),
        k_rows.stride(1),
        v_rows.stride(0),
        v_rows.stride(1),
        out.stride(0),
        out.stride(1),
        meta.tables.stride(0),
        GROUP=heads // kv_heads,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_D=block_d,
        USE_DOT=config.use_dot,
        num_warps=config.num_warps,
    )
    return out
