"""Tool calls in a completion's text -> OpenAI ``tool_calls``, for the chat template's format.

Two formats:

* ``hermes`` (Hermes, Qwen2.5, Qwen3): one or several ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks; text outside the blocks is the message's ``content``. A last block the model did not close (it
  stopped, or ran out of tokens, right after the JSON) counts when its JSON is complete.
* ``llama3`` (Llama 3.1+ JSON tool calling): the whole output is ``{"name": ..., "parameters": {...}}``
  (``arguments`` accepted too), optionally after ``<|python_tag|>``; several calls separated by ``;``.

Which format a model speaks comes from its chat template's text (:func:`detect_format`), unless the gateway's
``--tool-call-parser`` names one. Output that does not parse stays text, never an error: one malformed block
leaves the whole completion as ``content`` with no tool calls (a half-parsed answer would hide what the model
said). Arguments go out as JSON text (OpenAI's shape: ``function.arguments`` is a string).

Streaming (:class:`ToolCallStream`): when the request gave ``tools``, text that may be the start of a tool call
is held back (from ``<tool_call>``, or any suffix that could begin it, for hermes; the whole output while it
could still be one JSON object, for llama3); everything before is streamed as content as it comes. At the end
the held text is parsed: tool calls go out as ``tool_calls`` deltas in one chunk (all arguments at once, not
token by token), or the held text goes out as content when it was no tool call after all.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias

__all__ = [
    "PARSER_CHOICES",
    "Parsed",
    "ParserChoice",
    "ToolCall",
    "ToolCallFormat",
    "ToolCallStream",
    "detect_format",
    "new_call_id",
    "parse_tool_calls",
    "resolve_format",
    "wanted",
]

ToolCallFormat: TypeAlias = Literal["hermes", "llama3", "none"]
ParserChoice: TypeAlias = Literal["auto", "hermes", "llama3", "none"]
PARSER_CHOICES: tuple[ParserChoice, ...] = ("auto", "hermes", "llama3", "none")

HERMES_START = "<tool_call>"
HERMES_END = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_LLAMA3_MARKERS = (PYTHON_TAG, "<|start_header_id|>", "<|eot_id|>")
_DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call: ``arguments`` is JSON text of an object (OpenAI's ``function.arguments``)."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, object]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def to_delta(self, index: int) -> dict[str, object]:
        """The streamed form: a ``choices[].delta.tool_calls`` entry carrying the whole call."""
        return {"index": index, **self.to_openai()}


@dataclass(frozen=True, slots=True)
class Parsed:
    """A completion split into its text and its tool calls. ``content`` is None when there is no text (OpenAI
    sends ``content: null`` beside tool calls); without tool calls it is the completion's text unchanged."""

    content: str | None
    calls: tuple[ToolCall, ...]

    @property
    def finish_reason(self) -> str | None:
        """``tool_calls`` when calls were parsed; None: keep the sampler's reason (stop, length)."""
        return "tool_calls" if self.calls else None


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def detect_format(chat_template: str | dict[str, str] | None) -> ToolCallFormat:
    """The tool call format a chat template teaches: ``<tool_call>`` -> hermes; ``<|python_tag|>`` or Llama 3's
    header tokens -> llama3; anything else (no template, no tool support) -> none."""
    if isinstance(chat_template, dict):
        chat_template = "\n".join(chat_template.values())
    text = chat_template or ""
    if HERMES_START in text:
        return "hermes"
    if any(marker in text for marker in _LLAMA3_MARKERS):
        return "llama3"
    return "none"


def resolve_format(choice: ParserChoice, chat_template: str | dict[str, str] | None) -> ToolCallFormat:
    """The gateway flag's choice, or the template's format for "auto"."""
    if choice not in PARSER_CHOICES:
        raise ValueError(f"tool call parser must be one of {PARSER_CHOICES}, got {choice!r}")
    return detect_format(chat_template) if choice == "auto" else choice


def parse_tool_calls(text: str, fmt: ToolCallFormat) -> Parsed:
    """``text`` split into content and tool calls (see the module docstring); never raises on model output."""
    split = _split(text, fmt)
    if split is None:
        return Parsed(text, ())
    outside, calls = split
    return Parsed(outside.strip() or None, calls)


class ToolCallStream:
    """Streamed text with tool calls held back: :meth:`feed` each text delta and send what it returns as content;
    :meth:`finish` at the end gives the content not sent yet and the tool calls."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self._fmt = fmt
        self._text = ""
        self._sent = 0  # characters of _text already returned as content

    @property
    def text(self) -> str:
        return self._text

    def feed(self, delta: str) -> str:
        self._text += delta
        safe = max(self._sent, _safe_length(self._text, self._fmt))
        out = self._text[self._sent : safe]
        self._sent = safe
        return out

    def finish(self) -> Parsed:
        split = _split(self._text, self._fmt)
        if split is None:
            rest = self._text[self._sent :]
            return Parsed(rest or None, ())
        outside, calls = split
        # What was sent is a prefix of the text before the first call, hence of `outside`.
        rest = outside[self._sent :]
        return Parsed(rest if rest.strip() else None, calls)


# Internals


def _split(text: str, fmt: ToolCallFormat) -> tuple[str, tuple[ToolCall, ...]] | None:
    """(text outside the calls, the calls), or None when the text holds no well-formed call."""
    if fmt == "hermes":
        return _split_hermes(text)
    if fmt == "llama3":
        return _split_llama3(text)
    return None


def _split_hermes(text: str) -> tuple[str, tuple[ToolCall, ...]] | None:
    outside: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    while (start := text.find(HERMES_START, pos)) >= 0:
        outside.append(text[pos:start])
        body_start = start + len(HERMES_START)
        end = text.find(HERMES_END, body_start)
        body = text[body_start:] if end < 0 else text[body_start:end]
        call = _call_of(_whole_json(body), ("arguments", "parameters"))
        if call is None:
            return None
        calls.append(call)
        pos = len(text) if end < 0 else end + len(HERMES_END)
    if not calls:
        return None
    outside.append(text[pos:])
    return "".join(outside), tuple(calls)


def _split_llama3(text: str) -> tuple[str, tuple[ToolCall, ...]] | None:
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :].lstrip()
    calls: list[ToolCall] = []
    pos = 0
    while True:
        try:
            value, end = _DECODER.raw_decode(body, pos)
        except json.JSONDecodeError:
            return None
        call = _call_of(value, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)
        pos = _skip_space(body, end)
        if pos == len(body):
            return "", tuple(calls)
        if body[pos] != ";":
            return None
        pos = _skip_space(body, pos + 1)
        if pos == len(body):  # a trailing separator
            return "", tuple(calls)


def _whole_json(body: str) -> object:
    """The JSON value that is all of ``body`` (whitespace around it allowed), or None."""
    start = _skip_space(body, 0)
    try:
        value, end = _DECODER.raw_decode(body, start)
    except json.JSONDecodeError:
        return None
    return value if _skip_space(body, end) == len(body) else None


def _call_of(value: object, argument_keys: tuple[str, ...]) -> ToolCall | None:
    """A call from a parsed ``{"name": str, <argument key>: object | JSON text of an object}``, or None."""
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return None
    arguments: object = next((value[key] for key in argument_keys if key in value), {})
    if isinstance(arguments, str):  # some models write the arguments as JSON text already
        text = arguments
        arguments = _whole_json(arguments)
        if not isinstance(arguments, dict):
            return None
        return ToolCall(new_call_id(), name, text.strip())
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None
    return ToolCall(new_call_id(), name, json.dumps(arguments, ensure_ascii=False))


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _safe_length(text: str, fmt: ToolCallFormat) -> int:
    """How many leading characters of ``text`` are content whatever comes next."""
    if fmt == "hermes":
        start = text.find(HERMES_START)
        if start >= 0:
            return start
        # Hold a suffix that could grow into "<tool_call>".
        for k in range(min(len(HERMES_START) - 1, len(text)), 0, -1):
            if HERMES_START.startswith(text[-k:]):
                return len(text) - k
        return len(text)
    if fmt == "llama3":
        head = text.lstrip()
        if not head or head.startswith("{") or head.startswith(PYTHON_TAG) or PYTHON_TAG.startswith(head):
            return 0  # may still be (or is) a JSON tool call: hold all of it
        return len(text)
    return len(text)


def wanted(tools: Sequence[object], tool_choice: object) -> bool:
    """Whether a chat request's output is parsed for tool calls: it gave tools and did not say ``"none"`` (a
    forced call, ``"required"`` or a named function, is parsed like any other: structured.py's grammar wrote it
    in this format)."""
    return bool(tools) and tool_choice != "none"
