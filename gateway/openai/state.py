"""The OpenAI surface's own state, hung off the aiohttp app: the tokenizer its chat templates render with."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from opentinker.gateway.openai.chat_template import TokenizerHandle


@dataclass(slots=True)
class OpenAIState:
    tokenizer: TokenizerHandle = field(default_factory=TokenizerHandle)  # --tokenizer


OPENAI = web.AppKey("openai", OpenAIState)


def openai_of(request: web.Request) -> OpenAIState:
    return request.app[OPENAI]
