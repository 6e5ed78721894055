"""Tests for opentinker.client.renderer: chat rendering, loss weights, datums, prompts and response parsing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from opentinker.client.renderer import RenderedConversation, Renderer
from opentinker.client.tiny_model import CHAT_TEMPLATE

SYSTEM = {"role": "system", "content": "You are terse."}
CONVERSATION: list[dict[str, str]] = [
    SYSTEM,
    {"role": "user", "content": "What is 12+7?"},
    {"role": "assistant", "content": "12+7=19"},
    {"role": "user", "content": "And 3*4?"},
    {"role": "assistant", "content": "3*4=12"},
    {"role": "user", "content": "Thank you!"},
    {"role": "assistant", "content": "You're welcome, have a great day!"},
]
ANSWERS = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
IM_END = "<|im_end|>"


def _tokenizer_with_template(tiny_model: Path, template: str) -> Any:
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = template
    return tok


def _weighted_runs(rendered: RenderedConversation) -> list[list[int]]:
    runs: list[list[int]] = []
    previous = 0.0
    for token, weight in zip(rendered.tokens, rendered.weights, strict=True):
        assert weight in (0.0, 1.0)
        if weight:
            if not previous:
                runs.append([])
            runs[-1].append(token)
        previous = weight
    return runs


def _decode(tokenizer: Any, tokens: list[int] | tuple[int, ...]) -> str:
    text = tokenizer.decode(list(tokens), skip_special_tokens=False)
    assert isinstance(text, str)
    return text


def test_tokens_are_the_chat_template(renderer: Renderer, tokenizer: Any) -> None:
    rendered = renderer.render(CONVERSATION)
    expected = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert _decode(tokenizer, rendered.tokens) == expected
    assert len(rendered.weights) == len(rendered.tokens)


def test_all_assistant_weights_cover_each_answer_and_its_end(renderer: Renderer, tokenizer: Any) -> None:
    rendered = renderer.render(CONVERSATION, "all_assistant")
    runs = _weighted_runs(rendered)
    assert [_decode(tokenizer, run) for run in runs] == [answer + IM_END for answer in ANSWERS]
    # Nothing else is weighted: the headers, the user turns and the newline after each <|im_end|>.
    assert sum(rendered.weights) == sum(len(run) for run in runs)
    assert _decode(tokenizer, rendered.tokens[-1:]) == "\n"
    assert rendered.weights[-1] == 0.0


def test_last_assistant_weights_cover_only_the_last_answer(renderer: Renderer, tokenizer: Any) -> None:
    rendered = renderer.render(CONVERSATION, "last_assistant")
    runs = _weighted_runs(rendered)
    assert [_decode(tokenizer, run) for run in runs] == [ANSWERS[-1] + IM_END]


def test_all_weights_every_token(renderer: Renderer) -> None:
    rendered = renderer.render(CONVERSATION, "all")
    assert rendered.weights == (1.0,) * len(rendered.tokens)
    assert rendered.tokens == renderer.render(CONVERSATION).tokens


def test_default_is_all_assistant(renderer: Renderer) -> None:
    assert renderer.render(CONVERSATION) == renderer.render(CONVERSATION, "all_assistant")


@pytest.mark.parametrize("train_on", ["last_assistant", "all_assistant"])
def test_prefix_method_agrees_with_generation_markers(renderer: Renderer, train_on: Any) -> None:
    assert renderer.supports_generation_markers
    by_markers = renderer.assistant_spans(CONVERSATION, mask_method="generation")
    by_prefix = renderer.assistant_spans(CONVERSATION, mask_method="prefix")
    assert by_markers == by_prefix
    assert len(by_prefix) == len(ANSWERS)
    rendered = renderer.render(CONVERSATION, train_on, mask_method="generation")
    assert rendered == renderer.render(CONVERSATION, train_on, mask_method="prefix")
    assert rendered == renderer.render(CONVERSATION, train_on, mask_method="auto")


def test_generation_mask_is_hf_assistant_mask(renderer: Renderer, tokenizer: Any) -> None:
    out = tokenizer.apply_chat_template(
        CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    rendered = renderer.render(CONVERSATION, "all_assistant", mask_method="prefix")
    assert list(rendered.tokens) == list(out["input_ids"])
    assert [int(w) for w in rendered.weights] == list(out["assistant_masks"])


def test_template_without_markers_falls_back_to_prefixes(tiny_model: Path, renderer: Renderer) -> None:
    plain = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    fallback = Renderer(_tokenizer_with_template(tiny_model, plain))
    assert not fallback.supports_generation_markers
    for train_on in ("last_assistant", "all_assistant"):
        assert fallback.render(CONVERSATION, train_on) == renderer.render(CONVERSATION, train_on)
    with pytest.raises(ValueError, match="generation"):
        fallback.render(CONVERSATION, mask_method="generation")


def test_template_that_rewrites_history_is_refused(tiny_model: Path) -> None:
    # Earlier assistant turns are rendered differently once a later message exists: no token prefix.
    rewriting = CHAT_TEMPLATE.replace(
        "{{ message['content'] + '<|im_end|>' }}",
        "{{ (message['content'] if loop.last else '...') + '<|im_end|>' }}",
    )
    assert rewriting != CHAT_TEMPLATE
    renderer = Renderer(_tokenizer_with_template(tiny_model, rewriting))
    with pytest.raises(ValueError, match="incrementally"):
        renderer.render(CONVERSATION, mask_method="prefix")


def test_bad_arguments(renderer: Renderer) -> None:
    with pytest.raises(ValueError, match="no assistant message"):
        renderer.render(CONVERSATION[:2], "last_assistant")
    with pytest.raises(ValueError, match="train_on"):
        renderer.render(CONVERSATION, "assistant")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mask_method"):
        renderer.render(CONVERSATION, mask_method="magic")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'role' and 'content'"):
        renderer.render([{"role": "user"}])
    with pytest.raises(TypeError, match="not one mapping"):
        renderer.render(SYSTEM)  # type: ignore[arg-type]


def test_to_datum_shifts_by_one(renderer: Renderer, tokenizer: Any) -> None:
    rendered = renderer.render(CONVERSATION[:3], "last_assistant")
    datum = renderer.to_datum(rendered)
    inputs = datum.model_input.to_ints()
    targets = datum.loss_fn_inputs["target_tokens"].tolist()
    weights = datum.loss_fn_inputs["weights"].tolist()
    n = len(rendered.tokens)
    assert len(inputs) == len(targets) == len(weights) == n - 1
    for i in range(n - 1):  # input position i predicts target i, the next token
        assert inputs[i] == rendered.tokens[i]
        assert targets[i] == rendered.tokens[i + 1]
        assert weights[i] == rendered.weights[i + 1]
    # The first weighted target is the answer's first token, predicted from the header's newline.
    first = weights.index(1.0)
    assert _decode(tokenizer, inputs[: first + 1]).endswith("<|im_start|>assistant\n")
    assert _decode(tokenizer, [t for t, w in zip(targets, weights, strict=True) if w]) == ANSWERS[0] + IM_END
    assert datum.loss_fn_inputs["target_tokens"].dtype == "int64"
    assert datum.loss_fn_inputs["weights"].dtype == "float32"
    assert renderer.sft_datum(CONVERSATION[:3], train_on="last_assistant") == datum


def test_to_datum_needs_two_tokens() -> None:
    with pytest.raises(ValueError, match="at least 2 tokens"):
        RenderedConversation((5,), (1.0,)).to_datum()
    with pytest.raises(ValueError, match="weights"):
        RenderedConversation((5, 6), (1.0,))


def test_prompt_tokens_end_with_assistant_header(renderer: Renderer, tokenizer: Any) -> None:
    prompt = renderer.prompt_tokens(CONVERSATION[:2])
    assert _decode(tokenizer, prompt).endswith("<|im_end|>\n<|im_start|>assistant\n")
    full = renderer.render(CONVERSATION[:3]).tokens
    assert tuple(prompt) == full[: len(prompt)]  # the answer continues the prompt
    without = renderer.prompt_tokens(CONVERSATION[:2], add_generation_prompt=False)
    assert _decode(tokenizer, without).endswith("What is 12+7?<|im_end|>\n")


def test_parse_response(renderer: Renderer, tokenizer: Any) -> None:
    answer = tokenizer.encode("12+7=19", add_special_tokens=False)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert set(renderer.stop_token_ids) >= {im_end, eot}
    assert renderer.parse_response([*answer, im_end]) == ("12+7=19", True)
    assert renderer.parse_response([*answer, im_end, *answer]) == ("12+7=19", True)  # stops at the first
    assert renderer.parse_response(answer) == ("12+7=19", False)
    assert renderer.parse_response([*answer, eot]) == ("12+7=19", True)
    assert renderer.parse_response([im_end]) == ("", True)
    assert renderer.parse_response([]) == ("", False)


def test_custom_stop_tokens(tokenizer: Any) -> None:
    answer = tokenizer.encode("12+7=19", add_special_tokens=False)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    renderer = Renderer(tokenizer, stop_token_ids=[answer[-1]])
    assert renderer.stop_token_ids == (answer[-1],)
    text, ended = renderer.parse_response([*answer, im_end])
    assert ended
    assert text == _decode(tokenizer, answer[:-1])
