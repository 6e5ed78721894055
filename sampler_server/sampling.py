"""Next-token sampling for a batch: temperature, top-k, top-p, per-sequence seeded generators.

Reported logprobs are the model's own (log_softmax of the raw logits, temperature 1), so that they are
comparable to the trainer's logprobs for importance sampling. A row whose params ask for `top_logprobs` also
gets its position's most likely tokens in that same sense: one topk over the rows that ask, at the largest k
asked, each row keeping its own k; a batch where no row asks computes nothing more.

A row whose logits are not finite (an adapter whose delta overflowed the residual stream), or whose
probabilities are not after the temperature (finite logits that overflow when divided by it), draws no token:
its index is reported in `Draw.failed` and the other rows are sampled as if it were not there. One tenant's
adapter must not fail the batch it shares with every other tenant (torch.multinomial raises for the whole call).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opentinker.sampler_server.sequence import Sequence, TopLogprobs


@dataclass(frozen=True, slots=True)
class Draw:
    tokens: list[int]  # one per row; 0 for a failed row
    logprobs: list[float]  # one per row; NaN for a failed row
    failed: frozenset[int]  # rows that drew nothing: their logits or probabilities are not finite
    top: dict[int, TopLogprobs]  # row -> its most likely tokens, for the rows that asked (and did not fail)


def sample(logits: torch.Tensor, sequences: list[Sequence]) -> Draw:
    """logits: [B, V] float32, one row per sequence -> (token, logprob) per sequence, and the rows that failed."""
    finite = logits.isfinite().all(-1)  # [B]: one reduction for the batch, the common case all True
    failed = set() if bool(finite.all()) else {int(i) for i in (~finite).nonzero().flatten().tolist()}
    logprobs = logits.log_softmax(-1)  # [B, V]; a failed row's values are never read
    if all(s.params.greedy for s in sequences):
        tokens = logits.argmax(-1)  # [B]
        return _drawn(tokens.tolist(), logprobs, failed, sequences)
    chosen: list[int] = []
    for row, seq in enumerate(sequences):
        params = seq.params
        if row in failed:
            chosen.append(0)
            continue
        if params.greedy:
            chosen.append(int(logits[row].argmax()))
            continue
        scores = logits[row] / params.temperature  # [V]
        if params.top_k > 0 and params.top_k < scores.numel():
            kth = torch.topk(scores, params.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if 0.0 < params.top_p < 1.0:
            ordered, order = scores.sort(descending=True)
            cumulative = ordered.softmax(-1).cumsum(-1)
            drop = cumulative - ordered.softmax(-1) >= params.top_p  # keep the smallest prefix reaching top_p
            scores = scores.scatter(0, order[drop], float("-inf"))
        probs = scores.softmax(-1)
        if not bool(probs.isfinite().all()):  # finite logits that overflowed once divided by the temperature
            failed.add(row)
            chosen.append(0)
            continue
        chosen.append(int(torch.multinomial(probs, 1, generator=seq.generator)))
    return _drawn(chosen, logprobs, failed, sequences)


def _drawn(tokens: list[int], logprobs: torch.Tensor, failed: set[int], sequences: list[Sequence]) -> Draw:
    index = torch.tensor(tokens, dtype=torch.long, device=logprobs.device)
    picked: list[float] = logprobs.gather(1, index[:, None]).squeeze(1).tolist()
    for row in failed:
        tokens[row], picked[row] = 0, float("nan")
    return Draw(tokens, picked, frozenset(failed), _top(logprobs, failed, sequences))


def _top(logprobs: torch.Tensor, failed: set[int], sequences: list[Sequence]) -> dict[int, TopLogprobs]:
    """logprobs: [B, V] -> each asking row's k most likely tokens, most likely first (ties as torch.topk)."""
    rows = [row for row, seq in enumerate(sequences) if seq.params.top_logprobs and row not in failed]
    if not rows:
        return {}
    k = min(max(sequences[row].params.top_logprobs for row in rows), logprobs.shape[-1])
    index = torch.tensor(rows, dtype=torch.long, device=logprobs.device)
    values, ids = logprobs.index_select(0, index).topk(k, dim=-1)  # [R, k] each, sorted descending
    top_ids: list[list[int]] = ids.tolist()
    top_values: list[list[float]] = values.tolist()
    top = {}
    for row, row_ids, row_values in zip(rows, top_ids, top_values, strict=True):
        own = sequences[row].params.top_logprobs
        top[row] = TopLogprobs(row_ids[:own], row_values[:own])
    return top
