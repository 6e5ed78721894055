"""Two tenants on the gateway's one tokenizer thread (chat templates, encodes, logprob pieces): tenant gw-a floods
/v1 with long conversations; past --max-tokenizer-jobs-per-tenant waiting renders it is answered 429 (the SDK's
RateLimitError), while gw-b's requests, sent during the flood, are answered as usual. Text that cannot fit in
the context is refused 400 before it reaches the thread at all. (The order the thread takes the tenants in is
tested in test_fair_executor.py.)"""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest
from gatewayutil import KEY_A, KEY_B
from openaiutil import async_openai_client, openai_client
from serverproc import ServerProcess

GATEWAY_FLAGS = ("--max-tokenizer-jobs-per-tenant", "1")
CONTEXT = 2048  # the session's tiny model's max_position_embeddings
FITS_CHARS = 16 * CONTEXT - 2000  # just under the gateway's 16 characters per context token: it renders these


def _base_id(gateway: ServerProcess) -> str:
    with openai_client(gateway, KEY_B) as client:
        return next(iter(client.models.list())).id


def _long_messages(i: int) -> list[Any]:
    return [{"role": "user", "content": f"{i} " + "the quick brown fox jumps over the lazy dog " * (FITS_CHARS // 44)}]


def test_text_too_long_for_the_context_is_refused_before_rendering(gateway: ServerProcess) -> None:
    base = _base_id(gateway)
    with openai_client(gateway, KEY_A) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                model=base, messages=[{"role": "user", "content": "x" * (16 * CONTEXT + 1)}], max_tokens=1
            )
        assert refused.value.code == "context_length_exceeded" and "characters of text" in refused.value.message
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=base, prompt="y" * (16 * CONTEXT + 1), max_tokens=1)
        assert refused.value.code == "context_length_exceeded"
        ok = client.chat.completions.create(model=base, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        assert ok.choices[0].message.role == "assistant"


def test_a_tenant_flooding_the_tokenizer_is_refused_and_another_is_served(gateway: ServerProcess) -> None:
    base = _base_id(gateway)

    async def main() -> tuple[list[BaseException | Any], list[Any]]:
        async with async_openai_client(gateway, KEY_A) as noisy, async_openai_client(gateway, KEY_B) as quiet:
            refused, stop = asyncio.Event(), asyncio.Event()
            outcomes: list[BaseException | Any] = []

            async def flood(worker: int) -> None:  # sends again as soon as answered, until gw-b is done
                while not stop.is_set():
                    try:
                        outcomes.append(
                            await noisy.chat.completions.create(
                                model=base, messages=_long_messages(worker), max_tokens=1
                            )
                        )
                    except openai.APIError as exc:
                        outcomes.append(exc)
                        if isinstance(exc, openai.RateLimitError):
                            refused.set()

            floods = [asyncio.create_task(flood(i)) for i in range(8)]
            await asyncio.wait_for(refused.wait(), 120)  # gw-a's queue is full now
            answers: list[Any] = []
            for i in range(3):  # gw-b's own requests, during the flood: renders and logprob pieces, an encode
                answers.append(
                    await quiet.chat.completions.create(
                        model=base,
                        messages=[{"role": "user", "content": f"hello {i}"}],
                        max_tokens=2,
                        logprobs=True,
                    )
                )
            answers.append(await quiet.completions.create(model=base, prompt="one two", max_tokens=2))
            stop.set()
            await asyncio.gather(*floods)
            return outcomes, answers

    flooded, answers = asyncio.run(main())
    limited = [r for r in flooded if isinstance(r, openai.RateLimitError)]
    assert limited and all(r.code == "rate_limit_exceeded" for r in limited)
    # gw-a's admitted renders are answered too: too many tokens for the context (the sampler's 400), never a 5xx.
    others = [r for r in flooded if not isinstance(r, openai.RateLimitError)]
    assert others and all(
        isinstance(r, openai.BadRequestError) and r.code == "context_length_exceeded" for r in others
    ), others
    assert [a.object for a in answers] == ["chat.completion"] * 3 + ["text_completion"]
    assert all(a.usage.completion_tokens >= 1 for a in answers)
