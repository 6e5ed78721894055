"""A streamed /v1 answer (server-sent events): a chunk per sampler message, the finish reasons, usage, ``[DONE]``;
errors after the first token as an ``{"error": ...}`` event."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from contextlib import aclosing, suppress

from aiohttp import web

from opentinker.gateway.backend import Backend
from opentinker.gateway.openai import episode_capture, errors, responses
from opentinker.gateway.openai.answers import finish_reasons, logprobs_json
from opentinker.gateway.openai.errors import OpenAIError
from opentinker.gateway.openai.responses import DONE, Json, envelope, finish_reason, sse
from opentinker.gateway.openai.sampling_job import CHAT, COMPLETIONS, Choice, Job, exact_version, messages_of
from opentinker.gateway.state import gateway_of, principal_of
from opentinker.v1 import sampler_pb2

log = logging.getLogger(__name__)


def _chunk_choice(job: Job, choice: Choice, text: str, tokens: Sequence[int], logprobs: Json | None) -> Json:
    out: Json = {"index": choice.index}
    if job.endpoint == CHAT:
        out["delta"] = {"content": text if choice.held is None else choice.held.feed(text)}
    else:
        out["text"] = text
    out["logprobs"] = logprobs
    done = choice.stop_reason != sampler_pb2.STOP_REASON_UNSPECIFIED
    out["finish_reason"] = finish_reason(choice.stop_reason) if done and job.endpoint == COMPLETIONS else None
    if job.options.return_token_ids:
        out["token_ids"] = list(tokens)
    return out


async def stream(request: web.Request, backend: Backend, job: Job) -> web.StreamResponse:
    """SSE: a first chunk (chat: each choice's role), then one chunk per sampler message, the finish reasons,
    usage when stream_options.include_usage, ``[DONE]``. Errors before the first token are HTTP errors; later
    ones an ``{"error": ...}`` event. A client that goes away cancels the samples."""
    gw, principal = gateway_of(request), principal_of(request)
    opts = job.options
    kind = "chat.completion.chunk" if job.endpoint == CHAT else "text_completion"
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    offsets = [0] * len(job.choices)  # characters answered per choice (completions' text_offset)
    async with aclosing(messages_of(backend, job)) as messages:
        first = await anext(messages, None)  # failures before the first token are HTTP errors
        try:
            await response.prepare(request)
            head: Json
            if job.endpoint == CHAT:
                roles: list[Json] = [
                    {
                        "index": c.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                        **({"token_ids": []} if opts.return_token_ids else {}),
                    }
                    for c in job.choices
                ]
                head = envelope(kind, job.response_id, job.created, job.model or _exact_of(first, job), roles)
                if opts.return_token_ids:
                    head["prompt_token_ids"] = list(job.prompts[0])
                await response.write(sse(head))
            sent_prompt = [False] * len(job.choices)
            pending = [] if first is None else [first]
            while True:
                item = pending.pop() if pending else await anext(messages, None)
                if item is None:
                    break
                i, message = item
                choice, text = job.add(i, message)
                logprobs = None
                if opts.logprobs:
                    logprobs = await logprobs_json(
                        request, job, message.tokens, message.logprobs, message.top_logprobs, offsets[choice.index]
                    )
                offsets[choice.index] += len(text)
                out = _chunk_choice(job, choice, text, message.tokens, logprobs)
                if job.endpoint == COMPLETIONS and opts.return_token_ids and not sent_prompt[choice.index]:
                    sent_prompt[choice.index] = True
                    out["prompt_token_ids"] = list(choice.prompt)
                await response.write(sse(envelope(kind, job.response_id, job.created, job.model, [out])))
                if job.endpoint == CHAT and choice.stop_reason != sampler_pb2.STOP_REASON_UNSPECIFIED:
                    delta, reason = _held_back(choice)
                    end: Json = {
                        "index": choice.index,
                        "delta": delta,
                        "logprobs": None,
                        "finish_reason": reason or finish_reason(choice.stop_reason),
                    }
                    if opts.return_token_ids:
                        end["token_ids"] = []
                    await response.write(sse(envelope(kind, job.response_id, job.created, job.model, [end])))
            if any(c.stop_reason == sampler_pb2.STOP_REASON_UNSPECIFIED for c in job.choices):
                raise RuntimeError("the sampler's stream ended before every sample finished")
            if opts.include_usage:
                tail = envelope(kind, job.response_id, job.created, job.model, [])
                tail["usage"] = responses.usage(sum(map(len, job.prompts)), sum(len(c.tokens) for c in job.choices))
                await response.write(sse(tail))
            records = job.records(finish_reasons(job)[0])
            await episode_capture.capture(gw, principal.tenant, job.episode, records)
            await response.write(DONE)
        except ConnectionResetError:
            log.info("%s: the client went away; its samples are cancelled", job.response_id)
            return response
        except OpenAIError as exc:
            await _stream_error(response, errors.of_gateway_error(exc))
        except Exception:
            incident = uuid.uuid4().hex[:12]
            log.exception("%s %s failed mid-stream (incident %s)", request.method, request.path, incident)
            error = errors.error_json(500, "internal_error", f"internal gateway error (incident {incident})")
            await _stream_error(response, error)
    return response


def _held_back(choice: Choice) -> tuple[Json, str | None]:
    """The last chunk's delta of a streamed chat choice: the text held back that was no tool call, and the tool
    calls, all at once; "tool_calls" as the finish reason when there are some."""
    if choice.held is None:
        return {}, None
    end = choice.held.finish()
    delta: Json = {} if end.content is None else {"content": end.content}
    if end.calls:
        delta["tool_calls"] = [call.to_delta(i) for i, call in enumerate(end.calls)]
    return delta, end.finish_reason


def _exact_of(first: tuple[int, sampler_pb2.SampleResponse] | None, job: Job) -> str:
    return job.model if first is None else exact_version(first[1].version, job.base)


async def _stream_error(response: web.StreamResponse, error: Json) -> None:
    with suppress(ConnectionResetError):
        await response.write(sse(error))
