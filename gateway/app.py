"""The aiohttp application: API-key auth and error answers (the tinker SDK's shape under /api/v1, OpenAI's under
/v1) around both surfaces' routes (tinker/ and openai/), which it mounts with their state next to the shared one."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from opentinker.gateway import episode_routes, openapi
from opentinker.gateway.auth import KEY_PREFIX
from opentinker.gateway.errors import GatewayError, RequestFailed
from opentinker.gateway.openai import errors as openai_errors
from opentinker.gateway.openai import routes as openai_routes
from opentinker.gateway.openai.state import OPENAI, OpenAIState
from opentinker.gateway.state import GATEWAY, Gateway, gateway_of
from opentinker.gateway.tinker import checkpoint_gc, expiry, rest, sampling, saves, session_routes, training
from opentinker.gateway.tinker.state import TINKER, TinkerState
from opentinker.rpc.serving import request_ids

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_PUBLIC = frozenset({"/api/v1/healthz", "/openapi.json"})
_NO_RETRY = {"x-should-retry": "false"}
_OPENAI = "/v1/"  # the OpenAI-compatible routes (openai/): errors in OpenAI's shape


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


def create_app(
    gateway: Gateway, tinker: TinkerState | None = None, openai: OpenAIState | None = None
) -> web.Application:
    """Both surfaces on one app: the shared state, the tinker surface's (new tables unless given) and the OpenAI
    surface's (no tokenizer unless given)."""
    tinker = TinkerState(gateway.config) if tinker is None else tinker
    openai = OpenAIState() if openai is None else openai
    app = web.Application(middlewares=[errors_and_auth], client_max_size=gateway.config.max_body_bytes)
    app[GATEWAY], app[TINKER], app[OPENAI] = gateway, tinker, openai
    app.on_response_prepare.append(_request_id_header)
    app.router.add_get("/api/v1/healthz", healthz)
    app.router.add_get("/openapi.json", openapi_document)
    for module in (session_routes, training, saves, sampling, rest):
        module.add_routes(app)
    openai_routes.add_routes(app)
    episode_routes.add_routes(app)

    sweeps: list[asyncio.Task[None]] = []

    async def startup(app: web.Application) -> None:
        loop = asyncio.get_running_loop()
        sweeps.append(loop.create_task(expiry.run_sweeps(tinker)))
        sweeps.append(loop.create_task(checkpoint_gc.run_collector(gateway, tinker)))

    async def cleanup(app: web.Application) -> None:
        for task in sweeps:
            task.cancel()
        await asyncio.gather(*sweeps, return_exceptions=True)
        await tinker.futures.close()
        await gateway.backends.close()
        await tinker.durable.close()
        openai.tokenizer.close()

    app.on_startup.append(startup)
    app.on_cleanup.append(cleanup)
    return app
