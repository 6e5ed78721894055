"""What every /v1 request is admitted with before it samples: its JSON body, the sampler reference its ``model``
names for the caller's tenant (404 for anything else), and a check that its text can fit in the context."""

from __future__ import annotations

import asyncio
import functools

from aiohttp import web

from opentinker.gateway.backend import BaseModelInfo
from opentinker.gateway.bodies import JSON_INLINE_BYTES, parse_json
from opentinker.gateway.openai.errors import OpenAIError, model_not_found
from opentinker.gateway.state import gateway_of
from opentinker.rpc.serving.errors import InvalidArgument
from opentinker.weights.names import BASE, parse_reference, tenant_of

DEFAULT_CONTEXT = 4096  # the sampler's context unless --max-len says otherwise: the default max_tokens' bound
# The most text the gateway renders or encodes per token of the context (as the sampler bounds prompt_text): more
# cannot fit in the context, and it would hold the tokenizer thread every tenant shares for seconds.
TEXT_CHARS_PER_TOKEN = 16


def reference(model: str, tenant: str, base: BaseModelInfo) -> str:
    """The sampler reference ``model`` names for ``tenant``; 404 for anything it may not sample."""
    if model == BASE or base.matches(model):
        return BASE
    name, at, suffix = model.partition("@")
    if "/" not in name:
        name = f"{tenant}/{name}"
    elif tenant_of(name) != tenant:
        raise model_not_found(model)
    try:
        parse_reference(f"{name}{at}{suffix}")
    except InvalidArgument:
        raise model_not_found(model) from None
    return f"{name}{at}{suffix}"


async def json_body(request: web.Request) -> dict[str, object]:
    """The JSON body: the tinker routes' size and depth bounds, but strings as long as the body (long chats)."""
    gw = gateway_of(request)
    raw = await request.read()
    limit = gw.config.max_json_bytes
    parse = functools.partial(parse_json, raw, max_bytes=limit, max_string=limit)
    if len(raw) <= JSON_INLINE_BYTES or len(raw) > limit:
        return parse()
    async with gw.json_slots:
        return await asyncio.to_thread(parse, yielding=True)


def check_text_fits(chars: int, base: BaseModelInfo, param: str) -> None:
    """400 context_length_exceeded, before any tokenizing, for text that cannot fit in the model's context."""
    context = base.max_positions or DEFAULT_CONTEXT
    if chars > TEXT_CHARS_PER_TOKEN * context:
        raise OpenAIError(
            400,
            "context_length_exceeded",
            f"the request holds {chars:,} characters of text, more "
            f"than a {context:,}-token context can hold (the gateway tokenizes at most "
            f"{TEXT_CHARS_PER_TOKEN} characters per token of the context)",
            param,
        )
