"""Small dense-reward tasks for RL smoke tests and demos; a tiny random model learns each in a few steps.

    from opentinker.client import Renderer
    from opentinker.client.envs import EnvGroup
    from opentinker.client.tasks import DigitsTask

    renderer = Renderer.from_pretrained(model_dir)
    group = EnvGroup(DigitsTask.factory(renderer), group_size=8)

Every single-agent task is a one-turn `Env`: a short chat prompt (chosen by the seed), and a reward in
[0, 1] computed from the response's text up to its first stop token (`Renderer.parse_response`):

* `DigitsTask`: the fraction of the response's characters that are digits;
* `VowelsTask`: the fraction of the response's letters that are vowels (a, e, i, o, u, either case);
* `ShortAnswerTask`: 1 - n / budget for a response of n tokens that ends with a stop token (0 when it
  runs out of tokens without one): the earlier the model stops, the higher.

`EchoGame` is a two-agent `MultiAgentEnv`: a "speaker" says something, then a "listener", shown the
speaker's text, answers; both get the listener's echo score, the fraction of the speaker's first
characters that the listener repeats (multiset overlap, see `echo_reward`).

The reward functions are plain functions of text (`digits_reward`, `vowels_reward`, `short_answer_reward`,
`echo_reward`), so they can be checked by hand.

Sample these tasks at a low temperature (`TINY_MODEL_SAMPLING`: temperature 0.1, 12 tokens) when the policy is
a tiny random model: its final norm and small lm_head bound every logit to about +-1.3, so at temperature 1
no LoRA can move a token's probability by more than a few times and rewards barely move; temperature 0.1
multiplies those margins by 10, and the same LoRA updates then decide what is sampled. (The sampler reports
temperature-1 logprobs, which is what the trainer's importance ratios compare against.) With 4 groups of 8,
rank 8 and lr 3e-2, DigitsTask goes from ~0.02 to ~0.95 in 5-8 steps and ShortAnswerTask from ~0.02 to ~0.95.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar, Final, TypeVar

from opentinker.client.envs import MultiStepResult, StepResult
from opentinker.client.renderer import Renderer
from opentinker.client.sampling_types import SamplingParams

__all__ = [
    "TINY_MODEL_SAMPLING",
    "DigitsTask",
    "EchoGame",
    "ShortAnswerTask",
    "TextTask",
    "VowelsTask",
    "digits_reward",
    "echo_reward",
    "short_answer_reward",
    "vowels_reward",
]

TINY_MODEL_SAMPLING: Final = SamplingParams(max_tokens=12, temperature=0.1)
"""Sampling that lets a tiny random model's preferences show (see the module docstring)."""
VOWELS: Final = frozenset("aeiouAEIOU")
SPEAKER: Final = "speaker"
LISTENER: Final = "listener"


# Reward functions


def digits_reward(text: str) -> float:
    """The fraction of ``text``'s characters that are ASCII digits (0.0 for empty text)."""
    if not text:
        return 0.0
    return sum(c in "0123456789" for c in text) / len(text)


def vowels_reward(text: str) -> float:
    """The fraction of ``text``'s letters (``str.isalpha``) that are a, e, i, o or u, either case (0.0 when it
    has no letter)."""
    letters = [c for c in text if c.isalpha()]
    if not letters:
        return 0.0
    return sum(c in VOWELS for c in letters) / len(letters)


def short_answer_reward(num_tokens: int, ended: bool, budget: int) -> float:
    """1 - num_tokens / budget for a response of ``num_tokens`` tokens (its stop token excluded) that
    ``ended`` with a stop token; 0.0 for one cut off without a stop token. Clamped to [0, 1]."""
    if budget < 1:
        raise ValueError(f"budget must be at least 1, got {budget}")
    if not ended:
        return 0.0
    return min(1.0, max(0.0, 1.0 - num_tokens / budget))


def echo_reward(speaker_text: str, listener_text: str, prefix_chars: int = 8) -> float:
    """How much of the speaker's first ``prefix_chars`` characters the listener repeats: the size of the
    multiset intersection of those characters and the listener's characters, divided by their count (0.0
    when the speaker said nothing). Order is ignored, which keeps the reward dense for an untrained model."""
    target = Counter(speaker_text[:prefix_chars])
    total = sum(target.values())
    if not total:
        return 0.0
    return sum((target & Counter(listener_text)).values()) / total


# Single-agent tasks

_T = TypeVar("_T", bound="TextTask")


class TextTask:
    """A one-turn chat task: the prompt is ``PROMPTS[seed % len(PROMPTS)]`` (or ``prompt``), the reward a
    function of the response's text. Subclasses define PROMPTS and `score`."""

    PROMPTS: ClassVar[tuple[str, ...]] = ("Say something.",)

    def __init__(self, renderer: Renderer, seed: int = 0, *, prompt: str | None = None) -> None:
        self.renderer = renderer
        self.seed = seed
        self.prompt = self.PROMPTS[seed % len(self.PROMPTS)] if prompt is None else prompt
        self._observation = tuple(renderer.prompt_tokens([{"role": "user", "content": self.prompt}]))
        self.response: str | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(seed={self.seed}, prompt={self.prompt!r})"

    @classmethod
    def factory(cls: type[_T], renderer: Renderer, **kwargs: object) -> Callable[[int], _T]:
        """An EnvFactory: ``seed`` -> ``cls(renderer, seed, **kwargs)``."""

        def make(seed: int) -> _T:
            return cls(renderer, seed, **kwargs)  # type: ignore[arg-type]

        make.__qualname__ = f"{cls.__name__}.factory"
        return make

    def initial_observation(self) -> tuple[int, ...]:
        return self._observation

    def step(self, action: tuple[int, ...]) -> StepResult:
        text, ended = self.renderer.parse_response(action)
        self.response = text
        return StepResult(reward=self.score(action, text, ended), done=True)

    def score(self, action: Sequence[int], text: str, ended: bool) -> float:
        """The reward of a response: its tokens, its text before the stop token, whether it stopped."""
        raise NotImplementedError

    def reward_of(self, text: str, *, ended: bool = True) -> float:
        """The reward of a hand-written response ``text`` (tokenized, plus a stop token when ``ended``)."""
        tokens = list(self.renderer.tokenizer.encode(text, add_special_tokens=False))
        if ended:
            tokens.append(self.renderer.stop_token_ids[0])
        return self.step(tuple(tokens)).reward


class DigitsTask(TextTask):
    """Reward: the fraction of the response's characters that are digits."""

    PROMPTS = ("Numbers:", "Count to ten.", "What is 3+4?", "Digits please.")

    def score(self, action: Sequence[int], text: str, ended: bool) -> float:
        return digits_reward(text)


class VowelsTask(TextTask):
    """Reward: the fraction of the response's letters that are vowels."""

    PROMPTS = ("Sing a vowel.", "Say aaa.", "Read this aloud.", "Hello!")

    def score(self, action: Sequence[int], text: str, ended: bool) -> float:
        return vowels_reward(text)


class ShortAnswerTask(TextTask):
    """Reward: 1 - n / budget for a response of n tokens that ends with a stop token, 0 when cut off.

    ``budget`` should be the sampling max_tokens (a response of max_tokens tokens cannot also stop)."""

    PROMPTS = ("Answer briefly: is water wet?", "Yes or no?", "One word, please.", "Be short.")

    def __init__(self, renderer: Renderer, seed: int = 0, *, prompt: str | None = None, budget: int = 16) -> None:
        super().__init__(renderer, seed, prompt=prompt)
        self.budget = budget

    def score(self, action: Sequence[int], text: str, ended: bool) -> float:
        stops = set(self.renderer.stop_token_ids)
        length = next((i for i, token in enumerate(action) if token in stops), len(action))
        return short_answer_reward(length, ended, self.budget)


# A two-agent game


class EchoGame:
    """Two roles: the "speaker" answers a prompt; the "listener" is shown the speaker's text and asked to
    repeat it. Both get ``echo_reward(speaker_text, listener_text, prefix_chars)`` when the listener has
    answered (the speaker is rewarded when the listener succeeds). Two turns, speaker first."""

    roles: Final = (SPEAKER, LISTENER)
    PROMPTS: ClassVar[tuple[str, ...]] = ("Say a short word.", "Name a thing.", "Speak.", "Tell me a code.")

    def __init__(self, renderer: Renderer, seed: int = 0, *, prefix_chars: int = 8) -> None:
        self.renderer = renderer
        self.seed = seed
        self.prefix_chars = prefix_chars
        self.prompt = self.PROMPTS[seed % len(self.PROMPTS)]
        self._contexts: dict[str, tuple[int, ...]] = {
            SPEAKER: tuple(renderer.prompt_tokens([{"role": "user", "content": self.prompt}]))
        }
        self.speaker_text: str | None = None
        self.listener_text: str | None = None
        self._turn = 0

    def __repr__(self) -> str:
        return f"EchoGame(seed={self.seed}, prompt={self.prompt!r})"

    @classmethod
    def factory(cls, renderer: Renderer, *, prefix_chars: int = 8) -> Callable[[int], EchoGame]:
        """A MultiAgentEnvFactory: ``seed`` -> ``EchoGame(renderer, seed, prefix_chars=...)``."""

        def make(seed: int) -> EchoGame:
            return cls(renderer, seed, prefix_chars=prefix_chars)

        make.__qualname__ = "EchoGame.factory"
        return make

    def current_role(self) -> str:
        return SPEAKER if self._turn == 0 else LISTENER

    def observation(self, role: str) -> tuple[int, ...]:
        if role not in self._contexts:
            raise ValueError(f"role {role!r} has nothing to observe yet")
        return self._contexts[role]

    def step(self, role: str, action: tuple[int, ...]) -> MultiStepResult:
        if role != self.current_role():
            raise ValueError(f"it is {self.current_role()!r}'s turn, not {role!r}'s")
        text, _ended = self.renderer.parse_response(action)
        if role == SPEAKER:
            self.speaker_text = text
            self._turn = 1
            listener_prompt = [{"role": "user", "content": f"Repeat: {text}"}]
            self._contexts[LISTENER] = tuple(self.renderer.prompt_tokens(listener_prompt))
            return MultiStepResult({}, done=False)
        self.listener_text = text
        self._turn = 2
        reward = echo_reward(self.speaker_text or "", text, self.prefix_chars)
        return MultiStepResult({SPEAKER: reward, LISTENER: reward}, done=True)

    @property
    def rewards(self) -> Mapping[str, float]:
        """Both roles' reward once the episode is over (empty before)."""
        if self.listener_text is None:
            return {}
        reward = echo_reward(self.speaker_text or "", self.listener_text, self.prefix_chars)
        return {SPEAKER: reward, LISTENER: reward}
