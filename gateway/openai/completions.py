"""POST /v1/chat/completions and POST /v1/completions: a body checked into its request, the prompt rendered
(chat template) or encoded, then one sampling job answered whole or streamed."""

from __future__ import annotations

import uuid

from aiohttp import web

from opentinker.gateway.openai import episode_capture, structured, tool_calls
from opentinker.gateway.openai.admission import check_text_fits, json_body, reference
from opentinker.gateway.openai.answers import answer
from opentinker.gateway.openai.body_fields import text_size
from opentinker.gateway.openai.records import EPISODE_HEADER, episode_id
from opentinker.gateway.openai.requests import chat_request, completion_request
from opentinker.gateway.openai.sampling_job import CHAT, COMPLETIONS, Job
from opentinker.gateway.openai.state import openai_of
from opentinker.gateway.openai.streaming import stream
from opentinker.gateway.state import backend_of, gateway_of, principal_of


async def chat_completions(request: web.Request) -> web.StreamResponse:
    gw, principal, backend = gateway_of(request), principal_of(request), backend_of(request)
    tokenizer = openai_of(request).tokenizer
    body = await json_body(request)
    parsed = chat_request(body, gw.config.max_num_samples)
    episode = episode_id(request.headers.get(EPISODE_HEADER), parsed.metadata_episode)
    episode_capture.check_capturable(episode, parsed.options.n)
    base = await gw.backends.base_model(principal.token)
    ref = reference(parsed.model, principal.tenant, base)
    check_text_fits(
        text_size(parsed.messages) + text_size(parsed.tools) + text_size(parsed.template_kwargs), base, "messages"
    )
    source = base.started_as
    prompt = await tokenizer.render(principal.tenant, source, parsed.messages, parsed.tools, parsed.template_kwargs)
    job = Job(
        CHAT,
        f"chatcmpl-{uuid.uuid4().hex}",
        parsed.model,
        ref,
        (tuple(prompt),),
        parsed.options,
        base,
        source,
        parsed.tools,
        episode,
    )
    if tool_calls.wanted(parsed.tools, parsed.tool_choice.mode):
        parser = gw.config.tool_call_parser
        template = await tokenizer.chat_template(principal.tenant, source) if parser == "auto" else None
        job.tool_format = tool_calls.resolve_format(parser, template)  # type: ignore[arg-type]  # checked by the CLI
        if parsed.options.stream:
            for choice in job.choices:
                choice.held = tool_calls.ToolCallStream(job.tool_format)
    job.constraint = structured.constraint(parsed.response_format, parsed.tool_choice, parsed.tools, job.tool_format)
    return await (stream if parsed.options.stream else answer)(request, backend, job)


async def completions(request: web.Request) -> web.StreamResponse:
    gw, principal, backend = gateway_of(request), principal_of(request), backend_of(request)
    tokenizer = openai_of(request).tokenizer
    body = await json_body(request)
    parsed = completion_request(body, gw.config.max_num_samples)
    episode = episode_id(request.headers.get(EPISODE_HEADER), parsed.metadata_episode)
    episode_capture.check_capturable(episode, parsed.options.n * len(parsed.prompts))
    base = await gw.backends.base_model(principal.token)
    ref = reference(parsed.model, principal.tenant, base)
    for text in parsed.prompts:
        if isinstance(text, str):
            check_text_fits(len(text), base, "prompt")
    source = base.started_as
    prompts = [
        p if isinstance(p, tuple) else tuple(await tokenizer.encode(principal.tenant, source, p))
        for p in parsed.prompts
    ]
    job = Job(
        COMPLETIONS,
        f"cmpl-{uuid.uuid4().hex}",
        parsed.model,
        ref,
        tuple(prompts),
        parsed.options,
        base,
        source,
        (),
        episode,
    )
    job.constraint = structured.constraint(parsed.response_format, structured.ToolChoice(), (), "none")
    return await (stream if parsed.options.stream else answer)(request, backend, job)
