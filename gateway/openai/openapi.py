"""The OpenAI routes' part of the OpenAPI document (openapi.py): each /v1 model and completion route with the
body fields its handler reads (requests.py), their types and bounds, and the statuses it answers."""

from __future__ import annotations

from opentinker.gateway.openai import requests
from opentinker.gateway.route_schema import (
    BAD,
    EVENT_STREAM,
    JSON,
    MISSING,
    OBJECT,
    STRING,
    TOO_MANY,
    UNAVAILABLE,
    Route,
    Schema,
    bounded,
    nullable,
    object_of,
)

_MESSAGES: Schema = {  # requests.message
    "type": "array",
    "minItems": 1,
    "maxItems": requests.MAX_MESSAGES,
    "items": object_of(
        "role",
        role={"type": "string", "enum": sorted(requests.ROLES)},
        content={"type": ["string", "array", "null"], "items": object_of("type", "text", type=STRING, text=STRING)},
        name=STRING,
        reasoning_content=STRING,
        tool_call_id=STRING,
        tool_calls={"type": "array", "items": object_of("function", id=STRING, type=STRING, function=OBJECT)},
    ),
}
_PENALTY = bounded("number", -requests.MAX_PENALTY, requests.MAX_PENALTY)
# What /v1/chat/completions and /v1/completions both read (requests.options, _metadata_episode, _model).
_OPENAI_SAMPLING: dict[str, Schema] = {
    "model": {"type": "string", "minLength": 1},
    "max_tokens": bounded("integer", 1, requests.INT32_MAX),
    "max_completion_tokens": bounded("integer", 1, requests.INT32_MAX),
    "temperature": bounded("number", 0.0, 2.0),
    "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
    "frequency_penalty": _PENALTY,
    "presence_penalty": _PENALTY,
    "n": {"type": ["integer", "null"], "minimum": 1, "description": "at most --max-num-samples (64)"},
    "seed": bounded("integer", -(requests.UINT64 // 2), requests.UINT64 - 1),
    "stop": {
        "type": ["string", "array", "null"],
        "minLength": 1,
        "maxItems": requests.MAX_STOP,
        "items": {"type": "string", "minLength": 1},
    },
    "stream": nullable("boolean"),
    "stream_options": {"type": ["object", "null"], "properties": {"include_usage": nullable("boolean")}},
    "return_token_ids": nullable("boolean"),
    "response_format": {  # structured.response_format
        "type": ["object", "null"],
        "required": ["type"],
        "properties": {
            "type": {"enum": ["text", "json_object", "json_schema"]},
            "json_schema": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                    "schema": {"type": "object"},
                    "strict": nullable("boolean"),
                },
            },
        },
    },
    "logit_bias": {"type": ["object", "null"], "maxProperties": 0},
    "cache_salt": {  # vLLM's prefix-cache salt (requests._cache_salt)
        "type": ["string", "null"],
        "minLength": 1,
        "description": f"at most {requests.MAX_CACHE_SALT_BYTES} UTF-8 bytes",
    },
    "metadata": {"type": ["object", "null"], "properties": {"episode_id": STRING}},
    "user": STRING,
}
_EPISODE_HEADER: Schema = {"name": "X-OpenTinker-Episode", "in": "header", "required": False, "schema": STRING}
_V1_SAMPLE = (BAD, MISSING, TOO_MANY, UNAVAILABLE, 504)  # errors.from_backend

ROUTES: tuple[Route, ...] = (
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
        object_of(
            "model",
            "messages",
            messages=_MESSAGES,
            logprobs=nullable("boolean"),
            top_logprobs=bounded("integer", 0, requests.MAX_TOP_LOGPROBS),
            tools={"type": ["array", "null"], "items": object_of("type", "function", type=STRING, function=OBJECT)},
            tool_choice={"type": ["string", "object", "null"]},  # structured.tool_choice
            parallel_tool_calls=nullable("boolean"),
            chat_template_kwargs=nullable("object"),
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
        object_of(
            "model",
            "prompt",
            prompt={"type": ["string", "array"], "items": {"type": ["string", "integer", "array"]}},
            logprobs=bounded("integer", 0, 5),
            echo=nullable("boolean"),
            suffix=nullable("string"),
            **_OPENAI_SAMPLING,
        ),
        headers=(_EPISODE_HEADER,),
        answers=(JSON, EVENT_STREAM),
    ),
)
