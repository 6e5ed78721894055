"""The OpenAPI document (gateway/openapi.py) describes exactly the routes the app registers, so the HTTP fuzzer
(test_http_fuzz.py) reaches every route, a new one included; and it says what the gateway accepts."""

from __future__ import annotations

import json

from opentinker.gateway import openapi
from opentinker.gateway.app import create_app
from opentinker.gateway.auth import KeyStore
from opentinker.gateway.backend import Backends
from opentinker.gateway.state import Gateway


def _registered() -> set[tuple[str, str]]:
    app = create_app(Gateway(keys=KeyStore([]), backends=Backends("x:1", "x:2", "x:3")))  # nothing starts
    routes = set()
    for route in app.router.routes():
        if route.method == "HEAD":  # aiohttp's implicit HEAD of each GET
            continue
        assert route.resource is not None and route.resource.canonical
        routes.add((route.method, openapi.openapi_path(route.resource.canonical)))
    return routes


def _documented() -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, operations in openapi.document()["paths"].items() for method in operations}


def test_the_document_lists_exactly_the_routes_the_app_registers() -> None:
    registered = _registered()
    assert len(registered) == len(openapi.ROUTES)  # no route documented twice
    assert _documented() == registered


def test_the_document_is_json_and_names_every_path_parameter() -> None:
    document = json.loads(json.dumps(openapi.document()))
    assert document["openapi"].startswith("3.")
    for path, operations in document["paths"].items():
        names = {piece.partition("}")[0] for piece in path.split("{")[1:]}
        for operation in operations.values():
            assert {p["name"] for p in operation["parameters"] if p["in"] == "path"} == names
            assert "200" in operation["responses"]


def test_auth_is_the_gateways() -> None:
    """X-API-Key everywhere; Authorization: Bearer only under /v1 (app._authenticate); healthz and the document
    need none."""
    for path, operations in openapi.document()["paths"].items():
        for operation in operations.values():
            if path in ("/api/v1/healthz", "/openapi.json"):
                assert operation["security"] == []
                assert "401" not in operation["responses"]
            elif path.startswith("/v1/"):
                assert operation["security"] == [{"apiKey": []}, {"bearer": []}]
                assert "401" in operation["responses"]
            else:
                assert operation["security"] == [{"apiKey": []}]
                assert "401" in operation["responses"]


def test_the_openai_bodies_list_cache_salt_and_the_protobuf_route_its_media_type() -> None:
    paths = openapi.document()["paths"]
    for path in ("/v1/chat/completions", "/v1/completions"):
        schema = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert schema["properties"]["cache_salt"]["type"] == ["string", "null"]
        assert set(paths[path]["post"]["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    body = paths["/api/v1/forward_backward"]["post"]["requestBody"]["content"]
    assert set(body) == {"application/x-protobuf"}
