"""Request fields of the /v1 tests: bodies refused as malformed, values the gateway cannot honour (each with the
parameter its 400 names), the neighbouring values it does honour, and the check that malformed requests are
refused."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from chatutil import MESSAGES
from gatewayutil import base_url
from openai.types.chat import ChatCompletionToolParam
from serverproc import ServerProcess

TOOLS: list[ChatCompletionToolParam] = [
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
]

# Malformed chat bodies: each a 400 invalid_request_error.
BAD_BODIES: list[dict[str, object]] = [
    {"messages": "hello"},
    {"messages": []},
    {"messages": [{"role": "robot", "content": "x"}]},
    {"temperature": "hot"},
    {"n": 0},
    {"max_tokens": -1},
    {"stop": [1, 2]},
    {"top_logprobs": 3},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"metadata": {"episode_id": "no spaces allowed"}},
]

# Values that cannot be honoured, and the parameter the 400 names; the first four are refused by completions too.
REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "stop": ["}"]}, "stop"),  # a stop string could cut the object
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools to call
    ({"top_p": 0}, "top_p"),
]

# Their honoured neighbours: each served.
HONOURED: list[dict[str, Any]] = [
    {"response_format": {"type": "text"}},
    {"response_format": {"type": "json_object"}},
    {"tools": TOOLS, "tool_choice": "auto"},
    {"tools": TOOLS, "tool_choice": "none"},
    {"tools": TOOLS, "tool_choice": "required"},
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
]


def assert_bad_requests_refused(client: openai.OpenAI, gateway: ServerProcess, key: str, model: str) -> None:
    """Each of BAD_BODIES over a good chat with ``model``: a 400 invalid_request_error; a body that is not JSON: a
    400 with OpenAI's error fields; a malformed episode header: a 400."""
    for fields in BAD_BODIES:
        body = {"model": model, "messages": MESSAGES, "max_tokens": 2, **fields}
        with pytest.raises(openai.BadRequestError) as refused:
            client.post("/chat/completions", body=body, cast_to=httpx.Response)
        assert refused.value.type == "invalid_request_error", fields
    raw = httpx.post(
        f"{base_url(gateway)}/v1/chat/completions", content=b"{not json", headers={"Authorization": f"Bearer {key}"}
    )
    assert raw.status_code == 400 and set(json.loads(raw.text)["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=2,
            extra_headers={"X-OpenTinker-Episode": "a b"},
        )
