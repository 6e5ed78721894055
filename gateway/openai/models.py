"""GET /v1/models (the base model and the tenant's adapters) and GET /v1/models/{id} (one of them, with the
version a pinned reference resolves to)."""

from __future__ import annotations

from aiohttp import web

from opentinker.client.errors import OpenTinkerError
from opentinker.gateway.backend import Backend, BaseModelInfo
from opentinker.gateway.openai.admission import reference
from opentinker.gateway.openai.errors import backend_error
from opentinker.gateway.openai.responses import Json
from opentinker.gateway.state import backend_of, gateway_of, principal_of
from opentinker.v1 import registry_pb2
from opentinker.weights.names import BASE


def _base_json(base: BaseModelInfo) -> Json:
    return {
        "id": base.model,
        "object": "model",
        "created": 0,
        "owned_by": "opentinker",
        "root": base.model,
        "parent": None,
        "max_model_len": base.max_positions,
    }


def _adapter_json(adapter: registry_pb2.Adapter, base: BaseModelInfo, model_id: str | None = None) -> Json:
    return {
        "id": model_id or adapter.name,
        "object": "model",
        "created": adapter.create_time.seconds,
        "owned_by": adapter.tenant,
        "root": adapter.name,
        "parent": base.model,
        "aliases": dict(adapter.aliases),
        "latest_version": adapter.latest_version,
        "serving_alias": adapter.serving_alias or "latest",
    }


async def _tenant_adapters(backend: Backend, tenant: str) -> list[registry_pb2.Adapter]:
    prefix, token = f"{tenant}/", ""
    found: list[registry_pb2.Adapter] = []
    while True:
        page = registry_pb2.ListAdaptersRequest(prefix=prefix, page_size=1000, page_token=token)
        reply = await backend.registry.unary_async("ListAdapters", page, registry_pb2.ListAdaptersResponse)
        found.extend(a for a in reply.adapters if a.name.startswith(prefix))  # another tenant's: never
        token = reply.next_page_token
        if not token:
            return found


async def list_models(request: web.Request) -> web.Response:
    gw, principal, backend = gateway_of(request), principal_of(request), backend_of(request)
    base = await gw.backends.base_model(principal.token)
    adapters = await _tenant_adapters(backend, principal.tenant)
    data = [_base_json(base), *(_adapter_json(a, base) for a in adapters)]
    return web.json_response({"object": "list", "data": data})


async def get_model(request: web.Request) -> web.Response:
    gw, principal, backend = gateway_of(request), principal_of(request), backend_of(request)
    model = request.match_info["model"]
    base = await gw.backends.base_model(principal.token)
    ref = reference(model, principal.tenant, base)
    if ref == BASE:
        return web.json_response(_base_json(base))
    name = ref.partition("@")[0]
    try:
        got = await backend.registry.unary_async(
            "GetAdapter", registry_pb2.GetAdapterRequest(name=name), registry_pb2.GetAdapterResponse
        )
        answer = _adapter_json(got.adapter, base, model)
        if "@" in ref:
            resolved = await backend.registry.unary_async(
                "Resolve", registry_pb2.ResolveRequest(reference=ref), registry_pb2.ResolveResponse
            )
            answer["version"] = resolved.resolved.version
    except OpenTinkerError as exc:
        raise backend_error(exc, model) from exc
    return web.json_response(answer)
