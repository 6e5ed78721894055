"""Errors under /v1 in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the HTTP status
the openai SDK maps to its exception classes (401 AuthenticationError, 404 NotFoundError, 400 BadRequestError,
429 RateLimitError, 5xx InternalServerError)."""

from __future__ import annotations

import grpc

from opentinker.client.errors import OpenTinkerError
from opentinker.gateway.errors import GatewayError, backend_message

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


class OpenAIError(GatewayError):
    """A GatewayError that also names the request field at fault (``param``)."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(status, code, message, retry=status == 429)
        self.param = param


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, code, message, param)


def model_not_found(model: str) -> OpenAIError:
    """The same answer for a missing model and another tenant's: nothing tells one from the other."""
    shown = model if len(model) <= 200 else model[:200] + "..."
    return OpenAIError(
        404, "model_not_found", f"The model '{shown}' does not exist or you do not have access to it.", "model"
    )


def error_json(status: int, code: str, message: str, param: str | None = None) -> dict[str, object]:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code.lower()}}


def of_gateway_error(exc: GatewayError) -> dict[str, object]:
    return error_json(exc.status, exc.code, exc.message, exc.param if isinstance(exc, OpenAIError) else None)


def from_backend(exc: OpenTinkerError, model: str) -> OpenAIError | None:
    """A sampler/registry failure as the caller's error; None for a server-side one (answered 500, logged)."""
    code, reason, message = exc.code, (exc.reason or exc.code.name).lower(), backend_message(exc)
    if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED):
        return model_not_found(model)  # an adapter, alias or version the caller cannot sample: no existence leak
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        if exc.reason in ("PROMPT_TOO_LONG", "INVALID_SAMPLING_PARAMS") and "context" in exc.message:
            reason = "context_length_exceeded"
        return OpenAIError(400, reason, message, exc.metadata.get("field"))
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return OpenAIError(400, reason, message, "model")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return OpenAIError(429, reason, message)
    if code == grpc.StatusCode.UNAVAILABLE:
        return OpenAIError(503, reason, message)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return OpenAIError(504, reason, message)
    if code == grpc.StatusCode.DATA_LOSS:  # stored weights failed verification: the operator's to repair
        return OpenAIError(500, reason, message, "model")
    return None


def backend_error(exc: OpenTinkerError, model: str) -> Exception:
    """The caller's error for a sampler/registry failure; the failure itself when it is the server's."""
    translated = from_backend(exc, model)
    return exc if translated is None else translated  # a server-side failure: the middleware's 500 and incident
