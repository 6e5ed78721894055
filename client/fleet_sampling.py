"""Sampling through the fleet: the transport a SamplingClient uses when its ServiceClient has a registry and no
sampler address. Each request goes where client/fleet_router.py says; a replica that fails before the first
token is replaced by the next in hash order, and a stream that already delivered tokens continues on another
replica serving the same exact version, so the caller sees one stream.

Continuing a stream: the version the first message named is pinned (`name@N`), and each unfinished sample
goes on as its own request whose prompt is the original prompt plus the tokens already delivered, with
max_tokens less what was delivered; stop tokens, stop strings, logprobs and top_logprobs carry on. Greedy
samples are exact (the rest of a sample depends only on the version and the prefix). Not exact: seeded
sampling at temperature > 0 (the continuation is a fresh sample of the same distribution), frequency and
presence penalties (the delivered tokens become prompt, which penalties do not count), and a stop string
that would have spanned the break. A text prompt (prompt_text) cannot be extended with token ids, nor a
constrained sample's grammar resumed part way on another replica: they are retried only before their first token.

Per client, `name@latest` never goes backwards across replicas: the highest version seen of each adapter is
remembered (for FLOOR_TTL_S), and a replica that answers with an older one (its hot reload not through yet)
is asked again for that version exactly. Other aliases and bare names are not held up: a rollback of them is
meant to take effect at once.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncGenerator, Generator, Iterator
from contextlib import aclosing, closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, TypeVar

import grpc
from google.protobuf.message import Message

from opentinker.client.errors import OpenTinkerError
from opentinker.client.fleet_router import FleetRouter
from opentinker.client.fleet_types import Replica
from opentinker.client.registry_client import RegistryClient
from opentinker.client.sampling_client import SamplerConnection
from opentinker.v1 import common_pb2, sampler_pb2

M = TypeVar("M", bound=Message)

LISTING_TTL_S: Final = 1.0  # the fleet listing is read again at most this often (a lease is ~3 s)
# How long the @latest floor holds: far longer than replicas' hot reloads lag one another (tens of ms), short
# enough that a rollback of latest reaches this client too.
FLOOR_TTL_S: Final = 30.0
# A replica answering these is skipped for this request: gone, restarting, or full.
_FAILOVER: Final = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED})
_FULL: Final = frozenset({"QUEUE_FULL", "TENANT_QUEUE_FULL"})
_IDEMPOTENT: Final = frozenset({"ComputeLogprobs", "GetSamplerInfo", "GetStats", "ListLoaded", "LoadAdapter"})


def adapter_of(reference: str) -> str | None:
    """The adapter a reference names ("team/agent" of "team/agent@7"); None for the base model."""
    name = reference.partition("@")[0]
    return None if name in ("", "base") else name


def _follows_latest(reference: str) -> bool:
    """Whether the @latest floor applies: `name@latest` only. Other aliases and bare names (the serving alias)
    may be moved back on purpose (a rollback), and name@N is exact anyway."""
    return reference.partition("@")[2] == "latest"


def _should_fail_over(error: OpenTinkerError) -> bool:
    return error.code in _FAILOVER or (error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and error.reason in _FULL)


@dataclass
class _Leg:
    """One request on the wire and how its sample indexes map back to the caller's."""

    request: sampler_pb2.SampleRequest
    indexes: list[int]  # leg sample index -> caller sample index


@dataclass
class _Stream:
    """What the caller has received so far, from which the next legs are built after a failure."""

    original: sampler_pb2.SampleRequest
    delivered: dict[int, list[int]] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)
    version: common_pb2.ResolvedVersion | None = None

    def received(self, leg: _Leg, message: sampler_pb2.SampleResponse) -> sampler_pb2.SampleResponse:
        index = leg.indexes[message.sample_index]
        self.delivered.setdefault(index, []).extend(message.tokens)
        if message.stop_reason != sampler_pb2.STOP_REASON_UNSPECIFIED:
            self.finished.add(index)
        if self.version is None:
            self.version = message.version
        message.sample_index = index
        return message

    def continuations(self, leg: _Leg, error: OpenTinkerError) -> list[_Leg]:
        """The legs that finish ``leg``'s samples elsewhere; raises ``error`` when that cannot be exact."""
        unfinished = [i for i in leg.indexes if i not in self.finished]
        if not any(self.delivered.get(i) for i in leg.indexes):
            return [leg]  # nothing delivered: the same request, elsewhere
        if self.original.prompt_text or self.version is None or self.original.HasField("constraint"):
            raise error  # a text prompt cannot be extended by token ids, nor a grammar resumed mid-way (docstring)
        version = self.version
        model = f"{version.adapter}@{version.version}" if version.adapter else "base"
        legs = []
        for index in unfinished:
            request = sampler_pb2.SampleRequest()
            request.CopyFrom(self.original)
            request.model = model
            request.num_samples = 1
            request.prompt_logprobs = False  # sent already, with the first message
            request.prompt.chunks.add().encoded_text.tokens.extend(self.delivered.get(index, []))
            params = request.sampling_params
            params.max_tokens = (params.max_tokens or 16) - len(self.delivered.get(index, []))
            legs.append(_Leg(request, [index]))
        return legs


class FleetConnection:
    """The replicas of a registry's fleet behind SamplerConnection's interface (sample, unary and their async
    twins), so a SamplingClient on it routes, retries and continues without knowing it."""

    def __init__(
        self,
        registry: RegistryClient,
        token: str | None = None,
        *,
        timeout: float | None = None,
        ca_cert: Path | None = None,
        router: FleetRouter | None = None,
        owns_registry: bool = False,
    ) -> None:
        """``owns_registry``: close ``registry`` with this connection (a ServiceClient closes its own)."""
        self.address = f"fleet of {registry.address}"
        self.registry = registry
        self.router = router or FleetRouter()
        self.timeout = timeout
        self._token = token
        self._ca_cert = ca_cert
        self._lock = threading.Lock()
        self._connections: dict[str, SamplerConnection] = {}
        self._listing: tuple[float, list[Replica]] = (0.0, [])
        self._bases: dict[str, str] = {}
        self._floor: dict[str, tuple[int, float]] = {}  # adapter -> (highest @latest version seen, when)
        self._owns_registry = owns_registry

    # -- where to send ----------------------------------------------------------------------------------

    def replicas(self, *, fresh: bool = False) -> list[Replica]:
        with self._lock:
            read_at, listing = self._listing
        if fresh or time.monotonic() - read_at > LISTING_TTL_S:
            listing = self.registry.list_replicas("sampler")
            with self._lock:
                self._listing = (time.monotonic(), listing)
        return listing

    def route_inputs(self, reference: str, skip: set[str]) -> tuple[str | None, list[Replica], str]:
        """What the router needs for ``reference``: its adapter, the fleet (read again once a replica failed this
        request) and the adapter's base. Registry calls: off the event loop on the async paths."""
        adapter = adapter_of(reference)
        base = ""
        if adapter is not None:
            with self._lock:
                base = self._bases.get(adapter, "")
            if not base:
                base = self.registry.get_adapter(adapter).base_model_digest
                with self._lock:
                    self._bases[adapter] = base
        return adapter, self.replicas(fresh=bool(skip)), base

    @contextmanager
    def placed(self, reference: str, skip: set[str], inputs: tuple[str | None, list[Replica], str]) -> Iterator[str]:
        """The address of the replica taking ``reference``, counted in flight for the block, without the
        replicas this request already found failing; NO_REPLICA when none is left."""
        adapter, replicas, base = inputs
        with self.router.placed(adapter, replicas, base, skip) as replica:
            if replica is None:
                raise OpenTinkerError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"no serving sampler replica for {reference!r} in the fleet of registry {self.registry.address}"
                    + (f" (failing: {', '.join(sorted(skip))})" if skip else ""),
                    "NO_REPLICA",
                )
            yield replica.address

    def connection(self, address: str) -> SamplerConnection:
        with self._lock:
            connection = self._connections.get(address)
            if connection is None:
                connection = SamplerConnection(address, self._token, timeout=self.timeout, ca_cert=self._ca_cert)
                self._connections[address] = connection
            return connection

    def _pinned(self, leg: _Leg, message: sampler_pb2.SampleResponse) -> _Leg | None:
        """A leg asking again for the floor version when a replica answered a floating reference with an older
        one; None when the message's version is acceptable (the floor is raised to it)."""
        version = message.version
        if not version.adapter or not _follows_latest(leg.request.model):
            return None
        now = time.monotonic()
        with self._lock:
            floor, seen_at = self._floor.get(version.adapter, (0, 0.0))
            if version.version >= floor or now - seen_at > FLOOR_TTL_S:
                self._floor[version.adapter] = (version.version, now)
                return None
        request = sampler_pb2.SampleRequest()
        request.CopyFrom(leg.request)
        request.model = f"{version.adapter}@{floor}"
        return _Leg(request, leg.indexes)

    # -- the Sample stream -------------------------------------------------------------------------------

    def sample(self, request: sampler_pb2.SampleRequest) -> Generator[sampler_pb2.SampleResponse, None, None]:
        stream, legs, skip = _Stream(request), [_Leg(request, list(range(request.num_samples or 1)))], set[str]()
        while legs:
            leg = legs.pop(0)
            inputs = self.route_inputs(leg.request.model, skip)
            address: str | None = None
            first = True
            try:
                with (
                    self.placed(leg.request.model, skip, inputs) as address,
                    closing(self.connection(address).sample(leg.request)) as messages,
                ):
                    for message in messages:
                        if first and (again := self._pinned(leg, message)) is not None:
                            legs.insert(0, again)
                            break
                        first = False
                        yield stream.received(leg, message)
            except OpenTinkerError as error:
                if address is None or not _should_fail_over(error):
                    raise
                skip.add(address)
                legs[0:0] = stream.continuations(leg, error)

    async def sample_async(
        self, request: sampler_pb2.SampleRequest
    ) -> AsyncGenerator[sampler_pb2.SampleResponse, None]:
        stream, legs, skip = _Stream(request), [_Leg(request, list(range(request.num_samples or 1)))], set[str]()
        while legs:
            leg = legs.pop(0)
            inputs = await asyncio.to_thread(self.route_inputs, leg.request.model, skip)
            address: str | None = None
            first = True
            try:
                with self.placed(leg.request.model, skip, inputs) as address:
                    async with aclosing(self.connection(address).sample_async(leg.request)) as messages:
                        async for message in messages:
                            if first and (again := self._pinned(leg, message)) is not None:
                                legs.insert(0, again)
                                break
                            first = False
                            yield stream.received(leg, message)
            except OpenTinkerError as error:
                if address is None or not _should_fail_over(error):
                    raise
                skip.add(address)
                legs[0:0] = stream.continuations(leg, error)

    # -- unary calls -------------------------------------------------------------------------------------

    def unary(self, method: str, request: Message, response_type: type[M]) -> M:
        """On the request's replica; an idempotent call that meets a failing replica goes to the next."""
        skip: set[str] = set()
        reference = _reference_of(request)
        while True:
            address: str | None = None
            try:
                with self.placed(reference, skip, self.route_inputs(reference, skip)) as address:
                    return self.connection(address).unary(method, request, response_type)
            except OpenTinkerError as error:
                if address is None or method not in _IDEMPOTENT or not _should_fail_over(error):
                    raise
                skip.add(address)

    async def unary_async(self, method: str, request: Message, response_type: type[M]) -> M:
        skip: set[str] = set()
        reference = _reference_of(request)
        while True:
            address: str | None = None
            inputs = await asyncio.to_thread(self.route_inputs, reference, skip)
            try:
                with self.placed(reference, skip, inputs) as address:
                    return await self.connection(address).unary_async(method, request, response_type)
            except OpenTinkerError as error:
                if address is None or method not in _IDEMPOTENT or not _should_fail_over(error):
                    raise
                skip.add(address)

    # -- lifetime ----------------------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            connections, self._connections = list(self._connections.values()), {}
        for connection in connections:
            connection.close()
        if self._owns_registry:
            self.registry.close()

    async def aclose(self) -> None:
        with self._lock:
            connections = list(self._connections.values())
        for connection in connections:
            await connection.aclose()
        self.close()


def _reference_of(request: Message) -> str:
    """The reference a sampler request names ("base" when it names none: GetStats, GetSamplerInfo)."""
    for name in ("model", "reference"):
        if name in request.DESCRIPTOR.fields_by_name:
            return str(getattr(request, name)) or "base"
    return "base"
