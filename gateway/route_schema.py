"""What an OpenAPI description of a gateway route is made of: the JSON-schema builders both surfaces' parts use
(tinker/openapi.py, openai/openapi.py), the media types and statuses, and the `Route` record the document
(openapi.py) is assembled from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Schema = dict[str, Any]

STRING: Schema = {"type": "string"}
BOOL: Schema = {"type": "boolean"}
OBJECT: Schema = {"type": "object"}


def nullable(kind: str) -> Schema:
    return {"type": [kind, "null"]}


def bounded(kind: str, low: float, high: float, *, nullable: bool = True) -> Schema:
    """A number the handler takes in ``low..high`` (null or absent: its default)."""
    return {"type": [kind, "null"] if nullable else kind, "minimum": low, "maximum": high}


def object_of(*required: str, **properties: Schema) -> Schema:
    schema: Schema = {"type": "object", "properties": properties}
    if required:
        schema["required"] = list(required)
    return schema


def closed(schema: Schema) -> Schema:
    """An object that may hold no other fields (its handler refuses them)."""
    return {**schema, "additionalProperties": False}


JSON = "application/json"
PROTOBUF = "application/x-protobuf"
EVENT_STREAM = "text/event-stream"

# Statuses, by what a route does; every route also answers 401 without a valid key (unless public) and 400/413
# for a body it reads that is not JSON or too large.
OK, BAD, MISSING, TOO_MANY, UNAVAILABLE = 200, 400, 404, 429, 503
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
