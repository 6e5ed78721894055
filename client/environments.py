"""What an RL environment is, as the rollouts see it: a single-agent `Env` and a `MultiAgentEnv` of named
roles, over token ids, with what their steps return. The rollouts themselves are in `opentinker.client.envs`
(which re-exports these), the turn-by-turn engine in `opentinker.client.rollout_engine`; both import this
module, and it imports neither."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeAlias, runtime_checkable


@dataclass(frozen=True, slots=True)
class StepResult:
    """The outcome of one Env.step: this turn's reward, whether the episode ended, and (when it did not)
    the full context of the next turn: the previous observation + the action + the environment's tokens."""

    reward: float
    done: bool
    next_observation: tuple[int, ...] | None = None


@runtime_checkable
class Env(Protocol):
    """A single-agent environment over token ids. An instance plays one episode."""

    def initial_observation(self) -> tuple[int, ...]:
        """The first turn's full prompt (chat-rendered, ending with the assistant header)."""
        ...

    def step(self, action: tuple[int, ...]) -> StepResult:
        """Scores ``action`` (the sampled tokens, its stop token included)."""
        ...


EnvFactory: TypeAlias = Callable[[int], Env]
"""``factory(seed)`` -> a fresh Env for task instance ``seed``; equal seeds must give equivalent envs (the
copies of one GRPO group)."""


@dataclass(frozen=True, slots=True)
class MultiStepResult:
    """The outcome of one MultiAgentEnv.step: rewards per role (roles absent get 0) and whether it ended."""

    rewards: Mapping[str, float]
    done: bool


@runtime_checkable
class MultiAgentEnv(Protocol):
    """An environment of several named roles taking turns; each role is played by its own adapter.

    The rollout asks ``current_role()`` who acts, samples that role's adapter from ``observation(role)``
    (the full context that role sees) and calls ``step(role, action)`` until ``done``.
    """

    @property
    def roles(self) -> tuple[str, ...]:
        """Every role of the game, in a stable order."""
        ...

    def current_role(self) -> str:
        """The role that acts next (only asked while the episode is not done)."""
        ...

    def observation(self, role: str) -> tuple[int, ...]:
        """The full context ``role`` is sampled from on its turn."""
        ...

    def step(self, role: str, action: tuple[int, ...]) -> MultiStepResult:
        """Applies ``role``'s sampled ``action``; returns every role's reward for this turn."""
        ...


MultiAgentEnvFactory: TypeAlias = Callable[[int], MultiAgentEnv]
"""``factory(seed)`` -> a fresh MultiAgentEnv; equal seeds must give equivalent games."""
