"""The K/V cache: one pool of fixed-size blocks that every sequence's tokens live in.

A sequence's block table lists the blocks that hold its positions in order: the K/V of the token at position p
sits in block `table[p // block_size]`, row `p % block_size`, of every layer. Memory is proportional to the
tokens held, not to `max_seqs * max_len`:

    bytes = num_blocks * block_size * num_layers * 2 (K and V) * num_kv_heads * head_dim * dtype_size

Which blocks a sequence gets (and which it shares) is the block manager's business (block_manager.py); this
class only holds the tensors. A cache of `n` blocks of `max_len` tokens, one block per sequence, is the old
slot cache: model-level tests and benchmarks address it with `ForwardBatch.build(..., kv_slots=...)`.
"""

from __future__ import annotations

import torch

from opentinker.weights.model_config import ModelConfig


class KVCache:
    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        # k[layer], v[layer]: [num_blocks, block_size, num_kv_heads, head_dim]; rows of a block are positions
        self.k: list[torch.Tensor] = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        self.v: list[torch.Tensor] = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]

    @staticmethod
    def bytes_for(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype) -> int:
        """Memory a cache of this size takes, before allocating it."""
        dtype_size = torch.empty((), dtype=dtype).element_size()
        return num_blocks * block_size * config.num_layers * 2 * config.num_kv_heads * config.head_dim * dtype_size

    @staticmethod
    def blocks_for(config: ModelConfig, megabytes: float, block_size: int, dtype: torch.dtype) -> int:
        """How many blocks fit in `megabytes` MiB."""
        return int(megabytes * 2**20) // KVCache.bytes_for(config, 1, block_size, dtype)

    def copy_block(self, src: int, dst: int, rows: int) -> None:
        """Block dst's first `rows` positions take block src's K/V in every layer (copy-on-write of a partly
        filled block that two sequences would otherwise both append to)."""
        for k, v in zip(self.k, self.v, strict=True):
            k[dst, :rows] = k[src, :rows]
            v[dst, :rows] = v[src, :rows]

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))
