"""One step's rows: the forward batch of every sequence's chunk (flat tokens, positions, block tables, the logit
rows to compute), each token's and each logit row's adapter slot, and back from the logits each ending sequence's
last-position row (with the prompt logprobs of the chunks that want them, scoring.py)."""

from __future__ import annotations

import torch

from opentinker.sampler_server.model.batch import ForwardBatch
from opentinker.sampler_server.scoring import gather_prompt_logprobs, wants_prompt_logprobs
from opentinker.sampler_server.sequence import Sequence


def prepare_forward(
    computed: list[tuple[Sequence, int]], device: torch.device
) -> tuple[ForwardBatch, list[int], list[int]]:
    """The forward batch of each sequence's chunk (its next `chunk` tokens from num_cached on), the adapter
    slot of each of its N tokens and of each of its M logit rows: one per sequence whose chunk ends it (its
    last position, to sample from), every position of a prompt chunk whose prompt logprobs are wanted,
    none for other partial chunks."""
    tokens: list[int] = []
    positions: list[int] = []
    token_slots: list[int] = []
    row_slots: list[int] = []
    new_lens: list[int] = []
    logits_indices: list[int] = []
    for seq, chunk in computed:
        new = seq.token_slice(seq.num_cached, seq.num_cached + chunk)  # a prompt chunk, or the last sampled token
        start = len(tokens)
        tokens.extend(new)
        positions.extend(range(seq.num_cached, seq.num_cached + chunk))
        token_slots.extend([seq.lora_slot] * chunk)
        new_lens.append(chunk)
        if wants_prompt_logprobs(seq):
            logits_indices.extend(range(start, start + chunk))
        elif seq.num_cached + chunk == seq.num_tokens:
            logits_indices.append(start + chunk - 1)
        row_slots.extend([seq.lora_slot] * (len(logits_indices) - len(row_slots)))
    forward = ForwardBatch(
        tokens=torch.tensor(tokens, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        block_tables=[seq.block_table for seq, _ in computed],
        new_lens=new_lens,
        context_lens=[seq.num_cached + chunk for seq, chunk in computed],
        logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=device),
    )
    return forward, token_slots, row_slots


def last_logits(computed: list[tuple[Sequence, int]], logits: torch.Tensor) -> torch.Tensor:
    """logits: [M, V], the rows `prepare_forward` asked for -> [E, V], the last-position row of each sequence
    whose chunk ends it and that samples; gathers prompt logprobs chunk by chunk where they were asked for."""
    rows: list[int] = []
    offset = 0
    for seq, chunk in computed:
        ends = seq.num_cached + chunk == seq.num_tokens
        if wants_prompt_logprobs(seq):
            gather_prompt_logprobs(seq, chunk, logits[offset : offset + chunk])
            offset += chunk
        elif ends:
            offset += 1
        if ends and not seq.scores_only:  # a score samples nothing: no last-position row
            rows.append(offset - 1)
    if rows == list(range(logits.shape[0])):
        return logits  # every row is a last position (a decode step): no [E, V] copy
    return logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]
