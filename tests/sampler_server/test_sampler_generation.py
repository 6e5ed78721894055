"""Generation through real trainer, registry and sampler processes: a batch mixing 8 adapter versions matches
each adapter alone in peft, sampler and trainer logprobs agree, a request stays pinned to the version it
resolved while `latest` moves, seeds reproduce, stop conditions stop, new requests join a running batch,
and cancelled streams release everything they held."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from samplerutil import (
    TOL,
    PeftReference,
    Result,
    Sampler,
    artifact_path,
    collect,
    greedy,
    loaded,
    max_diff,
    params,
    prompt,
    request,
    run,
    score,
    snapshot,
    stats,
    train,
    trained_adapter,
    wait_until,
)
from serverproc import ServerProcess, registry_store
from trainerutil import Trainer, forward, logprobs, sft_datum

from opentinker.v1 import registry_pb2, sampler_pb2

NUM_ADAPTERS = 8
RANKS = (2, 4, 8, 16)


@dataclass(frozen=True)
class Adapter:
    name: str
    version: registry_pb2.Version
    artifact: Path

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version.version}"


@pytest.fixture(scope="module")
def adapters(trainer: Trainer, registry_server: ServerProcess) -> list[Adapter]:
    """8 adapters of different ranks, alphas, seeds and data, each published once (version 1)."""
    store = registry_store(registry_server)
    out = []
    for i in range(NUM_ADAPTERS):
        name, version = trained_adapter(trainer, seed=i + 1, rank=RANKS[i % len(RANKS)], alpha=8.0 * (1 + i % 3))
        out.append(Adapter(name, version, artifact_path(store, version)))
    return out


@pytest.fixture(scope="module")
def peft_ref(tiny_model: Path) -> PeftReference:
    return PeftReference(tiny_model)


def test_mixed_batch_matches_each_adapter_alone_in_peft(
    sampler: Sampler, adapters: list[Adapter], peft_ref: PeftReference
) -> None:
    for adapter in adapters:  # resident first, so that the requests below start together
        sampler.LoadAdapter(sampler_pb2.LoadAdapterRequest(reference=adapter.ref))
    max_tokens = 24
    prompts = [prompt(i, length=5 + i) for i in range(NUM_ADAPTERS)]
    barrier = threading.Barrier(NUM_ADAPTERS)
    first_at: dict[int, float] = {}

    def one(i: int) -> Result:
        req = request(adapters[i].ref, prompts[i], params(max_tokens=max_tokens, logprobs=True))
        barrier.wait()
        stream = sampler.Sample(req, timeout=60)
        first = next(stream)
        first_at[i] = time.monotonic()
        return collect(stream, first)

    with concurrent.futures.ThreadPoolExecutor(NUM_ADAPTERS) as pool:
        results = list(pool.map(one, range(NUM_ADAPTERS)))
    # All 8 were in flight together: every stream had started before the first one finished.
    assert max(first_at.values()) < min(r.finished_at for r in results)
    outputs = [r.only.tokens for r in results]
    assert len({tuple(t) for t in outputs}) >= NUM_ADAPTERS - 1, outputs  # the adapters really differ
    for adapter, p, result in zip(adapters, prompts, results, strict=True):
        sample = result.only
        assert set(result.versions) == {(adapter.name, 1)}
        model = peft_ref.model(adapter.artifact)
        expected = peft_ref.greedy(model, p, max_tokens)
        assert sample.tokens == expected, (adapter.ref, sample.tokens, expected)
        reference = peft_ref.logprobs(model, p + sample.tokens)
        (scored,) = score(sampler, adapter.ref, p + sample.tokens)
        assert max_diff(scored, reference) <= TOL
        assert max_diff(sample.logprobs, reference[len(p) - 1 :]) <= TOL  # streamed logprobs too
    # The base model in the same kind of batch is the base model.
    base = peft_ref.model(None)
    assert greedy(sampler, "base", prompts[0], max_tokens) == peft_ref.greedy(base, prompts[0], max_tokens)


def test_trainer_and_sampler_logprobs_agree(trainer: Trainer, sampler: Sampler, adapters: list[Adapter]) -> None:
    for i, adapter in enumerate(adapters[:4]):  # ranks 2, 4, 8, 16
        tokens = prompt(100 + i, length=20)
        trained = logprobs(forward(trainer, adapter.name, [sft_datum(tokens)]))[0]
        (sampled,) = score(sampler, adapter.ref, tokens)
        assert max_diff(trained, sampled) <= TOL, adapter.ref


def test_request_stays_pinned_to_its_version_while_latest_moves(trainer: Trainer, sampler: Sampler) -> None:
    name, _ = trained_adapter(trainer, seed=50)
    train(trainer, name, seed=51, steps=3)  # the trainer now holds version 2's weights, not yet published
    p = prompt(50)
    max_tokens = 1000
    stream = sampler.Sample(request(name, p, params(max_tokens=max_tokens)), timeout=60)
    first = next(stream)
    assert (first.version.adapter, first.version.version) == (name, 1)
    assert snapshot(trainer, name).version == 2  # latest -> 2 mid-generation
    # The long request was still running when latest moved, holding version 1.
    held = loaded(sampler)
    assert f"{name}@1" in held and held[f"{name}@1"].active_requests >= 1
    result = collect(stream, first)
    assert set(result.versions) == {(name, 1)} and len(result.versions) > 1
    assert result.only.tokens == greedy(sampler, f"{name}@1", p, max_tokens)
    after = run(sampler, request(name, p, params(max_tokens=20)))
    assert set(after.versions) == {(name, 2)}
    assert after.only.tokens == greedy(sampler, f"{name}@2", p, 20)
    assert after.only.tokens != result.only.tokens[:20]  # version 2 really is other weights


def test_seeds_reproduce(sampler: Sampler, adapters: list[Adapter]) -> None:
    model, p = adapters[0].ref, prompt(7)

    def draw(seed: int, n: int = 1, **kw: float) -> list[list[int]]:
        sampling = params(temperature=1.0, max_tokens=24, seed=seed, **kw)  # type: ignore[arg-type]
        result = run(sampler, request(model, p, sampling, num_samples=n))
        assert sorted(result.samples) == list(range(n))
        return [result.samples[i].tokens for i in range(n)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)
    group = draw(7, n=4)
    assert len({tuple(t) for t in group}) == 4  # the samples of one request differ from each other...
    assert draw(7, n=4) == group  # ...and reproduce as a set
    assert draw(3, top_k=40, top_p=0.9) == draw(3, top_k=40, top_p=0.9)
    # top_k=1 (or a tiny top_p) leaves only the argmax, whatever the temperature and seed.
    assert draw(5, top_k=1) == [greedy(sampler, model, p, 24)]
    assert draw(6, top_p=1e-6) == [greedy(sampler, model, p, 24)]


def test_stop_conditions(sampler: Sampler, peft_ref: PeftReference) -> None:
    tokenizer = peft_ref.tokenizer
    p = prompt(1)
    full = run(sampler, request("base", p, params(max_tokens=12)))
    tokens = full.only.tokens
    assert full.only.stop_reason == sampler_pb2.STOP_REASON_LENGTH and len(tokens) == 12
    assert peft_ref.eos not in tokens
    assert full.only.text == tokenizer.decode(tokens, skip_special_tokens=True)

    # A stop string: the text token k adds, where it first appears.
    def text(n: int) -> str:
        return str(tokenizer.decode(tokens[:n], skip_special_tokens=True))

    k = next(
        k
        for k in range(2, 11)
        if (added := text(k + 1)[len(text(k)) :]).strip() and "\ufffd" not in text(k + 1) and added not in text(k)
    )
    stop = text(k + 1)[len(text(k)) :]
    stopped = run(sampler, request("base", p, params(max_tokens=12, stop_strings=[stop]))).only
    assert stopped.stop_reason == sampler_pb2.STOP_REASON_STOP_STRING
    assert stopped.tokens == tokens[: k + 1] and stopped.text.endswith(stop)

    # A stop token id: generation ends with it, included.
    j = next(j for j in range(2, 11) if tokens[j] not in tokens[:j])
    stopped = run(sampler, request("base", p, params(max_tokens=12, stop_token_ids=[tokens[j]]))).only
    assert stopped.stop_reason == sampler_pb2.STOP_REASON_STOP_TOKEN and stopped.tokens == tokens[: j + 1]

    # The model's own end-of-sequence token stops too (a prompt whose greedy path reaches it).
    for seed in range(20):
        eos_run = run(sampler, request("base", prompt(seed), params(max_tokens=200))).only
        if eos_run.stop_reason == sampler_pb2.STOP_REASON_STOP_TOKEN:
            assert eos_run.tokens[-1] == peft_ref.eos and peft_ref.eos not in eos_run.tokens[:-1]
            break
    else:
        pytest.fail("no prompt reached end-of-sequence")


def test_logprobs_and_prompt_logprobs(sampler: Sampler, adapters: list[Adapter]) -> None:
    model, p = adapters[1].ref, prompt(9, length=11)
    result = run(sampler, request(model, p, params(max_tokens=10, logprobs=True), prompt_logprobs=True))
    sample = result.only
    assert len(sample.logprobs) == len(sample.tokens) == 10
    assert len(sample.prompt_logprobs) == len(p) - 1
    (scored,) = score(sampler, model, p + sample.tokens)
    assert max_diff(sample.prompt_logprobs, scored[: len(p) - 1]) <= TOL
    assert max_diff(sample.logprobs, scored[len(p) - 1 :]) <= TOL
    # Not asked: not sent.
    plain = run(sampler, request(model, p, params(max_tokens=10))).only
    assert plain.logprobs == [] and plain.prompt_logprobs == [] and plain.tokens == sample.tokens
    # With several samples, each one's first message carries them.
    sampling = params(temperature=1.0, max_tokens=5, seed=1, logprobs=True)
    multi = run(sampler, request(model, p, sampling, num_samples=3, prompt_logprobs=True))
    for s in multi.samples.values():
        assert max_diff(s.prompt_logprobs, scored[: len(p) - 1]) <= TOL and len(s.logprobs) == len(s.tokens)
    # A one-token prompt has no prompt logprobs; it still generates.
    one = run(sampler, request(model, p[:1], params(max_tokens=3), prompt_logprobs=True)).only
    assert one.prompt_logprobs == [] and len(one.tokens) == 3


def test_requests_join_a_running_batch(sampler: Sampler, adapters: list[Adapter]) -> None:
    long_req = request(adapters[2].ref, prompt(20), params(max_tokens=1200))
    solo = run(sampler, long_req).only.tokens
    shorts = [request(a.ref, prompt(30 + i), params(max_tokens=16)) for i, a in enumerate(adapters[3:])]
    shorts.append(request("base", prompt(40), params(max_tokens=16)))
    expected = [run(sampler, r).only.tokens for r in shorts]
    stream = sampler.Sample(long_req, timeout=60)
    first = next(stream)
    with concurrent.futures.ThreadPoolExecutor(len(shorts) + 1) as pool:
        long_future = pool.submit(collect, stream, first)
        results = list(pool.map(lambda r: run(sampler, r), shorts))
        long_result = long_future.result()
    assert [r.only.tokens for r in results] == expected
    # They finished while the long one was still generating: nobody waited for the batch to drain.
    assert max(r.finished_at for r in results) < long_result.finished_at
    assert long_result.only.tokens == solo


def test_cancelled_streams_release_everything(sampler: Sampler, adapters: list[Adapter]) -> None:
    streams = []
    for i in range(20):
        model = adapters[i % 4].ref if i % 5 else "base"
        sampling = params(temperature=1.0, max_tokens=1500, seed=i) if i % 2 else params(max_tokens=1500)
        stream = sampler.Sample(request(model, prompt(60 + i), sampling, num_samples=1 + i % 3), timeout=60)
        next(stream)
        streams.append(stream)
    for stream in streams:
        stream.cancel()
    for stream in streams:
        with pytest.raises(grpc.RpcError) as caught:
            for _ in stream:
                pass
        assert caught.value.code() == grpc.StatusCode.CANCELLED

    def idle() -> bool:
        current = stats(sampler)
        return (
            current.running_requests == 0
            and current.waiting_requests == 0
            and all(a.active_requests == 0 for a in loaded(sampler).values())
        )

    assert wait_until(idle, timeout=5.0), (stats(sampler), loaded(sampler))
    # The server still serves, with the same answers as before.
    p = prompt(3)
    assert greedy(sampler, adapters[0].ref, p) == greedy(sampler, adapters[0].ref, p)
    assert run(sampler, request(adapters[1].ref, p, params(max_tokens=5))).only.stop_reason == (
        sampler_pb2.STOP_REASON_LENGTH
    )


def test_streamed_text_adds_up_to_the_decoded_tokens(sampler: Sampler, peft_ref: PeftReference) -> None:
    """Random tokens split multi-byte characters across tokens: the text deltas still add up to the decoded output."""
    sampling = params(temperature=1.0, max_tokens=100, seed=11)
    result = run(sampler, request("base", prompt(11), sampling, num_samples=32))
    decoded = [peft_ref.tokenizer.decode(s.tokens, skip_special_tokens=True) for s in result.samples.values()]
    assert sum("\ufffd" in text for text in decoded) >= 8  # the case is exercised: bytes that are no character
    for sample, text in zip(result.samples.values(), decoded, strict=True):
        assert sample.text == text, sample.tokens


def test_sampling_filters_and_reported_logprobs(sampler: Sampler, peft_ref: PeftReference) -> None:
    """top_k / top_p keep only the tokens they should; reported logprobs are the model's own, whatever the
    temperature (what importance sampling against the trainer needs)."""
    p = prompt(12)
    with torch.no_grad():
        logits = peft_ref.model(None)(torch.tensor([p])).logits[0, -1].float()  # [V]
    probs = logits.softmax(-1)
    order = probs.argsort(descending=True).tolist()
    top_p = float(probs[order[:2]].sum() + probs[order[2]] / 2)  # the smallest prefix reaching it: the top 3

    def firsts(**kw: float) -> set[int]:
        sampling = params(max_tokens=1, seed=1, logprobs=True, **kw)  # type: ignore[arg-type]
        result = run(sampler, request("base", p, sampling, num_samples=64))
        for sample in result.samples.values():  # temperature changes the choice, never the reported logprob
            assert abs(sample.logprobs[0] - float(logits.log_softmax(-1)[sample.tokens[0]])) <= TOL
        return {s.tokens[0] for s in result.samples.values()}

    assert firsts(temperature=1.0, top_k=3) <= set(order[:3])
    assert firsts(temperature=1.0, top_p=top_p) <= set(order[:3])
    assert firsts(temperature=5.0, top_k=2) <= set(order[:2])
    assert len(firsts(temperature=5.0)) > 10  # unfiltered at a high temperature: many different tokens


def test_sampler_info(sampler: Sampler) -> None:
    info: sampler_pb2.GetSamplerInfoResponse = sampler.GetSamplerInfo(sampler_pb2.GetSamplerInfoRequest())
    assert (info.max_slots, info.base_model.vocab_size, info.base_model.architecture) == (8, 512, "qwen2")
    assert info.lora_kernel in ("segments", "triton", "reference") and info.max_rank >= 16
