"""One sample's text, decoded from its token ids as they stream in, and its stop strings: the server's side.

The engine emits token ids only; the Sample handler keeps one `StreamText` per sample and feeds it each update's
tokens. Decoding and stop-string checks so cost the server process, not the engine's step (on the engine thread they
cost every sequence of the batch a tokenizer call per step).

A stop string ends the sample at the token that completes it: that token and its text are the last ones sent (as when
the engine checked them), the tokens the engine generated after it before it heard of the stop are dropped, and the
handler tells the engine to finish the sample (`EngineAPI.finish`).

Only a window of the output is decoded per token: from the token before the last emitted one (its context, for
tokenizers that drop a leading space at the start of a decode) to the end; decoding the whole output every time made a
long generation quadratic (285 us per sequence per token at 2,048 tokens on the tiny tokenizer). The bytes of an
incomplete multi-byte character decode to U+FFFD until the rest arrives, and then to other text: new text is held back
until it is complete, so that emitted text is never taken back. A character is at most 4 bytes, so a real one completes
within a few tokens; output that stays incomplete for MAX_HELD_TOKENS (an adapter that emits stray byte tokens) goes
out as its U+FFFD replacement characters: held without end, the window grew with the output and every token re-decoded
all of it (0.50 s of the server's event loop for one 2,048-token sample, shared by every tenant's streams).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_HELD_TOKENS = 16


@dataclass(frozen=True, slots=True)
class Fed:
    text: str  # what the fed tokens add to the text
    stop_at: int | None  # index into the fed tokens of the one that completed a stop string (None: no stop)


class StreamText:
    def __init__(self, tokenizer: Any | None, stop_strings: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = stop_strings
        self.output: list[int] = []
        self.text = ""  # all of it emitted
        self._prefix = 0  # output index where the next decode window starts (context for the new text)
        self._read = 0  # output tokens whose text is in `text`
        self.stopped = False

    def feed(self, tokens: list[int], *, final: bool) -> Fed:
        """Appends tokens (`final`: the sample ends with the last of them) -> their text and where a stop string
        completed. After a stop, nothing more is taken."""
        if self.stopped or self.tokenizer is None:
            return Fed("", None)
        delta = ""
        for index, token in enumerate(tokens):
            self.output.append(token)
            new = self._decode(final=final and index == len(tokens) - 1)
            delta += new
            if new and self.stop_strings and _ends_with_stop(self.text, len(new), self.stop_strings):
                self.stopped = True
                if index < len(tokens) - 1 or not final:
                    delta += self._decode(final=True)  # nothing more will complete a held-back character
                return Fed(delta, index)
        if final and not tokens:
            delta += self._decode(final=True)
        return Fed(delta, None)

    def _decode(self, *, final: bool) -> str:
        assert self.tokenizer is not None
        output = self.output
        before = self.tokenizer.decode(output[self._prefix : self._read], skip_special_tokens=True)
        text: str = self.tokenizer.decode(output[self._prefix :], skip_special_tokens=True)
        held = len(output) - self._read
        if not final and held < MAX_HELD_TOKENS and (len(text) <= len(before) or text.endswith("\ufffd")):
            return ""
        delta = text[len(before) :]
        self._prefix, self._read = self._read, len(output)
        self.text += delta
        return delta


def _ends_with_stop(text: str, new_chars: int, stops: tuple[str, ...]) -> bool:
    """Whether a stop string occurs in `text` overlapping its last `new_chars` characters (earlier text was
    checked when it came)."""
    return any(stop in text[-(new_chars + len(stop) - 1) :] for stop in stops)
