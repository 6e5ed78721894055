"""OpenAI leaves a stop string out of the answer; the sampler stops once its text ends with one and streams
that text. ``StopCut`` cuts it, and while streaming holds back the text that could still become one, so no
character is ever sent and then taken back. The token ids are never cut: they are what was sampled."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class StopCut:
    stops: tuple[str, ...]
    text: str = ""  # everything the sampler sent
    sent: int = 0  # characters of text given out
    _longest: int = field(init=False)

    def __post_init__(self) -> None:
        self._longest = max((len(s) for s in self.stops), default=0)

    def _stop_at(self) -> int | None:
        start = max(0, self.sent - self._longest)  # text before this cannot hold a stop string not seen yet
        found = [i for s in self.stops if (i := self.text.find(s, start)) >= 0]
        return min(found) if found else None

    def feed(self, delta: str) -> str:
        """The text that can be sent now."""
        if not self.stops:
            self.sent += len(delta)
            self.text += delta
            return delta
        self.text += delta
        cut = self._stop_at()
        if cut is None:
            held = max((k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
            cut = len(self.text) - held
        cut = max(cut, self.sent)
        out = self.text[self.sent : cut]
        self.sent = cut
        return out

    def finish(self) -> str:
        """The rest, once the sample ended: what was held back, unless a stop string begins in it."""
        cut = self._stop_at() if self.stops else None
        end = len(self.text) if cut is None else max(cut, self.sent)
        out = self.text[self.sent : end]
        self.sent = end
        return out

    @property
    def answer(self) -> str:
        """The whole answer's text, once finished."""
        return self.text[: self.sent]
