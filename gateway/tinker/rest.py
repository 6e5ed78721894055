"""The routes of the tinker SDK's RestClient: training runs (list, get, with their ``user_metadata``), checkpoints
(list per run and per tenant, get, delete, TTL, publish flags) and weights_info for a ``tinker://`` path.

Everything is the caller's tenant's: another tenant's run or checkpoint answers 404 exactly as one that does not
exist. A run id is a model id. Deleting a checkpoint frees its path at once; what it stood for (a saved state, a
registry version) is deleted by checkpoint_gc.py, which keeps a version an alias points to until the alias moves.
``public`` is a flag only: it is listed, but loading a checkpoint stays limited to its own tenant (the trainer and
registry scope states and versions to tenants).
"""

from __future__ import annotations

from datetime import UTC, datetime

from aiohttp import web

from opentinker.gateway.bodies import Json, field_of, json_body
from opentinker.gateway.errors import RequestFailed, bad_request, not_found
from opentinker.gateway.state import principal_of
from opentinker.gateway.tinker.checkpoints import KIND_OF_SEGMENT, Checkpoint, expiry
from opentinker.gateway.tinker.runs import TrainingRun
from opentinker.gateway.tinker.state import TinkerState, tinker_of
from opentinker.weights.base_model import UNEMBED_MODULE

MAX_PAGE = 1000
ACCESS_SCOPES = ("owned", "accessible")  # one scope here: a tenant accesses its own runs


def _time(unix: float) -> str:
    return datetime.fromtimestamp(unix, UTC).isoformat()


def checkpoint_json(checkpoint: Checkpoint) -> Json:
    return {
        "checkpoint_id": checkpoint.checkpoint_id,
        "checkpoint_type": "training" if checkpoint.kind == "state" else "sampler",
        "time": _time(checkpoint.created),
        "tinker_path": checkpoint.path,
        "size_bytes": checkpoint.size_bytes,
        "public": checkpoint.public,
        "user_metadata": checkpoint.user_metadata,
        "expires_at": None if checkpoint.expires_at is None else _time(checkpoint.expires_at),
    }


def run_json(gw: TinkerState, run: TrainingRun) -> Json:
    checkpoints = gw.checkpoints.of_run(run.model_id, run.tenant)
    states = [c for c in checkpoints if c.kind == "state"]
    samplers = [c for c in checkpoints if c.kind == "sampler"]
    model = gw.models.find(run.model_id)
    return {
        "training_run_id": run.model_id,
        "base_model": run.base_model,
        "model_owner": run.tenant,
        "is_lora": True,
        "corrupted": model is not None and model.lane.poisoned is not None,
        "lora_rank": run.lora.rank,
        "last_request_time": _time(run.last_request),
        "last_checkpoint": checkpoint_json(states[-1]) if states else None,
        "last_sampler_checkpoint": checkpoint_json(samplers[-1]) if samplers else None,
        "user_metadata": run.user_metadata,
    }


def _int_param(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise bad_request(f"{name} must be a whole number from {low} to {high}, got {raw[:32]!r}", "INVALID_FIELD")
    return value


def _page(request: web.Request, default_limit: int) -> tuple[int, int]:
    access = request.query.get("access_scope", "owned")
    if access not in ACCESS_SCOPES:
        raise bad_request(f"access_scope must be one of {', '.join(ACCESS_SCOPES)}", "INVALID_FIELD")
    return _int_param(request, "limit", default_limit, 1, MAX_PAGE), _int_param(request, "offset", 0, 0, 1 << 62)


def _run(request: web.Request) -> TrainingRun:
    return tinker_of(request).runs.get(request.match_info["run_id"], principal_of(request).tenant)


def _checkpoint(request: web.Request) -> Checkpoint:
    """The checkpoint a ``.../checkpoints/{segment}/{name}`` route names; 404 for an unknown one (or another
    tenant's)."""
    run = _run(request)
    segment, name = request.match_info["segment"], request.match_info["name"]
    path = f"tinker://{run.model_id}/{segment}/{name}"
    checkpoint = tinker_of(request).checkpoints.find(path) if segment in KIND_OF_SEGMENT else None
    if checkpoint is None or checkpoint.tenant != run.tenant:
        raise not_found(f"unknown checkpoint {path!r}", "UNKNOWN_CHECKPOINT")
    return checkpoint


async def list_training_runs(request: web.Request) -> web.Response:
    gw, tenant = tinker_of(request), principal_of(request).tenant
    limit, offset = _page(request, 20)
    runs = gw.runs.of_tenant(tenant)
    return web.json_response(
        {
            "training_runs": [run_json(gw, run) for run in runs[offset : offset + limit]],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)},
        }
    )


async def get_training_run(request: web.Request) -> web.Response:
    _page(request, 1)  # checks access_scope
    return web.json_response(run_json(tinker_of(request), _run(request)))


async def list_checkpoints(request: web.Request) -> web.Response:
    run = _run(request)
    checkpoints = tinker_of(request).checkpoints.of_run(run.model_id, run.tenant)
    return web.json_response({"checkpoints": [checkpoint_json(c) for c in checkpoints]})


async def list_user_checkpoints(request: web.Request) -> web.Response:
    gw, tenant = tinker_of(request), principal_of(request).tenant
    limit, offset = _page(request, 100)
    checkpoints = gw.checkpoints.of_tenant(tenant)
    return web.json_response(
        {
            "checkpoints": [checkpoint_json(c) for c in checkpoints[offset : offset + limit]],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(checkpoints)},
        }
    )


async def get_checkpoint(request: web.Request) -> web.Response:
    return web.json_response(checkpoint_json(_checkpoint(request)))


async def delete_checkpoint(request: web.Request) -> web.Response:
    """The path goes at once (a new save may reuse it); its saved state or version is deleted by the GC."""
    gw, checkpoint = tinker_of(request), _checkpoint(request)
    tombstone = gw.checkpoints.retire(checkpoint.path)
    if tombstone is not None:
        await gw.durable.put_checkpoint(tombstone)
        await gw.durable.drop_checkpoint(checkpoint.path)
    return web.json_response({})


async def set_ttl(request: web.Request) -> web.Response:
    gw, checkpoint = tinker_of(request), _checkpoint(request)
    body = await json_body(request)
    if "ttl_seconds" not in body:
        raise bad_request("ttl_seconds is required (null removes the expiry)", "MISSING_FIELD")
    try:
        expires_at = expiry(body["ttl_seconds"])
    except ValueError as exc:
        raise bad_request(str(exc), "INVALID_FIELD") from None
    checkpoint.expires_at = expires_at
    await gw.durable.put_checkpoint(checkpoint)
    return web.json_response({})


async def _publish(request: web.Request, public: bool) -> web.Response:
    """Sets the flag; setting it again succeeds and changes nothing (the SDK retries a 409 as a transient
    conflict, so "already public" cannot be one)."""
    gw, checkpoint = tinker_of(request), _checkpoint(request)
    if checkpoint.public != public:
        checkpoint.public = public
        await gw.durable.put_checkpoint(checkpoint)
    return web.json_response({})


async def publish(request: web.Request) -> web.Response:
    return await _publish(request, True)


async def unpublish(request: web.Request) -> web.Response:
    return await _publish(request, False)


async def weights_info(request: web.Request) -> web.Response:
    gw, tenant = tinker_of(request), principal_of(request).tenant
    body = await json_body(request)
    path = field_of(body, "tinker_path", str)
    assert path is not None
    try:
        checkpoint = gw.checkpoints.get(path, tenant)
    except RequestFailed as exc:
        raise not_found(exc.message, "UNKNOWN_CHECKPOINT") from None
    run = gw.runs.find(checkpoint.model_id)
    targets = set(checkpoint.lora.target_modules) or {"all-linear"}
    return web.json_response(
        {
            "base_model": run.base_model if run is not None else "",
            "optimizer_config": {"type": "adamw"},
            "is_lora": True,
            "lora_rank": checkpoint.lora.rank,
            "train_unembed": UNEMBED_MODULE in targets,
            "train_mlp": bool(targets & {"all-linear", "mlp"}),
            "train_attn": bool(targets & {"all-linear", "attn"}),
        }
    )


def add_routes(app: web.Application) -> None:
    one = "/api/v1/training_runs/{run_id}/checkpoints/{segment}/{name}"
    app.router.add_get("/api/v1/training_runs", list_training_runs)
    app.router.add_get("/api/v1/training_runs/{run_id}", get_training_run)
    app.router.add_get("/api/v1/training_runs/{run_id}/checkpoints", list_checkpoints)
    app.router.add_get(one, get_checkpoint)
    app.router.add_delete(one, delete_checkpoint)
    app.router.add_put(one + "/ttl", set_ttl)
    app.router.add_post(one + "/publish", publish)
    app.router.add_delete(one + "/publish", unpublish)
    app.router.add_get("/api/v1/checkpoints", list_user_checkpoints)
    app.router.add_post("/api/v1/weights_info", weights_info)
