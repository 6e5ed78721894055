"""The logprobs oracle of the /v1 tests: at each sampled position, the k most likely tokens and their logprobs in a
direct transformers forward of the same weights, and the assertions comparing a reply's top_logprobs with it."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from chatutil import extra


def top_k(model: Any, prompt: list[int], sampled: list[int], k: int) -> list[tuple[list[int], list[float]]]:
    """The oracle: at each sampled token's position, the k most likely ids and their logprobs (log_softmax of the
    logits at temperature 1) in a direct transformers forward of the prompt and the sampled prefix, fp32."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + sampled])).logits[0].float()  # [L, V]
    positions = logits[len(prompt) - 1 : len(prompt) - 1 + len(sampled)].log_softmax(-1)  # [T, V]
    values, ids = positions.topk(k, dim=-1)
    return list(zip(ids.tolist(), values.tolist(), strict=True))


def assert_alternatives(
    entries: list[Any], expected: list[tuple[list[int], list[float]]], tokenizer: Any, k: int
) -> None:
    """Each chat logprobs entry's top_logprobs: the oracle's k most likely tokens, in its order, its logprobs."""
    assert len(entries) == len(expected)
    for entry, (ids, values) in zip(entries, expected, strict=True):
        top = entry.top_logprobs
        assert len(top) == k
        assert [t.logprob for t in top] == pytest.approx(values, abs=1e-4)
        assert [t.token for t in top] == [tokenizer.decode([i]) for i in ids]
        assert all(t.bytes == list(t.token.encode()) for t in top)
        if entry.token in [t.token for t in top]:  # the chosen token's entry is its own logprob
            assert next(t.logprob for t in top if t.token == entry.token) == pytest.approx(entry.logprob, abs=1e-6)


def assert_same_alternatives(entries: list[Any], expected: list[Any]) -> None:
    """Chat logprobs entries with the top_logprobs of ``expected``: the same tokens, the same logprobs."""
    assert [[t.token for t in e.top_logprobs] for e in entries] == [[t.token for t in e.top_logprobs] for e in expected]
    assert [t.logprob for e in entries for t in e.top_logprobs] == pytest.approx(
        [t.logprob for e in expected for t in e.top_logprobs], abs=1e-5
    )


def _completion_tops(expected: list[tuple[list[int], list[float]]], tokenizer: Any) -> list[dict[str, float]]:
    """OpenAI's completions form of the oracle under greedy decoding (the chosen token ranks first, so it is in):
    per position {token: logprob} of the k most likely, the likelier of two ids with one text kept."""
    tops = []
    for ids, values in expected:
        ranked: dict[str, float] = {}
        for token_id, logprob in zip(ids, values, strict=True):
            ranked.setdefault(tokenizer.decode([token_id]), logprob)
        tops.append(ranked)
    return tops


def assert_completion_alternatives(
    client: openai.OpenAI,
    body: dict[str, Any],
    tokens: list[int],
    expected: list[tuple[list[int], list[float]]],
    tokenizer: Any,
    chosen: list[float],
) -> None:
    """The completions ``body`` with logprobs=3, streamed and not: the same ``tokens``, at each position the 3 most
    likely of the oracle's ``expected`` as a {token: logprob} dict; with logprobs=0: no top_logprobs, the ``chosen``
    tokens' logprobs."""
    legacy = client.completions.create(**body, logprobs=3)
    assert extra(legacy.choices[0], "token_ids") == tokens
    tops = legacy.choices[0].logprobs.top_logprobs
    oracle = _completion_tops(expected, tokenizer)
    assert tops is not None and [list(t) for t in tops] == [list(t) for t in oracle]
    assert [v for t in tops for v in t.values()] == pytest.approx([v for t in oracle for v in t.values()], abs=1e-4)
    chunks_text = list(client.completions.create(**body, logprobs=3, stream=True))
    streamed_tops = [
        t for c in chunks_text if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.top_logprobs or []
    ]
    assert [list(t) for t in streamed_tops] == [list(t) for t in tops]
    zero = client.completions.create(**body, logprobs=0)
    assert zero.choices[0].logprobs is not None and zero.choices[0].logprobs.top_logprobs is None
    assert zero.choices[0].logprobs.token_logprobs == pytest.approx(chosen, abs=1e-5)
