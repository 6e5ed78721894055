"""The base model's tokenizer in the gateway: chat messages -> prompt token ids through its chat template, text
prompts -> ids (as the sampler tokenizes them: no special tokens added), token ids -> the strings of logprobs.

Loaded once, on first use, off the event loop, from ``--tokenizer`` or else the name or path the trainer was
started with (it runs next to the model in every deployment we have); hub ids resolve through the local
Hugging Face cache only. Every use runs on one worker thread (a fast tokenizer is not safe to share between
threads, and a long chat template renders without holding the event loop), shared by the tenants in turns
(rpc/serving/fair_executor.py): one tenant's backlog of huge conversations delays another's request by one job
at most, and a tenant with ``--max-tokenizer-jobs-per-tenant`` jobs waiting is answered 429 for the next."""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from opentinker.gateway.openai.errors import OpenAIError, invalid
from opentinker.gateway.openai.requests import Message
from opentinker.rpc.serving.fair_executor import FairExecutor, TenantQueueFull

_T = TypeVar("_T")
Tokenizer = Any  # transformers.PreTrainedTokenizerBase (transformers is untyped here)


def _load(source: str) -> Tokenizer:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a hub from the gateway
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)


def _render(
    tokenizer: Tokenizer, messages: Sequence[Message], tools: Sequence[dict[str, object]], kwargs: dict[str, object]
) -> list[int]:
    if getattr(tokenizer, "chat_template", None) is None:
        raise invalid("this model's tokenizer has no chat template: use /v1/completions", "messages")
    try:
        text = tokenizer.apply_chat_template(
            list(messages), tools=list(tools) or None, add_generation_prompt=True, tokenize=False, **kwargs
        )
    except Exception as exc:  # jinja's TemplateError and whatever a template raises for messages it refuses
        raise invalid(f"the chat template refused these messages: {str(exc)[:300]}", "messages") from exc
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return ids


def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return ids


def _template(tokenizer: Tokenizer) -> str | dict[str, str] | None:
    template: str | dict[str, str] | None = getattr(tokenizer, "chat_template", None)
    return template


def _pieces(tokenizer: Tokenizer, ids: Sequence[int]) -> list[str]:
    return [tokenizer.decode([t]) for t in ids]


class TokenizerHandle:
    """The tokenizer, loaded on first use from ``source`` or the base model the trainer reports; every call names
    the tenant it works for (its turn on the shared thread)."""

    def __init__(self, source: str | None = None, max_jobs_per_tenant: int = 64) -> None:
        self.source = source
        self._tokenizer: Tokenizer | None = None
        self._lock = asyncio.Lock()
        self._thread = FairExecutor(max_jobs_per_tenant, thread_name="gateway-tokenizer")

    async def _on_thread(self, tenant: str, call: Callable[[], _T]) -> _T:
        try:
            return await self._thread.run(tenant, call)
        except TenantQueueFull as exc:
            raise OpenAIError(
                429,
                "rate_limit_exceeded",
                f"{exc.limit} of your requests are already waiting for "
                "the gateway's tokenizer; retry when they are answered",
            ) from exc

    async def _run(self, tenant: str, where: str, fn: Callable[..., _T], *args: object) -> _T:
        """``fn(tokenizer, *args)`` on the tokenizer's thread; ``where``: the trainer's model, unless --tokenizer."""
        if self._tokenizer is None:
            async with self._lock:
                if self._tokenizer is None:
                    try:
                        self._tokenizer = await self._on_thread(tenant, functools.partial(_load, self.source or where))
                    except OpenAIError:
                        raise
                    except Exception as exc:  # not found offline, not a model directory
                        raise OpenAIError(
                            500,
                            "tokenizer_unavailable",
                            f"cannot load the tokenizer of {self.source or where!r} "
                            "(start the gateway with --tokenizer PATH)",
                        ) from exc
        return await self._on_thread(tenant, functools.partial(fn, self._tokenizer, *args))

    async def render(
        self,
        tenant: str,
        source: str,
        messages: Sequence[Message],
        tools: Sequence[dict[str, object]],
        kwargs: dict[str, object],
    ) -> list[int]:
        """The prompt token ids of ``messages`` (and ``tools``), ending with the assistant's generation prompt."""
        return await self._run(tenant, source, _render, messages, tools, kwargs)

    async def encode(self, tenant: str, source: str, text: str) -> list[int]:
        return await self._run(tenant, source, _encode, text)

    async def chat_template(self, tenant: str, source: str) -> str | dict[str, str] | None:
        """The chat template's text (tool_calls.py detects the model's tool call format from it)."""
        return await self._run(tenant, source, _template)

    async def pieces(self, tenant: str, source: str, ids: Sequence[int]) -> list[str]:
        """Each token's own text (for logprobs)."""
        return await self._run(tenant, source, _pieces, ids)

    def close(self) -> None:
        self._thread.close()
