"""The unmodified openai SDK (sync and async) against /v1 of a real gateway over real trainer, sampler and registry
processes: models per tenant, chat completions streamed and not on name@latest with the exact version, token ids
equal to a direct gRPC Sample's, logprobs equal to ComputeLogprobs', top_logprobs equal to a transformers forward
of the same weights, n > 1, stop strings, seeds, token-id prompts, another tenant's model, a wrong key, malformed
bodies."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from gatewayutil import KEY_A, KEY_B, base_url
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam
from openaiutil import async_openai_client, openai_client, train_adapter
from samplerutil import PeftReference
from serverproc import ServerProcess, registry_store
from transformers import AutoTokenizer

from opentinker.client import SamplingParams, ServiceClient

AGENT = "gw-a/oai-agent"
OTHER = "gw-b/oai-other"
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 plus 3?"},
]


@pytest.fixture(scope="module")
def service(
    trainer_server: ServerProcess, sampler_server: ServerProcess, registry_server: ServerProcess
) -> Iterator[ServiceClient]:
    with ServiceClient(trainer_server.address, sampler_server.address, registry_server.address) as client:
        yield client


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


def extra(obj: object, name: str) -> Any:
    """A vLLM-style extra field the SDK keeps on its pydantic models."""
    extras = getattr(obj, "model_extra", None) or {}
    return extras[name]


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

    async def streamed() -> tuple[list[Any], str, list[int], list[Any]]:
        async with async_openai_client(gateway, KEY_A) as client:
            stream = await client.chat.completions.create(
                **request, stream=True, stream_options={"include_usage": True}, extra_body={"return_token_ids": True}
            )
            chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        tokens = [t for c in chunks if c.choices for t in extra(c.choices[0], "token_ids")]
        return chunks, text, tokens, [c.choices[0].finish_reason for c in chunks if c.choices]

    chunks, text, tokens, reasons = asyncio.run(streamed())
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
    assert [[t.token for t in e.top_logprobs] for e in streamed] == [[t.token for t in e.top_logprobs] for e in content]
    assert [t.logprob for e in streamed for t in e.top_logprobs] == pytest.approx(
        [t.logprob for e in content for t in e.top_logprobs], abs=1e-5
    )

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
    legacy = client_a.completions.create(**text, logprobs=3)
    assert extra(legacy.choices[0], "token_ids") == tokens
    tops = legacy.choices[0].logprobs.top_logprobs
    oracle = _completion_tops(top_k(model, prompt, tokens, 3), tokenizer)
    assert tops is not None and [list(t) for t in tops] == [list(t) for t in oracle]
    assert [v for t in tops for v in t.values()] == pytest.approx([v for t in oracle for v in t.values()], abs=1e-4)
    chunks_text = list(client_a.completions.create(**text, logprobs=3, stream=True))
    streamed_tops = [
        t for c in chunks_text if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.top_logprobs or []
    ]
    assert [list(t) for t in streamed_tops] == [list(t) for t in tops]
    zero = client_a.completions.create(**text, logprobs=0)
    assert zero.choices[0].logprobs is not None and zero.choices[0].logprobs.top_logprobs is None
    assert zero.choices[0].logprobs.token_logprobs == pytest.approx([e.logprob for e in content], abs=1e-5)

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

    async def together() -> dict[str, Any]:
        async with async_openai_client(gateway, KEY_A) as client:
            replies = await asyncio.gather(*(client.chat.completions.create(**body(name)) for name in asks))
        return dict(zip(asks, replies, strict=True))

    both = asyncio.run(together())
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

    bad: list[dict[str, object]] = [
        {"messages": "hello"},
        {"messages": []},
        {"messages": [{"role": "robot", "content": "x"}]},
        {"temperature": "hot"},
        {"n": 0},
        {"max_tokens": -1},
        {"stop": [1, 2]},
        {"top_logprobs": 3},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        {"metadata": {"episode_id": "no spaces allowed"}},
    ]
    for fields in bad:
        body = {"model": AGENT, "messages": MESSAGES, "max_tokens": 2, **fields}
        with pytest.raises(openai.BadRequestError) as refused:
            client_a.post("/chat/completions", body=body, cast_to=httpx.Response)
        assert refused.value.type == "invalid_request_error", fields
    raw = httpx.post(
        f"{base_url(gateway)}/v1/chat/completions", content=b"{not json", headers={"Authorization": f"Bearer {KEY_A}"}
    )
    assert raw.status_code == 400 and set(json.loads(raw.text)["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError):
        client_a.chat.completions.create(
            model=AGENT,
            messages=MESSAGES,
            max_tokens=2,
            extra_headers={"X-OpenTinker-Episode": "a b"},
        )
    # still serving
    ok = client_a.chat.completions.create(model=AGENT, messages=MESSAGES, max_tokens=2)
    assert ok.choices[0].message.role == "assistant"


def test_penalties_change_greedy_output_as_the_samplers_do(
    client_a: openai.OpenAI, service: ServiceClient, versions: dict[str, int]
) -> None:
    base_id = next(iter(client_a.models.list())).id
    for i in range(40):
        messages = [{"role": "user", "content": f"Say {i} again."}]
        chat: dict[str, Any] = {
            "model": base_id,
            "messages": messages,
            "max_tokens": 16,
            "temperature": 0.0,
            "extra_body": {"return_token_ids": True},
        }
        plain = client_a.chat.completions.create(**chat)
        tokens = extra(plain.choices[0], "token_ids")
        repeated = [t for t in set(tokens) if tokens.count(t) >= 2]
        if repeated:
            break
    else:
        raise AssertionError("no chat whose greedy reply repeats a token")
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
    tools: list[ChatCompletionToolParam] = [
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
    ]
    refused: list[tuple[dict[str, Any], str]] = [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": {}}}}, "response_format"),
        ({"tools": tools, "tool_choice": "required"}, "tool_choice"),
        ({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
        ({"top_p": 0}, "top_p"),
    ]
    sampler = service.create_sampling_client("base")
    before = sampler.stats().tokens_generated
    for fields, param in refused:
        with pytest.raises(openai.BadRequestError) as caught:
            client_a.chat.completions.create(model=base_id, messages=MESSAGES, max_tokens=2, **fields)
        assert caught.value.param == param and caught.value.type == "invalid_request_error", (fields, caught.value)
        assert param in caught.value.message
    for fields, param in refused[:4]:
        with pytest.raises(openai.BadRequestError) as caught:
            client_a.completions.create(model=base_id, prompt="Hi", max_tokens=2, extra_body=fields)
        assert caught.value.param == param, (fields, caught.value)
    assert sampler.stats().tokens_generated == before
    # What is honoured is served: text, auto, none.
    for fields in (
        {"response_format": {"type": "text"}},
        {"tools": tools, "tool_choice": "auto"},
        {"tools": tools, "tool_choice": "none"},
    ):
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
    headers = {"Authorization": f"Bearer {KEY_A}"}
    with httpx.stream("POST", f"{base_url(gateway)}/v1/chat/completions", json=body, headers=headers) as reply:
        assert reply.status_code == 200
        lines = reply.iter_lines()
        assert next(line for line in lines if line.startswith("data: ")).startswith("data: {")
    # The sample ends when the gateway's next write fails: well before its 1,900 tokens.
    deadline = time.monotonic() + 60
    while (stats := sampler.stats()).running_requests or stats.waiting_requests:
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)
    assert stats.tokens_generated - before < 1900, stats
    ok = client.chat.completions.create(model=AGENT, messages=MESSAGES, max_tokens=2)
    assert ok.choices[0].message.role == "assistant"
    client.close()
