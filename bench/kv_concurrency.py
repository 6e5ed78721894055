"""The memory figure of the paged KV cache: with one KV budget (in tokens, i.e. bytes / bytes per token), how
many sequences of mixed lengths are held at once by the paged design (blocks of 16 tokens, a sequence holds
ceil(length / 16) of them) and by the slot design it replaced (max_seqs slots of max_len tokens each, so
budget // max_len sequences whatever they hold). Counted, not timed: the real BlockManager and Scheduler admit
real Sequences until the blocks run out; the prefix cache is off, so no sequence is helped by another's blocks.

Lengths are Zipf-distributed (many short contexts, a few up to the whole context), each the most tokens the
sequence holds (prompt and output), seeded.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from opentinker.sampler_server.block_manager import BLOCK_SIZE, BlockManager
from opentinker.sampler_server.scheduler import Scheduler
from opentinker.sampler_server.sequence import SamplingParams, Sequence


@dataclass(frozen=True, slots=True)
class Concurrency:
    budget_tokens: int  # the KV budget: slot design max_seqs x max_len, the same bytes as the paged pool
    max_len: int
    slot_sequences: int  # sequences the slot design holds at once
    paged_sequences: int  # sequences the paged design admitted before its blocks ran out
    mean_length: float  # of the admitted sequences
    blocks_used: int
    blocks_total: int

    @property
    def ratio(self) -> float:
        return self.paged_sequences / self.slot_sequences


def zipf_lengths(count: int, max_len: int, *, seed: int = 0, exponent: float = 1.1, unit: int = 32) -> list[int]:
    """Lengths unit * k for a Zipf-distributed rank k (P(k) ~ k^-exponent), capped at max_len - 1."""
    rng = random.Random(seed)
    ranks = range(1, max_len // unit + 1)
    weights = [k**-exponent for k in ranks]
    return [min(max_len - 1, unit * k + rng.randrange(unit)) for k in rng.choices(ranks, weights, k=count)]


def measure(
    *, max_seqs: int = 16, max_len: int = 4096, seed: int = 0, offered: int = 4096, lengths: list[int] | None = None
) -> Concurrency:
    """The slot design's budget (max_seqs x max_len tokens) as a paged pool; `offered` sequences (of `lengths`,
    default Zipf) queued."""
    budget = max_seqs * max_len
    blocks = BlockManager(budget // BLOCK_SIZE, BLOCK_SIZE, prefix_cache=False)
    scheduler = Scheduler(max_seqs=offered, max_batch_tokens=budget, blocks=blocks)  # seats never the limit
    params = SamplingParams(temperature=0.0, max_tokens=1)
    for i, length in enumerate(lengths or zipf_lengths(offered, max_len, seed=seed)):
        tokens = [(7 * i + j) % 1000 + 3 for j in range(length)]
        scheduler.add(Sequence(seq_id=i, request_id=f"r{i}", sample_index=0, prompt=tokens, params=params, lora_slot=0))
    while True:  # a prefill admits until the next sequence's blocks are not free; a decode (no new token) takes none
        before = len(scheduler.running)
        scheduler.schedule()
        scheduler.schedule()  # one of the two is a prefill: it never runs twice in a row while others decode
        if len(scheduler.running) == before:
            break
    running = scheduler.running
    return Concurrency(
        budget_tokens=budget,
        max_len=max_len,
        slot_sequences=max_seqs,
        paged_sequences=len(running),
        mean_length=sum(s.num_tokens for s in running) / len(running),
        blocks_used=blocks.num_used,
        blocks_total=blocks.num_blocks,
    )


def report(result: Concurrency) -> str:
    return (
        f"KV budget {result.budget_tokens:,} tokens ({result.slot_sequences} slots x {result.max_len}): slot "
        f"design {result.slot_sequences} sequences at once, paged {result.paged_sequences} (mean length "
        f"{result.mean_length:.0f}, {result.blocks_used}/{result.blocks_total} blocks): {result.ratio:.1f}x"
    )
