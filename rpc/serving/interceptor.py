"""One server interceptor: authenticate, run the handler, map errors, count.

Every RPC of every server passes through `ServiceInterceptor`, so no handler can leak UNKNOWN or a
traceback: `ServiceError`s become their status with ErrorInfo, anything unexpected becomes INTERNAL. Each
call has a request id (the caller's `x-request-id`, else a new one; rpc/serving/request_ids.py): a failed call's
status carries it, and the server log has one line under it with what the client is not shown.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeAlias

import grpc
from google.protobuf.message import DecodeError
from grpc import aio
from prometheus_client import Counter, Histogram

from opentinker.rpc.serving import request_ids
from opentinker.rpc.serving.auth import LOCAL_PRINCIPAL, Principal, TokenTable, reset_principal, set_principal
from opentinker.rpc.serving.errors import (
    CALLER_CODES,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    ServiceError,
    Unauthenticated,
)

log = logging.getLogger("opentinker.rpc")

RPC_REQUESTS = Counter("opentinker_rpc_requests_total", "RPCs handled, by method and status code", ["method", "code"])
RPC_SECONDS = Histogram(
    "opentinker_rpc_duration_seconds",
    "RPC handling time (streams: until the last message)",
    ["method"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 300),
)

# Infrastructure services answer without a token (load balancers, grpcurl).
_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

_Context = aio.ServicerContext[Any, Any]
if TYPE_CHECKING:
    Handler: TypeAlias = grpc.RpcMethodHandler[Any, Any]


async def abort_with(context: _Context, error: ServiceError, request_id: str | None = None) -> None:
    from grpc_status import rpc_status

    if request_id is not None:
        error = error.for_request(request_id)
    status = rpc_status.to_status(error.to_status())
    trailing = tuple(status.trailing_metadata)
    if request_id is not None:
        trailing += ((request_ids.REQUEST_ID_KEY, request_id),)
    await context.abort(status.code, status.details, trailing_metadata=trailing)


def _log_failure(method: str, request_id: str, error: ServiceError) -> None:
    level = logging.INFO if error.code in CALLER_CODES else logging.WARNING
    detail = f"; detail: {error.detail}" if error.detail else ""
    name = error.code.name
    log.log(level, "%s failed (request %s): %s %s: %s%s", method, request_id, name, error.reason, error.message, detail)


def _authenticate(tokens: TokenTable | None, metadata: tuple[tuple[str, str | bytes], ...]) -> Principal:
    if tokens is None:
        return LOCAL_PRINCIPAL
    header = next((v for k, v in metadata if k == "authorization"), None)
    if header is None:
        raise Unauthenticated("missing 'authorization: Bearer <token>' metadata")
    text = header.decode() if isinstance(header, bytes) else header
    scheme, _, token = text.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise Unauthenticated("authorization metadata must be 'Bearer <token>'")
    principal = tokens.lookup(token.strip())
    if principal is None:
        raise Unauthenticated("unknown bearer token")
    return principal


class TenantCalls:
    """Calls each user tenant has in flight on this server, bounded per tenant: one tenant that opens hundreds
    of calls (uploads it never finishes, slow listings) holds that many of the server's buffers and event-loop
    turns; beyond the bound its next call is refused before its handler runs. Admins (the servers' own service
    tokens, operators) and a server without tokens are not counted."""

    def __init__(self, limit: int, flag: str) -> None:
        self.limit = limit  # 0: no limit
        self.flag = flag
        self.open: dict[str, int] = {}

    def enter(self, principal: Principal) -> str | None:
        tenant = principal.tenant
        if self.limit <= 0 or tenant is None or principal.is_admin:
            return None
        held = self.open.get(tenant, 0)
        if held >= self.limit:
            raise ResourceExhausted(
                f"tenant {tenant!r} has {held} calls in flight on this server, its limit ({self.flag} "
                f"{self.limit}): wait for some to finish",
                reason="TOO_MANY_REQUESTS",
                tenant=tenant,
            )
        self.open[tenant] = held + 1
        return tenant

    def leave(self, tenant: str | None) -> None:
        if tenant is None:
            return
        held = self.open[tenant] - 1
        if held:
            self.open[tenant] = held
        else:
            del self.open[tenant]


class ServiceInterceptor(aio.ServerInterceptor):
    def __init__(self, tokens: TokenTable | None, calls: TenantCalls | None = None) -> None:
        self._tokens = tokens
        self._calls = calls or TenantCalls(0, "")

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or method.startswith(_OPEN_PREFIXES):
            return handler
        metadata = tuple(handler_call_details.invocation_metadata or ())
        request_id = request_ids.from_metadata(metadata)
        try:
            principal: Principal | ServiceError = _authenticate(self._tokens, metadata)
        except ServiceError as error:
            principal = error
        return _wrap(handler, method, principal, self._calls, request_id)


def _record(method: str, started: float, code: grpc.StatusCode) -> None:
    RPC_REQUESTS.labels(method, code.name).inc()
    RPC_SECONDS.labels(method).observe(time.perf_counter() - started)


@contextlib.asynccontextmanager
async def _rpc_scope(
    method: str, principal: Principal | ServiceError, context: _Context, calls: TenantCalls, request_id: str
) -> AsyncIterator[None]:
    """Run one RPC's handler as `principal`, map what it raises to a status, record metrics."""
    started = time.perf_counter()
    code = grpc.StatusCode.OK
    token = None
    counted: str | None = None
    id_token = request_ids.current.set(request_id)
    try:
        if isinstance(principal, ServiceError):
            raise principal
        counted = calls.enter(principal)
        token = set_principal(principal)
        yield
    except aio.AbortError:
        code = context.code() or grpc.StatusCode.UNKNOWN
        raise
    except ServiceError as error:
        code = error.code
        _log_failure(method, request_id, error)
        await abort_with(context, error, request_id)
    except Exception:
        code = grpc.StatusCode.INTERNAL
        log.exception("unhandled error in %s (request %s)", method, request_id)
        internal = Internal("internal error; the server log has the details under this id", incident=request_id)
        await abort_with(context, internal, request_id)
    except BaseException:  # cancelled by the client or by shutdown
        code = grpc.StatusCode.CANCELLED
        raise
    finally:
        calls.leave(counted)
        with contextlib.suppress(ValueError):  # see below
            request_ids.current.reset(id_token)
        if token is not None:
            # A stream whose client left mid-stream is dropped by gRPC at a `yield`, and closed later by
            # asyncio's async-generator finalizer in another context: the principal was set in the RPC's own
            # context, which ended with its task, so there is nothing to reset (and reset() would raise).
            with contextlib.suppress(ValueError):
                reset_principal(token)
        _record(method, started, code)


def _wrap(
    handler: Handler, method: str, principal: Principal | ServiceError, calls: TenantCalls, request_id: str
) -> Handler:
    if handler.request_streaming and handler.response_streaming:
        raise NotImplementedError("bidirectional streaming RPCs are not used by OpenTinker")

    deserializer = _lenient(handler.request_deserializer)
    if handler.response_streaming:
        stream_behavior: Any = handler.unary_stream

        async def streaming(request: Any, context: _Context) -> AsyncIterator[Any]:
            responses = None
            try:
                async with _rpc_scope(method, principal, context, calls, request_id):
                    responses = stream_behavior(_decoded(request), context)
                    async for response in responses:
                        yield response
            finally:
                if responses is not None and hasattr(responses, "aclose"):
                    await responses.aclose()  # the handler's own cleanup (a watch slot) now, not at collection

        return grpc.unary_stream_rpc_method_handler(streaming, deserializer, handler.response_serializer)

    unary_behavior: Any = handler.stream_unary if handler.request_streaming else handler.unary_unary

    async def unary(request: Any, context: _Context) -> Any:
        async with _rpc_scope(method, principal, context, calls, request_id):
            if handler.request_streaming:
                return await unary_behavior(_decoded_stream(request), context)
            return await unary_behavior(_decoded(request), context)
        raise AssertionError("unreachable: the scope aborts on error")

    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, deserializer, handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(unary, deserializer, handler.response_serializer)


class _Undecodable:
    """A request message that did not parse (corrupt wire format, invalid UTF-8 in a string field)."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    # gRPC answers a deserializer's exception with UNKNOWN (INTERNAL in streams); we want INVALID_ARGUMENT.
    if deserializer is None:
        return None
    parse = deserializer

    def lenient(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as error:
            return _Undecodable(str(error))

    return lenient


def _decoded(request: Any) -> Any:
    if isinstance(request, _Undecodable):
        raise InvalidArgument(f"malformed request: {request.error}", reason="MALFORMED_REQUEST")
    return request


async def _decoded_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        yield _decoded(request)
