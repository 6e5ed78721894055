"""vLLM's cache_salt on /v1 with the unmodified openai SDK (``extra_body``): it reaches the sampler, so one
tenant's requests with different salts share no prefix-cache blocks and the same salt shares them (the sampler's
count of prompt tokens found cached); a salt that is not a non-empty string of at most 256 UTF-8 bytes is a 400
naming cache_salt, and nothing is sampled for it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
from gatewayutil import KEY_A
from openai.types.chat import ChatCompletionMessageParam
from openaiutil import async_openai_client, openai_client
from registryutil import unique_name
from samplerutil import wait_until
from serverproc import ServerProcess

from opentinker.client import SamplingClient, ServiceClient
from opentinker.gateway.bodies import parse_json
from opentinker.gateway.errors import GatewayError
from opentinker.gateway.openai.requests import chat_request, completion_request


@pytest.fixture(scope="module")
def client(gateway: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai_client(gateway, KEY_A) as opened:
        yield opened


@pytest.fixture(scope="module")
def sampler(sampler_server: ServerProcess) -> Iterator[SamplingClient]:
    """The session sampler's figures (no tokens there: every caller's)."""
    with ServiceClient(sampler=sampler_server.address) as service:
        sampling = service.create_sampling_client("base")
        sampling.sample([5, 6, 7])  # the engine's figures (its block size) are in GetStats once it has worked
        assert wait_until(lambda: sampling.stats().kv_block_size > 0)
        yield sampling


def found(sampler: SamplingClient, call: Callable[[], object]) -> int:
    """The prompt tokens the sampler found in its prefix cache for `call`'s requests."""
    before = sampler.stats().own_prompt_tokens_cached
    call()
    return sampler.stats().own_prompt_tokens_cached - before


def test_cache_salt_splits_one_tenants_prefix_cache(
    client: openai.OpenAI, gateway: ServerProcess, sampler: SamplingClient
) -> None:
    base = next(iter(client.models.list())).id
    block = sampler.stats().kv_block_size
    salt = unique_name("v1-salt")  # nothing earlier in the session used these salts
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Count the blocks of this rather long question, one by one, please. " * 3}
    ]

    def chat(cache_salt: str | None) -> None:
        extra_body: dict[str, Any] = {} if cache_salt is None else {"cache_salt": cache_salt}
        client.chat.completions.create(
            model=base, messages=messages, max_tokens=2, temperature=0.0, extra_body=extra_body
        )

    assert found(sampler, lambda: chat(f"{salt}-a")) == 0
    assert found(sampler, lambda: chat(f"{salt}-b")) == 0  # another salt: none of salt a's blocks
    cached = found(sampler, lambda: chat(f"{salt}-a"))  # the same salt: its full blocks
    assert cached >= block, cached
    assert found(sampler, lambda: chat(None)) == 0  # no salt: not salt a's blocks either

    async def streamed() -> None:
        async with async_openai_client(gateway, KEY_A) as aclient:
            stream = await aclient.chat.completions.create(
                model=base, messages=messages, max_tokens=2, stream=True, extra_body={"cache_salt": f"{salt}-b"}
            )
            async for _ in stream:
                pass

    assert found(sampler, lambda: asyncio.run(streamed())) == cached  # streamed, async: salt b's own blocks

    tokens = [(29 * i + 3) % 400 + 5 for i in range(2 * block + 3)]  # two full blocks and a bit

    def complete(cache_salt: str) -> None:
        client.completions.create(
            model=base, prompt=tokens, max_tokens=2, temperature=0.0, extra_body={"cache_salt": cache_salt}
        )

    assert found(sampler, lambda: complete(f"{salt}-a")) == 0
    assert found(sampler, lambda: complete(f"{salt}-b")) == 0
    assert found(sampler, lambda: complete(f"{salt}-a")) == 2 * block
    assert found(sampler, lambda: complete("é" * 128)) == 0  # 256 UTF-8 bytes: the most a salt may have


def test_a_bad_cache_salt_is_a_400_naming_it(client: openai.OpenAI, sampler: SamplingClient) -> None:
    base = next(iter(client.models.list())).id
    before = sampler.stats().tokens_generated
    bad: list[object] = [7, True, ["a"], {"salt": "a"}, "", "é" * 129]  # 129 characters, 258 UTF-8 bytes
    for salt in bad:
        with pytest.raises(openai.BadRequestError) as chat:
            client.chat.completions.create(
                model=base, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, extra_body={"cache_salt": salt}
            )
        with pytest.raises(openai.BadRequestError) as completion:
            client.completions.create(model=base, prompt="Hi", max_tokens=2, extra_body={"cache_salt": salt})
        for refused in (chat.value, completion.value):
            assert refused.param == "cache_salt" and refused.type == "invalid_request_error", (salt, refused)
            assert "cache_salt" in refused.message
    assert sampler.stats().tokens_generated == before  # nothing was sampled for them


def test_the_parsed_salt_and_a_lone_surrogate() -> None:
    """What the sampler is sent ("": none, as absent or null), and JSON text that is not Unicode ("\\ud800",
    which json.loads accepts) refused by the body parser, naming the field, before any route reads it."""
    chat: dict[str, object] = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    completion: dict[str, object] = {"model": "m", "prompt": "Hi"}
    assert chat_request(chat, 8).options.cache_salt == ""
    assert chat_request({**chat, "cache_salt": None}, 8).options.cache_salt == ""
    assert chat_request({**chat, "cache_salt": "é" * 128}, 8).options.cache_salt == "é" * 128
    assert completion_request({**completion, "cache_salt": "s"}, 8).options.cache_salt == "s"
    raw = b'{"model": "m", "prompt": "Hi", "cache_salt": "\\ud800"}'
    with pytest.raises(GatewayError) as refused:
        parse_json(raw, max_bytes=1 << 20, max_string=1 << 20)
    assert (
        refused.value.status == 400 and refused.value.code == "MALFORMED_JSON" and "cache_salt" in refused.value.message
    )
