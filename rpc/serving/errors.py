"""Service errors: a precise gRPC status plus a google.rpc.ErrorInfo detail.

Handlers raise a `ServiceError` subclass; the interceptor turns it into the status. Anything else that
escapes a handler becomes INTERNAL (the traceback stays in the server log). Either way the client gets the
call's request id (rpc/serving/request_ids.py) and the log has the same id.

What a client reads is written for the client: what failed and what to do. Internals (a Redis host:port, a
file path on the server, an exception's text) go in `detail` (`logged_with`), which only the server log sees.
"""

from __future__ import annotations

from typing import Self, TypeVar

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

ERROR_DOMAIN = "opentinker"
# A status travels in HTTP/2 trailers, which clients cap at 8 KiB: text echoing the input (a 10 MB name) is
# clipped, or the client would get a transport error instead of ours.
MAX_MESSAGE_BYTES = 1024
MAX_METADATA_VALUE_BYTES = 256
_D = TypeVar("_D", error_details_pb2.ErrorInfo, error_details_pb2.RequestInfo)


# Codes that say the caller asked for something wrong, not that a server failed: the interceptor logs them at
# INFO (the others, at WARNING, are the operator's business); the gateway reports them as the user's errors.
CALLER_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)


def clip(text: str, limit: int) -> str:
    """`text` cut to at most about `limit` UTF-8 bytes, saying how long it was."""
    data = text.encode("utf-8", "backslashreplace")
    if len(data) <= limit:
        return data.decode()
    return data[: limit - 32].decode("utf-8", "ignore") + f"... ({len(data)} bytes)"


class ServiceError(Exception):
    """An error with a gRPC status code, a reason (UPPER_SNAKE_CASE) and string metadata; `detail`: for the
    server log only (never sent)."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    default_reason: str = "INTERNAL"

    def __init__(self, message: str, *, reason: str | None = None, **metadata: str | int) -> None:
        message = clip(message, MAX_MESSAGE_BYTES)
        super().__init__(message)
        self.message = message
        self.reason = reason or self.default_reason
        self.detail: str | None = None
        self.request_id = ""  # set by for_request: sent as a google.rpc.RequestInfo detail
        self.metadata = {key: clip(str(value), MAX_METADATA_VALUE_BYTES) for key, value in metadata.items()}

    def logged_with(self, detail: str) -> Self:
        """Adds what the server log (not the client) gets about this error: an address, a path, an exception."""
        self.detail = detail
        return self

    def for_request(self, request_id: str) -> ServiceError:
        """This error as sent for one call: the request id in the message and in a RequestInfo detail."""
        suffix = f" (request {request_id})"
        message = clip(self.message, MAX_MESSAGE_BYTES - 96)  # the id survives clipping
        if not message.endswith(suffix):  # an upstream server's message for the same call has it already
            message += suffix
        sent = type(self)(message, reason=self.reason, **self.metadata)
        sent.detail, sent.request_id = self.detail, request_id
        return sent

    def to_status(self) -> status_pb2.Status:
        info = error_details_pb2.ErrorInfo(reason=self.reason, domain=ERROR_DOMAIN, metadata=self.metadata)
        details = [any_pb2.Any()]
        details[0].Pack(info)
        if self.request_id:
            details.append(any_pb2.Any())
            details[1].Pack(error_details_pb2.RequestInfo(request_id=self.request_id))
        return status_pb2.Status(code=self.code.value[0], message=self.message, details=details)


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT
    default_reason = "INVALID_ARGUMENT"


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND
    default_reason = "NOT_FOUND"


class AlreadyExists(ServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS
    default_reason = "ALREADY_EXISTS"


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION
    default_reason = "FAILED_PRECONDITION"


class PermissionDenied(ServiceError):
    code = grpc.StatusCode.PERMISSION_DENIED
    default_reason = "PERMISSION_DENIED"


class Unauthenticated(ServiceError):
    code = grpc.StatusCode.UNAUTHENTICATED
    default_reason = "UNAUTHENTICATED"


class DataLoss(ServiceError):
    code = grpc.StatusCode.DATA_LOSS
    default_reason = "DIGEST_MISMATCH"


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    default_reason = "RESOURCE_EXHAUSTED"


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE
    default_reason = "UNAVAILABLE"


class Internal(ServiceError):
    code = grpc.StatusCode.INTERNAL
    default_reason = "INTERNAL"


def _detail(error: grpc.RpcError, kind: type[_D]) -> _D | None:
    from grpc_status import rpc_status

    if not hasattr(error, "trailing_metadata") or not hasattr(error, "code"):
        return None  # neither a sync grpc.Call nor a grpc.aio.AioRpcError
    status = rpc_status.from_call(error)
    if status is None:
        return None
    for detail in status.details:
        message = kind()
        if detail.Unpack(message):
            return message
    return None


def error_info(error: grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    """Client side: the ErrorInfo detail of a failed call, if it carries one."""
    return _detail(error, error_details_pb2.ErrorInfo)


def request_id_of(error: grpc.RpcError) -> str:
    """Client side: the request id a server gave a failed call ("" if none): quote it to the operator."""
    info = _detail(error, error_details_pb2.RequestInfo)
    return info.request_id if info is not None else ""


def describe(error: grpc.RpcError) -> str:
    """One line for people: "CODE: message [REASON]" (what the CLIs print after "error: ")."""
    info = error_info(error)
    code = error.code().name if isinstance(error, grpc.Call) else "UNKNOWN"
    details = error.details() if isinstance(error, grpc.Call) else str(error)
    return f"{code}: {details}" + (f" [{info.reason}]" if info is not None else "")
