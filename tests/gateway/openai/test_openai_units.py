"""The /v1 pieces that need no server: stop-string cutting while streaming, body checks, references, episode ids."""

from __future__ import annotations

import pytest

from opentinker.gateway.backend import BaseModelInfo
from opentinker.gateway.openai import structured
from opentinker.gateway.openai.admission import reference
from opentinker.gateway.openai.errors import OpenAIError
from opentinker.gateway.openai.records import episode_id
from opentinker.gateway.openai.requests import chat_request, completion_request
from opentinker.gateway.openai.stop_strings import StopCut

BASE = BaseModelInfo("org/tiny", "/models/tiny", "Qwen2ForCausalLM", 512, frozenset())


@pytest.mark.parametrize("splits", [[1], [2], [3], [1, 2, 5, 7, 11]])
def test_stop_cut_never_sends_a_stop_string_and_never_takes_text_back(splits: list[int]) -> None:
    text, stops = "abc<ENDxyz", ("<END", "zz")
    cut, sent, start = StopCut(stops), "", 0
    for end in [*splits, len(text)]:
        piece = text[start:end]
        start = max(start, end)
        out = cut.feed(piece)
        assert "<" not in out
        sent += out
        assert text.startswith(sent)
    sent += cut.finish()
    assert sent == cut.answer == "abc"


def test_stop_cut_sends_a_held_back_prefix_that_never_became_a_stop() -> None:
    cut = StopCut(("<END",))
    assert cut.feed("ab<EN") == "ab"
    assert cut.feed("X") == "<ENX"
    assert cut.feed("<") == ""
    assert cut.finish() == "<"
    assert cut.answer == "ab<ENX<"
    plain = StopCut(())
    assert plain.feed("x<") == "x<" and plain.finish() == ""


def test_chat_bodies_are_checked_into_template_messages() -> None:
    body = {
        "model": "agent",
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "terse"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "2"},
        ],
        "stop": "END",
        "seed": -1,
        "n": 2,
        "unknown_field": {"ignored": True},
    }
    parsed = chat_request(body, max_num_samples=8)
    system, assistant, tool = parsed.messages
    assert system == {"role": "system", "content": "be terse"}
    assert assistant["tool_calls"] == [
        {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}, "id": "call_1"}
    ]
    assert tool["tool_call_id"] == "call_1"
    assert parsed.options.stop == ("END",) and parsed.options.seed == 2**64 - 1 and parsed.options.n == 2
    for bad in (
        {"n": 9},
        {"temperature": 3},
        {"top_p": 0},
        {"stream_options": 1},
        {"tools": [{"type": "x"}]},
        {"tool_choice": "sometimes"},
        {"logprobs": "yes"},
        {"max_tokens": 0},
    ):
        with pytest.raises(OpenAIError) as caught:
            chat_request({**body, **bad}, max_num_samples=8)
        assert caught.value.status == 400 and caught.value.param is not None


def test_completion_prompts() -> None:
    assert completion_request({"model": "m", "prompt": [1, 2]}, 8).prompts == ((1, 2),)
    assert completion_request({"model": "m", "prompt": [[1], [2, 3]]}, 8).prompts == ((1,), (2, 3))
    assert completion_request({"model": "m", "prompt": ["a", "b"]}, 8).prompts == ("a", "b")
    bads: list[object] = [[], [1, "a"], [[]], "", [-1], {"x": 1}]
    for bad in bads:
        with pytest.raises(OpenAIError):
            completion_request({"model": "m", "prompt": bad}, 8)
    with pytest.raises(OpenAIError):
        completion_request({"model": "m", "prompt": ["a", "b", "c"], "n": 3}, 8)  # 9 samples > 8


def test_references_stay_in_the_callers_tenant() -> None:
    assert reference("agent", "team-a", BASE) == "team-a/agent"
    assert reference("agent@stable", "team-a", BASE) == "team-a/agent@stable"
    assert reference("team-a/agent@12", "team-a", BASE) == "team-a/agent@12"
    assert reference("org/tiny", "team-a", BASE) == reference("base", "team-a", BASE) == "base"
    for other in ("team-b/agent", "team-b/agent@1", "Bad Name", "team-a/agent@0", "a/b/c"):
        with pytest.raises(OpenAIError) as caught:
            reference(other, "team-a", BASE)
        assert caught.value.status == 404 and caught.value.code == "model_not_found"


def test_episode_ids() -> None:
    assert episode_id("ep-1:turn.2", None) == "ep-1:turn.2" == episode_id(None, "ep-1:turn.2")
    assert episode_id(None, None) is None and episode_id("x", "x") == "x"
    for header, metadata in (("a b", None), (None, "x" * 129), ("a", "b"), ("", None)):
        with pytest.raises(OpenAIError):
            episode_id(header, metadata)


def test_penalties_are_read_and_bounded_like_openais() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    plain = chat_request(chat, 8).options
    assert (plain.frequency_penalty, plain.presence_penalty) == (0.0, 0.0)
    both = chat_request({**chat, "frequency_penalty": 1.5, "presence_penalty": -2}, 8).options
    assert (both.frequency_penalty, both.presence_penalty) == (1.5, -2.0)
    text = completion_request({"model": "m", "prompt": "hi", "presence_penalty": 2.0}, 8).options
    assert text.presence_penalty == 2.0
    for name in ("frequency_penalty", "presence_penalty"):
        for bad in (2.01, -2.5, "1", True, float("nan"), float("inf")):
            for parse, body in ((chat_request, chat), (completion_request, {"model": "m", "prompt": "hi"})):
                with pytest.raises(OpenAIError) as caught:
                    parse({**body, name: bad}, 8)
                assert caught.value.status == 400 and caught.value.param == name, (name, bad)


def test_what_cannot_be_honoured_is_refused_naming_the_parameter() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    text = {"model": "m", "prompt": "hi"}
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True}}
    # accepted: what is honoured, or what asks for nothing
    accepted: list[dict[str, object]] = [
        {"response_format": {"type": "text"}},
        {"response_format": None},
        {"response_format": {"type": "json_object"}},
        {"response_format": schema},
        {"tool_choice": "auto"},
        {"tool_choice": "none"},
        {"tool_choice": "required", "parallel_tool_calls": False},
        {"tool_choice": {"type": "function", "function": {"name": "f"}}},
        {"logit_bias": {}},
    ]
    for fine in accepted:
        chat_request({**chat, **fine}, 8)
    assert chat_request({**chat, "tool_choice": "auto"}, 8).tool_choice.mode == "auto"
    named = chat_request({**chat, "tool_choice": {"type": "function", "function": {"name": "f"}}}, 8).tool_choice
    assert (named.mode, named.names, named.parallel) == ("required", ("f",), False)
    assert completion_request({**text, "response_format": schema}, 8).response_format.schema == {"type": "object"}
    refused: list[tuple[dict[str, object], str]] = [
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),  # no json_schema
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format"),  # no name
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": 1}}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "stop": "}"}, "stop"),
        ({"tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {}}}, "tool_choice"),
        ({"tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": tools}}}, "tool_choice"),
        ({"tool_choice": "required", "stop": ["x"]}, "stop"),
        ({"tool_choice": "required", "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"logit_bias": {"50256": -100}}, "logit_bias"),
    ]
    for fields, param in refused:
        for parse, body in ((chat_request, chat), (completion_request, text)):
            if "tool_choice" in fields and parse is completion_request:
                continue  # completions have no tools
            with pytest.raises(OpenAIError) as caught:
                parse({**body, **fields}, 8)
            # The field, or a path inside it (response_format.json_schema.name).
            assert caught.value.status == 400 and (caught.value.param or "").split(".")[0] == param, fields
    with pytest.raises(OpenAIError) as caught:  # "required" with no tools to call
        chat_request({**chat, "tools": None, "tool_choice": "required"}, 8)
    assert caught.value.param == "tool_choice"
    with pytest.raises(OpenAIError) as caught:
        chat_request({**chat, "top_p": 0}, 8)
    assert caught.value.param == "top_p" and "temperature" in caught.value.message


def test_the_grammar_each_combination_forces() -> None:
    seat = {
        "$defs": {"Choice": {"enum": ["a", "b"]}},
        "type": "object",
        "properties": {"x": {"$ref": "#/$defs/Choice"}},
    }
    size = {"$defs": {"Choice": {"enum": [1, 2]}}, "type": "object", "properties": {"y": {"$ref": "#/$defs/Choice"}}}
    tools: tuple[dict[str, object], ...] = (
        {"type": "function", "function": {"name": "seat", "parameters": seat}},
        {"type": "function", "function": {"name": "size", "parameters": size}},
    )
    schema = structured.ResponseFormat("json_schema", "pet", {"type": "object", "properties": {"b": {}, "a": {}}})
    required = structured.ToolChoice("required", ("seat", "size"))
    assert structured.constraint(structured.ResponseFormat(), structured.ToolChoice(), tools, "hermes") is None
    plain = structured.constraint(schema, structured.ToolChoice("none"), tools, "hermes")
    assert plain is not None and plain.kind == "json_schema" and plain.source.index('"b"') < plain.source.index('"a"')
    # Without a call format, "auto" with a format is the format alone; a forced call is refused.
    alone = structured.constraint(schema, structured.ToolChoice(), tools, "none")
    assert alone is not None and alone.kind == "json_schema"
    with pytest.raises(OpenAIError) as caught:
        structured.constraint(structured.ResponseFormat(), required, tools, "none")
    assert caught.value.param == "tool_choice" and "--tool-call-parser" in caught.value.message
    forced = structured.constraint(structured.ResponseFormat(), required, tools, "hermes")
    assert forced is not None and (forced.kind, forced.param) == ("lark", "tool_choice")
    # Two tools' definitions of one name stay apart under the call's root.
    assert '"tool0_Choice"' in forced.source and '"tool1_Choice"' in forced.source
    assert '"#/$defs/tool1_Choice"' in forced.source and "<tool_call>" in forced.source
    either = structured.constraint(schema, structured.ToolChoice("auto"), tools, "llama3")
    assert either is not None and either.source.startswith("start: calls | answer") and '"parameters"' in either.source
    assert either.param == "response_format"
