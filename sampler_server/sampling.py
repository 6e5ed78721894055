"""Next-token sampling for a batch: temperature, top-k, top-p, per-sequence seeded generators.

Reported logprobs are the model's own (log_softmax of the raw logits, temperature 1), so that they are
comparable to the trainer's logprobs for importance sampling.
"""

from __future__ import annotations

import torch

from opentinker.sampler_server.sequence import Sequence


def sample(logits: torch.Tensor, sequences: list[Sequence]) -> tuple[list[int], list[float]]:
    """logits: [B, V] float32, one row per sequence -> (token, logprob) per sequence."""
    logprobs = logits.log_softmax(-1)  # [B, V]
    if all(s.params.greedy for s in sequences):
        tokens = logits.argmax(-1)  # [B]
        return tokens.tolist(), logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
    chosen: list[int] = []
    for row, seq in enumerate(sequences):
        params = seq.params
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
        chosen.append(int(torch.multinomial(probs, 1, generator=seq.generator)))
    index = torch.tensor(chosen, dtype=torch.long, device=logits.device)
    return chosen, logprobs.gather(1, index[:, None]).squeeze(1).tolist()
