"""Channels to one server, shared by the clients of a ServiceClient: one synchronous channel, plus one
grpc.aio channel per event loop (an aio channel is bound to the loop it was opened on; those of loops that
have since closed are dropped). Every failure comes out as an OpenTinkerError."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Generic, TypeVar

import grpc
import grpc.aio
from google.protobuf.message import Message

from opentinker.client.errors import OpenTinkerError, from_rpc_error
from opentinker.rpc.serving import request_ids
from opentinker.rpc.serving.channel import bearer_metadata, open_aio_channel, open_channel

M = TypeVar("M", bound=Message)
S = TypeVar("S")


@contextmanager
def translated() -> Iterator[None]:
    """Turns any gRPC failure (sync or aio) raised inside the block into an OpenTinkerError."""
    try:
        yield
    except grpc.RpcError as err:
        raise from_rpc_error(err) from err


def checked(response: object, response_type: type[M]) -> M:
    # The generated stubs are untyped; checking the type here keeps the callers typed.
    if not isinstance(response, response_type):
        raise TypeError(f"expected {response_type.__name__}, got {type(response).__name__}")
    return response


class Connection(Generic[S]):
    def __init__(
        self,
        address: str,
        make_stub: Callable[[grpc.Channel], S],
        token: str | None = None,
        *,
        timeout: float | None,
        ca_cert: Path | None = None,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self.ca_cert = ca_cert
        self._auth: tuple[tuple[str, str], ...] = tuple(bearer_metadata(token))
        self._make_stub = make_stub
        self._channel = open_channel(address, ca_cert)
        self.stub = make_stub(self._channel)
        self._lock = threading.Lock()
        self._aio: dict[asyncio.AbstractEventLoop, tuple[grpc.aio.Channel, S]] = {}
        self._closed = False

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The bearer token, and the request id of the call being served when a server (the gateway, the
        sampler resolving through the registry) calls on a client's behalf: its logs and ours share the id."""
        return self._auth + request_ids.outgoing()

    def call_metadata(self, request: Message) -> tuple[tuple[str, str], ...]:
        """The metadata sent with ``request``: ``metadata``, plus what a subclass adds for routing."""
        return self.metadata

    def check_open(self) -> None:
        if self._closed:
            raise OpenTinkerError(grpc.StatusCode.CANCELLED, "the client is closed", "CLIENT_CLOSED")

    def aio_stub(self) -> S:
        """The stub on the running event loop's aio channel (opened on first use)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            self.check_open()
            for old in [old for old in self._aio if old.is_closed()]:
                del self._aio[old]  # its loop is gone: nothing can await its close any more
            entry = self._aio.get(loop)
            if entry is None:
                channel = open_aio_channel(self.address, self.ca_cert)
                entry = (channel, self._make_stub(channel))  # type: ignore[arg-type]
                self._aio[loop] = entry
            return entry[1]

    def unary(self, method: str, request: Message, response_type: type[M]) -> M:
        self.check_open()
        with translated():
            response = getattr(self.stub, method)(request, timeout=self.timeout, metadata=self.call_metadata(request))
        return checked(response, response_type)

    async def unary_async(self, method: str, request: Message, response_type: type[M]) -> M:
        stub = self.aio_stub()
        with translated():
            response = await getattr(stub, method)(request, timeout=self.timeout, metadata=self.call_metadata(request))
        return checked(response, response_type)

    async def aclose(self) -> None:
        """Closes the running loop's aio channel (awaiting it), then everything else (see close)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            entry = self._aio.pop(loop, None)
        if entry is not None:
            await entry[0].close()
        self.close()

    def close(self) -> None:
        """Closes the sync channel and asks every live event loop to close its aio channel."""
        with self._lock:
            self._closed = True
            entries, self._aio = list(self._aio.items()), {}
        self._channel.close()
        for loop, (channel, _stub) in entries:
            if loop.is_running() and not loop.is_closed():
                asyncio.run_coroutine_threadsafe(channel.close(), loop)
