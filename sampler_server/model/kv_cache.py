"""The K/V cache: one fixed slot of `max_len` positions per running sequence.

Choice: a slot per sequence (not paged blocks). A sequence owns slot `s` from admission to finish and writes
the K/V of the token at position p to `[s, :, p, :]` of every layer. That keeps the forward simple (the keys
of a sequence are one contiguous slice, no block tables) and needs no fragmentation bookkeeping; the price is
that every slot reserves `max_len` positions whether the sequence uses them or not, so `max_seqs * max_len`
bounds memory rather than the tokens actually held:

    bytes = max_seqs * max_len * num_layers * 2 (K and V) * num_kv_heads * head_dim * dtype_size

Which slot a sequence gets is the scheduler's business; this class only holds the tensors.
"""

from __future__ import annotations

import torch

from opentinker.weights.model_config import ModelConfig


class KVCache:
    def __init__(
        self, config: ModelConfig, max_seqs: int, max_len: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        if max_seqs < 1 or max_len < 1:
            raise ValueError(f"max_seqs and max_len must be >= 1, got {max_seqs} and {max_len}")
        self.config = config
        self.max_seqs = max_seqs
        self.max_len = max_len
        self.device = device
        self.dtype = dtype
        shape = (max_seqs, config.num_kv_heads, max_len, config.head_dim)
        # k[layer], v[layer]: [max_seqs, num_kv_heads, max_len, head_dim]
        self.k: list[torch.Tensor] = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        self.v: list[torch.Tensor] = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]

    @staticmethod
    def bytes_for(config: ModelConfig, max_seqs: int, max_len: int, dtype: torch.dtype) -> int:
        """Memory a cache of this size takes, before allocating it."""
        dtype_size = torch.empty((), dtype=dtype).element_size()
        return max_seqs * max_len * config.num_layers * 2 * config.num_kv_heads * config.head_dim * dtype_size

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Slot dst's first `length` positions take slot src's K/V in every layer (a sample taking its request's
        prompt from the sample that computed it: a copy of length * kv_heads * head_dim values per tensor, not
        a prefill)."""
        for k, v in zip(self.k, self.v, strict=True):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))
