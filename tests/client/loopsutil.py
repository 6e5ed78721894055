"""Scripted stand-ins for the training loop twin tests (tests/client/test_loops.py): a ServiceClient whose training
and sampling clients log every call to one shared log, and scripted single- and multi-agent envs (no server)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from types import SimpleNamespace
from typing import cast

from opentinker.client import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    LoraConfig,
    MultiStepResult,
    OptimStepResult,
    SampledSequence,
    SampledVersion,
    SampleResult,
    SamplingParams,
    ServiceClient,
    StepResult,
)


class _ScriptedTraining:
    """A TrainingClient stand-in: logs every call; each save publishes the next version."""

    def __init__(self, adapter: str, log: list[tuple[object, ...]]) -> None:
        self.adapter = adapter
        self.log = log
        self.number = 0

    def forward_backward(
        self,
        data: Sequence[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: Mapping[str, float] | None = None,
        trace_ids: Iterable[str] = (),
    ) -> ForwardBackwardOutput:
        self.log.append(
            ("forward_backward", self.adapter, len(data), loss_fn, dict(loss_fn_config or {}), tuple(trace_ids))
        )
        return ForwardBackwardOutput(logprobs=(), loss_fn_outputs=(), metrics={"loss:sum": 0.5 * len(data)})

    async def forward_backward_async(
        self,
        data: Sequence[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: Mapping[str, float] | None = None,
        trace_ids: Iterable[str] = (),
    ) -> ForwardBackwardOutput:
        await asyncio.sleep(0)
        return self.forward_backward(data, loss_fn, loss_fn_config, trace_ids)

    def optim_step(self, adam_params: AdamParams | None = None) -> OptimStepResult:
        self.log.append(("optim_step", self.adapter, adam_params))
        return OptimStepResult(step=0, metrics={})

    async def optim_step_async(self, adam_params: AdamParams | None = None) -> OptimStepResult:
        await asyncio.sleep(0)
        return self.optim_step(adam_params)

    def save_snapshot(self, *, metrics: Mapping[str, float] | None = None) -> SimpleNamespace:
        self.number += 1
        self.log.append(("save_snapshot", self.adapter, dict(metrics or {})))
        return SimpleNamespace(adapter=self.adapter, number=self.number)

    async def save_snapshot_async(self, *, metrics: Mapping[str, float] | None = None) -> SimpleNamespace:
        await asyncio.sleep(0)
        return self.save_snapshot(metrics=metrics)


class _ScriptedSampler:
    """Sample i of a request: tokens (i % 3, 9), from the exact version the client was created for."""

    def __init__(self, reference: str, log: list[tuple[object, ...]]) -> None:
        adapter, number = reference.split("@")
        self.version = SampledVersion(adapter, int(number), reference, "")
        self.log = log

    def sample(self, prompt: Sequence[int], params: SamplingParams | None = None, num_samples: int = 1) -> SampleResult:
        self.log.append(("sample", self.version.exact, tuple(prompt), num_samples))
        sequences = tuple(
            SampledSequence((i % 3, 9), (-0.5, -0.25), f"s{i}", "stop_token", self.version) for i in range(num_samples)
        )
        return SampleResult(sequences=sequences, prompt_logprobs=None, prompt_tokens=len(prompt))

    async def sample_async(
        self, prompt: Sequence[int], params: SamplingParams | None = None, num_samples: int = 1
    ) -> SampleResult:
        await asyncio.sleep(0)
        return self.sample(prompt, params, num_samples)


class _ScriptedService:
    def __init__(self) -> None:
        self.log: list[tuple[object, ...]] = []

    def create_training_client(
        self, adapter: str, lora: LoraConfig | None = None, *, seed: int = 0
    ) -> _ScriptedTraining:
        self.log.append(("create_training_client", adapter, lora, seed))
        return _ScriptedTraining(adapter, self.log)

    async def create_training_client_async(
        self, adapter: str, lora: LoraConfig | None = None, *, seed: int = 0
    ) -> _ScriptedTraining:
        await asyncio.sleep(0)
        return self.create_training_client(adapter, lora, seed=seed)

    def create_sampling_client(self, reference: str) -> _ScriptedSampler:
        return _ScriptedSampler(reference, self.log)

    def by_adapter(self, adapter: str) -> list[tuple[object, ...]]:
        return [entry for entry in self.log if entry[1] == adapter or str(entry[1]).startswith(f"{adapter}@")]


class _FirstToken:
    """One turn; reward = the action's first token."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def initial_observation(self) -> tuple[int, ...]:
        return (1, 2, 3 + self.seed)

    def step(self, action: tuple[int, ...]) -> StepResult:
        return StepResult(float(action[0]), True)


class _TwoTurns:
    """Role "a" then role "b"; each role is rewarded its action's first token."""

    roles = ("a", "b")

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.turn = 0

    def current_role(self) -> str:
        return "ab"[self.turn]

    def observation(self, role: str) -> tuple[int, ...]:
        return (5, self.seed, self.turn)

    def step(self, role: str, action: tuple[int, ...]) -> MultiStepResult:
        self.turn += 1
        return MultiStepResult({role: float(action[0])}, done=self.turn == 2)


def _service(fake: _ScriptedService) -> ServiceClient:
    return cast("ServiceClient", fake)
