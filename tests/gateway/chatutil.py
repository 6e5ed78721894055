"""Chats of the /v1 tests through the openai SDK: the conversation they share, the SDK's vLLM-style extra fields, a
streamed chat collected or hung up on early, chats sent at once, a greedy chat whose reply repeats a token, and
waiting for the sampler to go idle."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai
from gatewayutil import base_url
from openai.types.chat import ChatCompletionMessageParam
from openaiutil import async_openai_client
from serverproc import ServerProcess

from opentinker.client import SamplerStats, SamplingClient

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 plus 3?"},
]


def extra(obj: object, name: str) -> Any:
    """A vLLM-style extra field the SDK keeps on its pydantic models."""
    extras = getattr(obj, "model_extra", None) or {}
    return extras[name]


def stream_chat(
    gateway: ServerProcess, key: str, request: dict[str, Any]
) -> tuple[list[Any], str, list[int], list[Any]]:
    """``request`` streamed through the async SDK, usage and token ids included: the chunks, the text, the token ids
    and the finish reasons."""

    async def streamed() -> tuple[list[Any], str, list[int], list[Any]]:
        async with async_openai_client(gateway, key) as client:
            stream = await client.chat.completions.create(
                **request, stream=True, stream_options={"include_usage": True}, extra_body={"return_token_ids": True}
            )
            chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        tokens = [t for c in chunks if c.choices for t in extra(c.choices[0], "token_ids")]
        return chunks, text, tokens, [c.choices[0].finish_reason for c in chunks if c.choices]

    return asyncio.run(streamed())


def hang_up_early(gateway: ServerProcess, key: str, body: dict[str, Any]) -> None:
    """The streamed chat ``body`` over plain HTTP, the connection closed once the first data line has come."""
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream("POST", f"{base_url(gateway)}/v1/chat/completions", json=body, headers=headers) as reply:
        assert reply.status_code == 200
        lines = reply.iter_lines()
        assert next(line for line in lines if line.startswith("data: ")).startswith("data: {")


def chats_at_once(gateway: ServerProcess, key: str, bodies: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each named chat body sent at the same time through the async SDK: the replies by name."""

    async def together() -> dict[str, Any]:
        async with async_openai_client(gateway, key) as client:
            replies = await asyncio.gather(*(client.chat.completions.create(**body) for body in bodies.values()))
        return dict(zip(bodies, replies, strict=True))

    return asyncio.run(together())


def repeating_greedy_chat(client: openai.OpenAI, model: str) -> tuple[dict[str, Any], Any, list[int], list[int]]:
    """The first of 40 greedy chats with ``model`` whose reply repeats a token: the request, the reply, its token ids
    and the ids it repeats."""
    for i in range(40):
        messages = [{"role": "user", "content": f"Say {i} again."}]
        chat: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "max_tokens": 16,
            "temperature": 0.0,
            "extra_body": {"return_token_ids": True},
        }
        plain = client.chat.completions.create(**chat)
        tokens = extra(plain.choices[0], "token_ids")
        repeated = [t for t in set(tokens) if tokens.count(t) >= 2]
        if repeated:
            return chat, plain, tokens, repeated
    raise AssertionError("no chat whose greedy reply repeats a token")


def wait_until_idle(sampler: SamplingClient, timeout: float) -> SamplerStats:
    """The sampler's stats once it runs and queues no request (an assertion error after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while (stats := sampler.stats()).running_requests or stats.waiting_requests:
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)
    return stats
