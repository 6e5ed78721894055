"""The registry as seen from the trainer and the sampler: a channel whose calls carry the request id they
serve, and calls (and streams) whose failures keep their status and reason but not the registry's address.
Moving artifacts over these calls is weights/artifact_transfer.py's job.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import TypeVar

import grpc

from opentinker.rpc.serving import request_ids
from opentinker.rpc.serving.channel import CHANNEL_OPTIONS, open_aio_channel
from opentinker.rpc.serving.errors import ServiceError, Unavailable, error_info

Metadata = list[tuple[str, str]] | None
T = TypeVar("T")

_BY_CODE: dict[grpc.StatusCode, type[ServiceError]] = {cls.code: cls for cls in ServiceError.__subclasses__()}


def registry_error(exc: grpc.aio.AioRpcError) -> ServiceError:
    """A failed registry call as our own error: same code, reason and metadata; UNAVAILABLE if unreachable.
    The registry's own messages are written for clients and pass on; gRPC's text for a call that did not get
    an answer from the registry names its address, so that goes to our log only (`detail`)."""
    code = exc.code() or grpc.StatusCode.UNKNOWN
    detail = f"registry call failed: {code.name}: {exc.details()}"
    info = error_info(exc)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        where = {"registry_reason": info.reason} if info is not None else {}
        return Unavailable(
            "the registry is unavailable; retry shortly, and if it persists ask the operator to check it",
            reason="REGISTRY_UNAVAILABLE",
            **where,
        ).logged_with(detail)
    if info is None:  # refused by gRPC itself (a message over the size limit): no text of the registry's
        return _BY_CODE.get(code, Unavailable)(f"the registry call failed ({code.name})").logged_with(detail)
    return _BY_CODE.get(code, Unavailable)(f"registry: {exc.details()}", reason=info.reason, **info.metadata)


def registry_channel(address: str, ca: Path | None) -> grpc.aio.Channel:
    """A channel to the registry (open it inside the server's event loop): TLS verified against `ca` when given.
    Calls on it carry the request id of the call they serve, so the registry logs them under the same id."""
    # Reconnects to a restarted registry within 2 s, not gRPC's default of up to 2 minutes: the fleet's leases
    # (a few seconds) and the followers' catch-up depend on it.
    options = (*CHANNEL_OPTIONS, ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000))
    return open_aio_channel(address, ca, options=options, interceptors=(request_ids.FORWARD,))


async def registry_call(call: Awaitable[T]) -> T:
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        raise registry_error(exc) from None


async def registry_stream(stream: AsyncIterator[T]) -> AsyncIterator[T]:
    try:
        async for message in stream:
            yield message
    except grpc.aio.AioRpcError as exc:
        raise registry_error(exc) from None
