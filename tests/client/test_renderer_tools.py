"""The tiny model's chat template with tools (Qwen2.5's shape) and the Renderer's ``tools``: conversations without
tools render byte for byte as before; tool calls are trained inside the generation markers; a turn's prompt extends
the previous prompt and its completion."""

from __future__ import annotations

from typing import Any

import pytest

from opentinker.client.renderer import RenderedConversation, Renderer
from opentinker.client.tiny_model import CHAT_TEMPLATE

# The template as it was before tools: what every conversation without tools must still render to.
CHATML_BEFORE_TOOLS = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}"
    "{{ message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOOLS: list[dict[str, object]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
AGENT: list[dict[str, object]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    {"role": "assistant", "content": "Sunny, 21 C."},
]
RENDERED_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'


def _text(tokenizer: Any, tokens: list[int] | tuple[int, ...]) -> str:
    text = tokenizer.decode(list(tokens), skip_special_tokens=False)
    assert isinstance(text, str)
    return text


def _trained(rendered: RenderedConversation) -> list[int]:
    return [t for t, w in zip(rendered.tokens, rendered.weights, strict=True) if w]


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "r"}],
        [{"role": "assistant", "content": ""}, {"role": "user", "content": "<tool_call>{}</tool_call>"}],
    ],
)
def test_without_tools_the_rendering_and_masks_are_unchanged(tokenizer: Any, messages: list[dict[str, str]]) -> None:
    for generation_prompt in (False, True):
        now = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        before = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, chat_template=CHATML_BEFORE_TOOLS
        )
        assert now == before
        no_tools: list[list[dict[str, object]] | None] = [None, []]  # an empty tools list is no tools
        for tools in no_tools:
            again = tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
            )
            assert again == before
    masked = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    masked_before = tokenizer.apply_chat_template(
        messages, return_dict=True, return_assistant_tokens_mask=True, chat_template=CHATML_BEFORE_TOOLS
    )
    assert masked["input_ids"] == masked_before["input_ids"]
    assert masked["assistant_masks"] == masked_before["assistant_masks"]


def test_tools_render_in_qwen25_shape(tokenizer: Any) -> None:
    text = tokenizer.apply_chat_template(AGENT, tools=TOOLS, tokenize=False)
    schema = '{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", '
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n\n")
    assert f"<tools>\n{schema}" in text and "\n</tools>\n" in text
    assert text.count("<|im_start|>system") == 1  # the system message went into the tools block
    assert text.endswith(
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        f"<|im_start|>assistant\n{RENDERED_CALL}\n"
        "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nSunny, 21 C.<|im_end|>\n"
    )
    no_system = tokenizer.apply_chat_template(AGENT[1:2], tools=TOOLS, tokenize=False)
    assert no_system.startswith("<|im_start|>system\n# Tools\n\n")


def test_tool_calls_and_tool_messages_without_tools(tokenizer: Any) -> None:
    messages = [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {"function": {"name": "a", "arguments": {"k": 1}}},  # arguments as an object, too
                {"name": "b", "arguments": "{}"},  # and a call without the "function" wrapper
            ],
        },
        {"role": "tool", "content": "r1"},
        {"role": "tool", "content": "r2"},
    ]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>user\nx<|im_end|>\n"
        "<|im_start|>assistant\nChecking.\n"
        '<tool_call>\n{"name": "a", "arguments": {"k": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n<tool_response>\nr2\n</tool_response><|im_end|>\n"
    )


def test_renderer_trains_the_tool_call_and_the_answer(renderer: Renderer, tokenizer: Any) -> None:
    rendered = renderer.render(AGENT, "all_assistant", tools=TOOLS)
    assert _text(tokenizer, _trained(rendered)) == RENDERED_CALL + "Sunny, 21 C.<|im_end|>"
    assert renderer.render(AGENT, "all_assistant", tools=TOOLS, mask_method="prefix") == rendered
    last = renderer.render(AGENT, "last_assistant", tools=TOOLS)
    assert _text(tokenizer, _trained(last)) == "Sunny, 21 C.<|im_end|>"
    datum = renderer.sft_datum(AGENT, "all_assistant", tools=TOOLS)
    assert list(datum.model_input.to_ints()) == list(rendered.tokens[:-1])
    assert renderer.render(AGENT, tools=TOOLS).tokens != renderer.render(AGENT).tokens  # the tools block counts


def test_each_prompt_extends_the_previous_prompt_and_completion(renderer: Renderer, tokenizer: Any) -> None:
    first = renderer.prompt_tokens(AGENT[:2], tools=TOOLS)
    completion = tokenizer.encode(RENDERED_CALL, add_special_tokens=False)
    second = renderer.prompt_tokens(AGENT[:4], tools=TOOLS)
    assert second[: len(first) + len(completion)] == first + completion
    assert _text(tokenizer, first).endswith("<|im_start|>assistant\n")


def test_an_assistant_message_needs_content_or_tool_calls(renderer: Renderer) -> None:
    with pytest.raises(ValueError, match="'role' and 'content'"):
        renderer.render([{"role": "assistant", "name": "x"}])
    assert renderer.render([{"role": "assistant", "tool_calls": [CALL]}]).length > 0
    assert CHAT_TEMPLATE.count("{% generation %}") == 1
