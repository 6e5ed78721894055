"""The paged KV cache's books: which blocks are free, how many sequences reference each, and every sequence's
block table (`Sequence.block_table`, the blocks holding its positions in order).

A sequence holds `ceil(num_tokens / block_size)` blocks: admission takes the blocks of its prompt (or, after a
preemption, of its prompt and output so far), and a decode step takes one more block whenever the token it
writes starts a new block. Memory is then proportional to the tokens held, not to max_seqs x max_len. The
tensors are `model.kv_cache.KVCache`; this file never touches them.
"""

from __future__ import annotations

import collections

from opentinker.sampler_server.sequence import Sequence

BLOCK_SIZE = 16  # tokens per block (vLLM's and nano-vllm's default order of size: small waste, short tables)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need >= 1 block of >= 1 token, got {num_blocks} blocks of {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refs = [0] * num_blocks  # sequences whose table holds each block
        self._free: collections.deque[int] = collections.deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def needed(self, seq: Sequence) -> int:
        """Blocks seq must take before its next forward: enough to hold positions 0..num_tokens-1."""
        return max(0, self.blocks_for(seq.num_tokens) - len(seq.block_table))

    def can_grow(self, seq: Sequence) -> bool:
        return self.needed(seq) <= len(self._free)

    def grow(self, seq: Sequence) -> None:
        """Gives seq the blocks its next forward writes to (the caller checked `can_grow`)."""
        for _ in range(self.needed(seq)):
            block = self._free.popleft()
            self.refs[block] = 1
            seq.block_table.append(block)

    def release(self, seq: Sequence) -> None:
        """seq lets go of every block it holds (finished, aborted or preempted); its K/V are gone."""
        for block in seq.block_table:
            self.refs[block] -= 1
            assert self.refs[block] >= 0, f"block {block} released more often than taken"
            if self.refs[block] == 0:
                self._free.append(block)
        seq.block_table = []
        seq.num_cached = 0
