"""Structured outputs under /v1: ``response_format`` and ``tool_choice`` read into what they force, then built into
the sampler's grammar (``SampleRequest.constraint``), so the shape is guaranteed by masked decoding whatever the
weights, never hoped for.

* ``response_format`` ``{"type": "json_object"}``: any JSON object. ``{"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}}``: that schema (``strict`` false is enforced all the same: there is no weaker
  mode). ``{"type": "text"}`` or absent: free.
* ``tool_choice`` ``"required"``: the output is one or more calls (at most ``MAX_PARALLEL_CALLS``; exactly one
  when ``parallel_tool_calls`` is false) of the request's tools, each call's arguments valid for its tool's
  ``parameters`` schema. ``{"type": "function", "function": {"name": N}}``: exactly one call of N.
  ``{"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [...]}}``: like "required" over the
  listed tools. ``"auto"`` with a ``response_format``: either calls or the formatted answer; ``"auto"`` alone:
  free text, calls parsed from it as before.
* Calls are written in the chat template's own tool-call format (tool_calls.py: hermes ``<tool_call>`` blocks
  or llama3 JSON), so the forced output parses as the family's tool call and a model trained on its template
  sees its own format; a template with no tool-call format cannot be forced (400).

Grammars are Lark text in llguidance's dialect (``%json {schema}`` embeds a JSON schema), compiled by the sampler;
a schema it refuses is the sampler's INVALID_ARGUMENT, answered 400 naming the field that carried it. Stop strings
and a forced shape are refused together: a stop string could cut the output where the grammar may not end.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias

from opentinker.gateway.openai.body_fields import Body, obj, string, type_name
from opentinker.gateway.openai.errors import invalid
from opentinker.gateway.openai.tool_calls import HERMES_END, HERMES_START, ToolCallFormat
from opentinker.v1 import sampler_pb2

MAX_PARALLEL_CALLS = 4  # calls one forced answer may hold; a grammar needs a bound, and agents rarely want more
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for json_schema.name
# The JSON inside a grammar comes out as the chat templates write it (", " and ": ", no free whitespace): a weak
# or random model would otherwise spend its max_tokens on the whitespace JSON allows between tokens.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

ToolMode: TypeAlias = Literal["none", "auto", "required"]


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """``kind`` "text" (free), "json_object" or "json_schema" (``schema``, ``name``)."""

    kind: Literal["text", "json_object", "json_schema"] = "text"
    name: str = ""
    schema: dict[str, object] | None = None


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """``mode`` and, when forced, the tools it may call (``names``: all of the request's for "required")."""

    mode: ToolMode | None = None  # None: the field was absent
    names: tuple[str, ...] = ()
    parallel: bool = True  # parallel_tool_calls

    @property
    def forced(self) -> bool:
        return self.mode == "required"


@dataclass(frozen=True, slots=True)
class OutputConstraint:
    """The sampler's grammar for one request and where it came from (``param``: the field named by errors)."""

    kind: Literal["json_object", "json_schema", "lark"]
    source: str  # the schema's JSON text or the Lark grammar ("" for json_object)
    param: Literal["response_format", "tool_choice"]

    def to_proto(self) -> sampler_pb2.Constraint:
        if self.kind == "json_object":
            return sampler_pb2.Constraint(json_object=True)
        if self.kind == "json_schema":
            return sampler_pb2.Constraint(json_schema=self.source)
        return sampler_pb2.Constraint(lark=self.source)

    def to_record(self) -> dict[str, str]:
        """What an episode turn keeps: enough to rebuild the masks the tokens were drawn under."""
        return {"kind": self.kind, "source": self.source, "origin": self.param}


# Reading the body


def response_format(body: Body) -> ResponseFormat:
    value = body.get("response_format")
    if value is None:
        return ResponseFormat()
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise invalid("'response_format' must be an object with a 'type'", "response_format", "invalid_type")
    kind = value["type"]
    if kind in ("text", "json_object"):
        return ResponseFormat(kind)
    if kind != "json_schema":
        raise invalid(
            f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind[:64]!r}",
            "response_format",
        )
    spec = obj(value, "json_schema", where="response_format.")
    if not spec:
        raise invalid(
            "'response_format.json_schema' is required for type 'json_schema'",
            "response_format",
            "missing_required_parameter",
        )
    name = string(spec, "name", where="response_format.json_schema.", required=True) or ""
    if not _SCHEMA_NAME.fullmatch(name):
        raise invalid("'response_format.json_schema.name' must be 1-64 of a-z, A-Z, 0-9, '_' or '-'", "response_format")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid("'response_format.json_schema.strict' must be a boolean", "response_format", "invalid_type")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise invalid(
            f"'response_format.json_schema.schema' must be an object, got {type_name(schema)}",
            "response_format",
            "invalid_type",
        )
    return ResponseFormat("json_schema", name, schema)


def tool_choice(body: Body, tools: Sequence[dict[str, object]]) -> ToolChoice:
    """``tool_choice`` checked against the request's ``tools``: a forced call names tools the request gave."""
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("'parallel_tool_calls' must be a boolean", "parallel_tool_calls", "invalid_type")
    parallel = parallel is not False
    given = tuple(_tool_name(tool) for tool in tools)
    if choice is None or choice in ("none", "auto"):
        return ToolChoice(choice, (), parallel)
    if choice == "required":
        if not given:
            raise invalid("'tool_choice' 'required' needs 'tools'", "tool_choice")
        return ToolChoice("required", given, parallel)
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = string(obj(choice, "function", where="tool_choice."), "name", where="tool_choice.function.")
        if name is None:
            raise invalid("'tool_choice.function.name' is required", "tool_choice", "missing_required_parameter")
        return ToolChoice("required", (_known(name, given),), parallel=False)
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        return _allowed_tools(obj(choice, "allowed_tools", where="tool_choice."), given, parallel)
    raise invalid(
        "'tool_choice' must be 'none', 'auto', 'required', {'type': 'function', 'function': {'name': ...}} or "
        "{'type': 'allowed_tools', ...}",
        "tool_choice",
    )


def _allowed_tools(spec: dict[str, object], given: tuple[str, ...], parallel: bool) -> ToolChoice:
    mode, listed = spec.get("mode"), spec.get("tools")
    if not isinstance(listed, list) or not listed:
        raise invalid("'tool_choice.allowed_tools.tools' must be a non-empty array", "tool_choice", "invalid_type")
    names = []
    for i, tool in enumerate(listed):
        where = f"tool_choice.allowed_tools.tools[{i}]."
        function = obj(tool if isinstance(tool, dict) else {}, "function", where=where)
        name = string(function, "name", where=f"{where}function.", required=True)
        names.append(_known(name or "", given))
    if mode == "required":
        return ToolChoice("required", tuple(dict.fromkeys(names)), parallel)
    # "auto" over a subset would need free text that never spells a call of another tool: not a grammar we keep.
    raise invalid(
        f"'tool_choice.allowed_tools.mode' {str(mode)[:32]!r} is not supported, only 'required' (for a choice "
        "between text and calls, use 'auto' with the subset as 'tools')",
        "tool_choice",
        "unsupported_value",
    )


def _tool_name(tool: dict[str, object]) -> str:
    function = tool.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) else ""


def _known(name: str, given: tuple[str, ...]) -> str:
    if name not in given:
        raise invalid(f"'tool_choice' names the function {name[:64]!r}, which is not in 'tools'", "tool_choice")
    return name


# Building the grammar


def constraint(
    fmt: ResponseFormat, choice: ToolChoice, tools: Sequence[dict[str, object]], call_format: ToolCallFormat
) -> OutputConstraint | None:
    """The grammar a request's fields force, or None when its output is free."""
    forced_calls = choice.forced
    answer_too = fmt.kind != "text" and not forced_calls
    # "auto" (OpenAI's default with tools) and a format: calls or the object, when the template has a call format.
    calls_too = choice.mode in (None, "auto") and bool(tools) and fmt.kind != "text" and call_format != "none"
    if not forced_calls and not calls_too:
        if fmt.kind == "json_object":
            return OutputConstraint("json_object", "", "response_format")
        if fmt.kind == "json_schema":
            return OutputConstraint("json_schema", json.dumps(fmt.schema), "response_format")
        return None
    if call_format == "none":
        raise invalid(
            "this model's chat template has no tool-call format, so a call cannot be forced; start the gateway "
            "with --tool-call-parser hermes or llama3 if the model was trained on one",
            "tool_choice",
        )
    names = choice.names if forced_calls else tuple(_tool_name(t) for t in tools)
    calls = _calls_rule(names, tools, call_format, choice.parallel)
    if not answer_too:
        return OutputConstraint("lark", f"start: calls\n{calls}", "tool_choice")
    answer = "%json " + json.dumps(_compact({"type": "object"} if fmt.schema is None else fmt.schema))
    return OutputConstraint("lark", f"start: calls | answer\nanswer: {answer}\n{calls}", "response_format")


def _calls_rule(
    names: Sequence[str], tools: Sequence[dict[str, object]], call_format: ToolCallFormat, parallel: bool
) -> str:
    """Lark rules ``calls`` and ``call``: one call, or up to MAX_PARALLEL_CALLS, in the template's format."""
    by_name = {_tool_name(t): t for t in tools}
    arguments_key = "arguments" if call_format == "hermes" else "parameters"
    defs: dict[str, object] = {}
    options = []
    for i, name in enumerate(names):
        parameters = _hoisted(_parameters(by_name[name]), f"tool{i}_", defs)
        options.append(_call_schema(name, parameters, arguments_key))
    body: dict[str, object] = options[0] if len(options) == 1 else {"anyOf": options}
    if defs:
        body = {**body, "$defs": defs}
    separator = json.dumps("\n" if call_format == "hermes" else "; ")
    more = f" ({separator} call){{0,{MAX_PARALLEL_CALLS - 1}}}" if parallel else ""
    if call_format == "hermes":
        call = f"{json.dumps(HERMES_START + chr(10))} call_json {json.dumps(chr(10) + HERMES_END)}"
    else:
        call = "call_json"
    return f"calls: call{more}\ncall: {call}\ncall_json: %json {json.dumps(_compact(body))}"


def _parameters(tool: dict[str, object]) -> dict[str, object]:
    function = tool.get("function")
    parameters = function.get("parameters") if isinstance(function, dict) else None
    return parameters if isinstance(parameters, dict) and parameters else {"type": "object", "properties": {}}


def _hoisted(schema: dict[str, object], prefix: str, defs: dict[str, object]) -> dict[str, object]:
    """A tool's parameters moved under the call's root: its ``$defs`` (or ``definitions``) join ``defs`` under
    ``prefix`` and its references follow, so two tools' definitions of one name stay apart ("#" itself, a
    recursive schema's root, becomes a definition too)."""
    own = {**schema}
    local = {**_mapping(own.pop("$defs", None)), **_mapping(own.pop("definitions", None))}
    recursive = False

    def moved(value: object) -> object:
        nonlocal recursive
        if isinstance(value, dict):
            out = {k: moved(v) for k, v in value.items()}
            ref = value.get("$ref")
            if isinstance(ref, str) and (ref == "#" or ref.startswith(("#/$defs/", "#/definitions/"))):
                recursive = recursive or ref == "#"
                out["$ref"] = f"#/$defs/{prefix}" + ("root" if ref == "#" else ref.split("/", 2)[2])
            return out
        if isinstance(value, list):
            return [moved(v) for v in value]
        return value

    for name, definition in local.items():
        defs[prefix + name] = moved(definition)
    root = moved(own)
    assert isinstance(root, dict)
    if recursive:
        defs[prefix + "root"] = root
    return root


def _mapping(value: object) -> dict[str, object]:
    return value if isinstance(value, dict) else {}


def _call_schema(name: str, parameters: dict[str, object], arguments_key: str) -> dict[str, object]:
    # "name" first: the chat templates write it first, and a streamed call says what it calls before its arguments.
    return {
        "type": "object",
        "properties": {"name": {"const": name}, arguments_key: parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def _compact(schema: dict[str, object]) -> dict[str, object]:
    return {**schema, "x-guidance": _COMPACT}
