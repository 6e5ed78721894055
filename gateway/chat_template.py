"""The base model's tokenizer in the gateway: chat messages -> prompt token ids through its chat template, text
prompts -> ids (as the sampler tokenizes them: no special tokens added), token ids -> the strings of logprobs.

Loaded once, on first use, off the event loop, from ``--tokenizer`` or else the name or path the trainer was
started with (it runs next to the model in every deployment we have); hub ids resolve through the local
Hugging Face cache only. Every use runs on one worker thread: a fast tokenizer is not safe to share between
threads, and a long chat template renders without holding the event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from opentinker.gateway.openai_errors import OpenAIError, invalid
from opentinker.gateway.openai_requests import Message

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


def _pieces(tokenizer: Tokenizer, ids: Sequence[int]) -> list[str]:
    return [tokenizer.decode([t]) for t in ids]


class TokenizerHandle:
    """The tokenizer, loaded on first use from ``source`` or the base model the trainer reports."""

    def __init__(self, source: str | None = None) -> None:
        self.source = source
        self._tokenizer: Tokenizer | None = None
        self._lock = asyncio.Lock()
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gateway-tokenizer")

    async def _run(self, where: str, fn: Callable[..., _T], *args: object) -> _T:
        """``fn(tokenizer, *args)`` on the tokenizer's thread; ``where``: the trainer's model, unless --tokenizer."""
        if self._tokenizer is None:
            async with self._lock:
                if self._tokenizer is None:
                    loop = asyncio.get_running_loop()
                    try:
                        self._tokenizer = await loop.run_in_executor(self._thread, _load, self.source or where)
                    except Exception as exc:  # not found offline, not a model directory
                        raise OpenAIError(
                            500, "tokenizer_unavailable", f"cannot load the tokenizer of {self.source or where!r} "
                            "(start the gateway with --tokenizer PATH)",
                        ) from exc  # fmt: skip
        call = functools.partial(fn, self._tokenizer, *args)
        return await asyncio.get_running_loop().run_in_executor(self._thread, call)

    async def render(
        self,
        source: str,
        messages: Sequence[Message],
        tools: Sequence[dict[str, object]],
        kwargs: dict[str, object],
    ) -> list[int]:
        """The prompt token ids of ``messages`` (and ``tools``), ending with the assistant's generation prompt."""
        return await self._run(source, _render, messages, tools, kwargs)

    async def encode(self, source: str, text: str) -> list[int]:
        return await self._run(source, _encode, text)

    async def pieces(self, source: str, ids: Sequence[int]) -> list[str]:
        """Each token's own text (for logprobs)."""
        return await self._run(source, _pieces, ids)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
