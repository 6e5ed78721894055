"""Next-token sampling for the whole batch in tensor ops, one device-to-host copy per step.

    logits [B, V] --penalties--> scores --/ temperature, top-k, top-p--> probs --argmax(probs / E)--> tokens
    logits --logit - logsumexp--> reported logprobs (and the top-k of the rows that ask, by the same formula)
    tokens, their logprobs, the rows that failed and the top logprobs: one packed tensor, one copy to the host

Every row has its own parameters, and the batch mixes them freely (greedy and sampled rows, different
temperatures, top-k, top-p and penalties): each is a [B] tensor, and a filter no row uses costs nothing. The draw
is the exponential race, argmax(p / E) with E ~ Exp(1) per token, exactly a draw from p and what torch.multinomial
does for one sample: a seeded row's noise comes from its own CPU generator (drawn on the host, no device work and
no sync), so a seeded sample draws the same tokens whatever else shares its batch and whatever the device, the
same tokens the row-by-row multinomial drew before; the [B, V] noise goes to the device in one copy. (An inverse
CDF from one uniform per row was tried: right in distribution, but with a seed reused across RL iterations every
iteration's draws are coupled monotonically, and tests/client/test_loops.py's policy stopped learning.)

Frequency and presence penalties follow OpenAI's definition over the tokens the sample generated so far:
score[t] = logit[t] - count[t] * frequency_penalty - (count[t] > 0) * presence_penalty, before the temperature;
greedy rows take the argmax of the penalized scores.

Reported logprobs are the model's own (the log-softmax of the raw logits, temperature 1, before penalties, top-k and
top-p), so that they are comparable to the trainer's logprobs for importance sampling. A row whose params ask for
`top_logprobs` also gets its position's most likely tokens in that same sense: one topk over the rows that ask,
at the largest k asked, each row keeping its own k. A constrained row's (grammar_masks.py) are of the masked,
renormalized distribution instead, and its top tokens are only ones its grammar allowed.

A row whose logits are not finite (an adapter whose delta overflowed the residual stream), or whose
probabilities are not after the temperature (finite logits that overflow when divided by it), draws no token:
its index is reported in `Draw.failed` and the other rows are sampled as if it were not there. One tenant's
adapter must not fail the batch it shares with every other tenant. The check is one fused reduction over the
batch, read back with the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opentinker.sampler_server.grammar_masks import StepMasks, apply_masks
from opentinker.sampler_server.sequence import SamplingParams, Sequence, TopLogprobs


@dataclass(frozen=True, slots=True)
class Draw:
    tokens: list[int]  # one per row; 0 for a failed row
    logprobs: list[float]  # one per row; NaN for a failed row
    failed: frozenset[int]  # rows that drew nothing: their logits or probabilities are not finite
    top: dict[int, TopLogprobs]  # row -> its most likely tokens, for the rows that asked (and did not fail)


def sample(logits: torch.Tensor, sequences: list[Sequence], masks: StepMasks | None = None) -> Draw:
    """logits: [B, V] float32, one row per sequence -> (token, logprob) per sequence, and the rows that failed.
    A constrained row (masks) samples among its grammar's tokens, and its logprobs are of that masked,
    renormalized distribution: what it was actually drawn from."""
    params = [seq.params for seq in sequences]
    device = logits.device
    # A row is finite iff its max and min are (NaN propagates through both): two cheap reductions, where
    # isfinite().all() writes a [B, V] mask first (1 ms a step for 32 rows of 8k on this CPU).
    ok = logits.amax(-1).isfinite() & logits.amin(-1).isfinite()  # [B], of the model's logits before any mask
    logits = apply_masks(logits, masks)  # [B, V]
    scores = _penalized(logits, sequences)  # [B, V]
    if all(p.greedy for p in params):
        tokens = scores.argmax(-1)  # [B]
    else:
        greedy = torch.tensor([p.greedy for p in params], device=device)  # [B] bool
        temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=device)
        filtered = _top_p(_top_k(scores / temperature[:, None], params), params)  # [B, V]
        probs = filtered.softmax(-1)  # [B, V]
        ok &= greedy | probs.amax(-1).isfinite()  # finite logits that overflowed once divided by the temperature
        drawn = (probs / _exponentials(sequences, probs.shape[-1]).to(device)).argmax(-1)  # [B]: exponential race
        tokens = torch.where(greedy, scores.argmax(-1), drawn)
    # The model's own logprob of each chosen token: logit - logsumexp, without writing the [B, V] log_softmax.
    lse = logits.logsumexp(-1)  # [B]
    chosen = logits.gather(1, tokens[:, None]).squeeze(1) - lse  # [B]
    asking = [row for row, p in enumerate(params) if p.top_logprobs]
    k = min(max((params[row].top_logprobs for row in asking), default=0), logits.shape[-1])
    parts = [tokens.double(), chosen.double(), ok.double()]
    if asking:
        index = torch.tensor(asking, dtype=torch.long, device=device)
        values, ids = logits.index_select(0, index).topk(k, dim=-1)  # [R, k] each, descending
        values = values - lse.index_select(0, index)[:, None]  # the same formula as `chosen`, so they agree exactly
        parts += [ids.double().flatten(), values.double().flatten()]
    host: list[float] = torch.cat(parts).tolist()  # the step's one device-to-host copy
    b = len(sequences)
    failed = frozenset(row for row in range(b) if not host[2 * b + row])
    token_ids = [0 if row in failed else int(host[row]) for row in range(b)]
    picked = [float("nan") if row in failed else host[b + row] for row in range(b)]
    top: dict[int, TopLogprobs] = {}
    offset = 3 * b
    for i, row in enumerate(asking):
        if row in failed:
            continue
        own = min(params[row].top_logprobs, k)
        ids_at, values_at = offset + i * k, offset + len(asking) * k + i * k
        kept = [v for v in host[values_at : values_at + own] if v != float("-inf")]  # not a grammar's masked tokens
        top[row] = TopLogprobs([int(t) for t in host[ids_at : ids_at + len(kept)]], kept)
    return Draw(token_ids, picked, failed, top)


def _penalized(logits: torch.Tensor, sequences: list[Sequence]) -> torch.Tensor:
    """logits: [B, V] -> the scores after each row's frequency and presence penalties over its output so far; the
    logits themselves when no row has a penalty."""
    rows = [row for row, seq in enumerate(sequences) if seq.params.penalized and seq.output]
    if not rows:
        return logits
    b, vocab = logits.shape
    flat: list[int] = []  # row * V + token for every output token of a penalized row
    for row in rows:
        flat.extend(row * vocab + token for token in sequences[row].output)
    counts = torch.zeros(b * vocab, dtype=logits.dtype, device=logits.device)
    counts.index_add_(
        0,
        torch.tensor(flat, dtype=torch.long, device=logits.device),
        torch.ones(len(flat), dtype=logits.dtype, device=logits.device),
    )
    counts = counts.view(b, vocab)  # [B, V] times each token was generated
    frequency = torch.tensor([s.params.frequency_penalty for s in sequences], device=logits.device)  # [B]
    presence = torch.tensor([s.params.presence_penalty for s in sequences], device=logits.device)  # [B]
    return logits - counts * frequency[:, None] - (counts > 0).to(logits.dtype) * presence[:, None]


def _top_k(scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """scores: [B, V] -> the same with everything below each row's k-th largest score at -inf (k 0: all kept)."""
    vocab = scores.shape[-1]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if not any(ks):
        return scores
    kth = scores.topk(max(ks), dim=-1).values  # [B, kmax], descending
    index = torch.tensor([max(k, 1) - 1 for k in ks], dtype=torch.long, device=scores.device)
    threshold = kth.gather(1, index[:, None])  # [B, 1]
    unlimited = torch.tensor([k == 0 for k in ks], device=scores.device)[:, None]
    return scores.masked_fill(~unlimited & (scores < threshold), float("-inf"))


def _top_p(scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """scores: [B, V] -> each row keeps the smallest set of most likely tokens whose probability reaches its
    top_p (the rest at -inf); rows with top_p 1 are untouched."""
    rows = [row for row, p in enumerate(params) if 0.0 < p.top_p < 1.0]
    if not rows:
        return scores
    index = torch.tensor(rows, dtype=torch.long, device=scores.device)
    top_p = torch.tensor([params[row].top_p for row in rows], device=scores.device)[:, None]  # [R, 1]
    ordered, order = scores.index_select(0, index).sort(dim=-1, descending=True)  # [R, V]
    probs = ordered.softmax(-1)
    drop = probs.cumsum(-1) - probs >= top_p  # [R, V]: the mass before this token already reaches top_p
    kept = torch.empty_like(ordered).scatter_(1, order, ordered.masked_fill(drop, float("-inf")))
    out = scores.clone()
    out[index] = kept
    return out


def _exponentials(sequences: list[Sequence], vocab: int) -> torch.Tensor:
    """[B, V] Exp(1) noise: each seeded row's from its own generator, the others' from torch's default one.
    argmax(p / E) is a draw from p (the exponential race, which torch.multinomial itself uses for one sample), and
    it draws from a row's generator exactly what torch.multinomial(p, 1, generator=g) did, so seeded samples keep
    the tokens they drew before sampling was batched."""
    noise = torch.empty(len(sequences), vocab).exponential_()
    for row, seq in enumerate(sequences):
        if seq.generator is not None and not seq.params.greedy:
            noise[row].exponential_(generator=seq.generator)
    return noise
