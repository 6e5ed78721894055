"""The gateway's routes as an OpenAPI 3.1 document, served at GET /openapi.json (no key needed).

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
from dataclasses import dataclass, field
from typing import Any

from opentinker.gateway import convert, episode_routes, openai_requests, rest, runs, sampling
from opentinker.gateway.checkpoints import MAX_TTL_SECONDS
from opentinker.gateway.episodes import EPISODE_ID
from opentinker.gateway.fields import FLOAT32_MAX, INT32_MAX, INT64_MAX, UINT64_MAX
from opentinker.weights.peft import MAX_RANK

Schema = dict[str, Any]

_STRING: Schema = {"type": "string"}
_BOOL: Schema = {"type": "boolean"}
_OBJECT: Schema = {"type": "object"}


def _nullable(kind: str) -> Schema:
    return {"type": [kind, "null"]}


def _range(kind: str, low: float, high: float, *, nullable: bool = True) -> Schema:
    """A number the handler takes in ``low..high`` (null or absent: its default)."""
    return {"type": [kind, "null"] if nullable else kind, "minimum": low, "maximum": high}


def _body(*required: str, **properties: Schema) -> Schema:
    schema: Schema = {"type": "object", "properties": properties}
    if required:
        schema["required"] = list(required)
    return schema


def _closed(schema: Schema) -> Schema:
    """An object that may hold no other fields (its handler refuses them)."""
    return {**schema, "additionalProperties": False}


_FLOAT32 = _range("number", -FLOAT32_MAX, FLOAT32_MAX)  # fields.number: a finite float32
_TOKEN: Schema = {"type": "integer", "minimum": 0, "maximum": INT32_MAX}
_TOKENS: Schema = {"type": "array", "items": _TOKEN}
_SEQ_ID = _range("integer", 1, INT64_MAX, nullable=False)  # within the model's window: checked at run time
_INT32 = _range("integer", 0, INT32_MAX, nullable=False)
_TTL = _range("integer", 1, MAX_TTL_SECONDS)  # checkpoints.expiry; null: never expires
_METADATA: Schema = {  # runs.user_metadata
    "type": ["object", "null"],
    "maxProperties": runs.MAX_METADATA_ENTRIES,
    "propertyNames": {"maxLength": runs.MAX_METADATA_KEY},
    "additionalProperties": {"type": ["string", "number", "boolean"]},
}
_LORA = _body(  # convert.lora_config
    rank=_range("integer", 1, MAX_RANK),
    seed=_range("integer", 0, UINT64_MAX),
    train_attn=_nullable("boolean"),
    train_mlp=_nullable("boolean"),
    train_unembed=_nullable("boolean"),
)
_ADAM = _body(  # convert.adam_params
    **{name: _FLOAT32 for name in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")}
)
_SAMPLING_PARAMS = _body(  # convert.sampling_params
    max_tokens=_range("integer", 1, convert.MAX_SAMPLE_TOKENS),
    temperature=_range("number", 0.0, 1e4),
    top_k=_range("integer", -1, INT32_MAX),
    top_p=_range("number", 0.0, 1.0),
    seed=_range("integer", 0, UINT64_MAX),
    stop={
        "type": ["string", "array", "null"],
        "maxItems": convert.MAX_STOP,
        "items": {"type": ["string", "integer"], "minimum": 0, "maximum": INT32_MAX},
    },
)
_MODEL_INPUT = _body(  # convert.prompt_tokens
    "chunks", chunks={"type": "array", "items": _body("tokens", type={"const": "encoded_text"}, tokens=_TOKENS)}
)
_MESSAGES: Schema = {  # openai_requests.message
    "type": "array",
    "minItems": 1,
    "maxItems": openai_requests.MAX_MESSAGES,
    "items": _body(
        "role",
        role={"type": "string", "enum": sorted(openai_requests.ROLES)},
        content={"type": ["string", "array", "null"], "items": _body("type", "text", type=_STRING, text=_STRING)},
        name=_STRING,
        reasoning_content=_STRING,
        tool_call_id=_STRING,
        tool_calls={"type": "array", "items": _body("function", id=_STRING, type=_STRING, function=_OBJECT)},
    ),
}
_PENALTY = _range("number", -openai_requests.MAX_PENALTY, openai_requests.MAX_PENALTY)
# What /v1/chat/completions and /v1/completions both read (openai_requests.options, _metadata_episode, _model).
_OPENAI_SAMPLING: dict[str, Schema] = {
    "model": {"type": "string", "minLength": 1},
    "max_tokens": _range("integer", 1, INT32_MAX),
    "max_completion_tokens": _range("integer", 1, INT32_MAX),
    "temperature": _range("number", 0.0, 2.0),
    "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
    "frequency_penalty": _PENALTY,
    "presence_penalty": _PENALTY,
    "n": {"type": ["integer", "null"], "minimum": 1, "description": "at most --max-num-samples (64)"},
    "seed": _range("integer", -(openai_requests.UINT64 // 2), openai_requests.UINT64 - 1),
    "stop": {
        "type": ["string", "array", "null"],
        "minLength": 1,
        "maxItems": openai_requests.MAX_STOP,
        "items": {"type": "string", "minLength": 1},
    },
    "stream": _nullable("boolean"),
    "stream_options": {"type": ["object", "null"], "properties": {"include_usage": _nullable("boolean")}},
    "return_token_ids": _nullable("boolean"),
    "response_format": {"type": ["object", "null"], "required": ["type"], "properties": {"type": {"const": "text"}}},
    "logit_bias": {"type": ["object", "null"], "maxProperties": 0},
    "cache_salt": {  # vLLM's prefix-cache salt (openai_requests._cache_salt)
        "type": ["string", "null"],
        "minLength": 1,
        "description": f"at most {openai_requests.MAX_CACHE_SALT_BYTES} UTF-8 bytes",
    },
    "metadata": {"type": ["object", "null"], "properties": {"episode_id": _STRING}},
    "user": _STRING,
}
_EPISODE_HEADER: Schema = {"name": "X-OpenTinker-Episode", "in": "header", "required": False, "schema": _STRING}
_CONTENT_ENCODING: Schema = {
    "name": "Content-Encoding",
    "in": "header",
    "required": False,
    "schema": {"type": "string", "enum": ["zstd"]},
}

# Error bodies: app._error under /api/v1, openai_errors.error_json under /v1.
_TINKER_ERROR = _body("error", "detail", error=_STRING, detail=_STRING, request_id=_STRING)
_OPENAI_ERROR = _body(
    "error",
    error=_body(
        "message", "type", "code", message=_STRING, type=_STRING, param=_nullable("string"), code=_nullable("string")
    ),
)

JSON = "application/json"
PROTOBUF = "application/x-protobuf"
EVENT_STREAM = "text/event-stream"

# Statuses, by what a route does; every route also answers 401 without a valid key (unless public) and 400/413
# for a body it reads that is not JSON or too large.
OK, BAD, MISSING, TOO_MANY, UNAVAILABLE = 200, 400, 404, 429, 503
SESSION = (BAD, MISSING, 410)  # an unknown (404) or finished (410) session
STATE = UNAVAILABLE  # a write to the gateway's state store (--redis-url) that failed


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    path: str  # aiohttp's form: {name} or {name:regex}
    summary: str
    statuses: tuple[int, ...] = ()  # besides 200 and the 401/400/413 every route of its kind answers
    body: Schema | None = None  # the JSON body its handler reads
    binary: bool = False  # a protobuf body: forward_backward
    query: dict[str, Schema] = field(default_factory=dict)
    headers: tuple[Schema, ...] = ()
    public: bool = False  # answers without an API key
    answers: tuple[str, ...] = (JSON,)  # the media types of a 200

    @property
    def openai(self) -> bool:
        return self.path.startswith("/v1/")

    def all_statuses(self) -> list[int]:
        found = {OK, *self.statuses}
        if not self.public:
            found.add(401)
        if self.body is not None or self.binary:
            found |= {BAD, 413}
        return sorted(found)


_CHECKPOINT = "/api/v1/training_runs/{run_id}/checkpoints/{segment}/{name}"
_PAGE = {  # rest._page
    "limit": _range("integer", 1, rest.MAX_PAGE, nullable=False),
    "offset": _range("integer", 0, 1 << 62, nullable=False),
    "access_scope": {"type": "string", "enum": list(rest.ACCESS_SCOPES)},
}
_SUBMIT = (BAD, MISSING, TOO_MANY, STATE)  # a numbered request on a model's lane (training._submit)
_V1_SAMPLE = (BAD, MISSING, TOO_MANY, UNAVAILABLE, 504)  # openai_errors.from_backend

ROUTES: tuple[Route, ...] = (
    Route("GET", "/api/v1/healthz", "Liveness", public=True),
    Route("GET", "/openapi.json", "This document", public=True),
    Route("POST", "/api/v1/client/config", "The SDK's feature flags", body=_body(sdk_version=_nullable("string"))),
    Route("POST", "/api/v1/client/dynamic_config", "The SDK's runtime flags (the body is not read)"),
    Route("GET", "/api/v1/get_server_capabilities", "The base model served"),
    Route(
        "POST",
        "/api/v1/create_session",
        "A tinker session",
        (TOO_MANY, STATE),
        _body(sdk_version=_nullable("string"), tags={"type": "array", "items": _STRING}, user_metadata=_METADATA),
    ),
    Route(
        "POST",
        "/api/v1/session_heartbeat",
        "Keeps a session alive",
        SESSION,
        _body("session_id", session_id=_STRING),
    ),
    Route(
        "POST",
        "/api/v1/sessions/{session_id}/finish",
        "Ends a session",
        (MISSING, STATE),
        _body(reason={"type": ["object", "null"], "properties": {"type": _STRING}}),
    ),
    Route(
        "POST",
        "/api/v1/retrieve_future",
        "A request's result (long poll): JSON, or a tinker protobuf for forward_backward and asample",
        (MISSING,),
        _body("request_id", request_id=_STRING),
        answers=(JSON, PROTOBUF),
    ),
    Route("POST", "/api/v1/cancel_future", "Accepted and ignored", (), _body("request_id", request_id=_STRING)),
    Route("POST", "/api/v1/telemetry", "Accepted and dropped (the body is read, not parsed)", body=_OBJECT),
    Route(
        "POST",
        "/api/v1/create_model",
        "A LoRA training run (a future)",
        (*SESSION, TOO_MANY),
        _body(
            "session_id",
            "model_seq_id",
            "base_model",
            session_id=_STRING,
            model_seq_id=_INT32,
            base_model=_STRING,
            lora_config=_LORA,
            optimizer_config=_body(type=_STRING),
            user_metadata=_METADATA,
        ),
    ),
    Route("POST", "/api/v1/get_info", "A training run's model", (MISSING,), _body("model_id", model_id=_STRING)),
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
        _body("model_id", "seq_id", model_id=_STRING, seq_id=_SEQ_ID, adam_params=_ADAM, optimizer_params=_OBJECT),
    ),
    Route(
        "POST",
        "/api/v1/save_weights",
        "Saves the training state (a future)",
        _SUBMIT,
        _body(
            "model_id",
            "seq_id",
            model_id=_STRING,
            seq_id=_SEQ_ID,
            path=_nullable("string"),
            overwrite=_nullable("boolean"),
            ttl_seconds=_TTL,
            user_metadata=_METADATA,
        ),
    ),
    Route(
        "POST",
        "/api/v1/save_weights_for_sampler",
        "Publishes sampler weights (a future)",
        _SUBMIT,
        _body(
            "model_id",
            "seq_id",
            model_id=_STRING,
            seq_id=_SEQ_ID,
            path=_nullable("string"),
            kind=_STRING,
            sampling_session_seq_id=_range("integer", 0, INT32_MAX),
            ttl_seconds=_TTL,
            user_metadata=_METADATA,
        ),
    ),
    Route(
        "POST",
        "/api/v1/load_weights",
        "Loads a saved state: into a new model (session_id, model_seq_id) or an existing one (model_id, seq_id)",
        (*_SUBMIT, 410),
        _body(
            "path",
            path=_STRING,
            optimizer=_nullable("boolean"),
            session_id=_STRING,
            model_seq_id=_INT32,
            base_model=_STRING,
            model_id=_STRING,
            seq_id=_SEQ_ID,
            user_metadata=_METADATA,
        ),
    ),
    Route(
        "POST",
        "/api/v1/create_sampling_session",
        "A sampling session of the base model or of sampler weights",
        (*SESSION, STATE),
        _body(
            "session_id",
            "sampling_session_seq_id",
            session_id=_STRING,
            sampling_session_seq_id=_INT32,
            model_path=_nullable("string"),
            base_model=_nullable("string"),
        ),
    ),
    Route("GET", "/api/v1/samplers/{sampler_id}", "A sampling session", (MISSING,)),
    Route(
        "POST",
        "/api/v1/asample",
        "Samples (or computes prompt logprobs) from a sampling session or a model path (a future)",
        (MISSING, TOO_MANY),
        _body(
            "prompt",
            sampling_session_id=_nullable("string"),
            seq_id=_range("integer", 0, INT64_MAX, nullable=False),
            model_path=_nullable("string"),
            base_model=_nullable("string"),
            prompt=_MODEL_INPUT,
            num_samples={"type": ["integer", "null"], "minimum": 1, "description": "at most --max-num-samples (64)"},
            sampling_params=_SAMPLING_PARAMS,
            prompt_logprobs=_nullable("boolean"),
            prompt_logprobs_last_n=_range("integer", 0, INT32_MAX),
            topk_sample_logprobs=_range("integer", 0, sampling.MAX_TOPK_SAMPLE_LOGPROBS),
            topk_prompt_logprobs=_range("integer", 0, INT32_MAX),
            prompt_alt_tokens_k=_range("integer", 0, INT32_MAX),
            record_stability_info=_nullable("boolean"),
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
        _body("ttl_seconds", ttl_seconds=_TTL),
    ),
    Route("POST", _CHECKPOINT + "/publish", "Makes a checkpoint public", (MISSING, STATE)),
    Route("DELETE", _CHECKPOINT + "/publish", "Makes a checkpoint private", (MISSING, STATE)),
    Route("GET", "/api/v1/checkpoints", "The tenant's checkpoints", (BAD,), query=_PAGE),
    Route(
        "POST",
        "/api/v1/weights_info",
        "A checkpoint's base model and LoRA",
        (MISSING,),
        _body("tinker_path", tinker_path=_STRING),
    ),
    Route("GET", "/v1/models", "The base model and the tenant's adapters"),
    Route(
        "GET",
        "/v1/models/{model:.+}",
        "One model (a reference of the tenant's, or the base model)",
        (BAD, MISSING, UNAVAILABLE),
    ),
    Route(
        "POST",
        "/v1/chat/completions",
        "OpenAI chat completions (text/event-stream with stream: true)",
        _V1_SAMPLE,
        _body(
            "model",
            "messages",
            messages=_MESSAGES,
            logprobs=_nullable("boolean"),
            top_logprobs=_range("integer", 0, openai_requests.MAX_TOP_LOGPROBS),
            tools={"type": ["array", "null"], "items": _body("type", "function", type=_STRING, function=_OBJECT)},
            tool_choice={"type": ["string", "object", "null"]},
            chat_template_kwargs=_nullable("object"),
            **_OPENAI_SAMPLING,
        ),
        headers=(_EPISODE_HEADER,),
        answers=(JSON, EVENT_STREAM),
    ),
    Route(
        "POST",
        "/v1/completions",
        "OpenAI completions: a text, texts, token ids or arrays of them (text/event-stream with stream: true)",
        _V1_SAMPLE,
        _body(
            "model",
            "prompt",
            prompt={"type": ["string", "array"], "items": {"type": ["string", "integer", "array"]}},
            logprobs=_range("integer", 0, 5),
            echo=_nullable("boolean"),
            suffix=_nullable("string"),
            **_OPENAI_SAMPLING,
        ),
        headers=(_EPISODE_HEADER,),
        answers=(JSON, EVENT_STREAM),
    ),
    Route(
        "GET",
        "/v1/episodes",
        "The tenant's recent episodes",
        (BAD, STATE),
        query={"limit": _range("integer", 1, episode_routes.MAX_LIST, nullable=False)},
    ),
    Route("GET", "/v1/episodes/{episode_id}", "An episode", (BAD, MISSING, STATE)),
    Route(
        "POST",
        "/v1/episodes/{episode_id}/reward",
        "Rewards an episode ({reward}) or one of its turns ({turn, reward})",
        (MISSING, STATE),
        _closed(_body("reward", reward={"type": "number"}, turn={"type": "integer", "minimum": 0})),
    ),
    Route("DELETE", "/v1/episodes/{episode_id}", "Deletes an episode", (BAD, MISSING, STATE)),
)


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
        {"name": name, "in": "path", "required": True, "schema": _PATH_PARAMETERS.get(name, _STRING)}
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
