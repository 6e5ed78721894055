"""The tinker routes' part of the OpenAPI document (openapi.py): each /api/v1 route with the body fields its
handler reads, their types and bounds (from the modules that check them), and the statuses it answers."""

from __future__ import annotations

from opentinker.gateway.route_schema import (
    BAD,
    JSON,
    MISSING,
    OBJECT,
    PROTOBUF,
    STATE,
    STRING,
    TOO_MANY,
    Route,
    Schema,
    bounded,
    nullable,
    object_of,
)
from opentinker.gateway.tinker import convert, rest, runs, sampling
from opentinker.gateway.tinker.checkpoints import MAX_TTL_SECONDS
from opentinker.gateway.tinker.fields import FLOAT32_MAX, INT32_MAX, INT64_MAX, UINT64_MAX
from opentinker.weights.peft import MAX_RANK

SESSION = (BAD, MISSING, 410)  # an unknown (404) or finished (410) session
_FLOAT32 = bounded("number", -FLOAT32_MAX, FLOAT32_MAX)  # fields.number: a finite float32
_TOKEN: Schema = {"type": "integer", "minimum": 0, "maximum": INT32_MAX}
_TOKENS: Schema = {"type": "array", "items": _TOKEN}
_SEQ_ID = bounded("integer", 1, INT64_MAX, nullable=False)  # within the model's window: checked at run time
_INT32 = bounded("integer", 0, INT32_MAX, nullable=False)
_TTL = bounded("integer", 1, MAX_TTL_SECONDS)  # checkpoints.expiry; null: never expires
_METADATA: Schema = {  # runs.user_metadata
    "type": ["object", "null"],
    "maxProperties": runs.MAX_METADATA_ENTRIES,
    "propertyNames": {"maxLength": runs.MAX_METADATA_KEY},
    "additionalProperties": {"type": ["string", "number", "boolean"]},
}
_LORA = object_of(  # convert.lora_config
    rank=bounded("integer", 1, MAX_RANK),
    seed=bounded("integer", 0, UINT64_MAX),
    train_attn=nullable("boolean"),
    train_mlp=nullable("boolean"),
    train_unembed=nullable("boolean"),
)
_ADAM = object_of(  # convert.adam_params
    **{name: _FLOAT32 for name in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")}
)
_SAMPLING_PARAMS = object_of(  # convert.sampling_params
    max_tokens=bounded("integer", 1, convert.MAX_SAMPLE_TOKENS),
    temperature=bounded("number", 0.0, 1e4),
    top_k=bounded("integer", -1, INT32_MAX),
    top_p=bounded("number", 0.0, 1.0),
    seed=bounded("integer", 0, UINT64_MAX),
    stop={
        "type": ["string", "array", "null"],
        "maxItems": convert.MAX_STOP,
        "items": {"type": ["string", "integer"], "minimum": 0, "maximum": INT32_MAX},
    },
)
_MODEL_INPUT = object_of(  # convert.prompt_tokens
    "chunks", chunks={"type": "array", "items": object_of("tokens", type={"const": "encoded_text"}, tokens=_TOKENS)}
)
_CONTENT_ENCODING: Schema = {
    "name": "Content-Encoding",
    "in": "header",
    "required": False,
    "schema": {"type": "string", "enum": ["zstd"]},
}

_CHECKPOINT = "/api/v1/training_runs/{run_id}/checkpoints/{segment}/{name}"
_PAGE = {  # rest._page
    "limit": bounded("integer", 1, rest.MAX_PAGE, nullable=False),
    "offset": bounded("integer", 0, 1 << 62, nullable=False),
    "access_scope": {"type": "string", "enum": list(rest.ACCESS_SCOPES)},
}
_SUBMIT = (BAD, MISSING, TOO_MANY, STATE)  # a numbered request on a model's lane (training.submit)
ROUTES: tuple[Route, ...] = (
    Route("POST", "/api/v1/client/config", "The SDK's feature flags", body=object_of(sdk_version=nullable("string"))),
    Route("POST", "/api/v1/client/dynamic_config", "The SDK's runtime flags (the body is not read)"),
    Route("GET", "/api/v1/get_server_capabilities", "The base model served"),
    Route(
        "POST",
        "/api/v1/create_session",
        "A tinker session",
        (TOO_MANY, STATE),
        object_of(sdk_version=nullable("string"), tags={"type": "array", "items": STRING}, user_metadata=_METADATA),
    ),
    Route(
        "POST",
        "/api/v1/session_heartbeat",
        "Keeps a session alive",
        SESSION,
        object_of("session_id", session_id=STRING),
    ),
    Route(
        "POST",
        "/api/v1/sessions/{session_id}/finish",
        "Ends a session",
        (MISSING, STATE),
        object_of(reason={"type": ["object", "null"], "properties": {"type": STRING}}),
    ),
    Route(
        "POST",
        "/api/v1/retrieve_future",
        "A request's result (long poll): JSON, or a tinker protobuf for forward_backward and asample",
        (MISSING,),
        object_of("request_id", request_id=STRING),
        answers=(JSON, PROTOBUF),
    ),
    Route("POST", "/api/v1/cancel_future", "Accepted and ignored", (), object_of("request_id", request_id=STRING)),
    Route("POST", "/api/v1/telemetry", "Accepted and dropped (the body is read, not parsed)", body=OBJECT),
    Route(
        "POST",
        "/api/v1/create_model",
        "A LoRA training run (a future)",
        (*SESSION, TOO_MANY),
        object_of(
            "session_id",
            "model_seq_id",
            "base_model",
            session_id=STRING,
            model_seq_id=_INT32,
            base_model=STRING,
            lora_config=_LORA,
            optimizer_config=object_of(type=STRING),
            user_metadata=_METADATA,
        ),
    ),
    Route("POST", "/api/v1/get_info", "A training run's model", (MISSING,), object_of("model_id", model_id=STRING)),
    Route(
        "POST",
        "/api/v1/forward_backward",
        "A forward(-backward) pass: a tinker ForwardBackwardRequest protobuf, zstd-compressed or not (a future)",
        _SUBMIT,
        binary=True,
        headers=(_CONTENT_ENCODING,),
    ),
    Route(
        "POST",
        "/api/v1/optim_step",
        "An AdamW step (a future)",
        _SUBMIT,
        object_of("model_id", "seq_id", model_id=STRING, seq_id=_SEQ_ID, adam_params=_ADAM, optimizer_params=OBJECT),
    ),
    Route(
        "POST",
        "/api/v1/save_weights",
        "Saves the training state (a future)",
        _SUBMIT,
        object_of(
            "model_id",
            "seq_id",
            model_id=STRING,
            seq_id=_SEQ_ID,
            path=nullable("string"),
            overwrite=nullable("boolean"),
            ttl_seconds=_TTL,
            user_metadata=_METADATA,
        ),
    ),
    Route(
        "POST",
        "/api/v1/save_weights_for_sampler",
        "Publishes sampler weights (a future)",
        _SUBMIT,
        object_of(
            "model_id",
            "seq_id",
            model_id=STRING,
            seq_id=_SEQ_ID,
            path=nullable("string"),
            kind=STRING,
            sampling_session_seq_id=bounded("integer", 0, INT32_MAX),
            ttl_seconds=_TTL,
            user_metadata=_METADATA,
        ),
    ),
    Route(
        "POST",
        "/api/v1/load_weights",
        "Loads a saved state: into a new model (session_id, model_seq_id) or an existing one (model_id, seq_id)",
        (*_SUBMIT, 410),
        object_of(
            "path",
            path=STRING,
            optimizer=nullable("boolean"),
            session_id=STRING,
            model_seq_id=_INT32,
            base_model=STRING,
            model_id=STRING,
            seq_id=_SEQ_ID,
            user_metadata=_METADATA,
        ),
    ),
    Route(
        "POST",
        "/api/v1/create_sampling_session",
        "A sampling session of the base model or of sampler weights",
        (*SESSION, STATE),
        object_of(
            "session_id",
            "sampling_session_seq_id",
            session_id=STRING,
            sampling_session_seq_id=_INT32,
            model_path=nullable("string"),
            base_model=nullable("string"),
        ),
    ),
    Route("GET", "/api/v1/samplers/{sampler_id}", "A sampling session", (MISSING,)),
    Route(
        "POST",
        "/api/v1/asample",
        "Samples (or computes prompt logprobs) from a sampling session or a model path (a future)",
        (MISSING, TOO_MANY),
        object_of(
            "prompt",
            sampling_session_id=nullable("string"),
            seq_id=bounded("integer", 0, INT64_MAX, nullable=False),
            model_path=nullable("string"),
            base_model=nullable("string"),
            prompt=_MODEL_INPUT,
            num_samples={"type": ["integer", "null"], "minimum": 1, "description": "at most --max-num-samples (64)"},
            sampling_params=_SAMPLING_PARAMS,
            prompt_logprobs=nullable("boolean"),
            prompt_logprobs_last_n=bounded("integer", 0, INT32_MAX),
            topk_sample_logprobs=bounded("integer", 0, sampling.MAX_TOPK_SAMPLE_LOGPROBS),
            topk_prompt_logprobs=bounded("integer", 0, INT32_MAX),
            prompt_alt_tokens_k=bounded("integer", 0, INT32_MAX),
            record_stability_info=nullable("boolean"),
        ),
    ),
    Route("GET", "/api/v1/training_runs", "The tenant's training runs", (BAD,), query=_PAGE),
    Route("GET", "/api/v1/training_runs/{run_id}", "A training run", (BAD, MISSING), query=_PAGE),
    Route("GET", "/api/v1/training_runs/{run_id}/checkpoints", "A run's checkpoints", (MISSING,)),
    Route("GET", _CHECKPOINT, "A checkpoint", (MISSING,)),
    Route("DELETE", _CHECKPOINT, "Deletes a checkpoint", (MISSING, STATE)),
    Route(
        "PUT",
        _CHECKPOINT + "/ttl",
        "Sets (or, with null, removes) a checkpoint's expiry",
        (MISSING, STATE),
        object_of("ttl_seconds", ttl_seconds=_TTL),
    ),
    Route("POST", _CHECKPOINT + "/publish", "Makes a checkpoint public", (MISSING, STATE)),
    Route("DELETE", _CHECKPOINT + "/publish", "Makes a checkpoint private", (MISSING, STATE)),
    Route("GET", "/api/v1/checkpoints", "The tenant's checkpoints", (BAD,), query=_PAGE),
    Route(
        "POST",
        "/api/v1/weights_info",
        "A checkpoint's base model and LoRA",
        (MISSING,),
        object_of("tinker_path", tinker_path=STRING),
    ),
)
