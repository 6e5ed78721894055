"""`ForwardBatch`: the flat tokens of one forward step and where each sequence's tokens sit in the KV cache."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from opentinker.sampler_server.model.kv_cache import KVCache


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    tokens: torch.Tensor  # [N] int64, the new tokens of every sequence, concatenated
    positions: torch.Tensor  # [N] int64, absolute position of each token in its sequence
    kv_slots: list[int]  # [B] cache slot of each sequence
    new_lens: list[int]  # [B] new tokens per sequence in this batch (decode: all 1)
    context_lens: list[int]  # [B] tokens of each sequence in the cache after this step (prefix + new)
    logits_indices: torch.Tensor  # [M] int64 indices into the N tokens whose logits are wanted

    @classmethod
    def build(
        cls, chunks: Sequence[Sequence[int]], prefix_lens: Sequence[int], kv_slots: Sequence[int], *, all_logits: bool
    ) -> ForwardBatch:
        """Sequence b appends tokens `chunks[b]` after `prefix_lens[b]` cached ones; logits of the last token of
        each sequence, or of every token when `all_logits`."""
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
            kv_slots=list(kv_slots),
            new_lens=[len(chunk) for chunk in chunks],
            context_lens=[prefix + len(chunk) for chunk, prefix in zip(chunks, prefix_lens, strict=True)],
            logits_indices=torch.tensor(wanted, dtype=torch.int64),
        )

    def segments(self) -> Iterator[tuple[int, int, int, int]]:
        """(first token index, kv slot, new tokens, context length) of each sequence."""
        start = 0
        for slot, length, context in zip(self.kv_slots, self.new_lens, self.context_lens, strict=True):
            yield start, slot, length, context
            start += length


def check_batch(batch: ForwardBatch, cache: KVCache) -> None:
    """Host-side consistency checks (no device sync); a failure is a scheduler bug, hence ValueError."""
    n = batch.tokens.shape[0]
    if not len(batch.kv_slots) == len(batch.new_lens) == len(batch.context_lens):
        raise ValueError("kv_slots, new_lens and context_lens must have one entry per sequence")
    if batch.positions.shape != (n,) or sum(batch.new_lens) != n:
        raise ValueError(
            f"{n} tokens but positions {tuple(batch.positions.shape)} and new_lens sum {sum(batch.new_lens)}"
        )
    if len(set(batch.kv_slots)) != len(batch.kv_slots):
        raise ValueError(f"a kv slot appears twice in one batch: {batch.kv_slots}")
    for slot, length, context in zip(batch.kv_slots, batch.new_lens, batch.context_lens, strict=True):
        if not 0 <= slot < cache.max_seqs:
            raise ValueError(f"kv slot {slot} outside [0, {cache.max_seqs})")
        if not 1 <= length <= context <= cache.max_len:
            raise ValueError(f"need 1 <= new_len {length} <= context_len {context} <= cache max_len {cache.max_len}")
