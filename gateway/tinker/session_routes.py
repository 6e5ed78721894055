"""The session-level tinker routes: client config, server capabilities, sessions and their heartbeats, futures
(retrieve and cancel), telemetry; and the SDK version check every session starts with."""

from __future__ import annotations

import logging

from aiohttp import web

from opentinker.gateway.bodies import field_of, json_body, required
from opentinker.gateway.errors import bad_request
from opentinker.gateway.state import gateway_of, principal_of
from opentinker.gateway.tinker.state import tinker_of

log = logging.getLogger(__name__)

SUPPORTED_SDK_VERSION = "0.38.0"
"""The tinker SDK version whose protocol this gateway speaks; others are served with a warning."""


MAX_SDK_VERSION = 64  # characters of a create_session's sdk_version


def check_sdk_version(version: object) -> str | None:
    """A warning for an SDK version this gateway was not built against (it is still served); 400 for a version
    that is not a short string."""
    if version is None:
        version = ""
    if not isinstance(version, str) or len(version) > MAX_SDK_VERSION:
        raise bad_request(f"sdk_version must be a string of at most {MAX_SDK_VERSION} characters", "INVALID_FIELD")
    if version == SUPPORTED_SDK_VERSION:
        return None
    message = (
        f"tinker SDK {version!r} is not the version this OpenTinker gateway supports ({SUPPORTED_SDK_VERSION}); "
        "requests are served, but some may not work"
    )
    log.warning("%s", message)
    return message


async def client_config(request: web.Request) -> web.Response:
    """Feature flags: plain API-key auth, the default HTTP transport, zstd-compressed forward_backward
    bodies sent as parallel chunks, per-request sample polling, client-side custom losses."""
    body = await json_body(request)
    check_sdk_version(body.get("sdk_version"))
    config = tinker_of(request).config
    return web.json_response(
        {
            "pjwt_auth_enabled": False,
            "credential_default_source": "api_key",
            "use_pyqwest_transport": False,
            "parallel_fwdbwd_chunks": True,
            "proto_compress_fwdbwd": config.compress_fwdbwd,
            "fwdbwd_max_chunk_len": config.fwdbwd_max_chunk_len,
            "fwdbwd_max_chunk_bytes_count": min(5_000_000, config.max_body_bytes // 2),
            "sample_use_retrieve_futures": False,
            "custom_loss_server_side": False,
            "sample_join_sampling_session": False,
        }
    )


async def client_dynamic_config(request: web.Request) -> web.Response:
    return web.json_response({"sample_cancel_enabled": False})


async def server_capabilities(request: web.Request) -> web.Response:
    base = await gateway_of(request).backends.base_model(principal_of(request).token)
    model = {"model_name": base.model, "max_context_length": base.max_positions, "trainable": True, "sampleable": True}
    return web.json_response({"supported_models": [model]})


async def create_session(request: web.Request) -> web.Response:
    gw, principal = tinker_of(request), principal_of(request)
    body = await json_body(request)
    version = body.get("sdk_version")
    warning = check_sdk_version(version)
    session = gw.sessions.create(principal.tenant, str(version or ""), gw.config.max_sessions_per_tenant)
    await gw.durable.put_session(session)
    reply: dict[str, object] = {"type": "create_session", "session_id": session.session_id}
    if warning is not None:
        reply["warning_message"] = warning
    return web.json_response(reply)


async def session_heartbeat(request: web.Request) -> web.Response:
    gw, principal = tinker_of(request), principal_of(request)
    body = await json_body(request)
    gw.sessions.heartbeat(required(body, "session_id", str), principal.tenant)
    return web.json_response({"type": "session_heartbeat"})


async def finish_session(request: web.Request) -> web.Response:
    gw, principal = tinker_of(request), principal_of(request)
    session = gw.sessions.get(request.match_info["session_id"], principal.tenant)
    body = await json_body(request)
    reason = body.get("reason")
    status = reason.get("type") if isinstance(reason, dict) else None
    if session.finished is None:
        session.finished = str(status or "success")
        await gw.durable.put_session(session)
    return web.json_response({})


async def retrieve_future(request: web.Request) -> web.Response:
    """Long-poll: the result once the request finished, else ``try_again`` after the poll window."""
    gw, principal = tinker_of(request), principal_of(request)
    body = await json_body(request)
    request_id = required(body, "request_id", str)
    future = await gw.futures.wait(request_id, principal.tenant)
    outcome = future.outcome
    if outcome is None:
        return web.json_response({"type": "try_again", "request_id": request_id, "queue_state": "active"})
    if outcome.failure is not None:
        return web.json_response({"error": outcome.failure.message, "category": outcome.failure.category})
    if outcome.proto is not None:
        return web.Response(body=outcome.proto, content_type="application/x-protobuf")
    return web.json_response(outcome.json)


async def cancel_future(request: web.Request) -> web.Response:
    """Accepted and ignored: the sample finishes; nothing else is charged for it here."""
    body = await json_body(request)
    field_of(body, "request_id", str)
    return web.json_response({})


async def telemetry(request: web.Request) -> web.Response:
    """SDK telemetry is accepted and dropped."""
    await request.read()
    return web.json_response({"status": "accepted"})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/api/v1/client/config", client_config)
    app.router.add_post("/api/v1/client/dynamic_config", client_dynamic_config)
    app.router.add_get("/api/v1/get_server_capabilities", server_capabilities)
    app.router.add_post("/api/v1/create_session", create_session)
    app.router.add_post("/api/v1/session_heartbeat", session_heartbeat)
    app.router.add_post("/api/v1/sessions/{session_id}/finish", finish_session)
    app.router.add_post("/api/v1/retrieve_future", retrieve_future)
    app.router.add_post("/api/v1/cancel_future", cancel_future)
    app.router.add_post("/api/v1/telemetry", telemetry)
