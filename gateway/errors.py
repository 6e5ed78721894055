"""Errors the gateway answers: an HTTP status the tinker SDK handles plus a JSON body, or a failed future.

Request-level errors (bad key, unknown model, unreadable body) are HTTP 4xx with ``x-should-retry: false``
so the SDK raises at once instead of retrying; errors found while running a request the gateway already
accepted become a failed future (``{"error": ..., "category": "user"|"server"}``), which the SDK raises
as ``RequestFailedError``.
"""

from __future__ import annotations

import logging

import grpc

from opentinker.client.errors import OpenTinkerError
from opentinker.rpc.serving import request_ids
from opentinker.rpc.serving.errors import CALLER_CODES

log = logging.getLogger(__name__)


class GatewayError(Exception):
    """An HTTP error answer: ``status`` and a one-line message; ``code`` is a stable UPPER_SNAKE_CASE tag."""

    def __init__(self, status: int, code: str, message: str, *, retry: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry = retry  # a 4xx the SDK may retry (with its backoff): a rate limit, not a wrong request

    def body(self) -> dict[str, str]:
        return {"error": self.code, "detail": self.message}


def bad_request(message: str, code: str = "INVALID_REQUEST") -> GatewayError:
    return GatewayError(400, code, message)


def not_found(message: str, code: str = "NOT_FOUND") -> GatewayError:
    return GatewayError(404, code, message)


class RequestFailed(Exception):
    """A future's failure: ``user`` errors are the caller's (bad input), ``server`` ones ours."""

    def __init__(self, message: str, category: str = "user", *, poisons: bool = True) -> None:
        super().__init__(message)
        self.message = message
        self.category = category
        # False when the failed request provably changed nothing (see _MODEL_UNCHANGED): later requests of the
        # model still run.
        self.poisons = poisons


# Reasons of failures after which the adapter is exactly as before the request: the trainer undoes an OptimStep
# whose weights break the magnitude rule (weights, AdamW state, step) and refuses such a SaveSnapshot.
_MODEL_UNCHANGED = frozenset({"WEIGHTS_OUT_OF_RANGE"})


def backend_message(exc: OpenTinkerError) -> str:
    """What a client is told of a trainer/sampler/registry failure. Our servers' messages are written for
    clients (rpc/serving/errors.py) and pass on; a failure without their ErrorInfo is gRPC's own (the server did not
    answer) and its text names the server's address: the client gets a generic message with the request id,
    the gateway's log the text under the same id."""
    if exc.reason:
        return exc.message
    request_id = request_ids.current.get() or request_ids.new_request_id()
    log.warning("backend call failed (request %s): %s", request_id, exc)
    return (
        "a server behind the gateway did not answer; retry shortly, and if it persists ask the operator "
        f"(request {request_id})"
    )


def from_backend(exc: OpenTinkerError) -> RequestFailed:
    """A trainer/sampler/registry error as a future failure, its status and reason kept in the message."""
    category = "user" if exc.code in CALLER_CODES else "server"
    reason = f"/{exc.reason}" if exc.reason else ""
    poisons = not (exc.code == grpc.StatusCode.FAILED_PRECONDITION and exc.reason in _MODEL_UNCHANGED)
    return RequestFailed(f"{exc.code.name}{reason}: {backend_message(exc)}", category, poisons=poisons)
