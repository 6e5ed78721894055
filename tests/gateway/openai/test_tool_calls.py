"""gateway/tool_calls.py: completions' text -> OpenAI tool_calls (hermes, llama3), streamed and not."""

from __future__ import annotations

import json

import pytest

from opentinker.client.tiny_model import CHAT_TEMPLATE
from opentinker.gateway.openai.tool_calls import (
    Parsed,
    ToolCallFormat,
    ToolCallStream,
    detect_format,
    parse_tool_calls,
    resolve_format,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def _calls(parsed: Parsed) -> list[tuple[str, dict[str, object]]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.calls]


# Hermes / Qwen


def test_hermes_one_call() -> None:
    parsed = parse_tool_calls(f"<tool_call>\n{WEATHER}\n</tool_call>", "hermes")
    assert _calls(parsed) == [("get_weather", {"city": "Paris"})]
    assert parsed.content is None
    assert parsed.finish_reason == "tool_calls"
    call = parsed.calls[0]
    assert call.id.startswith("call_") and len(call.id) > len("call_") + 8
    assert isinstance(call.arguments, str)  # OpenAI's shape: JSON text
    assert call.to_openai() == {
        "id": call.id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    assert call.to_delta(0) == {"index": 0, **call.to_openai()}


def test_hermes_two_calls_have_distinct_ids() -> None:
    time = '{"name": "get_time", "arguments": {"tz": "CET"}}'
    text = f"<tool_call>{WEATHER}</tool_call>\n<tool_call>{time}</tool_call>"
    parsed = parse_tool_calls(text, "hermes")
    assert _calls(parsed) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert len({call.id for call in parsed.calls}) == 2
    assert parsed.content is None


def test_hermes_text_before_and_after_stays_content() -> None:
    parsed = parse_tool_calls(f"Let me check.\n<tool_call>{WEATHER}</tool_call>\nOne moment.", "hermes")
    assert _calls(parsed) == [("get_weather", {"city": "Paris"})]
    assert parsed.content == "Let me check.\n\nOne moment."


def test_hermes_nested_braces_and_tags_inside_strings() -> None:
    args = {"query": "a {b} }} {{ c", "code": "if x: {'k': [1, 2]}", "tag": "</tool_call> inside"}
    text = "<tool_call>" + json.dumps({"name": "run", "arguments": args}) + "</tool_call>"
    # The end tag inside a string cuts the block there: the JSON is incomplete, so it is text.
    assert parse_tool_calls(text, "hermes") == Parsed(text, ())
    del args["tag"]
    text = "<tool_call>" + json.dumps({"name": "run", "arguments": args}) + "</tool_call>"
    assert _calls(parse_tool_calls(text, "hermes")) == [("run", args)]


def test_hermes_unicode_arguments_are_not_escaped() -> None:
    parsed = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"city": "東京"}}</tool_call>', "hermes")
    assert parsed.calls[0].arguments == '{"city": "東京"}'


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>',  # a brace short
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "", "arguments": {}}</tool_call>',
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',  # arguments must be an object
        '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>',
        '<tool_call>["f", {}]</tool_call>',
        '<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>',
        "<tool_call></tool_call>",
        "<tool_call>",
        '<tool_call>{"name": "f", "argu',  # cut off by max_tokens
    ],
)
def test_hermes_malformed_stays_text(text: str) -> None:
    assert parse_tool_calls(text, "hermes") == Parsed(text, ())


def test_hermes_one_bad_block_leaves_everything_text() -> None:
    text = f"<tool_call>{WEATHER}</tool_call><tool_call>{{oops</tool_call>"
    parsed = parse_tool_calls(text, "hermes")
    assert parsed.calls == () and parsed.content == text and parsed.finish_reason is None


def test_hermes_unclosed_last_block_with_complete_json() -> None:
    parsed = parse_tool_calls(f"<tool_call>\n{WEATHER}\n", "hermes")
    assert _calls(parsed) == [("get_weather", {"city": "Paris"})]


def test_hermes_arguments_variants() -> None:
    as_text = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "hermes")
    assert as_text.calls[0].arguments == '{"a": 1}'
    missing = parse_tool_calls('<tool_call>{"name": "f"}</tool_call>', "hermes")
    assert missing.calls[0].arguments == "{}"
    null = parse_tool_calls('<tool_call>{"name": "f", "arguments": null}</tool_call>', "hermes")
    assert null.calls[0].arguments == "{}"
    parameters = parse_tool_calls('<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>', "hermes")
    assert json.loads(parameters.calls[0].arguments) == {"a": 1}


def test_plain_text_and_no_parser() -> None:
    assert parse_tool_calls("It is sunny in Paris.", "hermes") == Parsed("It is sunny in Paris.", ())
    assert parse_tool_calls("", "hermes") == Parsed("", ())
    text = f"<tool_call>{WEATHER}</tool_call>"
    assert parse_tool_calls(text, "none") == Parsed(text, ())
    assert parse_tool_calls(WEATHER, "hermes") == Parsed(WEATHER, ())  # bare JSON is not hermes


# Llama 3


LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


@pytest.mark.parametrize("text", [LLAMA, f"<|python_tag|>{LLAMA}", f"  <|python_tag|> {LLAMA}\n", f"\n{LLAMA}  "])
def test_llama3_with_and_without_python_tag(text: str) -> None:
    parsed = parse_tool_calls(text, "llama3")
    assert _calls(parsed) == [("get_weather", {"city": "Paris"})]
    assert parsed.content is None and parsed.finish_reason == "tool_calls"


def test_llama3_arguments_key_and_several_calls() -> None:
    text = f'{LLAMA}; {{"name": "get_time", "arguments": {{"tz": "CET"}}}};'
    assert _calls(parse_tool_calls(text, "llama3")) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]


@pytest.mark.parametrize(
    "text",
    [
        f"Sure! {LLAMA}",  # text before: not the whole output
        f"{LLAMA} and more",
        f"{LLAMA}; oops",
        '{"answer": 42}',  # JSON, but no call
        '{"name": "f", "parameters": "x"}',
        '{"name": "f", "parameters": {"a": 1}',
        "<|python_tag|>",
        "<|python_tag|>print(1)",  # code interpreter output, not JSON
        "The weather is nice.",
        "[1, 2]",
    ],
)
def test_llama3_malformed_stays_text(text: str) -> None:
    assert parse_tool_calls(text, "llama3") == Parsed(text, ())


def test_llama3_nested_braces_in_strings() -> None:
    text = json.dumps({"name": "run", "parameters": {"code": "d = {'a': {'b': '}'}}"}})
    assert _calls(parse_tool_calls(text, "llama3")) == [("run", {"code": "d = {'a': {'b': '}'}}"})]


def test_hermes_text_is_not_llama3() -> None:
    text = f"<tool_call>{WEATHER}</tool_call>"
    assert parse_tool_calls(text, "llama3") == Parsed(text, ())


# Which format


def test_detect_format_from_templates() -> None:
    assert detect_format(CHAT_TEMPLATE) == "hermes"  # the tiny model's template is Qwen2.5-style
    assert detect_format("{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>' }}") == "llama3"
    assert detect_format("{{- '<|python_tag|>' + tool_call.name }}") == "llama3"
    assert detect_format("{% for m in messages %}{{ m['content'] }}{% endfor %}") == "none"
    assert detect_format(None) == "none"
    assert detect_format({"default": "x", "tool_use": "<tool_call>"}) == "hermes"


def test_resolve_format_flag_overrides_the_template() -> None:
    assert resolve_format("auto", CHAT_TEMPLATE) == "hermes"
    assert resolve_format("llama3", CHAT_TEMPLATE) == "llama3"
    assert resolve_format("none", CHAT_TEMPLATE) == "none"
    with pytest.raises(ValueError, match="one of"):
        resolve_format("mistral", CHAT_TEMPLATE)  # type: ignore[arg-type]


# Streaming


def _stream(text: str, fmt: ToolCallFormat, step: int = 1) -> tuple[list[str], Parsed]:
    stream = ToolCallStream(fmt)
    sent = [stream.feed(text[i : i + step]) for i in range(0, len(text), step)]
    return sent, stream.finish()


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_stream_hermes_holds_the_call_and_streams_text_before(step: int) -> None:
    text = f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>"
    sent, end = _stream(text, "hermes", step)
    assert "".join(sent) == "Let me check.\n"
    assert not any("<" in piece for piece in sent)  # no part of the tag leaks out as content
    assert end.content is None
    assert _calls(end) == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("step", [1, 4])
def test_stream_hermes_text_that_only_looks_like_a_tag(step: int) -> None:
    text = "a < b and <tool but not a call"
    sent, end = _stream(text, "hermes", step)
    assert "".join(sent) + (end.content or "") == text
    assert end.calls == ()


@pytest.mark.parametrize("step", [1, 5])
def test_stream_hermes_bad_call_comes_out_as_text(step: int) -> None:
    text = "ok <tool_call>{broken</tool_call> done"
    sent, end = _stream(text, "hermes", step)
    assert "".join(sent) == "ok "
    assert end == Parsed("<tool_call>{broken</tool_call> done", ())


def test_stream_hermes_text_after_the_call_comes_at_the_end() -> None:
    sent, end = _stream(f"<tool_call>{WEATHER}</tool_call> Done.", "hermes", 2)
    assert "".join(sent) == ""
    assert end.content == " Done."
    assert len(end.calls) == 1


@pytest.mark.parametrize("step", [1, 6])
def test_stream_llama3(step: int) -> None:
    sent, end = _stream(f"<|python_tag|>{LLAMA}", "llama3", step)
    assert "".join(sent) == "" and _calls(end) == [("get_weather", {"city": "Paris"})]
    sent, end = _stream("  Paris is sunny.", "llama3", step)
    assert "".join(sent) + (end.content or "") == "  Paris is sunny." and end.calls == ()
    sent, end = _stream('{"answer": 42}', "llama3", step)
    assert "".join(sent) == "" and end == Parsed('{"answer": 42}', ())
    assert "".join(_stream("<|pyth", "llama3", step)[0]) == ""  # may still become the tag


def test_stream_without_a_parser_passes_everything() -> None:
    text = f"<tool_call>{WEATHER}</tool_call>"
    sent, end = _stream(text, "none", 4)
    assert "".join(sent) == text and end == Parsed(None, ())
