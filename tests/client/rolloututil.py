"""Scripted stand-ins for the rollout engine tests (tests/client/test_envs.py): a SamplingClient that answers with
scripted sequences and records its requests, and scripted single- and multi-agent envs (no server)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import cast

from opentinker.client import (
    SampledSequence,
    SampledVersion,
    SampleResult,
    SamplingClient,
    SamplingParams,
    Trajectory,
    Transition,
)
from opentinker.client.envs import Env, MultiStepResult, StepResult

BASE = SampledVersion(adapter="", version=0, reference="base", sha256="")


def _trajectory(reward: float, trace_id: str) -> Trajectory:
    return Trajectory((Transition((1, 2), (3, 4), (-1.0, -1.0), reward),), trace_id)


class ScriptedSampler:
    """Stands in for a SamplingClient: answers each request with ``num_samples`` scripted sequences and
    records the requests."""

    def __init__(self, version: SampledVersion = BASE) -> None:
        self.version = version
        self.requests: list[tuple[tuple[int, ...], int]] = []

    def sample(self, prompt: Sequence[int], params: SamplingParams | None = None, num_samples: int = 1) -> SampleResult:
        assert params is not None and params.logprobs  # rollouts always ask for logprobs
        self.requests.append((tuple(prompt), num_samples))
        sequences = tuple(
            SampledSequence(
                tokens=(100 + i, 200 + len(prompt)),
                logprobs=(-0.5, -0.25),
                text=f"s{i}",
                stop_reason="length",
                version=self.version,
            )
            for i in range(num_samples)
        )
        return SampleResult(sequences=sequences, prompt_logprobs=None, prompt_tokens=len(prompt))

    async def sample_async(
        self, prompt: Sequence[int], params: SamplingParams | None = None, num_samples: int = 1
    ) -> SampleResult:
        return self.sample(prompt, params, num_samples)


class Conversation:
    """A multi-turn Env: each turn appends the action and a 2-token environment reply; reward = turn index;
    the episode ends after ``turns`` turns."""

    def __init__(self, turns: int) -> None:
        self.turns = turns
        self.context: tuple[int, ...] = (1, 2, 3)
        self.played = 0

    def initial_observation(self) -> tuple[int, ...]:
        return self.context

    def step(self, action: tuple[int, ...]) -> StepResult:
        self.played += 1
        self.context = (*self.context, *action, 7, 8)
        if self.played == self.turns:
            return StepResult(float(self.played), True)
        return StepResult(float(self.played), False, self.context)


def _client(fake: ScriptedSampler) -> SamplingClient:
    return cast("SamplingClient", fake)


class TwoRoles:
    """A scripted game: "a" acts, then "b", then "a" again; rewards go to the *other* role as well."""

    roles = ("a", "b")

    def __init__(self) -> None:
        self.turn = 0
        self.contexts: dict[str, tuple[int, ...]] = {"a": (1,), "b": (2,)}

    def current_role(self) -> str:
        return "ab"[self.turn % 2]

    def observation(self, role: str) -> tuple[int, ...]:
        return self.contexts[role]

    def step(self, role: str, action: tuple[int, ...]) -> MultiStepResult:
        self.turn += 1
        self.contexts[role] = (*self.contexts[role], *action, 9)
        if self.turn == 1:
            return MultiStepResult({"b": 0.25}, done=False)  # before b has acted: lands on b's first turn
        if self.turn == 2:
            return MultiStepResult({"a": 1.0, "b": 2.0}, done=False)
        return MultiStepResult({"a": 4.0}, done=True)


class _Factory:
    """EnvFactory of Conversation(2) (the seed is ignored)."""

    def __call__(self, seed: int) -> Env:
        return Conversation(2)


class _SlowSampler(ScriptedSampler):
    """sample_async yields to the event loop mid-request and logs when each request starts and ends."""

    def __init__(self, log: list[str], name: str) -> None:
        super().__init__()
        self.log = log
        self.name = name

    async def sample_async(
        self, prompt: Sequence[int], params: SamplingParams | None = None, num_samples: int = 1
    ) -> SampleResult:
        self.log.append(f"start {self.name}")
        await asyncio.sleep(0.01)
        self.log.append(f"end {self.name}")
        return self.sample(prompt, params, num_samples)


class _BothAct:
    """Two games: in one "a" acts first, in the other "b"; one turn each."""

    roles = ("a", "b")

    def __init__(self, first: str) -> None:
        self.first = first

    def current_role(self) -> str:
        return self.first

    def observation(self, role: str) -> tuple[int, ...]:
        return (1,)

    def step(self, role: str, action: tuple[int, ...]) -> MultiStepResult:
        return MultiStepResult({role: 1.0}, done=True)
