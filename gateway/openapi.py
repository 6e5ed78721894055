"""The gateway's routes as an OpenAPI 3.1 document, served at GET /openapi.json (no key needed), assembled from
both surfaces' parts (tinker/openapi.py, openai/openapi.py) and the shared routes (service, episodes).

It is what the HTTP fuzzer (tests/gateway/test_http_fuzz.py, schemathesis) generates requests from, and a test
checks that it lists exactly the routes the app registers, so a new route cannot go unfuzzed. Per route: its
path and query parameters and the headers it reads, the JSON body fields its handler reads with their types
(forward_backward: a tinker ``ForwardBackwardRequest`` protobuf, zstd allowed), the key it accepts (``X-API-Key``
everywhere; under /v1 also ``Authorization: Bearer``), and every status it can answer with the shape of its error
bodies (``{"error", "detail", "request_id"}`` under /api/v1, OpenAI's ``{"error": {...}}`` under /v1). The
handlers check values (ranges, lengths, references) and answer 400 naming the field; both surfaces accept fields
not listed here (the SDKs send some that are ignored).
"""

from __future__ import annotations

import copy

from opentinker.gateway import episode_routes
from opentinker.gateway.episodes import EPISODE_ID
from opentinker.gateway.openai import openapi as openai_part
from opentinker.gateway.route_schema import (
    BAD,
    JSON,
    MISSING,
    OK,
    PROTOBUF,
    STATE,
    STRING,
    Route,
    Schema,
    bounded,
    closed,
    nullable,
    object_of,
)
from opentinker.gateway.tinker import openapi as tinker_part

# Error bodies: app._error under /api/v1, openai/errors.error_json under /v1.
_TINKER_ERROR = object_of("error", "detail", error=STRING, detail=STRING, request_id=STRING)
_OPENAI_ERROR = object_of(
    "error",
    error=object_of(
        "message", "type", "code", message=STRING, type=STRING, param=nullable("string"), code=nullable("string")
    ),
)


_SERVICE: tuple[Route, ...] = (
    Route("GET", "/api/v1/healthz", "Liveness", public=True),
    Route("GET", "/openapi.json", "This document", public=True),
)
_EPISODES: tuple[Route, ...] = (
    Route(
        "GET",
        "/v1/episodes",
        "The tenant's recent episodes",
        (BAD, STATE),
        query={"limit": bounded("integer", 1, episode_routes.MAX_LIST, nullable=False)},
    ),
    Route("GET", "/v1/episodes/{episode_id}", "An episode", (BAD, MISSING, STATE)),
    Route(
        "POST",
        "/v1/episodes/{episode_id}/reward",
        "Rewards an episode ({reward}) or one of its turns ({turn, reward})",
        (MISSING, STATE),
        closed(object_of("reward", reward={"type": "number"}, turn={"type": "integer", "minimum": 0})),
    ),
    Route("DELETE", "/v1/episodes/{episode_id}", "Deletes an episode", (BAD, MISSING, STATE)),
)
ROUTES: tuple[Route, ...] = (*_SERVICE, *tinker_part.ROUTES, *openai_part.ROUTES, *_EPISODES)


def openapi_path(path: str) -> str:
    """aiohttp's ``{name:regex}`` as OpenAPI's ``{name}``."""
    out, rest = "", path
    while "{" in rest:
        head, _, tail = rest.partition("{")
        name, _, after = tail.partition("}")
        out += head + "{" + name.partition(":")[0] + "}"
        rest = after
    return out + rest


_DESCRIPTIONS = {
    200: "OK",
    400: "Bad request: the body is not JSON, or a field (named) is missing, of the wrong type or out of range",
    401: "Missing or unknown API key",
    404: "Not found (another tenant's reads the same)",
    410: "The session has finished",
    413: "Body too large",
    429: "Over a per-tenant bound: retry later",
    503: "A server or the state store behind the gateway is unavailable: retry later",
    504: "A server behind the gateway did not answer in time",
}


# Path parameters the handlers check for form (the others are looked up: unknown ones answer 404).
_PATH_PARAMETERS = {"episode_id": {"type": "string", "pattern": f"^{EPISODE_ID.pattern}$"}}


def _responses(route: Route) -> Schema:
    error = {JSON: {"schema": _OPENAI_ERROR if route.openai else _TINKER_ERROR}}
    responses: Schema = {}
    for status in route.all_statuses():
        content = {media: {} for media in route.answers} if status == OK else error
        responses[str(status)] = {"description": _DESCRIPTIONS[status], "content": content}
    return responses


def _security(route: Route) -> list[Schema]:
    if route.public:
        return []
    return [{"apiKey": []}, {"bearer": []}] if route.openai else [{"apiKey": []}]


def _operation(route: Route) -> Schema:
    path = openapi_path(route.path)
    parameters: list[Schema] = [
        {"name": name, "in": "path", "required": True, "schema": _PATH_PARAMETERS.get(name, STRING)}
        for name in (piece.partition("}")[0] for piece in path.split("{")[1:])
    ]
    parameters += [{"name": name, "in": "query", "required": False, "schema": s} for name, s in route.query.items()]
    parameters += route.headers
    slug = path.strip("/").replace("/", "_").replace("{", "").replace("}", "").replace(".", "_")
    operation: Schema = {
        "summary": route.summary,
        "operationId": f"{route.method.lower()}_{slug}",
        "parameters": parameters,
        "security": _security(route),
        "responses": _responses(route),
    }
    if route.body is not None:
        operation["requestBody"] = {"required": True, "content": {JSON: {"schema": route.body}}}
    elif route.binary:
        operation["requestBody"] = {
            "required": True,
            "content": {PROTOBUF: {"schema": {"type": "string", "format": "binary"}}},
        }
    return operation


def document(version: str = "1") -> Schema:
    """The OpenAPI document (JSON-serialisable), a new one each call: the routes share sub-schemas, which a
    caller may then change without changing this module's."""
    paths: dict[str, Schema] = {}
    for route in ROUTES:
        paths.setdefault(openapi_path(route.path), {})[route.method.lower()] = copy.deepcopy(_operation(route))
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "OpenTinker gateway",
            "version": version,
            "description": "The tinker SDK's protocol under /api/v1 and an OpenAI-compatible API under /v1.",
        },
        "components": {
            "securitySchemes": {
                "apiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"},
                "bearer": {"type": "http", "scheme": "bearer", "description": "the API key, under /v1 only"},
            }
        },
        "security": [{"apiKey": []}],
        "paths": paths,
    }
