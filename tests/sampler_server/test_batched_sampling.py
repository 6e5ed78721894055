"""The batched sampler (sampling.py): every row's filters in tensor ops, one device-to-host copy per call.

- A seeded row draws the same token alone and inside any mixed batch (greedy, temperatures, top-k, top-p,
  penalties, top logprobs side by side).
- Draws follow the row's filtered distribution: 20,000 seeded rows of one logits row, empirical frequencies
  against temperature + top-k + top-p (+ penalties) computed by hand in float64.
- Frequency and presence penalties follow OpenAI's formula over the sample's own output; the reported logprobs
  stay the model's own.
- `sample()` reads its results back once: a counting patch of every host read of a tensor sees one `tolist`.
"""

from __future__ import annotations

import math

import pytest
import torch

from opentinker.sampler_server.sampling import sample
from opentinker.sampler_server.sequence import SamplingParams, Sequence

VOCAB = 12


def _seq(index: int, seed: int | None = None, output: list[int] | None = None, **params: float) -> Sequence:
    seq = Sequence(index, f"r{index}", 0, [1], SamplingParams(**params), lora_slot=0, seed=seed)  # type: ignore[arg-type]
    if seed is not None:
        seq.generator = torch.Generator().manual_seed(seed)
    seq.output = list(output or [])
    return seq


MIXED = [  # (params, output so far)
    ({"temperature": 0.0}, []),
    ({"temperature": 1.0}, []),
    ({"temperature": 0.6, "top_k": 3}, []),
    ({"temperature": 1.3, "top_p": 0.7}, []),
    ({"temperature": 0.9, "top_k": 5, "top_p": 0.5}, []),
    ({"temperature": 1.0, "frequency_penalty": 1.5, "presence_penalty": 0.5}, [2, 2, 7]),
    ({"temperature": 0.0, "frequency_penalty": 2.0}, [4, 4]),
    ({"temperature": 0.8, "top_logprobs": 3}, []),
]


def test_a_seeded_row_draws_the_same_alone_and_in_a_mixed_batch() -> None:
    logits = torch.randn(len(MIXED), VOCAB, generator=torch.Generator().manual_seed(0))
    for trial in range(20):  # many seeds: a row reading another row's parameters or noise would show
        batch = [_seq(i, 100 * trial + i, out, **p) for i, (p, out) in enumerate(MIXED)]
        together = sample(logits, batch)
        for row, (p, out) in enumerate(MIXED):
            alone = sample(logits[row : row + 1], [_seq(row, 100 * trial + row, out, **p)])
            assert together.tokens[row] == alone.tokens[0], (trial, row)
            assert together.logprobs[row] == pytest.approx(alone.logprobs[0], abs=1e-6)
        assert set(together.top) == {7} and len(together.top[7].token_ids) == 3


def _expected(logits: torch.Tensor, output: list[int], params: SamplingParams) -> torch.Tensor:
    """[V] float64: the distribution a row with these params draws from, step by step as OpenAI and the
    top-k / top-p literature define it."""
    scores = logits.double().clone()
    for token in set(output):
        scores[token] -= output.count(token) * params.frequency_penalty + params.presence_penalty
    scores /= params.temperature
    if params.top_k:
        kth = scores.topk(params.top_k).values[-1]
        scores[scores < kth] = -math.inf
    probs = scores.softmax(-1)
    if params.top_p < 1.0:
        order = probs.argsort(descending=True)
        before = probs[order].cumsum(0) - probs[order]  # mass of the more likely tokens
        probs[order[before >= params.top_p]] = 0.0
        probs /= probs.sum()
    return probs


@pytest.mark.parametrize(
    ("params", "output"),
    [
        (SamplingParams(temperature=1.0), []),
        (SamplingParams(temperature=0.7, top_k=4), []),
        (SamplingParams(temperature=1.2, top_p=0.6), []),
        (SamplingParams(temperature=0.9, top_k=6, top_p=0.8), []),
        (SamplingParams(temperature=1.0, frequency_penalty=0.8, presence_penalty=0.4), [0, 0, 3, 5]),
    ],
    ids=["plain", "top_k", "top_p", "top_k+top_p", "penalties"],
)
def test_draws_follow_the_rows_filtered_distribution(params: SamplingParams, output: list[int]) -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3)) * 1.5
    expected = _expected(logits[0], output, params)
    n = 20_000
    rows = []
    for i in range(n):
        seq = Sequence(i, f"r{i}", 0, [1], params, lora_slot=0, seed=i)
        seq.generator = torch.Generator().manual_seed(i)
        seq.output = list(output)
        rows.append(seq)
    draw = sample(logits.expand(n, VOCAB).contiguous(), rows)
    counts = torch.bincount(torch.tensor(draw.tokens), minlength=VOCAB).double()
    assert all(counts[t] == 0 for t in range(VOCAB) if expected[t] == 0), "a filtered-out token was drawn"
    sigma = (n * expected * (1 - expected)).sqrt()
    assert ((counts - n * expected).abs() <= 5 * sigma + 1).all(), (counts / n, expected)
    lp = logits[0].log_softmax(-1)
    assert all(draw.logprobs[i] == pytest.approx(float(lp[t]), abs=1e-5) for i, t in enumerate(draw.tokens[:50]))


def test_penalties_change_the_choice_not_the_reported_logprobs() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.5, 1.0]])
    plain = sample(logits, [_seq(0, temperature=0.0)])
    assert plain.tokens == [1]
    # token 1 generated twice: 3.0 - 2 * 0.4 - 0.1 = 2.1 < 2.5, so the greedy choice moves to token 2
    penalized = sample(logits, [_seq(0, output=[1, 1], temperature=0.0, frequency_penalty=0.4, presence_penalty=0.1)])
    assert penalized.tokens == [2]
    assert penalized.logprobs[0] == pytest.approx(float(logits[0].log_softmax(-1)[2]), abs=1e-6)
    # a negative presence penalty favours what was said
    favoured = sample(logits, [_seq(0, output=[3], temperature=0.0, presence_penalty=-2.5)])
    assert favoured.tokens == [3]


def test_sample_reads_the_device_once(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[str] = []
    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *args: object, _name: str = name, _original: object = original) -> object:
            reads.append(_name)
            return _original(self, *args)  # type: ignore[operator]

        monkeypatch.setattr(torch.Tensor, name, counted)
    logits = torch.randn(len(MIXED), VOCAB, generator=torch.Generator().manual_seed(0))
    logits[3, 2] = math.nan
    batch = [_seq(i, 10 + i, out, **p) for i, (p, out) in enumerate(MIXED)]
    draw = sample(logits, batch)
    assert reads == ["tolist"], reads
    assert draw.failed == {3} and len(draw.tokens) == len(MIXED)
