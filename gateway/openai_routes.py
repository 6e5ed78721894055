"""The OpenAI-compatible surface under /v1, next to the tinker routes in the same gateway process:
GET /v1/models, GET /v1/models/{id}, POST /v1/chat/completions, POST /v1/completions.

``model`` is any reference of the caller's tenant (``team/agent`` = its serving alias, ``team/agent@stable``,
``team/agent@12``, a bare ``agent`` = ``<tenant>/agent``) or the base model's id; another tenant's adapter is
answered 404 exactly like a missing one. Each request is one Sample stream per prompt on the sampler (the n
choices are its num_samples), pinned to one exact version at admission: the answer's ``model`` names it."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing, suppress
from dataclasses import dataclass, field

from aiohttp import web

from opentinker.client.errors import OpenTinkerError
from opentinker.gateway import episode_capture, openai_errors, openai_responses, tool_calls
from opentinker.gateway.backend import Backend, BaseModelInfo
from opentinker.gateway.bodies import parse_json
from opentinker.gateway.openai_errors import OpenAIError, model_not_found
from opentinker.gateway.openai_records import EPISODE_HEADER, CompletedChoice, episode_id
from opentinker.gateway.openai_requests import SamplingOptions, chat_request, completion_request, text_size
from opentinker.gateway.openai_responses import DONE, Json, envelope, finish_reason, sse
from opentinker.gateway.state import JSON_INLINE_BYTES, backend_of, gateway_of, principal_of
from opentinker.gateway.stop_strings import StopCut
from opentinker.rpc.errors import InvalidArgument
from opentinker.v1 import common_pb2, registry_pb2, sampler_pb2
from opentinker.weights.names import BASE, parse_reference, tenant_of

log = logging.getLogger(__name__)

DEFAULT_CONTEXT = 4096  # the sampler's context unless --max-len says otherwise: the default max_tokens' bound
# The most text the gateway renders or encodes per token of the context (as the sampler bounds prompt_text): more
# cannot fit in the context, and it would hold the tokenizer thread every tenant shares for seconds.
TEXT_CHARS_PER_TOKEN = 16
CHAT, COMPLETIONS = "chat.completions", "completions"


# References and bodies


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


async def _body(request: web.Request) -> dict[str, object]:
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


def _exact(version: common_pb2.ResolvedVersion, base: BaseModelInfo) -> str:
    return f"{version.adapter}@{version.version}" if version.adapter else base.model


def _backend_error(exc: OpenTinkerError, model: str) -> Exception:
    translated = openai_errors.from_backend(exc, model)
    return exc if translated is None else translated  # a server-side failure: the middleware's 500 and incident


# One request's sampling


@dataclass(slots=True)
class _Choice:
    index: int
    prompt: tuple[int, ...]
    cut: StopCut
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[sampler_pb2.TopLogprobs] = field(default_factory=list)  # one per token when top_logprobs is asked
    stop_reason: int = sampler_pb2.STOP_REASON_UNSPECIFIED
    finished_at: float = 0.0
    held: tool_calls.ToolCallStream | None = None  # streamed chat with tools: text that may be a tool call waits


@dataclass(slots=True)
class _Job:
    endpoint: str
    response_id: str
    requested: str  # the model as the caller named it (error messages)
    reference: str
    prompts: tuple[tuple[int, ...], ...]
    options: SamplingOptions
    base: BaseModelInfo
    tokenizer_source: str
    tools: tuple[dict[str, object], ...] = ()
    episode: str | None = None
    tool_format: tool_calls.ToolCallFormat = "none"  # "none": the output is never parsed for tool calls
    created: int = field(default_factory=lambda: int(time.time()))
    started_at: float = field(default_factory=time.time)
    model: str = ""  # the exact version, from the sampler's first message
    choices: list[_Choice] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = self.options.n
        self.choices = [
            _Choice(i * n + j, prompt, StopCut(self.options.stop))
            for i, prompt in enumerate(self.prompts)
            for j in range(n)
        ]

    def sample_request(self, i: int) -> sampler_pb2.SampleRequest:
        prompt, opts = self.prompts[i], self.options
        max_tokens = opts.max_tokens
        if max_tokens is None:
            max_tokens = min(self.base.max_positions or DEFAULT_CONTEXT, DEFAULT_CONTEXT) - len(prompt)
            if max_tokens < 1:
                raise OpenAIError(
                    400,
                    "context_length_exceeded",
                    f"the prompt has {len(prompt)} tokens; the context has no room for a completion",
                    "messages",
                )
        params = sampler_pb2.SamplingParams(
            temperature=opts.temperature,
            top_p=opts.top_p if opts.top_p < 1.0 else 0.0,
            max_tokens=max_tokens,
            stop_strings=opts.stop,
            logprobs=True,  # always: the records keep the sampler's logprobs
            top_logprobs=opts.top_logprobs,
            frequency_penalty=opts.frequency_penalty,
            presence_penalty=opts.presence_penalty,
        )
        if opts.seed is not None:
            params.seed = opts.seed
        return sampler_pb2.SampleRequest(
            model=self.reference,
            prompt=common_pb2.ModelInput(
                chunks=[common_pb2.ModelInputChunk(encoded_text=common_pb2.EncodedTextChunk(tokens=prompt))]
            ),
            sampling_params=params,
            num_samples=opts.n,
            request_id=self.response_id,
            cache_salt=opts.cache_salt,
        )

    def add(self, i: int, message: sampler_pb2.SampleResponse) -> tuple[_Choice, str]:
        """Folds one sampler message in: the choice it belongs to and the text that may be sent now."""
        if not 0 <= message.sample_index < self.options.n:
            raise RuntimeError(f"the sampler answered sample_index {message.sample_index} of {self.options.n}")
        choice = self.choices[i * self.options.n + message.sample_index]
        self.model = self.model or _exact(message.version, self.base)
        if self.options.top_logprobs and len(message.top_logprobs) != len(message.tokens):
            raise RuntimeError(
                f"the sampler answered {len(message.top_logprobs)} top logprobs for {len(message.tokens)} tokens"
            )
        choice.tokens.extend(message.tokens)
        choice.logprobs.extend(message.logprobs)
        choice.top.extend(message.top_logprobs)
        text = choice.cut.feed(message.text)
        if message.stop_reason != sampler_pb2.STOP_REASON_UNSPECIFIED:
            choice.stop_reason = message.stop_reason
            choice.finished_at = time.time()
            text += choice.cut.finish()
        return choice, text

    def records(self, reasons: Sequence[str]) -> list[CompletedChoice]:
        return [
            CompletedChoice(
                request_id=self.response_id,
                index=c.index,
                endpoint=self.endpoint,
                prompt_token_ids=c.prompt,
                token_ids=tuple(c.tokens),
                logprobs=tuple(c.logprobs),
                model=self.model,
                finish_reason=reason,
                text=c.cut.answer,
                started_at=self.started_at,
                finished_at=c.finished_at,
            )
            for c, reason in zip(self.choices, reasons, strict=True)
        ]


Tagged = tuple[int, sampler_pb2.SampleResponse]  # a sampler message and the index of its prompt


async def _merged(streams: Sequence[AsyncGenerator[sampler_pb2.SampleResponse, None]]) -> AsyncGenerator[Tagged, None]:
    """Several prompts' Sample streams as one, each message tagged with its prompt's index."""
    queue: asyncio.Queue[Tagged | BaseException | None] = asyncio.Queue()

    async def pump(i: int, stream: AsyncGenerator[sampler_pb2.SampleResponse, None]) -> None:
        try:
            async for message in stream:
                await queue.put((i, message))
            await queue.put(None)
        except Exception as exc:
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        ended = 0
        while ended < len(tasks):
            item = await queue.get()
            if item is None:
                ended += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()  # cancels each Sample call: the sampler frees its sequences
        await asyncio.gather(*tasks, return_exceptions=True)


async def _messages(backend: Backend, job: _Job) -> AsyncGenerator[Tagged, None]:
    """Every sampler message of the job, tagged with its prompt's index; closing it cancels the samples."""
    requests = [job.sample_request(i) for i in range(len(job.prompts))]
    streams = [backend.sampler.sample_async(r) for r in requests]
    try:
        if len(streams) == 1:
            async for message in streams[0]:
                yield 0, message
        else:
            async for tagged in _merged(streams):
                yield tagged
    except OpenTinkerError as exc:
        raise _backend_error(exc, job.requested) from exc
    finally:
        for stream in streams:
            await stream.aclose()


# Answers


async def _logprobs(
    request: web.Request,
    job: _Job,
    tokens: Sequence[int],
    logprobs: Sequence[float],
    top: Sequence[sampler_pb2.TopLogprobs],
    offset: int,
) -> Json:
    """The logprobs of `tokens` in the endpoint's form, their texts and their alternatives' in one tokenizer job
    (``offset``: completions' characters already answered)."""
    gw, principal = gateway_of(request), principal_of(request)
    ids = [*tokens, *(t for alternatives in top for t in alternatives.token_ids)]
    texts = await gw.tokenizer.pieces(principal.tenant, job.tokenizer_source, ids)
    pieces, rest = texts[: len(tokens)], iter(texts[len(tokens) :])
    ranked: list[openai_responses.Alternatives] = [
        [(next(rest), logprob) for logprob in alternatives.logprobs] for alternatives in top
    ]
    if job.endpoint == CHAT:
        return openai_responses.chat_logprobs(pieces, logprobs, ranked if top else [[] for _ in tokens])
    return openai_responses.completion_logprobs(pieces, logprobs, ranked if job.options.top_logprobs else None, offset)


def _finish_reasons(job: _Job) -> tuple[list[str], list[tool_calls.Parsed | None]]:
    reasons, parsed = [], []
    for choice in job.choices:
        parse = job.endpoint == CHAT and job.tool_format != "none"
        calls = tool_calls.parse_tool_calls(choice.cut.answer, job.tool_format) if parse else None
        parsed.append(calls)
        reasons.append("tool_calls" if calls is not None and calls.calls else finish_reason(choice.stop_reason))
    return reasons, parsed


async def _answer(request: web.Request, backend: Backend, job: _Job) -> web.Response:
    gw, principal = gateway_of(request), principal_of(request)
    async with aclosing(_messages(backend, job)) as messages:
        async for i, message in messages:
            job.add(i, message)
    if any(c.stop_reason == sampler_pb2.STOP_REASON_UNSPECIFIED for c in job.choices):
        raise RuntimeError("the sampler's stream ended before every sample finished")
    reasons, parsed = _finish_reasons(job)
    opts, choices = job.options, []
    for choice, reason, calls in zip(job.choices, reasons, parsed, strict=True):
        out: Json = {"index": choice.index}
        logprobs = (
            await _logprobs(request, job, choice.tokens, choice.logprobs, choice.top, 0) if opts.logprobs else None
        )
        if job.endpoint == CHAT:
            content = choice.cut.answer if calls is None else calls.content
            out["message"] = openai_responses.chat_message(content, calls.calls if calls is not None else ())
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
    answer["usage"] = openai_responses.usage(sum(map(len, job.prompts)), sum(len(c.tokens) for c in job.choices))
    if opts.return_token_ids and len(job.prompts) == 1:
        answer["prompt_token_ids"] = list(job.prompts[0])
    await episode_capture.capture(gw, principal.tenant, job.episode, job.records(reasons))
    return web.json_response(answer)


def _chunk_choice(job: _Job, choice: _Choice, text: str, tokens: Sequence[int], logprobs: Json | None) -> Json:
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


async def _stream(request: web.Request, backend: Backend, job: _Job) -> web.StreamResponse:
    """SSE: a first chunk (chat: each choice's role), then one chunk per sampler message, the finish reasons,
    usage when stream_options.include_usage, ``[DONE]``. Errors before the first token are HTTP errors; later
    ones an ``{"error": ...}`` event. A client that goes away cancels the samples."""
    gw, principal = gateway_of(request), principal_of(request)
    opts = job.options
    kind = "chat.completion.chunk" if job.endpoint == CHAT else "text_completion"
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    offsets = [0] * len(job.choices)  # characters answered per choice (completions' text_offset)
    async with aclosing(_messages(backend, job)) as messages:
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
                    logprobs = await _logprobs(
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
                tail["usage"] = openai_responses.usage(
                    sum(map(len, job.prompts)), sum(len(c.tokens) for c in job.choices)
                )
                await response.write(sse(tail))
            records = job.records(_finish_reasons(job)[0])
            await episode_capture.capture(gw, principal.tenant, job.episode, records)
            await response.write(DONE)
        except ConnectionResetError:
            log.info("%s: the client went away; its samples are cancelled", job.response_id)
            return response
        except OpenAIError as exc:
            await _stream_error(response, openai_errors.of_gateway_error(exc))
        except Exception:
            incident = uuid.uuid4().hex[:12]
            log.exception("%s %s failed mid-stream (incident %s)", request.method, request.path, incident)
            error = openai_errors.error_json(500, "internal_error", f"internal gateway error (incident {incident})")
            await _stream_error(response, error)
    return response


def _held_back(choice: _Choice) -> tuple[Json, str | None]:
    """The last chunk's delta of a streamed chat choice: the text held back that was no tool call, and the tool
    calls, all at once; "tool_calls" as the finish reason when there are some."""
    if choice.held is None:
        return {}, None
    end = choice.held.finish()
    delta: Json = {} if end.content is None else {"content": end.content}
    if end.calls:
        delta["tool_calls"] = [call.to_delta(i) for i, call in enumerate(end.calls)]
    return delta, end.finish_reason


def _exact_of(first: tuple[int, sampler_pb2.SampleResponse] | None, job: _Job) -> str:
    return job.model if first is None else _exact(first[1].version, job.base)


async def _stream_error(response: web.StreamResponse, error: Json) -> None:
    with suppress(ConnectionResetError):
        await response.write(sse(error))


# Handlers


async def chat_completions(request: web.Request) -> web.StreamResponse:
    gw, principal, backend = gateway_of(request), principal_of(request), backend_of(request)
    body = await _body(request)
    parsed = chat_request(body, gw.config.max_num_samples)
    episode = episode_id(request.headers.get(EPISODE_HEADER), parsed.metadata_episode)
    episode_capture.check_capturable(episode, parsed.options.n)
    base = await gw.backends.base_model(principal.token)
    ref = reference(parsed.model, principal.tenant, base)
    check_text_fits(
        text_size(parsed.messages) + text_size(parsed.tools) + text_size(parsed.template_kwargs), base, "messages"
    )
    source = base.started_as
    prompt = await gw.tokenizer.render(principal.tenant, source, parsed.messages, parsed.tools, parsed.template_kwargs)
    job = _Job(
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
    if tool_calls.wanted(parsed.tools, parsed.tool_choice):
        parser = gw.config.tool_call_parser
        template = await gw.tokenizer.chat_template(principal.tenant, source) if parser == "auto" else None
        job.tool_format = tool_calls.resolve_format(parser, template)  # type: ignore[arg-type]  # checked by the CLI
        if parsed.options.stream:
            for choice in job.choices:
                choice.held = tool_calls.ToolCallStream(job.tool_format)
    return await (_stream if parsed.options.stream else _answer)(request, backend, job)


async def completions(request: web.Request) -> web.StreamResponse:
    gw, principal, backend = gateway_of(request), principal_of(request), backend_of(request)
    body = await _body(request)
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
        p if isinstance(p, tuple) else tuple(await gw.tokenizer.encode(principal.tenant, source, p))
        for p in parsed.prompts
    ]
    job = _Job(
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
    return await (_stream if parsed.options.stream else _answer)(request, backend, job)


def _base_json(base: BaseModelInfo) -> Json:
    return {
        "id": base.model,
        "object": "model",
        "created": 0,
        "owned_by": "opentinker",
        "root": base.model,
        "parent": None,
        "max_model_len": base.max_positions,
    }


def _adapter_json(adapter: registry_pb2.Adapter, base: BaseModelInfo, model_id: str | None = None) -> Json:
    return {
        "id": model_id or adapter.name,
        "object": "model",
        "created": adapter.create_time.seconds,
        "owned_by": adapter.tenant,
        "root": adapter.name,
        "parent": base.model,
        "aliases": dict(adapter.aliases),
        "latest_version": adapter.latest_version,
        "serving_alias": adapter.serving_alias or "latest",
    }


async def _tenant_adapters(backend: Backend, tenant: str) -> list[registry_pb2.Adapter]:
    prefix, token = f"{tenant}/", ""
    found: list[registry_pb2.Adapter] = []
    while True:
        page = registry_pb2.ListAdaptersRequest(prefix=prefix, page_size=1000, page_token=token)
        reply = await backend.registry.unary_async("ListAdapters", page, registry_pb2.ListAdaptersResponse)
        found.extend(a for a in reply.adapters if a.name.startswith(prefix))  # another tenant's: never
        token = reply.next_page_token
        if not token:
            return found


async def list_models(request: web.Request) -> web.Response:
    gw, principal, backend = gateway_of(request), principal_of(request), backend_of(request)
    base = await gw.backends.base_model(principal.token)
    adapters = await _tenant_adapters(backend, principal.tenant)
    data = [_base_json(base), *(_adapter_json(a, base) for a in adapters)]
    return web.json_response({"object": "list", "data": data})


async def get_model(request: web.Request) -> web.Response:
    gw, principal, backend = gateway_of(request), principal_of(request), backend_of(request)
    model = request.match_info["model"]
    base = await gw.backends.base_model(principal.token)
    ref = reference(model, principal.tenant, base)
    if ref == BASE:
        return web.json_response(_base_json(base))
    name = ref.partition("@")[0]
    try:
        got = await backend.registry.unary_async(
            "GetAdapter", registry_pb2.GetAdapterRequest(name=name), registry_pb2.GetAdapterResponse
        )
        answer = _adapter_json(got.adapter, base, model)
        if "@" in ref:
            resolved = await backend.registry.unary_async(
                "Resolve", registry_pb2.ResolveRequest(reference=ref), registry_pb2.ResolveResponse
            )
            answer["version"] = resolved.resolved.version
    except OpenTinkerError as exc:
        raise _backend_error(exc, model) from exc
    return web.json_response(answer)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", get_model)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
