"""SamplingClient: sample from one adapter reference on a sampler server (Tinker-style).

    from opentinker.client import SamplingParams, ServiceClient

    with ServiceClient(sampler="127.0.0.1:7072") as service:
        sampling = service.create_sampling_client("team-a/agent@stable")
        result = sampling.sample("Once upon a time", SamplingParams(max_tokens=32, temperature=0.7), num_samples=4)
        for seq in result.sequences:
            print(seq.version.exact, seq.stop_reason, seq.text)
        for chunk in sampling.stream([1, 2, 3], SamplingParams(max_tokens=64)):
            print(chunk.text, end="", flush=True)

A client is bound to one reference: "base", "name" (its "latest"), "name@alias" or "name@N". The sampler
resolves it once per request, so each result names the exact version that produced it
(``SampledVersion``), whatever the aliases do meanwhile. Prompts are token ids (a ModelInput or a sequence
of ints) or text, which the sampler tokenizes with the base model's tokenizer (no chat template).

``cache_salt`` (sample, stream, compute_logprobs): requests with different salts share no prefix-cache
blocks, even within one tenant (different tenants never do); the same salt, or none, shares them. At most
256 UTF-8 bytes (longer: INVALID_ARGUMENT / INVALID_CACHE_SALT from the sampler).

Every method has an ``*_async`` twin on a grpc.aio channel (one per event loop, opened on first use).
Every failure is an `OpenTinkerError` with the gRPC status code and the server's ErrorInfo reason.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Generator, Sequence
from contextlib import aclosing, closing
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Protocol, TypeVar

import grpc
import grpc.aio
from google.protobuf.message import Message

from opentinker.client.connection import Connection, checked, translated
from opentinker.client.datum import ModelInput
from opentinker.client.errors import OpenTinkerError
from opentinker.client.sampling_types import (
    LoadedAdapter,
    SampleChunk,
    SampledSequence,
    SampleResult,
    SamplerStats,
    SamplingParams,
    StopReason,
)
from opentinker.client.wire import (
    constraint_to_proto,
    loaded_adapter_from_proto,
    model_input_to_proto,
    sample_chunk_from_proto,
    sampler_stats_from_proto,
    sampling_params_to_proto,
)
from opentinker.v1 import sampler_pb2, sampler_pb2_grpc

__all__ = ["Prompt", "SamplingClient"]

Prompt = ModelInput | Sequence[int] | str
"""A prompt: token ids (a ModelInput, or a list / tuple / range / 1-D integer tensor) or text."""

_STREAM_INCOMPLETE: Final = "INCOMPLETE_STREAM"

ADAPTER_HEADER: Final = "x-opentinker-adapter"


def adapter_header(model: str) -> tuple[tuple[str, str], ...]:
    """``x-opentinker-adapter: <name>`` for a call on ``model`` ("name", "name@alias", "name@N"); none for the
    base model, or for a name that cannot be a header value (the sampler refuses it with a precise status)."""
    name = model.partition("@")[0]
    if not name or name == "base" or not (name.isascii() and name.isprintable()):
        return ()
    return ((ADAPTER_HEADER, name),)


_M = TypeVar("_M", bound=Message)


class SamplerConnection(Connection[sampler_pb2_grpc.SamplerServiceStub]):
    """The channels to one sampler server, shared by the SamplingClients of one ServiceClient; adds the
    streaming Sample call to the unary ones."""

    def __init__(
        self, address: str, token: str | None = None, *, timeout: float | None = None, ca_cert: Path | None = None
    ) -> None:
        super().__init__(address, sampler_pb2_grpc.SamplerServiceStub, token, timeout=timeout, ca_cert=ca_cert)

    def call_metadata(self, request: Message) -> tuple[tuple[str, str], ...]:
        """Adds the adapter a load balancer in front of several samplers hashes on (deploy/haproxy): every
        version of one adapter then lands on the same replica."""
        return self.metadata + adapter_header(getattr(request, "model", ""))

    def sample(self, request: sampler_pb2.SampleRequest) -> Generator[sampler_pb2.SampleResponse, None, None]:
        """The Sample stream's messages; closing the generator cancels the call."""
        self.check_open()
        call: Any = None
        try:
            with translated():
                call = self.stub.Sample(request, timeout=self.timeout, metadata=self.call_metadata(request))
                for message in call:
                    yield checked(message, sampler_pb2.SampleResponse)
        finally:
            if call is not None:
                call.cancel()  # a no-op once the stream has ended

    async def sample_async(
        self, request: sampler_pb2.SampleRequest
    ) -> AsyncGenerator[sampler_pb2.SampleResponse, None]:
        stub = self.aio_stub()
        call: Any = None
        try:
            with translated():
                call = stub.Sample(request, timeout=self.timeout, metadata=self.call_metadata(request))
                async for message in call:
                    yield checked(message, sampler_pb2.SampleResponse)
        finally:
            if call is not None:
                call.cancel()


class SampleTransport(Protocol):
    """What a SamplingClient sends its calls through: one sampler (SamplerConnection) or the fleet behind a
    registry (fleet_sampling.FleetConnection, which routes, retries and continues streams)."""

    address: str

    def sample(self, request: sampler_pb2.SampleRequest) -> Generator[sampler_pb2.SampleResponse, None, None]: ...

    def sample_async(self, request: sampler_pb2.SampleRequest) -> AsyncGenerator[sampler_pb2.SampleResponse, None]: ...

    def unary(self, method: str, request: Message, response_type: type[_M]) -> _M: ...

    async def unary_async(self, method: str, request: Message, response_type: type[_M]) -> _M: ...

    def close(self) -> None: ...

    async def aclose(self) -> None: ...


# Requests and replies, shared by the sync and async methods


def _sample_request(
    reference: str,
    prompt: Prompt,
    params: SamplingParams | None,
    num_samples: int,
    prompt_logprobs: bool,
    cache_salt: str = "",
) -> sampler_pb2.SampleRequest:
    if num_samples < 1:
        raise ValueError(f"num_samples must be at least 1, got {num_samples}")
    request = sampler_pb2.SampleRequest(
        model=reference,
        sampling_params=sampling_params_to_proto(params or SamplingParams()),
        num_samples=num_samples,
        prompt_logprobs=prompt_logprobs,
        cache_salt=_cache_salt(cache_salt),
    )
    if params is not None and params.constraint is not None:
        request.constraint.CopyFrom(constraint_to_proto(params.constraint))
    if isinstance(prompt, str):
        request.prompt_text = prompt
    else:
        request.prompt.CopyFrom(model_input_to_proto(_model_input(prompt)))
    return request


def _cache_salt(salt: str) -> str:
    if not isinstance(salt, str):
        raise TypeError(f"cache_salt must be a string, got {type(salt).__name__}")
    return salt


def _model_input(tokens: ModelInput | Sequence[int]) -> ModelInput:
    return tokens if isinstance(tokens, ModelInput) else ModelInput.from_ints(tokens)


def _logprobs_request(
    reference: str, tokens: ModelInput | Sequence[int], cache_salt: str = ""
) -> sampler_pb2.ComputeLogprobsRequest:
    if isinstance(tokens, str):
        raise TypeError("compute_logprobs takes token ids, not text")
    return sampler_pb2.ComputeLogprobsRequest(
        model=reference, inputs=[model_input_to_proto(_model_input(tokens))], cache_salt=_cache_salt(cache_salt)
    )


def _logprobs_of(response: sampler_pb2.ComputeLogprobsResponse) -> tuple[float, ...]:
    if len(response.results) != 1:
        raise OpenTinkerError(grpc.StatusCode.INTERNAL, f"expected 1 result, got {len(response.results)}")
    return tuple(response.results[0].logprobs)


class _Collector:
    """Folds a Sample stream's messages into a SampleResult."""

    def __init__(self, num_samples: int, want_prompt_logprobs: bool) -> None:
        self.chunks: list[list[SampleChunk]] = [[] for _ in range(num_samples)]
        self.stop: list[StopReason | None] = [None] * num_samples
        self.prompt_logprobs: tuple[float, ...] | None = () if want_prompt_logprobs else None
        self.prompt_tokens = 0
        self._seen_prompt = False

    def add(self, message: sampler_pb2.SampleResponse) -> SampleChunk:
        chunk = sample_chunk_from_proto(message)
        if not 0 <= chunk.sample_index < len(self.chunks):
            raise OpenTinkerError(grpc.StatusCode.INTERNAL, f"unexpected sample_index {chunk.sample_index}")
        if message.prompt_tokens and not self._seen_prompt:
            self._seen_prompt = True  # each sample's first message repeats them; the first one is kept
            self.prompt_tokens = message.prompt_tokens
            if self.prompt_logprobs is not None:
                self.prompt_logprobs = tuple(message.prompt_logprobs)
        self.chunks[chunk.sample_index].append(chunk)
        if chunk.stop_reason is not None:
            self.stop[chunk.sample_index] = chunk.stop_reason
        return chunk

    def result(self) -> SampleResult:
        sequences: list[SampledSequence] = []
        for index, (chunks, stop) in enumerate(zip(self.chunks, self.stop, strict=True)):
            if stop is None or not chunks:
                raise OpenTinkerError(
                    grpc.StatusCode.INTERNAL, f"the sample stream ended before sample {index} did", _STREAM_INCOMPLETE
                )
            sequences.append(
                SampledSequence(
                    tokens=tuple(t for c in chunks for t in c.tokens),
                    logprobs=tuple(lp for c in chunks for lp in c.logprobs),
                    text="".join(c.text for c in chunks),
                    stop_reason=stop,
                    version=chunks[0].version,
                    top_logprobs=tuple(top for c in chunks for top in c.top_logprobs),
                    replicas=tuple(dict.fromkeys(c.replica for c in chunks if c.replica)),
                )
            )
        return SampleResult(
            sequences=tuple(sequences), prompt_logprobs=self.prompt_logprobs, prompt_tokens=self.prompt_tokens
        )


class SamplingClient:
    """Samples from one reference on one sampler. Thread-safe; a context manager (``with`` / ``async with``).

    ``token`` is sent as ``authorization: Bearer <token>``. ``timeout`` (seconds) is each call's deadline,
    a whole Sample stream included; None (the default) sets none. One made by
    `ServiceClient.create_sampling_client` shares the ServiceClient's channels: closing the ServiceClient
    ends it, and its own close() does nothing.
    """

    def __init__(
        self,
        address: str,
        reference: str,
        token: str | None = None,
        *,
        timeout: float | None = None,
        ca_cert: Path | None = None,
    ) -> None:
        connection = SamplerConnection(address, token, timeout=timeout, ca_cert=ca_cert)
        self._setup(reference, connection, owns_connection=True)

    @classmethod
    def _on(cls, reference: str, connection: SampleTransport) -> SamplingClient:
        """A client on a connection someone else owns (a ServiceClient's)."""
        client = cls.__new__(cls)
        client._setup(reference, connection, owns_connection=False)
        return client

    def _setup(self, reference: str, connection: SampleTransport, *, owns_connection: bool) -> None:
        if not isinstance(reference, str) or not reference:
            raise ValueError("reference must be a non-empty string: base, name, name@alias or name@N")
        self.reference = reference
        self.address = connection.address
        self._connection = connection
        self._owns_connection = owns_connection

    def __repr__(self) -> str:
        return f"SamplingClient({self.reference!r}, sampler={self.address!r})"

    # Sampling

    def sample(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        num_samples: int = 1,
        *,
        prompt_logprobs: bool = False,
        cache_salt: str = "",
    ) -> SampleResult:
        """``num_samples`` completions of ``prompt`` (params None: SamplingParams()), collected from the stream.

        ``prompt_logprobs``: also return the logprobs of the prompt's tokens 1..n-1. ``cache_salt``: this
        request's prefix-cache blocks are shared only with requests of the same salt (module docstring).
        """
        collector = _Collector(num_samples, prompt_logprobs)
        request = _sample_request(self.reference, prompt, params, num_samples, prompt_logprobs, cache_salt)
        with closing(self._connection.sample(request)) as messages:
            for message in messages:
                collector.add(message)
        return collector.result()

    async def sample_async(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        num_samples: int = 1,
        *,
        prompt_logprobs: bool = False,
        cache_salt: str = "",
    ) -> SampleResult:
        collector = _Collector(num_samples, prompt_logprobs)
        request = _sample_request(self.reference, prompt, params, num_samples, prompt_logprobs, cache_salt)
        async with aclosing(self._connection.sample_async(request)) as messages:
            async for message in messages:
                collector.add(message)
        return collector.result()

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, num_samples: int = 1, *, cache_salt: str = ""
    ) -> Generator[SampleChunk, None, None]:
        """The samples' tokens as they are generated: one chunk per sample per step, samples interleaved.

        A generator: the request starts at the first ``next()``; closing it (``close()``, leaving a ``with
        contextlib.closing(...)`` block, or dropping it) cancels the request, which stops its generation.
        """
        request = _sample_request(self.reference, prompt, params, num_samples, False, cache_salt)
        with closing(self._connection.sample(request)) as messages:
            for message in messages:
                yield sample_chunk_from_proto(message)

    async def stream_async(
        self, prompt: Prompt, params: SamplingParams | None = None, num_samples: int = 1, *, cache_salt: str = ""
    ) -> AsyncGenerator[SampleChunk, None]:
        """stream() on the async channel. To stop early, ``aclose()`` it (``contextlib.aclosing``)."""
        request = _sample_request(self.reference, prompt, params, num_samples, False, cache_salt)
        async with aclosing(self._connection.sample_async(request)) as messages:
            async for message in messages:
                yield sample_chunk_from_proto(message)

    def compute_logprobs(self, tokens: ModelInput | Sequence[int], *, cache_salt: str = "") -> tuple[float, ...]:
        """logprobs[i] = log p(tokens[i+1] | tokens[..i]) under this reference: one fewer than the tokens.
        ``cache_salt``: as for sample(); the blocks this caches are found only by requests of the same salt."""
        request = _logprobs_request(self.reference, tokens, cache_salt)
        return _logprobs_of(self._connection.unary("ComputeLogprobs", request, sampler_pb2.ComputeLogprobsResponse))

    async def compute_logprobs_async(
        self, tokens: ModelInput | Sequence[int], *, cache_salt: str = ""
    ) -> tuple[float, ...]:
        request = _logprobs_request(self.reference, tokens, cache_salt)
        response = await self._connection.unary_async("ComputeLogprobs", request, sampler_pb2.ComputeLogprobsResponse)
        return _logprobs_of(response)

    # Residency and load

    def load(self, pin: bool = False) -> LoadedAdapter:
        """Makes the referenced version resident (pinned against eviction when ``pin``); INVALID_ARGUMENT for
        "base", which is always loaded."""
        request = sampler_pb2.LoadAdapterRequest(reference=self.reference, pin=pin)
        response = self._connection.unary("LoadAdapter", request, sampler_pb2.LoadAdapterResponse)
        return loaded_adapter_from_proto(response.adapter)

    async def load_async(self, pin: bool = False) -> LoadedAdapter:
        request = sampler_pb2.LoadAdapterRequest(reference=self.reference, pin=pin)
        response = await self._connection.unary_async("LoadAdapter", request, sampler_pb2.LoadAdapterResponse)
        return loaded_adapter_from_proto(response.adapter)

    def unload(self) -> bool:
        """Releases the referenced version's slot; False when requests still hold it (it is freed when the
        last one ends). NOT_FOUND / ADAPTER_NOT_LOADED when it is not resident."""
        request = sampler_pb2.UnloadAdapterRequest(reference=self.reference)
        return self._connection.unary("UnloadAdapter", request, sampler_pb2.UnloadAdapterResponse).freed_now

    async def unload_async(self) -> bool:
        request = sampler_pb2.UnloadAdapterRequest(reference=self.reference)
        response = await self._connection.unary_async("UnloadAdapter", request, sampler_pb2.UnloadAdapterResponse)
        return response.freed_now

    def base_model(self) -> str:
        """The name or path the sampler's base model was started with (GetSamplerInfo)."""
        request = sampler_pb2.GetSamplerInfoRequest()
        return self._connection.unary("GetSamplerInfo", request, sampler_pb2.GetSamplerInfoResponse).base_model.model

    def stats(self) -> SamplerStats:
        """The sampler's current load (the whole server's, not this reference's)."""
        response = self._connection.unary("GetStats", sampler_pb2.GetStatsRequest(), sampler_pb2.GetStatsResponse)
        return sampler_stats_from_proto(response)

    async def stats_async(self) -> SamplerStats:
        request = sampler_pb2.GetStatsRequest()
        return sampler_stats_from_proto(
            await self._connection.unary_async("GetStats", request, sampler_pb2.GetStatsResponse)
        )

    # Lifetime

    def close(self) -> None:
        """Closes the channels if this client opened them; a ServiceClient's are closed with it."""
        if self._owns_connection:
            self._connection.close()

    async def aclose(self) -> None:
        if self._owns_connection:
            await self._connection.aclose()

    def __enter__(self) -> SamplingClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    async def __aenter__(self) -> SamplingClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
