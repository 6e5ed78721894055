"""Tool calls in a model's output -> OpenAI ``tool_calls``.

TODO(H5, tool calling): parse the template's format (Hermes/Qwen ``<tool_call>{json}</tool_call>``, Llama 3
JSON) here. This stub finds none: every output stays text. Unparseable output must stay text, never an error.
openai_routes.py calls ``parse`` once per finished chat choice when the request had ``tools``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str  # "call_..."
    name: str
    arguments: str  # a JSON object, as text (what OpenAI's function.arguments holds)


@dataclass(frozen=True, slots=True)
class Parsed:
    content: str | None  # the text around the calls (None when there is none and there are calls)
    calls: tuple[ToolCall, ...]


def parse(text: str, tools: Sequence[dict[str, object]]) -> Parsed:
    """The tool calls in ``text`` for these ``tools``, and the text that is left."""
    return Parsed(content=text, calls=())
