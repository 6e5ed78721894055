"""A non-streamed /v1 answer: every choice sampled to its end, then one JSON body (chat message or completion
text, logprobs, finish reasons, usage), the choices captured into their episode."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import aclosing

from aiohttp import web

from opentinker.gateway.backend import Backend
from opentinker.gateway.openai import episode_capture, responses, tool_calls
from opentinker.gateway.openai.responses import Json, envelope, finish_reason
from opentinker.gateway.openai.sampling_job import CHAT, Job, messages_of
from opentinker.gateway.openai.state import openai_of
from opentinker.gateway.state import gateway_of, principal_of
from opentinker.v1 import sampler_pb2


async def logprobs_json(
    request: web.Request,
    job: Job,
    tokens: Sequence[int],
    logprobs: Sequence[float],
    top: Sequence[sampler_pb2.TopLogprobs],
    offset: int,
) -> Json:
    """The logprobs of `tokens` in the endpoint's form, their texts and their alternatives' in one tokenizer job
    (``offset``: completions' characters already answered)."""
    principal = principal_of(request)
    ids = [*tokens, *(t for alternatives in top for t in alternatives.token_ids)]
    texts = await openai_of(request).tokenizer.pieces(principal.tenant, job.tokenizer_source, ids)
    pieces, rest = texts[: len(tokens)], iter(texts[len(tokens) :])
    ranked: list[responses.Alternatives] = [
        [(next(rest), logprob) for logprob in alternatives.logprobs] for alternatives in top
    ]
    if job.endpoint == CHAT:
        return responses.chat_logprobs(pieces, logprobs, ranked if top else [[] for _ in tokens])
    return responses.completion_logprobs(pieces, logprobs, ranked if job.options.top_logprobs else None, offset)


def finish_reasons(job: Job) -> tuple[list[str], list[tool_calls.Parsed | None]]:
    reasons, parsed = [], []
    for choice in job.choices:
        parse = job.endpoint == CHAT and job.tool_format != "none"
        calls = tool_calls.parse_tool_calls(choice.cut.answer, job.tool_format) if parse else None
        parsed.append(calls)
        reasons.append("tool_calls" if calls is not None and calls.calls else finish_reason(choice.stop_reason))
    return reasons, parsed


async def answer(request: web.Request, backend: Backend, job: Job) -> web.Response:
    gw, principal = gateway_of(request), principal_of(request)
    async with aclosing(messages_of(backend, job)) as messages:
        async for i, message in messages:
            job.add(i, message)
    if any(c.stop_reason == sampler_pb2.STOP_REASON_UNSPECIFIED for c in job.choices):
        raise RuntimeError("the sampler's stream ended before every sample finished")
    reasons, parsed = finish_reasons(job)
    opts, choices = job.options, []
    for choice, reason, calls in zip(job.choices, reasons, parsed, strict=True):
        out: Json = {"index": choice.index}
        logprobs = (
            await logprobs_json(request, job, choice.tokens, choice.logprobs, choice.top, 0) if opts.logprobs else None
        )
        if job.endpoint == CHAT:
            content = choice.cut.answer if calls is None else calls.content
            out["message"] = responses.chat_message(content, calls.calls if calls is not None else ())
            out["logprobs"] = logprobs
        else:
            out["text"] = choice.cut.answer
            out["logprobs"] = logprobs
            if opts.return_token_ids:
                out["prompt_token_ids"] = list(choice.prompt)
        out["finish_reason"] = reason
        if opts.return_token_ids:
            out["token_ids"] = choice.tokens
        choices.append(out)
    kind = "chat.completion" if job.endpoint == CHAT else "text_completion"
    answer = envelope(kind, job.response_id, job.created, job.model, choices)
    answer["system_fingerprint"] = None
    answer["usage"] = responses.usage(sum(map(len, job.prompts)), sum(len(c.tokens) for c in job.choices))
    if opts.return_token_ids and len(job.prompts) == 1:
        answer["prompt_token_ids"] = list(job.prompts[0])
    await episode_capture.capture(gw, principal.tenant, job.episode, job.records(reasons))
    return web.json_response(answer)
