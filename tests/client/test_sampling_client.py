"""The sampling SDK (SamplingClient, ServiceClient.create_sampling_client and the sampling types) against the
session sampler, with a snapshot trained on the session trainer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import aclosing, closing
from dataclasses import dataclass, replace

import grpc
import pytest
from registryutil import unique_name
from samplerutil import wait_until
from serverproc import ServerProcess
from trainerutil import Trainer, create, lora, sft_batch, train_step

from opentinker.client import (
    ModelInput,
    OpenTinkerError,
    SampleChunk,
    SampledVersion,
    SampleResult,
    SamplingClient,
    SamplingParams,
    ServiceClient,
)
from opentinker.client.wire import sampling_params_to_proto
from opentinker.v1 import trainer_pb2

PROMPT = (17, 3, 250, 99, 41, 7)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
TOL = 1e-4


@dataclass(frozen=True)
class Snapshot:
    name: str
    version: int
    sha256: str


@pytest.fixture(scope="module")
def snapshot(trainer: Trainer) -> Snapshot:
    """A fresh adapter, trained 2 steps (so its output differs from the base model's) and published."""
    name = unique_name("sdk-sample")
    create(trainer, name, config=lora(rank=4), seed=3)
    for seed in range(2):
        train_step(trainer, name, sft_batch(seed))
    response: trainer_pb2.SaveSnapshotResponse = trainer.SaveSnapshot(trainer_pb2.SaveSnapshotRequest(adapter=name))
    return Snapshot(name, response.version.version, response.version.artifact_sha256)


@pytest.fixture(scope="module")
def service(sampler_server: ServerProcess) -> Iterator[ServiceClient]:
    # No tokens file on the session servers: any token is accepted (and must not disturb the calls).
    with ServiceClient(sampler=sampler_server.address, token="unused-token") as client:
        yield client


@pytest.fixture(scope="module")
def base(service: ServiceClient) -> SamplingClient:
    return service.create_sampling_client("base")


@pytest.fixture(scope="module")
def tuned(service: ServiceClient, snapshot: Snapshot) -> SamplingClient:
    return service.create_sampling_client(snapshot.name)


def expect_error(code: grpc.StatusCode, reason: str | None, fn: object, *args: object, **kwargs: object) -> None:
    with pytest.raises(OpenTinkerError) as caught:
        fn(*args, **kwargs)  # type: ignore[operator]
    assert caught.value.code == code, str(caught.value)
    if reason is not None:
        assert caught.value.reason == reason, str(caught.value)


def max_diff(a: Sequence[float], b: Sequence[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


# Types (no server)


def test_sampling_params_defaults_and_wire() -> None:
    params = SamplingParams()
    assert (params.max_tokens, params.temperature, params.top_k, params.top_p) == (16, 1.0, 0, 1.0)
    assert (params.seed, params.stop, params.stop_token_ids, params.logprobs) == (None, (), (), True)
    assert params.top_logprobs == 0
    wire = sampling_params_to_proto(params)
    assert wire.HasField("temperature") and not wire.HasField("seed") and wire.logprobs and wire.top_logprobs == 0
    assert sampling_params_to_proto(SamplingParams(top_logprobs=5)).top_logprobs == 5
    custom = SamplingParams(max_tokens=3, temperature=0.0, seed=7, stop=["\n", "END"], stop_token_ids=[5])
    wire = sampling_params_to_proto(custom)
    assert wire.HasField("temperature") and wire.temperature == 0.0  # greedy survives proto3's zero default
    assert (wire.seed, list(wire.stop_strings), list(wire.stop_token_ids)) == (7, ["\n", "END"], [5])
    assert custom.stop == ("\n", "END") and custom.stop_token_ids == (5,)
    assert SamplingParams(stop="\n").stop == ("\n",)  # a single string is one stop string
    assert replace(custom, max_tokens=5) == SamplingParams(5, 0.0, seed=7, stop=("\n", "END"), stop_token_ids=(5,))
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)  # the wire would read 0 as "default"
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(top_logprobs=-1)  # uint32 on the wire
    with pytest.raises(TypeError):
        SamplingParams(stop_token_ids=[1.5])  # type: ignore[list-item]
    assert SampledVersion("a/b", 3, "a/b@stable", "ab").exact == "a/b@3"
    assert SampledVersion("", 0, "base", "").exact == "base"


def test_penalties_and_top_p_zero_on_the_wire() -> None:
    params = SamplingParams()
    assert (params.frequency_penalty, params.presence_penalty) == (0.0, 0.0)
    wire = sampling_params_to_proto(SamplingParams(frequency_penalty=0.5, presence_penalty=-1.25))
    assert (wire.frequency_penalty, wire.presence_penalty) == (0.5, -1.25)
    # top_p 0 is greedy: the wire would read it as "off", so it goes out as temperature 0 (and so does a top_p
    # that float32 rounds to 0); any other top_p keeps the temperature.
    for tiny in (0.0, 1e-50):
        zero = sampling_params_to_proto(SamplingParams(temperature=0.9, top_p=tiny))
        assert zero.HasField("temperature") and zero.temperature == 0.0, tiny
    assert sampling_params_to_proto(SamplingParams(temperature=0.5, top_p=0.5)).temperature == 0.5


def test_create_sampling_client_needs_a_sampler_address() -> None:
    with ServiceClient(trainer="127.0.0.1:1") as service, pytest.raises(ValueError, match="sampler"):
        service.create_sampling_client("base")


# Sampling


def check_result(result: SampleResult, count: int, max_tokens: int, version: str, reference: str) -> None:
    assert len(result.sequences) == count
    assert result.prompt_tokens == len(PROMPT) and result.prompt_logprobs is None
    for seq in result.sequences:
        assert len(seq.tokens) == len(seq.logprobs) == max_tokens
        assert seq.stop_reason == "length"
        assert all(lp <= 0.0 for lp in seq.logprobs)
        assert isinstance(seq.text, str)
        assert seq.version.exact == version and seq.version.reference == reference


def test_sample_base_and_adapter(base: SamplingClient, tuned: SamplingClient, snapshot: Snapshot) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.9, seed=11)
    check_result(base.sample(PROMPT, params, num_samples=2), 2, 6, "base", "base")
    result = tuned.sample(list(PROMPT), params, num_samples=3)
    check_result(result, 3, 6, f"{snapshot.name}@{snapshot.version}", snapshot.name)
    assert result.sequences[0].version == SampledVersion(
        snapshot.name, snapshot.version, snapshot.name, snapshot.sha256
    )
    # The exact-version reference names the same version; the adapter changed the output.
    exact = SamplingClient(base.address, f"{snapshot.name}@{snapshot.version}")
    with exact:
        pinned = exact.sample(ModelInput.from_ints(PROMPT), GREEDY).sequences[0]
    assert pinned.version.exact == f"{snapshot.name}@{snapshot.version}"
    assert pinned.tokens == tuned.sample(PROMPT, GREEDY).sequences[0].tokens
    assert pinned.tokens != base.sample(PROMPT, GREEDY).sequences[0].tokens


def test_text_prompt(base: SamplingClient) -> None:
    result = base.sample("hello world", SamplingParams(max_tokens=4, temperature=0.0, logprobs=False))
    (seq,) = result.sequences
    assert result.prompt_tokens > 0 and len(seq.tokens) == 4 and seq.logprobs == ()
    assert seq.stop_reason == "length"


def test_greedy_sample_equals_its_stream(tuned: SamplingClient) -> None:
    (seq,) = tuned.sample(PROMPT, GREEDY).sequences
    chunks = list(tuned.stream(PROMPT, GREEDY))
    assert len(chunks) >= 2  # tokens arrive as they are generated
    assert all(isinstance(c, SampleChunk) and c.sample_index == 0 for c in chunks)
    assert [c.stop_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert tuple(t for c in chunks for t in c.tokens) == seq.tokens
    assert max_diff([lp for c in chunks for lp in c.logprobs], seq.logprobs) <= TOL
    assert "".join(c.text for c in chunks) == seq.text
    assert {c.version for c in chunks} == {seq.version}


def test_closing_a_stream_cancels_it(tuned: SamplingClient, service: ServiceClient) -> None:
    long = SamplingParams(max_tokens=512, temperature=0.0)
    with closing(tuned.stream(PROMPT, long, num_samples=2)) as stream:
        first = next(stream)
        assert first.tokens and first.stop_reason is None
    deadline = time.monotonic() + 5
    while tuned.stats().running_requests and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tuned.stats().running_requests == 0  # the generation stopped with the stream
    # Breaking out of a plain for loop (the generator is dropped) does the same; the client stays usable.
    for _chunk in tuned.stream(PROMPT, long):
        break
    assert len(tuned.sample(PROMPT, GREEDY).sequences[0].tokens) == GREEDY.max_tokens


def test_async_twins(base: SamplingClient, tuned: SamplingClient) -> None:
    (expected,) = tuned.sample(PROMPT, GREEDY).sequences

    async def run() -> tuple[list[SampleChunk], SampleResult, tuple[float, ...], list[SampleChunk]]:
        chunks = [chunk async for chunk in tuned.stream_async(PROMPT, GREEDY)]
        result = await tuned.sample_async(PROMPT, GREEDY)
        logprobs = await tuned.compute_logprobs_async([*PROMPT, *expected.tokens])
        early: list[SampleChunk] = []
        # seeded: an unseeded first token is the end-of-sequence token about once in 700 runs
        async with aclosing(base.stream_async(PROMPT, SamplingParams(max_tokens=512, seed=7))) as stream:
            async for chunk in stream:
                early.append(chunk)
                break
        return chunks, result, logprobs, early

    chunks, result, logprobs, early = asyncio.run(run())
    assert tuple(t for c in chunks for t in c.tokens) == expected.tokens
    assert result.sequences[0].tokens == expected.tokens
    assert max_diff(logprobs[len(PROMPT) - 1 :], expected.logprobs) <= TOL
    assert len(early) == 1 and early[0].stop_reason is None


def test_seeds_reproduce(tuned: SamplingClient) -> None:
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=1234)
    first = tuned.sample(PROMPT, params, num_samples=2)
    again = tuned.sample(PROMPT, params, num_samples=2)
    assert [s.tokens for s in first.sequences] == [s.tokens for s in again.sequences]
    assert first.sequences[0].tokens != first.sequences[1].tokens  # sample i uses seed + i
    other = tuned.sample(PROMPT, SamplingParams(max_tokens=8, temperature=1.0, seed=99))
    assert other.sequences[0].tokens != first.sequences[0].tokens


@pytest.mark.parametrize("which", ["base", "tuned"])
def test_compute_logprobs_match_greedy_sampling(which: str, base: SamplingClient, tuned: SamplingClient) -> None:
    client = base if which == "base" else tuned
    (seq,) = client.sample(PROMPT, GREEDY).sequences
    tokens = [*PROMPT, *seq.tokens]
    logprobs = client.compute_logprobs(tokens)
    assert len(logprobs) == len(tokens) - 1
    assert max_diff(logprobs[len(PROMPT) - 1 :], seq.logprobs) <= TOL
    assert max_diff(client.compute_logprobs(ModelInput.from_ints(tokens)), logprobs) <= TOL


def test_prompt_logprobs(tuned: SamplingClient) -> None:
    result = tuned.sample(PROMPT, SamplingParams(max_tokens=2, temperature=0.0), num_samples=2, prompt_logprobs=True)
    assert result.prompt_tokens == len(PROMPT)
    assert result.prompt_logprobs is not None and len(result.prompt_logprobs) == len(PROMPT) - 1
    assert max_diff(result.prompt_logprobs, tuned.compute_logprobs(PROMPT)) <= TOL


def test_top_logprobs(tuned: SamplingClient) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.0, top_logprobs=5)
    (seq,) = tuned.sample(PROMPT, params).sequences
    assert len(seq.top_logprobs) == len(seq.tokens) == 6
    for token, logprob, top in zip(seq.tokens, seq.logprobs, seq.top_logprobs, strict=True):
        ids, values = zip(*top, strict=True)
        assert len(ids) == len(set(ids)) == 5 and list(values) == sorted(values, reverse=True)
        assert ids[0] == token and abs(values[0] - logprob) <= TOL  # greedy: the chosen token ranks first
    streamed = [top for c in tuned.stream(PROMPT, params) for top in c.top_logprobs]
    assert [[t for t, _ in top] for top in streamed] == [[t for t, _ in top] for top in seq.top_logprobs]
    assert max_diff([lp for top in streamed for _, lp in top], [lp for top in seq.top_logprobs for _, lp in top]) <= TOL
    assert tuned.sample(PROMPT, GREEDY).sequences[0].top_logprobs == ()  # not asked: none


def test_load_unload_and_stats(service: ServiceClient, snapshot: Snapshot) -> None:
    client = service.create_sampling_client(f"{snapshot.name}@{snapshot.version}")
    loaded = client.load(pin=True)
    assert loaded.version.exact == f"{snapshot.name}@{snapshot.version}" and loaded.pinned and loaded.slot > 0
    before = client.stats().adapter_loads_total
    assert client.unload() is True
    stats = client.stats()
    assert stats.slots_total >= 1 and stats.tokens_generated > 0
    assert before >= 1  # at least the load above: every version loaded into a slot counts
    client.load()  # unloaded above: loading it again is one more load
    assert client.stats().adapter_loads_total == before + 1
    assert client.unload() is True
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REFERENCE", service.create_sampling_client("base").load)


def test_penalties_and_top_p_zero_reach_the_sampler(base: SamplingClient) -> None:
    """A strong presence penalty stops the greedy repeat of a token; top_p 0 samples what temperature 0 does,
    whatever the temperature and seed."""
    for seed in range(40):
        prompt = [(17 * seed + 3 * i) % 500 + 2 for i in range(6)]
        plain = list(base.sample(prompt, SamplingParams(max_tokens=16, temperature=0.0)).sequences[0].tokens)
        repeated = [t for t in set(plain) if plain.count(t) >= 2]
        if repeated:
            break
    else:
        raise AssertionError("no prompt whose greedy continuation repeats a token")
    strong = SamplingParams(max_tokens=16, temperature=0.0, presence_penalty=2.0)
    penalized = list(base.sample(prompt, strong).sequences[0].tokens)
    assert penalized != plain and all(penalized.count(t) < plain.count(t) for t in repeated), (plain, penalized)
    nucleus = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.0, seed=5)
    assert [list(s.tokens) for s in base.sample(prompt, nucleus, num_samples=2).sequences] == [plain, plain]
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    for bad in (SamplingParams(presence_penalty=2.5), SamplingParams(frequency_penalty=float("nan"))):
        expect_error(invalid, "INVALID_SAMPLING_PARAMS", base.sample, PROMPT, bad)


# Errors


def test_errors(service: ServiceClient, base: SamplingClient) -> None:
    missing = service.create_sampling_client(unique_name("missing"))
    not_found = grpc.StatusCode.NOT_FOUND
    expect_error(not_found, "ADAPTER_NOT_FOUND", missing.sample, PROMPT, GREEDY)
    expect_error(not_found, "ADAPTER_NOT_FOUND", lambda: list(missing.stream(PROMPT, GREEDY)))
    expect_error(not_found, "ADAPTER_NOT_FOUND", missing.compute_logprobs, PROMPT)
    expect_error(not_found, "ADAPTER_NOT_FOUND", asyncio.run, missing.sample_async(PROMPT, GREEDY))
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    bad_top_p = SamplingParams(top_p=1.5)
    expect_error(invalid, "INVALID_SAMPLING_PARAMS", base.sample, PROMPT, bad_top_p)
    expect_error(invalid, "INVALID_SAMPLING_PARAMS", asyncio.run, base.sample_async(PROMPT, bad_top_p))
    expect_error(invalid, "INVALID_SAMPLING_PARAMS", base.sample, PROMPT, SamplingParams(top_logprobs=21))
    expect_error(invalid, None, base.sample, [], GREEDY)  # empty prompt
    expect_error(invalid, "TOKEN_OUT_OF_RANGE", base.compute_logprobs, [1, 10**6])
    with pytest.raises(ValueError):
        base.sample(PROMPT, GREEDY, num_samples=0)


def test_closed_client_refuses_calls(sampler_server: ServerProcess) -> None:
    client = SamplingClient(sampler_server.address, "base")
    client.close()
    expect_error(grpc.StatusCode.CANCELLED, "CLIENT_CLOSED", client.sample, PROMPT, GREEDY)


def test_cache_salt_reaches_the_sampler(base: SamplingClient) -> None:
    """sample, stream, compute_logprobs and their async twins send cache_salt: a request salted otherwise finds
    none of the blocks a salted request cached, the same salt finds them (the caller's prompt tokens found in
    the prefix cache, GetStats); a salt beyond 256 UTF-8 bytes is the sampler's INVALID_CACHE_SALT."""
    base.sample(PROMPT, GREEDY)  # the engine's figures (its block size) are in GetStats once it has worked
    assert wait_until(lambda: base.stats().kv_block_size > 0)
    block = base.stats().kv_block_size
    salt = unique_name("salt")  # nothing earlier in the session used these salts
    params = SamplingParams(max_tokens=4, temperature=0.0)

    def found(call: Callable[[list[int], str], object], prompt: list[int], salt: str) -> int:
        """The prompt tokens `call` found cached: counted before its stream's messages are sent."""
        before = base.stats().own_prompt_tokens_cached
        call(prompt, salt)
        return base.stats().own_prompt_tokens_cached - before

    async def drain(chunks: AsyncIterator[SampleChunk]) -> None:
        async for _ in chunks:
            pass

    def sample(p: list[int], s: str) -> object:
        return base.sample(p, params, cache_salt=s)

    def stream(p: list[int], s: str) -> object:
        return list(base.stream(p, params, cache_salt=s))

    def sample_async(p: list[int], s: str) -> object:
        return asyncio.run(base.sample_async(p, params, cache_salt=s))

    def stream_async(p: list[int], s: str) -> object:
        return asyncio.run(drain(base.stream_async(p, params, cache_salt=s)))

    def logprobs(p: list[int], s: str) -> object:
        return base.compute_logprobs(p, cache_salt=s)

    def logprobs_async(p: list[int], s: str) -> object:
        return asyncio.run(base.compute_logprobs_async(p, cache_salt=s))

    # (caches under salt a, then salt b must find nothing, then salt a again must find it)
    cases = [(sample, stream, sample_async), (logprobs, stream_async, sample), (logprobs_async, sample, stream)]
    for n, (first, other, again) in enumerate(cases):
        prompt = [(31 * i + 11 * n) % 400 + 5 for i in range(2 * block + 3)]  # two full blocks and a bit
        first(prompt, f"{salt}-a")
        assert found(other, prompt, f"{salt}-b") == 0, n  # another salt: none of salt a's blocks
        assert found(again, prompt, f"{salt}-a") == 2 * block, n  # the same salt: both full blocks
    invalid, long = grpc.StatusCode.INVALID_ARGUMENT, "é" * 129  # 258 UTF-8 bytes
    expect_error(invalid, "INVALID_CACHE_SALT", base.sample, PROMPT, GREEDY, cache_salt=long)
    expect_error(invalid, "INVALID_CACHE_SALT", lambda: list(base.stream(PROMPT, GREEDY, cache_salt=long)))
    expect_error(invalid, "INVALID_CACHE_SALT", base.compute_logprobs, PROMPT, cache_salt=long)
    expect_error(invalid, "INVALID_CACHE_SALT", asyncio.run, base.sample_async(PROMPT, GREEDY, cache_salt=long))
    expect_error(invalid, "INVALID_CACHE_SALT", asyncio.run, base.compute_logprobs_async(PROMPT, cache_salt=long))
    with pytest.raises(TypeError, match="cache_salt"):
        base.sample(PROMPT, GREEDY, cache_salt=7)  # type: ignore[arg-type]
