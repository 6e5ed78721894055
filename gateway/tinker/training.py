"""Training routes: create_model, get_info, forward_backward (and forward), optim_step; and how a numbered request
is queued on its model's lane (see models.py) and a model created once (saves.py's load_weights creates them too)."""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

from aiohttp import web

from opentinker.gateway.backend import Backend
from opentinker.gateway.bodies import Json, field_of, json_body, required
from opentinker.gateway.errors import GatewayError, RequestFailed, bad_request
from opentinker.gateway.state import backend_of, gateway_of, principal_of
from opentinker.gateway.tinker import convert, fields, stability
from opentinker.gateway.tinker.futures import Future, Job, Outcome
from opentinker.gateway.tinker.models import TrainingModel
from opentinker.gateway.tinker.runs import TrainingRun, user_metadata
from opentinker.gateway.tinker.state import TinkerState, tinker_of
from opentinker.v1 import trainer_pb2

_DECODE_INLINE_BYTES = 256 << 10  # smaller plain bodies are parsed on the event loop
UNSUPPORTED_LOSS_HINT = "custom losses run client-side (forward_backward_custom)"


def future_reply(future_id: str, model_id: str | None = None) -> web.Response:
    body: Json = {"request_id": future_id}
    if model_id is not None:
        body["model_id"] = model_id
    return web.json_response(body)


def adapter_name(tenant: str, session_id: str, model_seq_id: int) -> str:
    return f"{tenant}/tinker-{session_id}-{model_seq_id}"


def model_to_create(gw: TinkerState, body: Json, session_id: str, tenant: str) -> tuple[int, str, str | None]:
    """(model_seq_id, model_id, the future of an earlier request creating it): a resent creation gets the
    first one's future instead of a second model."""
    model_seq_id = fields.required_integer(body, "model_seq_id", 0, fields.INT32_MAX)
    gw.sessions.active(session_id, tenant)
    model_id = f"{session_id}:train:{model_seq_id}"
    return model_seq_id, model_id, gw.models.creating.get(model_id)


def start_creation(gw: TinkerState, tenant: str, model_id: str, job: Job) -> web.Response:
    future = _start(gw, tenant, job)
    gw.models.creating[model_id] = future.request_id
    return future_reply(future.request_id, model_id)


def _start(gw: TinkerState, tenant: str, job: Job) -> Future:
    future = gw.futures.create(tenant)
    gw.futures.start(future, job)
    return future


async def create_adapter(
    gw: TinkerState,
    backend: Backend,
    request: trainer_pb2.TrainerServiceCreateAdapterRequest,
    model: TrainingModel,
    metadata: dict[str, str] | None,
    weights_from: str = "",
) -> None:
    """Creates the adapter (then loads the LoRA weights of saved state `weights_from`, if given) before the
    model becomes visible, so a failed load leaves no half-made model behind; its training run is stored before
    the client hears of the model id."""
    await backend.trainer.unary_async("CreateAdapter", request, trainer_pb2.TrainerServiceCreateAdapterResponse)
    if weights_from:
        load = trainer_pb2.LoadStateRequest(adapter=request.name, state_id=weights_from, weights_only=True)
        await backend.trainer.unary_async("LoadState", load, trainer_pb2.LoadStateResponse)
    run = TrainingRun(
        model.model_id, model.tenant, model.session_id, model.adapter, model.lora, model.base_model, metadata
    )
    await gw.durable.put_run(run)
    gw.runs.add(run)
    gw.models.add(model)


async def create_model(request: web.Request) -> web.Response:
    gw, principal, backend = tinker_of(request), principal_of(request), backend_of(request)
    backends = gateway_of(request).backends
    body = await json_body(request)
    session_id = required(body, "session_id", str)
    model_seq_id, model_id, resent = model_to_create(gw, body, session_id, principal.tenant)
    if resent is not None:
        return future_reply(resent, model_id)
    base_model = required(body, "base_model", str)
    config, seed = convert.lora_config(fields.mapping(body, "lora_config"))
    optimizer = fields.mapping(body, "optimizer_config")
    metadata = user_metadata(body.get("user_metadata"))

    async def job() -> Outcome:
        base = await backends.base_model(principal.token)
        if not base.matches(base_model):
            raise RequestFailed(f"base_model {base_model!r} is not served here; this server trains {base.model!r}")
        if optimizer.get("type", "adamw") != "adamw":
            raise RequestFailed(f"optimizer {optimizer.get('type')!r} is not supported (adamw only)")
        create = trainer_pb2.TrainerServiceCreateAdapterRequest(
            name=adapter_name(principal.tenant, session_id, model_seq_id),
            lora_config=config,
            seed=secrets.randbits(32) if seed is None else seed,
        )
        lane = gw.lane(model_id)
        model = TrainingModel(model_id, principal.tenant, session_id, create.name, config, base.model, lane)
        await create_adapter(gw, backend, create, model, metadata)
        return Outcome(json={"model_id": model_id, "type": "create_model"})

    return start_creation(gw, principal.tenant, model_id, job)


async def get_info(request: web.Request) -> web.Response:
    gw, principal = tinker_of(request), principal_of(request)
    body = await json_body(request)
    model = gw.models.get(required(body, "model_id", str), principal.tenant)
    base = await gateway_of(request).backends.base_model(principal.token)
    return web.json_response(
        {
            "type": "get_info",
            "model_id": model.model_id,
            "model_data": {"arch": base.architecture, "model_name": model.base_model, "tokenizer_id": model.base_model},
            "is_lora": True,
            "lora_rank": model.lora.rank,
            "model_name": model.base_model,
            "optimizer_config": {"type": "adamw"},
        }
    )


async def submit(
    request: web.Request, model: TrainingModel, seq_id: int, job: Job, size: int | None = None
) -> web.Response:
    """Queues a numbered request on its model's lane; a resent seq_id gets its first answer again. ``size``: the
    bytes the waiting request holds (its JSON body unless given)."""
    if seq_id < 1:
        raise bad_request(f"seq_id must be at least 1, got {seq_id}", "INVALID_SEQ_ID")
    resent = model.lane.resent(seq_id)
    if resent is not None:
        return future_reply(resent, model.model_id)
    gw = tinker_of(request)
    if size is None:
        size = len(await request.read())  # aiohttp keeps the body it read
    model.lane.check(seq_id)
    held, limit = gw.models.pending_bytes(model.tenant), gw.config.max_tenant_pending_bytes
    if model.lane.pending and model.lane.poisoned is None and held + size > limit:
        raise GatewayError(
            429, "TOO_MUCH_PENDING", f"tenant {model.tenant} has {held} bytes of requests waiting; at most {limit}"
        )
    future = gw.futures.create(model.tenant)
    try:
        model.lane.submit(seq_id, future, job, size)
    except GatewayError:
        gw.futures.discard(future)
        raise
    run = gw.runs.find(model.model_id)
    if run is not None:
        run.last_request = time.time()
    await gw.durable.put_seq(model.model_id, seq_id)  # after a restart, the lane expects the next one
    return future_reply(future.request_id, model.model_id)


async def forward_backward(request: web.Request) -> web.Response:
    gw, shared, principal, backend = tinker_of(request), gateway_of(request), principal_of(request), backend_of(request)
    raw = await request.read()
    encoding = request.headers.get("Content-Encoding", "")

    def decode() -> tuple[Any, int]:
        body = convert.decompress(raw, encoding, gw.config.max_body_bytes)
        return convert.parse_forward_backward(body, gw.config.max_string_length), len(body)

    if encoding or len(raw) > _DECODE_INLINE_BYTES:  # off the event loop, two at a time (each may be 64 MiB)
        async with shared.decode_slots:
            message, size = await asyncio.to_thread(decode)
    else:
        message, size = decode()
    model = gw.models.get(message.model_id, principal.tenant)
    convert.check_sizes(message)
    forward_only = bool(message.forward_only)

    async def job() -> Outcome:
        base = await shared.backends.base_model(principal.token)
        loss_fn = str(message.loss_fn)
        if loss_fn not in base.loss_fns:
            raise RequestFailed(
                f"loss_fn {loss_fn!r} is not supported by this server (supported: {', '.join(sorted(base.loss_fns))}; "
                f"{UNSUPPORTED_LOSS_HINT})"
            )
        config = convert.loss_fn_config(message)
        datums = await asyncio.to_thread(convert.datums, message)
        if loss_fn == stability.LOSS_FN:
            # records looked up (and touched) on the event loop that owns them; the checks run off it
            records = gw.stability.lookup(principal.tenant, model.session_id, stability.sequence_ids(message))
            await asyncio.to_thread(stability.apply, message, datums, records)
        outputs: list[trainer_pb2.LossFnOutput]
        if forward_only:
            fwd = trainer_pb2.ForwardRequest(
                adapter=model.adapter, datums=datums, loss_fn=loss_fn, loss_fn_config=config
            )
            reply = await backend.trainer.unary_async("Forward", fwd, trainer_pb2.ForwardResponse)
            outputs, metrics = list(reply.loss_fn_outputs), dict(reply.metrics)
        else:
            fb = trainer_pb2.ForwardBackwardRequest(
                adapter=model.adapter,
                datums=datums,
                loss_fn=loss_fn,
                loss_fn_config=config,
                trace_ids=convert.trace_ids(message, model.session_id),
            )
            fb_reply = await backend.trainer.unary_async("ForwardBackward", fb, trainer_pb2.ForwardBackwardResponse)
            outputs, metrics = list(fb_reply.loss_fn_outputs), dict(fb_reply.metrics)
        return Outcome(proto=convert.forward_backward_output(outputs, metrics))

    return await submit(request, model, int(message.seq_id), job, size)


async def optim_step(request: web.Request) -> web.Response:
    gw, principal, backend = tinker_of(request), principal_of(request), backend_of(request)
    body = await json_body(request)
    model = gw.models.get(required(body, "model_id", str), principal.tenant)
    adam = field_of(body, "adam_params", dict, required=False)
    other = field_of(body, "optimizer_params", dict, required=False)
    params = convert.adam_params(adam) if adam is not None else None

    async def job() -> Outcome:
        if params is None:
            kind = other.get("type") if other else None
            raise RequestFailed(f"optimizer {str(kind)[:64]!r} is not supported (AdamParams only)")
        step = trainer_pb2.OptimStepRequest(adapter=model.adapter, adam_params=params)
        reply = await backend.trainer.unary_async("OptimStep", step, trainer_pb2.OptimStepResponse)
        return Outcome(json={"metrics": dict(reply.metrics)})

    return await submit(request, model, fields.required_integer(body, "seq_id", 1, fields.INT64_MAX), job)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/api/v1/create_model", create_model)
    app.router.add_post("/api/v1/get_info", get_info)
    app.router.add_post("/api/v1/forward_backward", forward_backward)
    app.router.add_post("/api/v1/optim_step", optim_step)
