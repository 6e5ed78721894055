"""SampleRequest.constraint on a real sampler server (its engine in a process of its own): every sample of a
JSON-schema request parses and validates on random weights, a regex is matched, logprobs are reported, and bad
constraints are refused with INVALID_ARGUMENT INVALID_CONSTRAINT and the compiler's message, changing nothing."""

from __future__ import annotations

import json
import re
from typing import Any

import grpc
from badsampleutil import sample_error
from samplerutil import Sampler, params, prompt, request, run
from trainerutil import assert_status

from opentinker.v1 import sampler_pb2

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999},
        "label": {"type": "string", "maxLength": 10},
        "mood": {"enum": ["happy", "sad", "calm"]},
        "flag": {"type": "boolean"},
        "point": {
            "type": "object",
            "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
            "required": ["x", "y"],
            "additionalProperties": False,
        },
        "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    },
    "required": ["id", "label", "mood", "flag", "point", "items"],
    "additionalProperties": False,
}


FIELDS = {"id", "label", "mood", "flag", "point", "items"}


def _valid(value: dict[str, object]) -> bool:
    point, items, number = value["point"], value["items"], value["id"]
    return (
        set(value) == FIELDS
        and isinstance(number, int)
        and 1 <= number <= 9999
        and isinstance(value["label"], str)
        and len(value["label"]) <= 10
        and value["mood"] in ("happy", "sad", "calm")
        and isinstance(value["flag"], bool)
        and isinstance(point, dict)
        and set(point) == {"x", "y"}
        and isinstance(items, list)
        and len(items) <= 3
        and all(isinstance(i, int) and 0 <= i <= 9 for i in items)
    )


def test_every_sample_of_a_schema_parses_and_validates(sampler: Sampler) -> None:
    constraint = sampler_pb2.Constraint(json_schema=json.dumps(SCHEMA))
    sampling = params(temperature=1.0, max_tokens=200, seed=11)
    sampling.logprobs = True
    result = run(sampler, request("base", prompt(3), sampling, num_samples=8, constraint=constraint))
    assert len(result.samples) == 8
    for sample in result.samples.values():
        assert sample.stop_reason == sampler_pb2.STOP_REASON_STOP_TOKEN, sample.text
        assert _valid(json.loads(sample.text)), sample.text
        assert len(sample.logprobs) == len(sample.tokens) and all(lp <= 0 for lp in sample.logprobs)
    regex = sampler_pb2.Constraint(regex=r"[a-c]{2}-[0-9]{2}")
    again = run(sampler, request("base", prompt(4), params(temperature=1.0, max_tokens=40, seed=2), constraint=regex))
    assert re.fullmatch(r"[a-c]{2}-[0-9]{2}", again.only.text), again.only.text


def test_bad_constraints_are_refused_by_name(sampler: Sampler) -> None:
    cases: list[tuple[sampler_pb2.Constraint, dict[str, list[Any]], str]] = [
        (sampler_pb2.Constraint(json_schema='{"type": "strin"}'), {}, "strin"),
        (sampler_pb2.Constraint(json_schema="{not json"), {}, "not JSON"),
        (sampler_pb2.Constraint(regex="a(b"), {}, "unclosed group"),
        (sampler_pb2.Constraint(lark="start: nowhere"), {}, "unknown name"),
        (sampler_pb2.Constraint(regex=""), {}, "empty"),
        (sampler_pb2.Constraint(json_object=True), {"stop_strings": ["}"]}, "stop strings"),
        (sampler_pb2.Constraint(json_object=True), {"stop_token_ids": [7]}, "stop token ids"),
    ]
    for constraint, extra, words in cases:
        sampling = params(max_tokens=8)
        sampling.stop_strings.extend(extra.get("stop_strings", []))
        sampling.stop_token_ids.extend(extra.get("stop_token_ids", []))
        error = sample_error(sampler, request("base", prompt(5), sampling, constraint=constraint))
        assert_status(error, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_CONSTRAINT")
        assert words in (error.details() or ""), (words, error.details())
    free = run(sampler, request("base", prompt(5), params(max_tokens=4)))
    assert len(free.only.tokens) == 4  # nothing changed for the next request


def test_constraints_over_the_compile_bounds_are_refused_naming_the_limit(sampler: Sampler) -> None:
    """llguidance's parser limits bound its lexer, not its JSON-schema translation, whose time grows with the
    square of an object's optional properties (8,000 of them, a 75 KB schema: ~20 s). Over 256 per object, over
    256 KiB, or nested deeper than JSON parsing goes: INVALID_CONSTRAINT naming the bound, before any compile."""
    optional = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(300)}}
    cases = [
        (json.dumps(optional), "300 optional properties, over the limit of 256 per object"),
        (json.dumps({"type": "string", "description": "x" * 270_000}), "over 262,144 bytes"),
        ('{"a":' * 5000 + "1" + "}" * 5000, "nested too deeply"),
    ]
    for schema, words in cases:
        constraint = sampler_pb2.Constraint(json_schema=schema)
        error = sample_error(sampler, request("base", prompt(6), params(max_tokens=4), constraint=constraint))
        assert_status(error, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_CONSTRAINT")
        assert words in (error.details() or ""), (words, error.details())
    required = dict(optional, required=[f"p{i}" for i in range(100)])  # 200 optional: within the bound
    constraint = sampler_pb2.Constraint(json_schema=json.dumps(required))
    result = run(sampler, request("base", prompt(6), params(max_tokens=4), constraint=constraint))
    assert result.only.stop_reason == sampler_pb2.STOP_REASON_LENGTH
