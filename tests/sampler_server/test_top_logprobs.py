"""Top-k logprobs of every sampled token (SamplingParams.top_logprobs): the sampling function row by row, then a
real sampler process (its engine in a process of its own) checked against a direct transformers forward of the
same tiny model on the prompt and the sampled prefix, fp32. Rows that do not ask get nothing; a batch mixing
rows that ask for different k (and none) gives each exactly what it asked for."""

from __future__ import annotations

import concurrent.futures
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from samplerutil import TOL, PeftReference, Result, Sample, Sampler, collect, params, prompt, request, run

from opentinker.sampler_server.sampling import sample
from opentinker.sampler_server.sequence import SamplingParams, Sequence
from opentinker.v1 import sampler_pb2

# Unit: sample()


def _seq(index: int, *, top: int, temperature: float = 1.0) -> Sequence:
    seq = Sequence(index, f"r{index}", 0, [1], SamplingParams(temperature=temperature, top_logprobs=top), 0, seed=3)
    seq.generator = torch.Generator().manual_seed(3 + index)
    return seq


@pytest.mark.parametrize("temperature", [0.0, 0.8])  # the all-greedy path and the row-by-row one
def test_each_asking_row_gets_its_own_k_of_one_topk(temperature: float) -> None:
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    logits[3, 5] = math.nan  # a failed row asks too, and gets nothing
    rows = [_seq(i, top=k, temperature=temperature) for i, k in enumerate([3, 0, 20, 4, 1])]
    draw = sample(logits, rows)
    assert draw.failed == {3} and set(draw.top) == {0, 2, 4}
    expected = logits.log_softmax(-1)
    for row, k in ((0, 3), (2, 20), (4, 1)):
        values, ids = expected[row].topk(k)
        top = draw.top[row]
        assert top.token_ids == ids.tolist() and top.logprobs == pytest.approx(values.tolist(), abs=1e-6)
        assert top.logprobs == sorted(top.logprobs, reverse=True)
        if temperature == 0.0:  # greedy: the chosen token ranks first, with the same logprob
            assert top.token_ids[0] == draw.tokens[row] and top.logprobs[0] == draw.logprobs[row]
    alone = sample(logits[[1]], [_seq(1, top=0, temperature=temperature)])
    assert alone.top == {} and alone.tokens == [draw.tokens[1]]  # a row that does not ask: unchanged


def test_k_beyond_the_vocabulary_is_the_whole_vocabulary() -> None:
    logits = torch.randn(1, 8, generator=torch.Generator().manual_seed(2))
    (top,) = sample(logits, [_seq(0, top=20, temperature=0.0)]).top.values()
    assert sorted(top.token_ids) == list(range(8))


# A real sampler process against transformers


@pytest.fixture(scope="module")
def reference_model(tiny_model: Path) -> Any:
    return PeftReference(tiny_model).model(None)


def _reference_logprobs(model: Any, prompt_tokens: list[int], sampled: list[int]) -> torch.Tensor:
    """[len(sampled), V]: log_softmax of the logits at each sampled token's position (temperature 1)."""
    with torch.no_grad():
        logits: torch.Tensor = model(torch.tensor([prompt_tokens + sampled])).logits[0].float()  # [L, V]
    return logits[len(prompt_tokens) - 1 : len(prompt_tokens) - 1 + len(sampled)].log_softmax(-1)


def _assert_top_k(model: Any, prompt_tokens: list[int], got: Sample, k: int) -> None:
    """Each position's k entries are the reference's k most likely tokens and their logprobs (a near-tie within
    the tolerance may order two ids differently: the values are compared, and each id's own logprob)."""
    assert len(got.top_logprobs) == len(got.tokens) >= 1
    reference = _reference_logprobs(model, prompt_tokens, got.tokens)
    for position, top in enumerate(got.top_logprobs):
        ids, values = list(top.token_ids), list(top.logprobs)
        assert len(ids) == len(values) == k and len(set(ids)) == k
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx(reference[position].topk(k).values.tolist(), abs=TOL)
        assert values == pytest.approx(reference[position][ids].tolist(), abs=TOL)
        if got.logprobs and got.tokens[position] in ids:  # the chosen token's entry is its own logprob
            assert values[ids.index(got.tokens[position])] == pytest.approx(got.logprobs[position], abs=1e-6)


def test_greedy_top_logprobs_match_transformers(sampler: Sampler, reference_model: Any) -> None:
    tokens = prompt(70, length=9)
    asked = run(sampler, request("base", tokens, params(max_tokens=10, logprobs=True, top_logprobs=5))).only
    _assert_top_k(reference_model, tokens, asked, 5)
    assert [top.token_ids[0] for top in asked.top_logprobs] == asked.tokens  # greedy: the chosen ranks first
    assert [top.logprobs[0] for top in asked.top_logprobs] == asked.logprobs  # ...with the very same logprob
    plain = run(sampler, request("base", tokens, params(max_tokens=10, logprobs=True))).only
    assert plain.top_logprobs == [] and plain.tokens == asked.tokens and plain.logprobs == asked.logprobs


def test_a_batch_mixing_k_gives_each_row_what_it_asked(sampler: Sampler, reference_model: Any) -> None:
    asks = [0, 2, 7, 20]
    prompts = [prompt(80 + i, length=6 + i) for i in range(len(asks))]

    def sampling(k: int, seed: int) -> sampler_pb2.SampleRequest:
        return request(
            "base",
            prompts[asks.index(k)],
            params(temperature=1.0, seed=seed, max_tokens=8, logprobs=True, top_logprobs=k),
            num_samples=2,
        )

    def sample_k(k: int) -> Result:
        return collect(sampler.Sample(sampling(k, 40 + k), timeout=60))

    alone = {k: sample_k(k) for k in asks}
    with concurrent.futures.ThreadPoolExecutor(len(asks)) as pool:  # at once: rows with and without top-k
        futures = {k: pool.submit(sample_k, k) for k in asks}
        together = {k: f.result() for k, f in futures.items()}
    for k in asks:
        for index in (0, 1):
            got = together[k].samples[index]
            assert got.tokens == alone[k].samples[index].tokens
            assert got.logprobs == pytest.approx(alone[k].samples[index].logprobs, abs=TOL)
            if k == 0:
                assert got.top_logprobs == []
            else:
                _assert_top_k(reference_model, prompts[asks.index(k)], got, k)
