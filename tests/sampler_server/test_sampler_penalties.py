"""Frequency and presence penalties over gRPC, on a real sampler process: SamplingParams carries them to the engine
(greedy tokens equal a transformers forward with OpenAI's formula applied by hand, and a strong presence penalty
stops a repeat the plain greedy output has), reported logprobs stay the model's own, a penalized request next to
a plain one leaves the plain one's tokens alone, and values outside -2..2 (or not finite) are INVALID_ARGUMENT
naming the field, with nothing served for them."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from samplerutil import TOL, PeftReference, Sampler, collect, max_diff, params, prompt, request, run, score, stats
from trainerutil import assert_status, rpc_error

from opentinker.v1 import sampler_pb2

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> PeftReference:
    return PeftReference(tiny_model)


@pytest.fixture(scope="module")
def oracle(reference: PeftReference) -> Any:
    return reference.model(None)


def penalized_greedy(
    model: Any, eos: int, start: Sequence[int], frequency: float, presence: float, max_tokens: int = MAX_TOKENS
) -> list[int]:
    """OpenAI's definition, by hand in float64: at each step the argmax of logit - count * frequency -
    (count > 0) * presence, counts over the tokens generated so far; ends after an end-of-sequence token."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([[*start, *out]])).logits[0, -1].double()  # [V]
            counts = torch.zeros_like(logits)
            for token in out:
                counts[token] += 1
            token = int((logits - counts * frequency - (counts > 0).double() * presence).argmax())
            out.append(token)
            if token == eos:
                break
    return out


def sample(sampler: Sampler, tokens: Sequence[int], **kw: float) -> list[int]:
    return run(sampler, request("base", tokens, penalized(**kw))).only.tokens


def penalized(frequency: float = 0.0, presence: float = 0.0, **kw: Any) -> sampler_pb2.SamplingParams:
    sampling = params(max_tokens=MAX_TOKENS, **kw)
    sampling.frequency_penalty, sampling.presence_penalty = frequency, presence
    return sampling


@pytest.fixture(scope="module")
def repeating(sampler: Sampler) -> tuple[list[int], list[int]]:
    """A prompt whose plain greedy continuation says some token more than once, and that continuation."""
    for seed in range(40):
        p = prompt(600 + seed)
        plain = sample(sampler, p)
        if max(Counter(plain).values()) >= 2:
            return p, plain
    raise AssertionError("no prompt whose greedy continuation repeats a token")


def test_a_presence_penalty_stops_a_repeat_as_openai_defines_it(
    sampler: Sampler, repeating: tuple[list[int], list[int]], oracle: Any, reference: PeftReference
) -> None:
    p, plain = repeating
    assert plain == penalized_greedy(oracle, reference.eos, p, 0.0, 0.0)  # the oracle agrees without penalties
    repeated = [t for t, n in Counter(plain).items() if n >= 2]
    strong = sample(sampler, p, presence=2.0)
    assert strong == penalized_greedy(oracle, reference.eos, p, 0.0, 2.0)
    assert strong != plain
    assert all(strong.count(t) < plain.count(t) for t in repeated), (plain, strong)
    # The reported logprobs are the model's own, before the penalty: those ComputeLogprobs gives the same tokens.
    streamed = run(sampler, request("base", p, penalized(presence=2.0, logprobs=True))).only
    assert streamed.tokens == strong
    assert max_diff(streamed.logprobs, score(sampler, "base", p + strong)[0][len(p) - 1 :]) < TOL


@pytest.mark.parametrize(("frequency", "presence"), [(1.5, 0.0), (0.7, 0.3), (-2.0, 0.0), (0.0, -2.0), (2.0, 2.0)])
def test_penalties_follow_openais_formula(
    sampler: Sampler,
    repeating: tuple[list[int], list[int]],
    oracle: Any,
    reference: PeftReference,
    frequency: float,
    presence: float,
) -> None:
    p, _ = repeating
    got = sample(sampler, p, frequency=frequency, presence=presence)
    assert got == penalized_greedy(oracle, reference.eos, p, frequency, presence)


def test_a_penalized_request_leaves_its_batch_neighbours_alone(
    sampler: Sampler, repeating: tuple[list[int], list[int]]
) -> None:
    p, plain = repeating
    strong = sample(sampler, p, presence=2.0)
    assert strong != plain  # so that a penalty leaking into (or missing from) a row shows
    # Both streams are open before either is read, so the engine has both to batch (penalties are per row).
    streams = [sampler.Sample(request("base", p, penalized(presence=x)), timeout=60) for x in (2.0, 0.0, 2.0, 0.0)]
    got = [collect(stream).only.tokens for stream in streams]
    assert got == [strong, plain, strong, plain]
    # n > 1: each sample counts its own output only, so every greedy sample is the penalized one alone
    group = run(sampler, request("base", p, penalized(presence=2.0), num_samples=3))
    assert [group.samples[i].tokens for i in range(3)] == [strong] * 3


@pytest.mark.parametrize("field", ["frequency_penalty", "presence_penalty"])
@pytest.mark.parametrize("value", [2.01, -2.5, 100.0, math.nan, math.inf, -math.inf])
def test_out_of_range_penalties_are_invalid_argument(sampler: Sampler, field: str, value: float) -> None:
    before = stats(sampler).tokens_generated
    sampling = params(max_tokens=4)
    setattr(sampling, field, value)

    def call() -> None:
        for _ in sampler.Sample(request("base", [1, 2, 3], sampling), timeout=30):
            pass

    metadata = assert_status(rpc_error(call), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_SAMPLING_PARAMS")
    assert metadata.get("field") == f"sampling_params.{field}", metadata
    assert stats(sampler).tokens_generated == before  # refused before anything was sampled
    # the bounds themselves are served
    setattr(sampling, field, math.copysign(2.0, value))
    assert len(run(sampler, request("base", [1, 2, 3], sampling)).only.tokens) >= 1
