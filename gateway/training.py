"""Training routes: create_model, get_info, forward_backward (and forward), optim_step, save_weights,
save_weights_for_sampler, load_weights. Each numbered request runs on its model's lane (see models.py)."""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

from aiohttp import web

from opentinker.gateway import convert, fields, stability
from opentinker.gateway.backend import Backend
from opentinker.gateway.checkpoints import Checkpoint, checkpoint_path, expiry
from opentinker.gateway.errors import GatewayError, RequestFailed, bad_request
from opentinker.gateway.futures import Future, Job, Outcome
from opentinker.gateway.models import TrainingModel
from opentinker.gateway.runs import TrainingRun, user_metadata
from opentinker.gateway.sessions import SamplingSession
from opentinker.gateway.state import (
    Gateway,
    Json,
    backend_of,
    field_of,
    gateway_of,
    json_body,
    principal_of,
    required,
)
from opentinker.v1 import common_pb2, trainer_pb2

_DECODE_INLINE_BYTES = 256 << 10  # smaller plain bodies are parsed on the event loop
UNSUPPORTED_LOSS_HINT = "custom losses run client-side (forward_backward_custom)"


def _future_reply(future_id: str, model_id: str | None = None) -> web.Response:
    body: Json = {"request_id": future_id}
    if model_id is not None:
        body["model_id"] = model_id
    return web.json_response(body)


def _adapter_name(tenant: str, session_id: str, model_seq_id: int) -> str:
    return f"{tenant}/tinker-{session_id}-{model_seq_id}"


def _model_to_create(gw: Gateway, body: Json, session_id: str, tenant: str) -> tuple[int, str, str | None]:
    """(model_seq_id, model_id, the future of an earlier request creating it): a resent creation gets the
    first one's future instead of a second model."""
    model_seq_id = fields.required_integer(body, "model_seq_id", 0, fields.INT32_MAX)
    gw.sessions.active(session_id, tenant)
    model_id = f"{session_id}:train:{model_seq_id}"
    return model_seq_id, model_id, gw.models.creating.get(model_id)


def _start_creation(gw: Gateway, tenant: str, model_id: str, job: Job) -> web.Response:
    future = _start(gw, tenant, job)
    gw.models.creating[model_id] = future.request_id
    return _future_reply(future.request_id, model_id)


def _start(gw: Gateway, tenant: str, job: Job) -> Future:
    future = gw.futures.create(tenant)
    gw.futures.start(future, job)
    return future


async def _create_adapter(
    gw: Gateway,
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
    gw, principal, backend = gateway_of(request), principal_of(request), backend_of(request)
    body = await json_body(request)
    session_id = required(body, "session_id", str)
    model_seq_id, model_id, resent = _model_to_create(gw, body, session_id, principal.tenant)
    if resent is not None:
        return _future_reply(resent, model_id)
    base_model = required(body, "base_model", str)
    config, seed = convert.lora_config(fields.mapping(body, "lora_config"))
    optimizer = fields.mapping(body, "optimizer_config")
    metadata = user_metadata(body.get("user_metadata"))

    async def job() -> Outcome:
        base = await gw.backends.base_model(principal.token)
        if not base.matches(base_model):
            raise RequestFailed(f"base_model {base_model!r} is not served here; this server trains {base.model!r}")
        if optimizer.get("type", "adamw") != "adamw":
            raise RequestFailed(f"optimizer {optimizer.get('type')!r} is not supported (adamw only)")
        create = trainer_pb2.TrainerServiceCreateAdapterRequest(
            name=_adapter_name(principal.tenant, session_id, model_seq_id),
            lora_config=config,
            seed=secrets.randbits(32) if seed is None else seed,
        )
        lane = gw.lane(model_id)
        model = TrainingModel(model_id, principal.tenant, session_id, create.name, config, base.model, lane)
        await _create_adapter(gw, backend, create, model, metadata)
        return Outcome(json={"model_id": model_id, "type": "create_model"})

    return _start_creation(gw, principal.tenant, model_id, job)


async def get_info(request: web.Request) -> web.Response:
    gw, principal = gateway_of(request), principal_of(request)
    body = await json_body(request)
    model = gw.models.get(required(body, "model_id", str), principal.tenant)
    base = await gw.backends.base_model(principal.token)
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


async def _submit(
    request: web.Request, model: TrainingModel, seq_id: int, job: Job, size: int | None = None
) -> web.Response:
    """Queues a numbered request on its model's lane; a resent seq_id gets its first answer again. ``size``: the
    bytes the waiting request holds (its JSON body unless given)."""
    if seq_id < 1:
        raise bad_request(f"seq_id must be at least 1, got {seq_id}", "INVALID_SEQ_ID")
    resent = model.lane.resent(seq_id)
    if resent is not None:
        return _future_reply(resent, model.model_id)
    gw = gateway_of(request)
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
    return _future_reply(future.request_id, model.model_id)


async def forward_backward(request: web.Request) -> web.Response:
    gw, principal, backend = gateway_of(request), principal_of(request), backend_of(request)
    raw = await request.read()
    encoding = request.headers.get("Content-Encoding", "")

    def decode() -> tuple[Any, int]:
        body = convert.decompress(raw, encoding, gw.config.max_body_bytes)
        return convert.parse_forward_backward(body, gw.config.max_string_length), len(body)

    if encoding or len(raw) > _DECODE_INLINE_BYTES:  # off the event loop, two at a time (each may be 64 MiB)
        async with gw.decode_slots:
            message, size = await asyncio.to_thread(decode)
    else:
        message, size = decode()
    model = gw.models.get(message.model_id, principal.tenant)
    convert.check_sizes(message)
    forward_only = bool(message.forward_only)

    async def job() -> Outcome:
        base = await gw.backends.base_model(principal.token)
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

    return await _submit(request, model, int(message.seq_id), job, size)


async def optim_step(request: web.Request) -> web.Response:
    gw, principal, backend = gateway_of(request), principal_of(request), backend_of(request)
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

    return await _submit(request, model, fields.required_integer(body, "seq_id", 1, fields.INT64_MAX), job)


async def save_weights(request: web.Request) -> web.Response:
    """save_state: a trainer saved state (weights + optimizer) at ``tinker://<model>/weights/<name>``."""
    gw, principal, backend = gateway_of(request), principal_of(request), backend_of(request)
    body = await json_body(request)
    model = gw.models.get(required(body, "model_id", str), principal.tenant)
    name = field_of(body, "path", str, required=False) or "state"
    overwrite = fields.boolean(body, "overwrite")
    expires_at, metadata = _retention(body)

    async def job() -> Outcome:
        path = checkpoint_path(model.model_id, "state", name)
        if gw.checkpoints.exists(path) and not overwrite:
            raise RequestFailed(f"checkpoint {path} exists; pass overwrite=True to replace it")
        save = trainer_pb2.SaveStateRequest(adapter=model.adapter, label=name)
        reply = await backend.trainer.unary_async("SaveState", save, trainer_pb2.SaveStateResponse)
        checkpoint = Checkpoint(
            path,
            model.tenant,
            "state",
            reply.state_id,
            model.lora,
            model.model_id,
            expires_at=expires_at,
            size_bytes=reply.size_bytes,
            user_metadata=metadata,
        )
        await record_checkpoint(gw, checkpoint)
        return Outcome(json={"path": path, "type": "save_weights"})

    return await _submit(request, model, fields.required_integer(body, "seq_id", 1, fields.INT64_MAX), job)


async def save_weights_for_sampler(request: web.Request) -> web.Response:
    """A registry version of the model's adapter: at a ``sampler_weights`` path (named saves), or as a
    sampling session pinned to that exact version (save_weights_and_get_sampling_client)."""
    gw, principal, backend = gateway_of(request), principal_of(request), backend_of(request)
    body = await json_body(request)
    model = gw.models.get(required(body, "model_id", str), principal.tenant)
    name = field_of(body, "path", str, required=False)
    sampler_seq = fields.integer(body, "sampling_session_seq_id", 0, fields.INT32_MAX)
    kind = body.get("kind", "snapshot")
    expires_at, metadata = _retention(body)

    async def job() -> Outcome:
        if kind != "snapshot":
            raise RequestFailed(f"sampling client kind {kind!r} is not supported (snapshot only)")
        if name is None and sampler_seq is None:
            raise RequestFailed("give path or sampling_session_seq_id")
        path = checkpoint_path(model.model_id, "sampler", name) if name is not None else None
        save = trainer_pb2.SaveSnapshotRequest(adapter=model.adapter)
        reply = await backend.trainer.unary_async("SaveSnapshot", save, trainer_pb2.SaveSnapshotResponse)
        reference = f"{model.adapter}@{reply.version.version}"
        if path is not None:
            size = reply.version.artifact_size_bytes
            checkpoint = Checkpoint(
                path,
                model.tenant,
                "sampler",
                reference,
                model.lora,
                model.model_id,
                expires_at=expires_at,
                size_bytes=size,
                user_metadata=metadata,
            )
            await record_checkpoint(gw, checkpoint)
            return Outcome(json={"path": path, "type": "save_weights_for_sampler"})
        sampler_id = f"{model.session_id}:sample:{sampler_seq}"
        sampler = SamplingSession(sampler_id, model.tenant, model.session_id, reference, model.base_model, None)
        await gw.durable.put_sampler(sampler)
        gw.sessions.add_sampler(sampler)
        return Outcome(json={"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"})

    return await _submit(request, model, fields.required_integer(body, "seq_id", 1, fields.INT64_MAX), job)


def _retention(body: Json) -> tuple[float | None, dict[str, str] | None]:
    """A save's expiry (``ttl_seconds``) and ``user_metadata``; 400 INVALID_FIELD for either out of bounds."""
    try:
        expires_at = expiry(body.get("ttl_seconds"))
    except ValueError as exc:
        raise bad_request(str(exc), "INVALID_FIELD") from None
    return expires_at, user_metadata(body.get("user_metadata"))


async def record_checkpoint(gw: Gateway, checkpoint: Checkpoint) -> None:
    """Stores a new checkpoint; the one it replaces under the same path becomes a tombstone, its target deleted by
    the checkpoint GC (unless the new one stands for the same target)."""
    tombstone = gw.checkpoints.retire(checkpoint.path)
    if tombstone is not None:  # stored first: a crash in between leaves the old target to the GC, not leaked
        await gw.durable.put_checkpoint(tombstone)
    await gw.durable.put_checkpoint(checkpoint)
    gw.checkpoints.add(checkpoint)
    run = gw.runs.find(checkpoint.model_id)
    if run is not None:  # its last_request_time, stored with each save rather than with every request
        await gw.durable.put_run(run)


def _load_request(
    checkpoint: Checkpoint, adapter: str, optimizer: bool
) -> tuple[trainer_pb2.TrainerServiceCreateAdapterRequest, str]:
    """A new adapter from a checkpoint: a saved state with its optimizer resumes exactly (weights, AdamW state,
    step, RNG); without it, the state's LoRA weights are loaded after creation (returned: the state to load them
    from) with a fresh optimizer; sampler weights start from that version's weights with a fresh optimizer."""
    request = trainer_pb2.TrainerServiceCreateAdapterRequest(name=adapter, lora_config=checkpoint.lora)
    if checkpoint.kind == "state":
        if not optimizer:
            return request, checkpoint.target
        request.resume_state = checkpoint.target
    else:
        if optimizer:
            raise RequestFailed(f"{checkpoint.path} holds sampler weights only (no optimizer state)")
        request.init_from = checkpoint.target
    return request, ""


async def load_weights(request: web.Request) -> web.Response:
    """create_training_client_from_state[_with_optimizer] (session_id + model_seq_id: a new model), or the
    deprecated load_state on an existing model (model_id + seq_id)."""
    gw, principal, backend = gateway_of(request), principal_of(request), backend_of(request)
    body = await json_body(request)
    path = required(body, "path", str)
    optimizer = fields.boolean(body, "optimizer")
    session_id = field_of(body, "session_id", str, required=False)
    if session_id is None:
        model = gw.models.get(required(body, "model_id", str), principal.tenant)

        async def load_into() -> Outcome:
            checkpoint = gw.checkpoints.get(path, principal.tenant)
            if checkpoint.kind != "state":
                raise RequestFailed(
                    f"{path} holds sampler weights; load_state into an existing model needs a training state "
                    "(save_state): create a new training client from the sampler weights instead"
                )
            load = trainer_pb2.LoadStateRequest(
                adapter=model.adapter, state_id=checkpoint.target, weights_only=not optimizer
            )
            await backend.trainer.unary_async("LoadState", load, trainer_pb2.LoadStateResponse)
            return Outcome(json={"path": path, "model_id": model.model_id, "type": "load_weights"})

        return await _submit(request, model, fields.required_integer(body, "seq_id", 1, fields.INT64_MAX), load_into)

    model_seq_id, model_id, resent = _model_to_create(gw, body, session_id, principal.tenant)
    if resent is not None:
        return _future_reply(resent, model_id)
    base_override = field_of(body, "base_model", str, required=False)
    metadata = user_metadata(body.get("user_metadata"))

    async def create_from() -> Outcome:
        base = await gw.backends.base_model(principal.token)
        if base_override is not None and not base.matches(base_override):
            raise RequestFailed(f"base_model {base_override!r} is not served here; this server trains {base.model!r}")
        checkpoint = gw.checkpoints.get(path, principal.tenant)
        create, weights_from = _load_request(
            checkpoint, _adapter_name(principal.tenant, session_id, model_seq_id), optimizer
        )
        lora = common_pb2.LoraConfig()
        lora.CopyFrom(checkpoint.lora)
        model = TrainingModel(model_id, principal.tenant, session_id, create.name, lora, base.model, gw.lane(model_id))
        await _create_adapter(gw, backend, create, model, metadata, weights_from)
        return Outcome(json={"path": path, "model_id": model_id, "type": "load_weights"})

    return _start_creation(gw, principal.tenant, model_id, create_from)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/api/v1/create_model", create_model)
    app.router.add_post("/api/v1/get_info", get_info)
    app.router.add_post("/api/v1/forward_backward", forward_backward)
    app.router.add_post("/api/v1/optim_step", optim_step)
    app.router.add_post("/api/v1/save_weights", save_weights)
    app.router.add_post("/api/v1/save_weights_for_sampler", save_weights_for_sampler)
    app.router.add_post("/api/v1/load_weights", load_weights)
