"""Constrained decoding's typed records for SamplingParams(constraint=...): every sample then follows the grammar,
whatever the weights (the sampler masks each step's logits with llguidance; docs/structured.md).

    JsonSchema(MyModel)            a pydantic model class (its model_json_schema()) or a schema dict / JSON text
    JsonObject()                   any JSON object
    Regex(r"(yes|no)-[0-9]{3}")    the whole output matches
    Grammar('start: "a" | "b"')    a Lark grammar (llguidance's dialect; %json {...} embeds a schema)

A sample ends where its grammar may end (stop_reason "stop_token") or where max_tokens cuts it ("length": the
text is then an unfinished prefix). Stop strings cannot be combined with a constraint. The logprobs returned are
of the masked, renormalized distribution the tokens were drawn from (docs/structured.md explains what an RL
loop does with them).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

__all__ = ["Constraint", "Grammar", "JsonObject", "JsonSchema", "Regex"]


@dataclass(frozen=True, slots=True, init=False)
class JsonSchema:
    """A JSON Schema, kept as its JSON text in the order given: an object's fields come out in the order its
    ``properties`` lists them (the sampler's cache keys a schema by its sorted form, so key order costs no compile)."""

    schema: str

    def __init__(self, schema: type | Mapping[str, Any] | str) -> None:
        if isinstance(schema, str):
            value = json.loads(schema)
        elif isinstance(schema, Mapping):
            value = dict(schema)
        elif hasattr(schema, "model_json_schema"):  # a pydantic model class
            value = schema.model_json_schema()
        else:
            raise TypeError(f"JsonSchema takes a pydantic model class, a dict or JSON text, got {schema!r}")
        if not isinstance(value, dict):
            raise TypeError("a JSON schema is a JSON object")
        object.__setattr__(self, "schema", json.dumps(value))


@dataclass(frozen=True, slots=True)
class JsonObject:
    """Any JSON object."""


@dataclass(frozen=True, slots=True)
class Regex:
    pattern: str


@dataclass(frozen=True, slots=True)
class Grammar:
    """A Lark grammar in llguidance's dialect; `start` is the entry rule."""

    lark: str


Constraint: TypeAlias = JsonSchema | JsonObject | Regex | Grammar
