"""Save and load routes: save_weights (a trainer state at ``tinker://<model>/weights/<name>``),
save_weights_for_sampler (a registry version), load_weights (a new model from a checkpoint, or a state loaded into
an existing one); each runs on its model's lane like training.py's requests."""

from __future__ import annotations

from aiohttp import web

from opentinker.gateway.bodies import Json, field_of, json_body, required
from opentinker.gateway.errors import RequestFailed, bad_request
from opentinker.gateway.state import backend_of, gateway_of, principal_of
from opentinker.gateway.tinker import fields
from opentinker.gateway.tinker.checkpoints import Checkpoint, checkpoint_path, expiry
from opentinker.gateway.tinker.futures import Outcome
from opentinker.gateway.tinker.models import TrainingModel
from opentinker.gateway.tinker.runs import user_metadata
from opentinker.gateway.tinker.sessions import SamplingSession
from opentinker.gateway.tinker.state import TinkerState, tinker_of
from opentinker.gateway.tinker.training import (
    adapter_name,
    create_adapter,
    future_reply,
    model_to_create,
    start_creation,
    submit,
)
from opentinker.v1 import common_pb2, trainer_pb2


async def save_weights(request: web.Request) -> web.Response:
    """save_state: a trainer saved state (weights + optimizer) at ``tinker://<model>/weights/<name>``."""
    gw, principal, backend = tinker_of(request), principal_of(request), backend_of(request)
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

    return await submit(request, model, fields.required_integer(body, "seq_id", 1, fields.INT64_MAX), job)


async def save_weights_for_sampler(request: web.Request) -> web.Response:
    """A registry version of the model's adapter: at a ``sampler_weights`` path (named saves), or as a
    sampling session pinned to that exact version (save_weights_and_get_sampling_client)."""
    gw, principal, backend = tinker_of(request), principal_of(request), backend_of(request)
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

    return await submit(request, model, fields.required_integer(body, "seq_id", 1, fields.INT64_MAX), job)


def _retention(body: Json) -> tuple[float | None, dict[str, str] | None]:
    """A save's expiry (``ttl_seconds``) and ``user_metadata``; 400 INVALID_FIELD for either out of bounds."""
    try:
        expires_at = expiry(body.get("ttl_seconds"))
    except ValueError as exc:
        raise bad_request(str(exc), "INVALID_FIELD") from None
    return expires_at, user_metadata(body.get("user_metadata"))


async def record_checkpoint(gw: TinkerState, checkpoint: Checkpoint) -> None:
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
    gw, principal, backend = tinker_of(request), principal_of(request), backend_of(request)
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

        return await submit(request, model, fields.required_integer(body, "seq_id", 1, fields.INT64_MAX), load_into)

    model_seq_id, model_id, resent = model_to_create(gw, body, session_id, principal.tenant)
    if resent is not None:
        return future_reply(resent, model_id)
    base_override = field_of(body, "base_model", str, required=False)
    metadata = user_metadata(body.get("user_metadata"))

    backends = gateway_of(request).backends

    async def create_from() -> Outcome:
        base = await backends.base_model(principal.token)
        if base_override is not None and not base.matches(base_override):
            raise RequestFailed(f"base_model {base_override!r} is not served here; this server trains {base.model!r}")
        checkpoint = gw.checkpoints.get(path, principal.tenant)
        create, weights_from = _load_request(
            checkpoint, adapter_name(principal.tenant, session_id, model_seq_id), optimizer
        )
        lora = common_pb2.LoraConfig()
        lora.CopyFrom(checkpoint.lora)
        model = TrainingModel(model_id, principal.tenant, session_id, create.name, lora, base.model, gw.lane(model_id))
        await create_adapter(gw, backend, create, model, metadata, weights_from)
        return Outcome(json={"path": path, "model_id": model_id, "type": "load_weights"})

    return start_creation(gw, principal.tenant, model_id, create_from)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/api/v1/save_weights", save_weights)
    app.router.add_post("/api/v1/save_weights_for_sampler", save_weights_for_sampler)
    app.router.add_post("/api/v1/load_weights", load_weights)
