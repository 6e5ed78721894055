"""Chat rendering for supervised fine-tuning and sampling: messages -> tokens + per-token loss weights.

    from opentinker.client import Renderer

    renderer = Renderer.from_pretrained(model_dir)
    datum = renderer.sft_datum(messages, train_on="last_assistant")  # feeds forward_backward(cross_entropy)
    prompt = renderer.prompt_tokens(messages[:-1])  # ends with the assistant header: sample from here
    text, ended = renderer.parse_response(sequence.tokens)

The tokens are exactly what the tokenizer's chat template produces. An assistant message's weights cover its
content *and* its closing end-of-turn token (``<|im_end|>`` in ChatML), so that the model learns to stop; the
role header before it and the whitespace after its end-of-turn token get weight 0.

Which tokens belong to which assistant message is found one of two ways:

* ``"generation"``: the template's ``{% generation %}`` markers, through
  ``apply_chat_template(..., return_assistant_tokens_mask=True)``. Exact, but only templates that have the
  markers support it.
* ``"prefix"`` (works with any template that renders a conversation incrementally): assistant message k
  spans from the end of ``render(messages[:k], add_generation_prompt=True)`` (the role header) to the last
  stop token inside ``render(messages[:k + 1])``. Every rendered prefix must be a token prefix of the full
  rendering; a template that rewrites earlier turns (for example one that drops past reasoning) is refused
  with a ValueError rather than given misaligned weights.

``"auto"`` (the default) uses the markers when the template has them and they yield one span per assistant
message, and the prefix method otherwise.

transformers is imported only by :meth:`Renderer.from_pretrained`; a Renderer wraps any HF tokenizer object.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from opentinker.client.datum import Datum, ModelInput

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["MaskMethod", "RenderedConversation", "Renderer", "TrainOn"]

TrainOn: TypeAlias = Literal["last_assistant", "all_assistant", "all"]
"""Which tokens get weight 1: the last assistant message, every assistant message, or every token."""
MaskMethod: TypeAlias = Literal["auto", "generation", "prefix"]
"""How assistant tokens are located (see the module docstring)."""

_TRAIN_ON: tuple[TrainOn, ...] = ("last_assistant", "all_assistant", "all")
_MASK_METHODS: tuple[MaskMethod, ...] = ("auto", "generation", "prefix")
_ASSISTANT = "assistant"
# End-of-turn tokens of common chat formats; each counts as a stop token when the tokenizer knows it.
_KNOWN_END_TOKENS: tuple[str, ...] = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")

Span: TypeAlias = tuple[int, int]
Message: TypeAlias = Mapping[str, object]
"""A chat message: ``role`` and ``content`` (strings); an assistant's ``tool_calls``, a tool's ``tool_call_id``."""
Tools: TypeAlias = Sequence[Mapping[str, object]] | None


@dataclass(frozen=True, slots=True)
class RenderedConversation:
    """A rendered conversation: its tokens and one loss weight per token (1.0 = trained on)."""

    tokens: tuple[int, ...]
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        object.__setattr__(self, "weights", tuple(float(w) for w in self.weights))
        if len(self.tokens) != len(self.weights):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.weights)} weights")

    @property
    def length(self) -> int:
        return len(self.tokens)

    def to_datum(self) -> Datum:
        """The next-token datum: input ``tokens[:-1]``, target ``tokens[1:]``, weights ``weights[1:]``.

        Input position i predicts target i = token i + 1, weighted by that target token's weight.
        """
        if len(self.tokens) < 2:
            raise ValueError(f"a datum needs at least 2 tokens, the conversation has {len(self.tokens)}")
        return Datum(
            model_input=ModelInput.from_ints(self.tokens[:-1]),
            loss_fn_inputs={"target_tokens": self.tokens[1:], "weights": self.weights[1:]},
        )


class Renderer:
    """Renders chat messages with a HF tokenizer's chat template (see the module docstring).

    ``stop_token_ids``: the tokens that end an assistant turn; by default the tokenizer's eos token plus the
    well-known end-of-turn tokens it has (``<|im_end|>``, ``<|endoftext|>``, ``<|eot_id|>``, ...).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, stop_token_ids: Iterable[int] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template")
        self._tokenizer = tokenizer
        stops = _default_stop_ids(tokenizer) if stop_token_ids is None else [int(t) for t in stop_token_ids]
        if not stops:
            raise ValueError("no stop token: the tokenizer has no eos token; pass stop_token_ids")
        self._stop_ids: tuple[int, ...] = tuple(dict.fromkeys(stops))

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike[str], **tokenizer_kwargs: Any) -> Renderer:
        """Loads the tokenizer of ``model_dir`` (AutoTokenizer). The eos ids of its generation_config.json,
        if any, are stop tokens too."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir, **tokenizer_kwargs)
        stops = _default_stop_ids(tokenizer) + _generation_config_eos(Path(model_dir))
        return cls(tokenizer, stop_token_ids=stops)

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self._stop_ids

    # Rendering

    def render(
        self,
        messages: Sequence[Message],
        train_on: TrainOn = "all_assistant",
        *,
        mask_method: MaskMethod = "auto",
        tools: Tools = None,
    ) -> RenderedConversation:
        """The chat-template tokens of ``messages`` and their weights.

        ``train_on``: "last_assistant" / "all_assistant" weigh the content and closing end-of-turn token of
        the last / every assistant message 1.0 and every other token 0.0 (a ValueError when there is no
        assistant message: such a datum would train on nothing); "all" weighs every token 1.0.
        ``tools``: the tool schemas the template renders (OpenAI's ``tools`` list), when it supports them.
        """
        if train_on not in _TRAIN_ON:
            raise ValueError(f"train_on must be one of {_TRAIN_ON}, got {train_on!r}")
        msgs = _messages(messages)
        tokens = self._encode(msgs, tools=tools)
        if train_on == "all":
            return RenderedConversation(tuple(tokens), (1.0,) * len(tokens))
        spans = self.assistant_spans(msgs, mask_method=mask_method, tools=tools)
        if not spans:
            raise ValueError(f"train_on={train_on!r} but the conversation has no assistant message")
        chosen = spans[-1:] if train_on == "last_assistant" else spans
        weights = [0.0] * len(tokens)
        for start, end in chosen:
            weights[start:end] = [1.0] * (end - start)
        return RenderedConversation(tuple(tokens), tuple(weights))

    def to_datum(self, rendered: RenderedConversation) -> Datum:
        """``rendered.to_datum()``: input tokens[:-1], target tokens[1:], weights[1:]."""
        return rendered.to_datum()

    def sft_datum(
        self,
        messages: Sequence[Message],
        train_on: TrainOn = "all_assistant",
        *,
        mask_method: MaskMethod = "auto",
        tools: Tools = None,
    ) -> Datum:
        """``render(messages, train_on).to_datum()``: a cross_entropy datum."""
        return self.render(messages, train_on, mask_method=mask_method, tools=tools).to_datum()

    def assistant_spans(
        self,
        messages: Sequence[Message],
        *,
        mask_method: MaskMethod = "auto",
        tools: Tools = None,
    ) -> list[Span]:
        """One ``(start, end)`` token range per assistant message, in order: its content and closing stop
        token within the rendering of ``messages``."""
        if mask_method not in _MASK_METHODS:
            raise ValueError(f"mask_method must be one of {_MASK_METHODS}, got {mask_method!r}")
        msgs = _messages(messages)
        if mask_method == "prefix":
            return self._prefix_spans(msgs, tools)
        spans = self._generation_spans(msgs, tools) if self.supports_generation_markers else None
        if spans is not None:
            return spans
        if mask_method == "generation":
            raise ValueError(
                "the chat template has no usable {% generation %} markers "
                "(none, or they do not mark exactly one span per assistant message); use mask_method='prefix'"
            )
        return self._prefix_spans(msgs, tools)

    @property
    def supports_generation_markers(self) -> bool:
        """Whether the chat template marks assistant tokens with ``{% generation %}``."""
        template = self._tokenizer.chat_template
        texts = template.values() if isinstance(template, Mapping) else [template]
        return any(isinstance(t, str) and _GENERATION_TAG.search(t) for t in texts)

    # Sampling

    def prompt_tokens(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        *,
        tools: Tools = None,
    ) -> list[int]:
        """The tokens to sample the next assistant message from (ending with the assistant header)."""
        return self._encode(_messages(messages), add_generation_prompt=add_generation_prompt, tools=tools)

    def parse_response(self, tokens: Sequence[int]) -> tuple[str, bool]:
        """The text of a sampled response up to its first stop token (excluded), and whether a stop token
        was produced (False: the response was cut off, e.g. by max_tokens)."""
        ids = [int(t) for t in tokens]
        stops = set(self._stop_ids)
        end = next((i for i, token in enumerate(ids) if token in stops), None)
        body = ids if end is None else ids[:end]
        text = self._tokenizer.decode(body, skip_special_tokens=False)
        if not isinstance(text, str):  # decode of a flat list is a str; guard the declared union
            raise TypeError(f"tokenizer.decode returned {type(text).__name__}")
        return text, end is not None

    # Internals

    def _encode(
        self, messages: list[dict[str, object]], add_generation_prompt: bool = False, tools: Tools = None
    ) -> list[int]:
        out = self._tokenizer.apply_chat_template(
            messages,  # type: ignore[arg-type]  # tool_calls are lists, not strings
            tokenize=True,
            return_dict=True,
            add_generation_prompt=add_generation_prompt,
            tools=_tools(tools),
        )
        return _input_ids(out)

    def _generation_spans(self, messages: list[dict[str, object]], tools: Tools) -> list[Span] | None:
        """Spans from the template's generation markers; None when they do not map one-to-one onto the
        assistant messages (or the tokenizer cannot compute the mask)."""
        try:
            out: Any = self._tokenizer.apply_chat_template(
                messages,  # type: ignore[arg-type]
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
                tools=_tools(tools),
            )
            mask = [int(m) for m in _flat(out["assistant_masks"])]
        except (ValueError, KeyError, TypeError, NotImplementedError):
            return None
        if _input_ids(out) != self._encode(messages, tools=tools) or len(mask) != len(_input_ids(out)):
            return None
        spans = _runs(mask)
        if len(spans) != sum(m["role"] == _ASSISTANT for m in messages):
            return None
        return spans

    def _prefix_spans(self, messages: list[dict[str, object]], tools: Tools) -> list[Span]:
        full = self._encode(messages, tools=tools)
        stops = set(self._stop_ids)
        spans: list[Span] = []
        for k, message in enumerate(messages):
            if message["role"] != _ASSISTANT:
                continue
            before = self._encode(messages[:k], tools=tools) if k else []
            header = self._encode(messages[:k], add_generation_prompt=True, tools=tools)
            after = self._encode(messages[: k + 1], tools=tools)
            if full[: len(after)] != after or after[: len(before)] != before:
                raise ValueError(
                    f"the chat template does not render message {k} incrementally: the rendering of the first "
                    f"{k + 1} messages is not a token prefix of the longer one, so the prefix method cannot "
                    "attribute tokens to messages"
                )
            # The generation prompt is the assistant header when the template renders it as a prefix;
            # otherwise the message's tokens start right after the previous message.
            start = len(header) if after[: len(header)] == header else len(before)
            ends = [i + 1 for i in range(start, len(after)) if after[i] in stops]
            spans.append((start, ends[-1] if ends else len(after)))
        return spans


def _messages(messages: Sequence[Message]) -> list[dict[str, object]]:
    if isinstance(messages, Mapping):
        raise TypeError("messages must be a sequence of {'role': ..., 'content': ...} mappings, not one mapping")
    out: list[dict[str, object]] = []
    for i, message in enumerate(messages):
        # An assistant message that calls tools may leave its content out (OpenAI sends null).
        has_body = isinstance(message, Mapping) and ("content" in message or "tool_calls" in message)
        if not has_body or "role" not in message:
            raise ValueError(f"message {i} must be a mapping with 'role' and 'content', got {message!r}")
        out.append(dict(message))
    return out


def _tools(tools: Tools) -> list[dict[Any, Any] | Callable[..., Any]] | None:  # transformers' parameter type
    return None if tools is None else [dict(tool) for tool in tools]


def _flat(values: Any) -> list[Any]:
    """A token list from what a tokenizer returns: list, tensor / array, or a batch of one."""
    if hasattr(values, "tolist"):
        values = values.tolist()
    items: list[Any] = list(values)
    if len(items) == 1 and isinstance(items[0], (list, tuple)):
        items = list(items[0])
    return items


def _input_ids(out: Any) -> list[int]:
    ids = out["input_ids"] if isinstance(out, Mapping) or hasattr(out, "keys") else out
    return [int(t) for t in _flat(ids)]


def _runs(mask: Sequence[int]) -> list[Span]:
    """The maximal runs of nonzero entries, as (start, end) ranges."""
    spans: list[Span] = []
    start: int | None = None
    for i, value in enumerate([*mask, 0]):
        if value and start is None:
            start = i
        elif not value and start is not None:
            spans.append((start, i))
            start = None
    return spans


def _default_stop_ids(tokenizer: Any) -> list[int]:
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    ids.extend(int(added[name]) for name in _KNOWN_END_TOKENS if name in added)
    return ids


def _generation_config_eos(model_dir: Path) -> list[int]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return []
    try:
        eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return []
    if isinstance(eos, int):
        return [eos]
    if isinstance(eos, list):
        return [int(e) for e in eos if isinstance(e, int)]
    return []
