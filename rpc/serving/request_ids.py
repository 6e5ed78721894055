"""Request ids: one id per client call, carried from server to server in `x-request-id` metadata.

A client that gets an error gets the id with it (the ErrorInfo's `request_id`, the message's last words); the
server logs every failed call under the same id with what the client is not shown (a Redis address, a path, an
exception), so an operator finds the cause from what a user pastes. A caller may choose the id (the gateway
passes its HTTP request's id on); anything that is not a short token is replaced, so ids stay greppable.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable
from contextvars import ContextVar
from typing import Any, Final

import grpc
import grpc.aio

REQUEST_ID_KEY = "x-request-id"  # gRPC metadata key and HTTP header
_VALID = re.compile(r"[A-Za-z0-9._:-]{1,64}")

# The id of the call this task is serving (set by the server interceptor and the gateway's middleware): calls a
# server makes on its behalf (the sampler resolving through the registry) send it on.
current: ContextVar[str | None] = ContextVar("opentinker_request_id", default=None)


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


def accepted(value: str | bytes | None) -> str:
    """The caller's id when it is a short token ([A-Za-z0-9._:-], at most 64), else a new one."""
    text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
    return text if text is not None and _VALID.fullmatch(text) else new_request_id()


def from_metadata(metadata: Iterable[tuple[str, str | bytes]]) -> str:
    return accepted(next((value for key, value in metadata if key == REQUEST_ID_KEY), None))


def outgoing() -> tuple[tuple[str, str], ...]:
    """Metadata that carries the current call's id to the next server (empty outside a call)."""
    request_id = current.get()
    return ((REQUEST_ID_KEY, request_id),) if request_id else ()


class _Forward(
    grpc.aio.UnaryUnaryClientInterceptor,
    grpc.aio.UnaryStreamClientInterceptor,
    grpc.aio.StreamUnaryClientInterceptor,
):
    """Adds the current call's id to every call a server makes on a channel (the registry link)."""

    @staticmethod
    def _details(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        sent = outgoing()
        if not sent:
            return details
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *sent)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)

    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


FORWARD: Final = _Forward()
