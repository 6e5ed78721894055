"""`ForwardBatch`: the flat tokens of one forward step and the block table each sequence's tokens live in."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from opentinker.sampler_server.model.kv_cache import KVCache


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    tokens: torch.Tensor  # [N] int64, the new tokens of every sequence, concatenated
    positions: torch.Tensor  # [N] int64, absolute position of each token in its sequence
    block_tables: list[list[int]]  # [B] the cache blocks holding each sequence's positions, in order
    new_lens: list[int]  # [B] new tokens per sequence in this batch (decode: all 1)
    context_lens: list[int]  # [B] tokens of each sequence in the cache after this step (prefix + new)
    logits_indices: torch.Tensor  # [M] int64 indices into the N tokens whose logits are wanted

    @classmethod
    def build(
        cls,
        chunks: Sequence[Sequence[int]],
        prefix_lens: Sequence[int],
        kv_slots: Sequence[int] | None = None,
        *,
        block_tables: Sequence[Sequence[int]] | None = None,
        all_logits: bool,
    ) -> ForwardBatch:
        """Sequence b appends tokens `chunks[b]` after `prefix_lens[b]` cached ones, in `block_tables[b]` (or in
        the one block `kv_slots[b]`, a cache whose blocks are max_len long); logits of the last token of each
        sequence, or of every token when `all_logits`."""
        if block_tables is None:
            if kv_slots is None:
                raise ValueError("give kv_slots or block_tables")
            block_tables = [[slot] for slot in kv_slots]
        tokens: list[int] = []
        positions: list[int] = []
        wanted: list[int] = []
        for chunk, prefix in zip(chunks, prefix_lens, strict=True):
            start = len(tokens)
            tokens.extend(chunk)
            positions.extend(range(prefix, prefix + len(chunk)))
            wanted.extend(range(start, len(tokens)) if all_logits else [len(tokens) - 1])
        return cls(
            tokens=torch.tensor(tokens, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            block_tables=[list(table) for table in block_tables],
            new_lens=[len(chunk) for chunk in chunks],
            context_lens=[prefix + len(chunk) for chunk, prefix in zip(chunks, prefix_lens, strict=True)],
            logits_indices=torch.tensor(wanted, dtype=torch.int64),
        )

    def segments(self) -> Iterator[tuple[int, list[int], int, int]]:
        """(first token index, block table, new tokens, context length) of each sequence."""
        start = 0
        for table, length, context in zip(self.block_tables, self.new_lens, self.context_lens, strict=True):
            yield start, table, length, context
            start += length

    def token_rows(self, block_size: int) -> torch.Tensor:
        """[N] int64: the row of the flat cache ([num_blocks * block_size, ...]) each new token is written to."""
        rows: list[int] = []
        for table, length, context in zip(self.block_tables, self.new_lens, self.context_lens, strict=True):
            rows.extend(table[p // block_size] * block_size + p % block_size for p in range(context - length, context))
        return torch.tensor(rows, dtype=torch.int64)


def context_rows(table: Sequence[int], length: int, block_size: int) -> torch.Tensor:
    """[length] int64: the flat cache rows of positions 0..length-1 of a sequence with this block table."""
    blocks = torch.tensor(table[: -(-length // block_size)], dtype=torch.int64)
    rows = (blocks[:, None] * block_size + torch.arange(block_size, dtype=torch.int64)[None, :]).flatten()
    return rows[:length]


def check_batch(batch: ForwardBatch, cache: KVCache) -> None:
    """Host-side consistency checks (no device sync); a failure is a scheduler bug, hence ValueError."""
    n = batch.tokens.shape[0]
    if not len(batch.block_tables) == len(batch.new_lens) == len(batch.context_lens):
        raise ValueError("block_tables, new_lens and context_lens must have one entry per sequence")
    if batch.positions.shape != (n,) or sum(batch.new_lens) != n:
        raise ValueError(
            f"{n} tokens but positions {tuple(batch.positions.shape)} and new_lens sum {sum(batch.new_lens)}"
        )
    size = cache.block_size
    written: set[int] = set()
    for table, length, context in zip(batch.block_tables, batch.new_lens, batch.context_lens, strict=True):
        if not 1 <= length <= context <= len(table) * size:
            raise ValueError(
                f"need 1 <= new_len {length} <= context_len {context} <= the block table's "
                f"{len(table)} x {size} positions"
            )
        if any(not 0 <= block < cache.num_blocks for block in table):
            raise ValueError(f"a block of {table} is outside [0, {cache.num_blocks})")
        targets = set(table[(context - length) // size : (context - 1) // size + 1])
        if targets & written:
            raise ValueError(f"blocks {sorted(targets & written)} are written by two sequences in one batch")
        written |= targets
