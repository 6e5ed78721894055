"""The gateway's state, shared by every handler, and the request helpers they use."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TypeVar

from aiohttp import web

from opentinker.gateway.auth import KeyStore, Principal
from opentinker.gateway.backend import Backend, Backends
from opentinker.gateway.checkpoints import CheckpointTable
from opentinker.gateway.errors import bad_request
from opentinker.gateway.futures import FutureStore
from opentinker.gateway.models import ModelTable
from opentinker.gateway.sessions import SessionTable

log = logging.getLogger(__name__)

SUPPORTED_SDK_VERSION = "0.38.0"
"""The tinker SDK version whose protocol this gateway speaks; others are served with a warning."""


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    fwdbwd_max_chunk_len: int = 1024  # datums per forward_backward request the SDK sends
    compress_fwdbwd: bool = True  # ask the SDK to zstd-compress forward_backward bodies
    default_max_tokens: int = 16  # when SamplingParams.max_tokens is None
    poll_seconds: float = 20.0  # longest retrieve_future long-poll


@dataclass(slots=True)
class Gateway:
    keys: KeyStore
    backends: Backends
    config: GatewayConfig = field(default_factory=GatewayConfig)
    futures: FutureStore = field(default_factory=FutureStore)
    sessions: SessionTable = field(default_factory=SessionTable)
    models: ModelTable = field(default_factory=ModelTable)
    checkpoints: CheckpointTable = field(default_factory=CheckpointTable)

    def __post_init__(self) -> None:
        self.futures.poll_seconds = self.config.poll_seconds


GATEWAY = web.AppKey("gateway", Gateway)


def gateway_of(request: web.Request) -> Gateway:
    return request.app[GATEWAY]


def principal_of(request: web.Request) -> Principal:
    principal = request.get("principal")
    assert isinstance(principal, Principal), "the auth middleware sets the principal"
    return principal


def backend_of(request: web.Request) -> Backend:
    return gateway_of(request).backends.for_token(principal_of(request).token)


def check_sdk_version(version: object) -> str | None:
    """A warning for an SDK version this gateway was not built against (it is still served)."""
    if version == SUPPORTED_SDK_VERSION:
        return None
    message = (
        f"tinker SDK {version} is not the version this OpenTinker gateway supports ({SUPPORTED_SDK_VERSION}); "
        "requests are served, but some may not work"
    )
    log.warning(message)
    return message


# Reading JSON bodies

Json = dict[str, object]
_T = TypeVar("_T")


async def json_body(request: web.Request) -> Json:
    try:
        body = await request.json()
    except ValueError as exc:
        raise bad_request(f"body is not JSON: {exc}", "MALFORMED_JSON") from exc
    if not isinstance(body, dict):
        raise bad_request("body must be a JSON object", "MALFORMED_JSON")
    return body


def field_of(body: Json, name: str, kind: type[_T], *, required: bool = True) -> _T | None:
    value = body.get(name)
    if value is None:
        if required:
            raise bad_request(f"{name} is required", "MISSING_FIELD")
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise bad_request(f"{name} must be {kind.__name__}, got {type(value).__name__}", "INVALID_FIELD")
    return value


def required(body: Json, name: str, kind: type[_T]) -> _T:
    value = field_of(body, name, kind)
    assert value is not None
    return value
