"""The SDK's one error type: every failed call surfaces as an `OpenTinkerError`.

Servers attach a google.rpc.ErrorInfo detail to every error (domain "opentinker", reason UPPER_SNAKE_CASE,
string metadata); `from_rpc_error` lifts it out of the grpc.RpcError so callers can branch on
`err.code` / `err.reason` without touching gRPC status protos. Checks the SDK makes itself (for example
the digests of a downloaded artifact) raise the same type with the code the server would have used.
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc
import grpc.aio

from opentinker.rpc.serving.errors import error_info, request_id_of

__all__ = ["OpenTinkerError", "from_rpc_error"]


class OpenTinkerError(Exception):
    """A failed OpenTinker call: gRPC status code, message, ErrorInfo reason ("" if none) and metadata, and
    the request id the server logged it under ("" if none; quote it to the operator).

    ``str(err)`` reads ``"NOT_FOUND: adapter 'x' not found (request 3f2a...) [ADAPTER_NOT_FOUND]"``.
    """

    code: grpc.StatusCode
    message: str
    reason: str
    metadata: dict[str, str]
    request_id: str

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        reason: str = "",
        metadata: Mapping[str, str] | None = None,
        request_id: str = "",
    ) -> None:
        # Every constructor argument goes into args so that pickling (multiprocessing, Ray, ...) rebuilds
        # an equal error: Exception.__reduce__ calls cls(*args).
        meta = dict(metadata or {})
        super().__init__(code, message, reason, meta, request_id)
        self.code = code
        self.message = message
        self.reason = reason
        self.metadata = meta
        self.request_id = request_id

    def __str__(self) -> str:
        suffix = f" [{self.reason}]" if self.reason else ""
        return f"{self.code.name}: {self.message}{suffix}"

    def __repr__(self) -> str:
        return f"OpenTinkerError({self.code.name}, {self.message!r}, reason={self.reason!r})"


def from_rpc_error(err: grpc.RpcError) -> OpenTinkerError:
    """Converts a failed gRPC call (unary or streaming) into an `OpenTinkerError`."""
    if not isinstance(err, grpc.Call | grpc.aio.AioRpcError):
        # Raised by gRPC before any call existed (e.g. a closed channel): no status to read.
        return OpenTinkerError(grpc.StatusCode.UNKNOWN, str(err) or type(err).__name__)
    code = err.code()
    message = err.details() or ""
    if code is None:  # not finished; cannot happen for an error that was raised, but the type allows it
        code = grpc.StatusCode.UNKNOWN
    try:
        info = error_info(err)  # sync calls and grpc.aio errors alike
        request_id = request_id_of(err)
    except Exception:
        # A malformed grpc-status-details-bin trailer (a proxy, a foreign server) must not hide the status.
        info, request_id = None, ""
    if info is None:
        return OpenTinkerError(code, message, request_id=request_id)
    return OpenTinkerError(code, message, info.reason, dict(info.metadata), request_id)
