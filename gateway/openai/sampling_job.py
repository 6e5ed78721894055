"""One /v1 request's sampling: the job (its prompts, options and the exact version it samples) and its choices
as the sampler's messages fold in, and the messages of its Sample streams (one per prompt), merged."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field

from opentinker.client.errors import OpenTinkerError
from opentinker.gateway.backend import Backend, BaseModelInfo
from opentinker.gateway.openai import tool_calls
from opentinker.gateway.openai.admission import DEFAULT_CONTEXT
from opentinker.gateway.openai.errors import OpenAIError, backend_error
from opentinker.gateway.openai.records import CompletedChoice
from opentinker.gateway.openai.requests import SamplingOptions
from opentinker.gateway.openai.stop_strings import StopCut
from opentinker.gateway.openai.structured import OutputConstraint
from opentinker.v1 import common_pb2, sampler_pb2

CHAT, COMPLETIONS = "chat.completions", "completions"


def exact_version(version: common_pb2.ResolvedVersion, base: BaseModelInfo) -> str:
    return f"{version.adapter}@{version.version}" if version.adapter else base.model


@dataclass(slots=True)
class Choice:
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
class Job:
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
    constraint: OutputConstraint | None = None  # the grammar every choice follows (structured.py); None: free
    created: int = field(default_factory=lambda: int(time.time()))
    started_at: float = field(default_factory=time.time)
    model: str = ""  # the exact version, from the sampler's first message
    choices: list[Choice] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = self.options.n
        self.choices = [
            Choice(i * n + j, prompt, StopCut(self.options.stop))
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
            constraint=None if self.constraint is None else self.constraint.to_proto(),
        )

    def add(self, i: int, message: sampler_pb2.SampleResponse) -> tuple[Choice, str]:
        """Folds one sampler message in: the choice it belongs to and the text that may be sent now."""
        if not 0 <= message.sample_index < self.options.n:
            raise RuntimeError(f"the sampler answered sample_index {message.sample_index} of {self.options.n}")
        choice = self.choices[i * self.options.n + message.sample_index]
        self.model = self.model or exact_version(message.version, self.base)
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
                constraint=None if self.constraint is None else self.constraint.to_record(),
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


async def messages_of(backend: Backend, job: Job) -> AsyncGenerator[Tagged, None]:
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
        error = backend_error(exc, job.requested)
        if isinstance(error, OpenAIError) and error.param == "constraint" and job.constraint is not None:
            error.param = job.constraint.param  # the field of the request that carried the grammar
        raise error from exc
    finally:
        for stream in streams:
            await stream.aclose()
