"""The unmodified openai SDK (sync and async) against /v1 of a real gateway over real trainer, sampler and registry
processes: models per tenant, chat completions streamed and not on name@latest with the exact version, token ids
equal to a direct gRPC Sample's, logprobs equal to ComputeLogprobs', top_logprobs equal to a transformers forward
of the same weights, n > 1, stop strings, seeds, token-id prompts, another tenant's model, a wrong key, malformed
bodies."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from badrequestutil import HONOURED, REFUSED, assert_bad_requests_refused
from chatutil import MESSAGES, chats_at_once, extra, hang_up_early, repeating_greedy_chat, stream_chat, wait_until_idle
from gatewayutil import KEY_A, KEY_B
from openaiutil import async_openai_client, openai_client, train_adapter
from samplerutil import PeftReference
from serverproc import ServerProcess, registry_store
from toplogprobsutil import assert_alternatives, assert_completion_alternatives, assert_same_alternatives, top_k
from transformers import AutoTokenizer

from opentinker.client import SamplingParams, ServiceClient

AGENT = "gw-a/oai-agent"
OTHER = "gw-b/oai-other"


@pytest.fixture(scope="module")
def versions(service: ServiceClient) -> dict[str, int]:
    """gw-a's adapter with two versions (latest = 2), gw-b's with one."""
    return {AGENT: train_adapter(service, AGENT, snapshots=2, seed=1), OTHER: train_adapter(service, OTHER, seed=2)}


@pytest.fixture(scope="module")
def client_a(gateway: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai_client(gateway, KEY_A) as client:
        yield client


@pytest.fixture(scope="module")
def client_b(gateway: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai_client(gateway, KEY_B) as client:
        yield client


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> PeftReference:
    return PeftReference(tiny_model)


def test_models_are_listed_per_tenant(
    client_a: openai.OpenAI, client_b: openai.OpenAI, versions: dict[str, int], tiny_model: Path
) -> None:
    seen_a = {m.id: m for m in client_a.models.list()}
    seen_b = {m.id: m for m in client_b.models.list()}
    assert AGENT in seen_a and OTHER not in seen_a
    assert OTHER in seen_b and AGENT not in seen_b
    assert not [m for m in seen_a if m.startswith("gw-b/")] and not [m for m in seen_b if m.startswith("gw-a/")]
    agent = seen_a[AGENT]
    assert extra(agent, "latest_version") == versions[AGENT] == 2
    assert extra(agent, "aliases") == {"latest": 2}
    base = next(iter(seen_a))  # the base model comes first, under its public name
    assert base in seen_b and client_a.models.retrieve(base).id == base
    assert client_a.models.retrieve(AGENT).id == AGENT
    assert extra(client_a.models.retrieve(f"{AGENT}@1"), "version") == 1
    with pytest.raises(openai.NotFoundError):
        client_b.models.retrieve(AGENT)  # another tenant's: as if it did not exist
    with pytest.raises(openai.NotFoundError):
        client_a.models.retrieve("gw-a/no-such-agent")


def test_chat_completion_is_the_samplers_exact_tokens(
    client_a: openai.OpenAI,
    service: ServiceClient,
    versions: dict[str, int],
    tiny_model: Path,
    reference: PeftReference,
    registry_server: ServerProcess,
) -> None:
    reply = client_a.chat.completions.create(
        model=f"{AGENT}@latest",
        messages=MESSAGES,
        max_tokens=12,
        seed=7,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_token_ids": True},
    )
    assert reply.model == f"{AGENT}@{versions[AGENT]}" and reply.object == "chat.completion"
    prompt = extra(reply, "prompt_token_ids")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    rendered = tokenizer.apply_chat_template(list(map(dict, MESSAGES)), add_generation_prompt=True, tokenize=False)  # type: ignore[arg-type]
    assert prompt == tokenizer.encode(rendered, add_special_tokens=False)
    (choice,) = reply.choices
    tokens = extra(choice, "token_ids")
    assert isinstance(tokens, list) and isinstance(prompt, list) and 1 <= len(tokens) <= 12
    assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == len(tokens)
    assert choice.finish_reason == ("length" if len(tokens) == 12 else "stop")

    # A direct gRPC Sample of the same version, prompt and seed samples the same tokens.
    direct = service.create_sampling_client(f"{AGENT}@{versions[AGENT]}")
    (sampled,) = direct.sample(prompt, SamplingParams(max_tokens=12, seed=7, logprobs=True)).sequences
    assert list(sampled.tokens) == tokens
    assert choice.message.content == tokenizer.decode(tokens, skip_special_tokens=True) == sampled.text

    # Logprobs: the chosen tokens', equal to ComputeLogprobs of those tokens after the prompt.
    assert choice.logprobs is not None and choice.logprobs.content is not None
    logprobs = [entry.logprob for entry in choice.logprobs.content]
    scored = direct.compute_logprobs(prompt + tokens)[len(prompt) - 1 :]
    assert len(logprobs) == len(tokens) == len(scored)
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(logprobs, scored, strict=True)), (logprobs, scored)
    # top_logprobs: the model's 2 most likely tokens at each position, as a peft forward of the same version ranks
    # them (the sampled tokens were drawn at temperature 1: not always the first).
    version = service.registry_client().get_version(AGENT, versions[AGENT])
    model = reference.model(registry_store(registry_server) / "sha256" / version.sha256)
    assert_alternatives(choice.logprobs.content, top_k(model, prompt, tokens, 2), tokenizer, 2)


def test_streamed_chat_equals_the_answer(
    client_a: openai.OpenAI, gateway: ServerProcess, versions: dict[str, int]
) -> None:
    request: dict[str, Any] = {"model": AGENT, "messages": MESSAGES, "max_tokens": 10, "seed": 11, "temperature": 0.9}
    whole = client_a.chat.completions.create(**request, extra_body={"return_token_ids": True})
    chunks, text, tokens, reasons = stream_chat(gateway, KEY_A, request)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert extra(chunks[0], "prompt_token_ids") == extra(whole, "prompt_token_ids")
    assert {c.model for c in chunks} == {whole.model} == {f"{AGENT}@{versions[AGENT]}"}
    assert text == whole.choices[0].message.content and tokens == extra(whole.choices[0], "token_ids")
    assert [r for r in reasons if r is not None] == [whole.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == len(tokens)


def test_n_seeds_and_base_model(client_a: openai.OpenAI, versions: dict[str, int]) -> None:
    def three_seeded() -> Any:
        return client_a.chat.completions.create(
            model=AGENT, messages=MESSAGES, max_tokens=8, n=3, seed=5, extra_body={"return_token_ids": True}
        )

    three = three_seeded()
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert three.usage is not None
    assert three.usage.completion_tokens == sum(len(extra(c, "token_ids")) for c in three.choices)
    again = three_seeded()
    assert [extra(c, "token_ids") for c in again.choices] == [extra(c, "token_ids") for c in three.choices]
    base_id = next(iter(client_a.models.list())).id
    base = client_a.chat.completions.create(model=base_id, messages=MESSAGES, max_tokens=4)
    assert base.model == base_id


def test_stop_strings_cut_the_text_not_the_tokens(client_a: openai.OpenAI, versions: dict[str, int]) -> None:
    request: dict[str, Any] = {
        "model": AGENT,
        "messages": MESSAGES,
        "max_tokens": 24,
        "seed": 3,
        "extra_body": {"return_token_ids": True},
    }
    free = client_a.chat.completions.create(**request)
    text = free.choices[0].message.content
    assert isinstance(text, str) and len(text) >= 8, text
    stop = text[4:6]
    cut = client_a.chat.completions.create(**request, stop=[stop, "never-seen-stop"])
    assert cut.choices[0].message.content == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    free_tokens, cut_tokens = extra(free.choices[0], "token_ids"), extra(cut.choices[0], "token_ids")
    assert isinstance(cut_tokens, list) and isinstance(free_tokens, list)
    assert cut_tokens == free_tokens[: len(cut_tokens)]  # every sampled token, the stop string's included
    streamed = client_a.chat.completions.create(**request, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text[: text.find(stop)]


def test_completions_with_token_and_text_prompts(
    client_a: openai.OpenAI, service: ServiceClient, versions: dict[str, int]
) -> None:
    prompt = [17, 42, 99, 7, 256]
    reply = client_a.completions.create(
        model=f"{AGENT}@1", prompt=prompt, max_tokens=6, seed=9, logprobs=1, extra_body={"return_token_ids": True}
    )
    assert reply.model == f"{AGENT}@1"
    (sampled,) = (
        service.create_sampling_client(f"{AGENT}@1").sample(prompt, SamplingParams(max_tokens=6, seed=9)).sequences
    )
    assert extra(reply.choices[0], "token_ids") == list(sampled.tokens)
    assert extra(reply, "prompt_token_ids") == prompt and reply.choices[0].text == sampled.text
    assert reply.choices[0].logprobs is not None and len(reply.choices[0].logprobs.tokens or []) == len(sampled.tokens)
    two = client_a.completions.create(model=AGENT, prompt=["Hello", "What is"], max_tokens=3, n=2)
    assert sorted(c.index for c in two.choices) == [0, 1, 2, 3]
    chunks = list(client_a.completions.create(model=AGENT, prompt=prompt, max_tokens=6, seed=9, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == sampled.text


def test_top_logprobs_are_the_models_alternatives(
    client_a: openai.OpenAI, gateway: ServerProcess, reference: PeftReference, tiny_model: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = reference.model(None)
    base_id = next(iter(client_a.models.list())).id
    chat: dict[str, Any] = {
        "model": base_id,
        "messages": MESSAGES,
        "max_tokens": 10,
        "temperature": 0.0,
        "logprobs": True,
        "extra_body": {"return_token_ids": True},
    }
    reply = client_a.chat.completions.create(**chat, top_logprobs=5)
    prompt, tokens = extra(reply, "prompt_token_ids"), extra(reply.choices[0], "token_ids")
    content = reply.choices[0].logprobs.content
    assert content is not None and len(tokens) >= 2
    expected = top_k(model, prompt, tokens, 5)
    assert_alternatives(content, expected, tokenizer, 5)
    assert [ids[0] for ids, _ in expected] == tokens  # greedy: the chosen token ranks first...
    assert all(e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob for e in content)

    # Streamed: the same entries, chunk by chunk.
    chunks = list(client_a.chat.completions.create(**chat, top_logprobs=5, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    assert_same_alternatives(streamed, content)

    # top_logprobs 0 (or absent): the chosen tokens' logprobs only, the same tokens.
    plain = client_a.chat.completions.create(**chat)
    assert extra(plain.choices[0], "token_ids") == tokens
    plain_content = plain.choices[0].logprobs.content
    assert plain_content is not None and all(e.top_logprobs == [] for e in plain_content)
    assert [e.logprob for e in plain_content] == pytest.approx([e.logprob for e in content], abs=1e-5)

    # Completions: logprobs=k, each position a {token: logprob} dict (the chosen one included), streamed and not.
    text: dict[str, Any] = {
        "model": base_id,
        "prompt": prompt,
        "max_tokens": 10,
        "temperature": 0.0,
        "extra_body": {"return_token_ids": True},
    }
    chosen = [e.logprob for e in content]
    assert_completion_alternatives(client_a, text, tokens, top_k(model, prompt, tokens, 3), tokenizer, chosen)

    # Beyond OpenAI's bounds: 400 naming the field.
    with pytest.raises(openai.BadRequestError) as refused:
        client_a.chat.completions.create(**chat, top_logprobs=21)
    assert refused.value.param == "top_logprobs", refused.value
    with pytest.raises(openai.BadRequestError) as refused:
        client_a.completions.create(**text, logprobs=6)
    assert refused.value.param == "logprobs", refused.value


def test_a_batch_mixing_top_logprobs_gives_each_what_it_asked(
    client_a: openai.OpenAI, gateway: ServerProcess, reference: PeftReference, tiny_model: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    base_id = next(iter(client_a.models.list())).id
    asks: dict[str, dict[str, Any]] = {
        "top": {"messages": MESSAGES, "top_logprobs": 3},
        "none": {"messages": [{"role": "user", "content": "Name a colour."}]},
    }

    def body(name: str) -> dict[str, Any]:
        return {
            "model": base_id,
            "max_tokens": 8,
            "temperature": 0.0,
            "logprobs": True,
            "extra_body": {"return_token_ids": True},
            **asks[name],
        }

    alone = {name: client_a.chat.completions.create(**body(name)) for name in asks}
    both = chats_at_once(gateway, KEY_A, {name: body(name) for name in asks})
    for name in asks:
        choice = both[name].choices[0]
        assert extra(choice, "token_ids") == extra(alone[name].choices[0], "token_ids")
        assert choice.logprobs is not None and choice.logprobs.content is not None
        if name == "none":
            assert all(e.top_logprobs == [] for e in choice.logprobs.content)
        else:
            prompt, tokens = extra(both[name], "prompt_token_ids"), extra(choice, "token_ids")
            assert_alternatives(choice.logprobs.content, top_k(reference.model(None), prompt, tokens, 3), tokenizer, 3)


def test_other_tenants_models_wrong_keys_and_bad_bodies(
    client_a: openai.OpenAI, client_b: openai.OpenAI, gateway: ServerProcess, versions: dict[str, int]
) -> None:
    for model in (AGENT, f"{AGENT}@1", "oai-agent", "gw-b/no-such", "gw-b/bad name"):
        with pytest.raises(openai.NotFoundError) as caught:
            client_b.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
        assert caught.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client_b.completions.create(model=AGENT, prompt="Hi", max_tokens=2)

    async def async_other_tenant() -> None:
        async with async_openai_client(gateway, KEY_B) as client:
            with pytest.raises(openai.NotFoundError):
                await client.chat.completions.create(model=AGENT, messages=MESSAGES, stream=True)

    asyncio.run(async_other_tenant())
    for key in ("tml-no-such-key", "sk-not-ours"):
        with openai_client(gateway, key) as wrong, pytest.raises(openai.AuthenticationError) as denied:
            wrong.models.list()
        assert denied.value.code == "invalid_api_key"

    assert_bad_requests_refused(client_a, gateway, KEY_A, AGENT)
    # still serving
    ok = client_a.chat.completions.create(model=AGENT, messages=MESSAGES, max_tokens=2)
    assert ok.choices[0].message.role == "assistant"


def test_penalties_change_greedy_output_as_the_samplers_do(
    client_a: openai.OpenAI, service: ServiceClient, versions: dict[str, int]
) -> None:
    base_id = next(iter(client_a.models.list())).id
    chat, plain, tokens, repeated = repeating_greedy_chat(client_a, base_id)
    prompt = extra(plain, "prompt_token_ids")
    sampler = service.create_sampling_client("base")

    def direct(**penalties: float) -> list[int]:
        params = SamplingParams(max_tokens=16, temperature=0.0, **penalties)  # type: ignore[arg-type]
        return list(sampler.sample(prompt, params).sequences[0].tokens)

    # A strong presence penalty: the greedy reply stops repeating, with the sampler's own penalized tokens.
    strong = client_a.chat.completions.create(**chat, presence_penalty=2.0)
    penalized = extra(strong.choices[0], "token_ids")
    assert all(penalized.count(t) < tokens.count(t) for t in repeated), (tokens, penalized)
    assert penalized == direct(presence_penalty=2.0)
    streamed = client_a.chat.completions.create(**chat, presence_penalty=2.0, stream=True)
    assert [t for c in streamed if c.choices for t in extra(c.choices[0], "token_ids")] == penalized
    # Completions, with a frequency penalty (n > 1: each choice counts its own output, so greedy ones agree).
    text = client_a.completions.create(
        model=base_id,
        prompt=prompt,
        max_tokens=16,
        temperature=0.0,
        n=2,
        frequency_penalty=1.5,
        extra_body={"return_token_ids": True},
    )
    assert [extra(c, "token_ids") for c in text.choices] == [direct(frequency_penalty=1.5)] * 2
    assert direct(frequency_penalty=1.5) != tokens


def test_what_cannot_be_honoured_is_refused_naming_the_parameter(
    client_a: openai.OpenAI, service: ServiceClient, versions: dict[str, int]
) -> None:
    """No parameter is silently ignored: values the gateway cannot honour are 400s naming the parameter, and
    nothing is sampled for them."""
    base_id = next(iter(client_a.models.list())).id
    sampler = service.create_sampling_client("base")
    before = sampler.stats().tokens_generated
    for fields, param in REFUSED:
        with pytest.raises(openai.BadRequestError) as caught:
            client_a.chat.completions.create(model=base_id, messages=MESSAGES, max_tokens=2, **fields)
        assert caught.value.param == param and caught.value.type == "invalid_request_error", (fields, caught.value)
        assert param in caught.value.message
    for fields, param in REFUSED[:4]:
        with pytest.raises(openai.BadRequestError) as caught:
            client_a.completions.create(model=base_id, prompt="Hi", max_tokens=2, extra_body=fields)
        assert caught.value.param == param, (fields, caught.value)
    assert sampler.stats().tokens_generated == before
    # What is honoured is served: text, auto, none.
    for fields in HONOURED:
        ok = client_a.chat.completions.create(model=base_id, messages=MESSAGES, max_tokens=2, **fields)
        assert ok.choices[0].message.role == "assistant"


def test_a_client_that_goes_away_cancels_its_samples(
    gateway: ServerProcess, service: ServiceClient, versions: dict[str, int]
) -> None:
    # A greedy request that runs to its max_tokens (checked first), so only the disconnect can end it early.
    client = openai_client(gateway, KEY_A)
    base_id = next(iter(client.models.list())).id
    body = {"model": base_id, "messages": MESSAGES, "max_tokens": 1900, "temperature": 0.0}
    whole = client.chat.completions.create(**body)  # type: ignore[call-overload]
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 1900, whole.usage
    sampler = service.create_sampling_client("base")
    before = sampler.stats().tokens_generated
    body["stream"] = True
    hang_up_early(gateway, KEY_A, body)
    # The sample ends when the gateway's next write fails: well before its 1,900 tokens.
    stats = wait_until_idle(sampler, 60)
    assert stats.tokens_generated - before < 1900, stats
    ok = client.chat.completions.create(model=AGENT, messages=MESSAGES, max_tokens=2)
    assert ok.choices[0].message.role == "assistant"
    client.close()
