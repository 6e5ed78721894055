"""The aiohttp application: API-key auth, error answers the SDK handles, and the session-level routes
(client config, sessions, heartbeats, futures, telemetry). Training and sampling routes live in
training.py and sampling.py. Every path is under /api/v1/."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from opentinker.gateway import (
    checkpoint_gc,
    episode_routes,
    expiry,
    openai_errors,
    openai_routes,
    openapi,
    rest,
    sampling,
    training,
)
from opentinker.gateway.auth import KEY_PREFIX
from opentinker.gateway.errors import GatewayError, RequestFailed
from opentinker.gateway.state import (
    GATEWAY,
    Gateway,
    check_sdk_version,
    field_of,
    gateway_of,
    json_body,
    principal_of,
    required,
)
from opentinker.rpc import request_ids

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_PUBLIC = frozenset({"/api/v1/healthz", "/openapi.json"})
_NO_RETRY = {"x-should-retry": "false"}
_OPENAI = "/v1/"  # the OpenAI-compatible routes (openai_routes.py): errors in OpenAI's shape


def _error(status: int, code: str, message: str, retry: bool = False) -> web.Response:
    # 4xx answers say "do not retry" (the SDK would otherwise retry some of them: 409, 429) unless they are a
    # rate limit the SDK should back off from and retry.
    headers = _NO_RETRY if status < 500 and not retry else {}
    body = {"error": code, "detail": message, "request_id": request_ids.current.get() or ""}
    return web.json_response(body, status=status, headers=headers)


def _authenticate(request: web.Request) -> None:
    key = request.headers.get("X-API-Key", "")
    if not key and request.path.startswith(_OPENAI):  # the openai SDK's Authorization: Bearer <key>
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        key = key.strip() if scheme.lower() == "bearer" else ""
    if not key:
        raise GatewayError(401, "MISSING_API_KEY", "send the API key in the X-API-Key header")
    if not key.startswith(KEY_PREFIX):
        raise GatewayError(401, "INVALID_API_KEY", f"API keys start with {KEY_PREFIX!r}")
    principal = gateway_of(request).keys.lookup(key)
    if principal is None:
        raise GatewayError(401, "INVALID_API_KEY", "unknown API key")
    request["principal"] = principal


@web.middleware
async def errors_and_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    # Every answer carries X-Request-Id (the caller's, when it sent a short token, else a new one); the
    # gateway's calls to the servers carry it on, so one id finds a failure in every log.
    request_id = request_ids.accepted(request.headers.get(request_ids.REQUEST_ID_KEY))
    request["request_id"] = request_id
    token = request_ids.current.set(request_id)  # reset after: keep-alive requests share a connection's task
    try:
        return await _answer(request, handler, request_id)
    finally:
        request_ids.current.reset(token)


async def _answer(request: web.Request, handler: Handler, request_id: str) -> web.StreamResponse:
    error = _openai_error if request.path.startswith(_OPENAI) else _error
    try:
        if request.path not in _PUBLIC:
            _authenticate(request)
        return await handler(request)
    except GatewayError as exc:
        if error is _openai_error:
            return _openai_error(exc.status, exc.code, exc.message, exc.retry, openai_errors.of_gateway_error(exc))
        return _error(exc.status, exc.code, exc.message, exc.retry)
    except RequestFailed as exc:
        return error(400, "INVALID_REQUEST", exc.message)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = "BODY_TOO_LARGE" if exc.status == 413 else exc.reason.upper().replace(" ", "_")
        return error(exc.status, code, f"{request.method} {request.path[:200]}: {exc.reason}")
    except Exception:
        log.exception("%s %s failed (incident %s)", request.method, request.path, request_id)
        return error(500, "INTERNAL_ERROR", f"internal gateway error (incident {request_id})")


async def _request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    # on_response_prepare: also reaches streamed answers, whose headers go out before the handler returns.
    request_id = request.get("request_id")
    if request_id is not None:
        response.headers[request_ids.REQUEST_ID_KEY] = request_id


def _openai_error(
    status: int, code: str, message: str, retry: bool = False, body: dict[str, object] | None = None
) -> web.Response:
    headers = _NO_RETRY if status < 500 and not retry else {}
    payload = body or openai_errors.error_json(status, code, message)
    return web.json_response(payload, status=status, headers=headers)


# Service routes


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def openapi_document(request: web.Request) -> web.Response:
    return web.json_response(openapi.document())


async def client_config(request: web.Request) -> web.Response:
    """Feature flags: plain API-key auth, the default HTTP transport, zstd-compressed forward_backward
    bodies sent as parallel chunks, per-request sample polling, client-side custom losses."""
    body = await json_body(request)
    check_sdk_version(body.get("sdk_version"))
    config = gateway_of(request).config
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
    gw, principal = gateway_of(request), principal_of(request)
    base = await gw.backends.base_model(principal.token)
    model = {"model_name": base.model, "max_context_length": base.max_positions, "trainable": True, "sampleable": True}
    return web.json_response({"supported_models": [model]})


async def create_session(request: web.Request) -> web.Response:
    gw, principal = gateway_of(request), principal_of(request)
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
    gw, principal = gateway_of(request), principal_of(request)
    body = await json_body(request)
    gw.sessions.heartbeat(required(body, "session_id", str), principal.tenant)
    return web.json_response({"type": "session_heartbeat"})


async def finish_session(request: web.Request) -> web.Response:
    gw, principal = gateway_of(request), principal_of(request)
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
    gw, principal = gateway_of(request), principal_of(request)
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


def create_app(gateway: Gateway) -> web.Application:
    app = web.Application(middlewares=[errors_and_auth], client_max_size=gateway.config.max_body_bytes)
    app[GATEWAY] = gateway
    app.on_response_prepare.append(_request_id_header)
    app.router.add_get("/api/v1/healthz", healthz)
    app.router.add_get("/openapi.json", openapi_document)
    app.router.add_post("/api/v1/client/config", client_config)
    app.router.add_post("/api/v1/client/dynamic_config", client_dynamic_config)
    app.router.add_get("/api/v1/get_server_capabilities", server_capabilities)
    app.router.add_post("/api/v1/create_session", create_session)
    app.router.add_post("/api/v1/session_heartbeat", session_heartbeat)
    app.router.add_post("/api/v1/sessions/{session_id}/finish", finish_session)
    app.router.add_post("/api/v1/retrieve_future", retrieve_future)
    app.router.add_post("/api/v1/cancel_future", cancel_future)
    app.router.add_post("/api/v1/telemetry", telemetry)
    training.add_routes(app)
    sampling.add_routes(app)
    rest.add_routes(app)
    openai_routes.add_routes(app)
    episode_routes.add_routes(app)

    sweeps: list[asyncio.Task[None]] = []

    async def startup(app: web.Application) -> None:
        loop = asyncio.get_running_loop()
        sweeps.append(loop.create_task(expiry.run_sweeps(gateway)))
        sweeps.append(loop.create_task(checkpoint_gc.run_collector(gateway)))

    async def cleanup(app: web.Application) -> None:
        for task in sweeps:
            task.cancel()
        await asyncio.gather(*sweeps, return_exceptions=True)
        await gateway.futures.close()
        await gateway.backends.close()
        await gateway.durable.close()
        gateway.tokenizer.close()

    app.on_startup.append(startup)
    app.on_cleanup.append(cleanup)
    return app
