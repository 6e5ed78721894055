"""The RL loops' cores, written once (sans-IO, `opentinker.client.sansio`): single-agent and multi-agent RL
steps as generators of SDK calls; `opentinker.client.loops` runs them on the plain or the async methods.

One step: sample every group from the exact version the previous step saved, check every sample's version,
turn the groups into policy-gradient datums (group advantages), forward_backward, optim_step, save_snapshot.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.progress import Progress, TaskID

from opentinker.client.datum import Datum
from opentinker.client.envs import (
    Env,
    EnvFactory,
    EnvGroup,
    MultiAgentEnv,
    MultiAgentEnvFactory,
    SampledTrajectory,
    rollout_group,
    rollout_group_async,
    rollout_multi_agent_group,
    rollout_multi_agent_group_async,
)
from opentinker.client.progress import append_jsonl, progress_display
from opentinker.client.registry_client import Version
from opentinker.client.sampling_types import SamplingParams
from opentinker.client.sansio import Program, call, gather
from opentinker.client.service_client import ServiceClient
from opentinker.client.training_client import TrainingClient
from opentinker.client.training_types import AdamParams, ForwardBackwardOutput, LoraConfig
from opentinker.client.trajectory import datums_for_group

__all__ = ["RLConfig", "StepMetrics", "multi_agent_rl", "single_agent_rl"]


@dataclass(frozen=True, slots=True)
class StepMetrics:
    """One RL step of one adapter.

    ``mean_reward``: the mean total reward of the step's trajectories; ``loss``: forward_backward's
    "loss:sum" (0.0 when the step had no datum); ``version_sampled``: the version every rollout of the step
    came from; ``version_saved``: the version the step published; ``trace_ids``: every rollout's id.
    """

    step: int
    mean_reward: float
    loss: float
    version_sampled: int
    version_saved: int
    num_datums: int
    seconds: float
    adapter: str = ""
    num_trajectories: int = 0
    num_action_tokens: int = 0
    reward_std: float = 0.0
    trace_ids: tuple[str, ...] = field(default=(), repr=False)

    def as_dict(self) -> dict[str, Any]:
        """The JSON line written to metrics_path (without the trace ids)."""
        out = asdict(self)
        del out["trace_ids"]
        return out


# One adapter's run


@dataclass(frozen=True, slots=True)
class RLConfig:
    """The settings of an RL run (every adapter of a multi-agent run shares them)."""

    steps: int
    group_size: int
    groups_per_step: int
    sampling: SamplingParams
    adam: AdamParams | None
    loss_fn: str
    loss_fn_config: Mapping[str, float] | None
    normalize_std: bool
    max_turns: int
    seed: int

    def __post_init__(self) -> None:
        if self.steps < 1 or self.group_size < 1 or self.groups_per_step < 1:
            raise ValueError("steps, group_size and groups_per_step must be at least 1")

    def task_seed(self, step: int, group: int) -> int:
        return self.seed + (step - 1) * self.groups_per_step + group


class _Run:
    """The state of one adapter's RL run: its client, the version to sample next, its metrics."""

    def __init__(
        self,
        training: TrainingClient,
        config: RLConfig,
        metrics_path: Path | str | None,
        run_id: str | None,
        label: str | None = None,
    ) -> None:
        self.training = training
        self.adapter = training.adapter
        self.config = config
        self.metrics_path = Path(metrics_path) if metrics_path is not None else None
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self.label = label or self.adapter
        self.version = 0
        self.history: list[StepMetrics] = []
        self.started = 0.0
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    @property
    def reference(self) -> str:
        return f"{self.adapter}@{self.version}"

    def attach(self, progress: Progress | None) -> None:
        if progress is not None:
            self._progress = progress
            self._task = progress.add_task(self.label, total=self.config.steps, info="")

    def begin(self, version: Version) -> None:
        self.version = version.number
        self.started = time.perf_counter()

    def trace_prefix(self, step: int, group: int) -> str:
        return f"{self.adapter}:{self.run_id}:s{step}:g{group}"

    def check_versions(self, trajectories: Sequence[SampledTrajectory]) -> None:
        for trajectory in trajectories:
            for version in trajectory.versions:
                if (version.adapter, version.version) != (self.adapter, self.version):
                    raise RuntimeError(
                        f"rollout {trajectory.trace_id} was sampled from {version.exact}, not {self.reference}"
                    )

    def datums(self, groups: Sequence[Sequence[SampledTrajectory]]) -> tuple[list[Datum], list[str]]:
        datums: list[Datum] = []
        trace_ids: list[str] = []
        for group in groups:
            played = [t for t in group if t.transitions]
            group_datums, group_ids = datums_for_group(played, normalize_std=self.config.normalize_std)
            datums += group_datums
            trace_ids += group_ids
        return datums, trace_ids

    def record(
        self,
        step: int,
        groups: Sequence[Sequence[SampledTrajectory]],
        num_datums: int,
        output: ForwardBackwardOutput | None,
        saved: Version | None,
    ) -> StepMetrics:
        trajectories = [t for group in groups for t in group]
        rewards = [t.total_reward for t in trajectories]
        mean = math.fsum(rewards) / len(rewards) if rewards else 0.0
        std = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / len(rewards)) if rewards else 0.0
        now = time.perf_counter()
        metrics = StepMetrics(
            step=step,
            mean_reward=mean,
            loss=output.loss if output is not None else 0.0,
            version_sampled=self.version,
            version_saved=saved.number if saved is not None else self.version,
            num_datums=num_datums,
            seconds=now - self.started,
            adapter=self.adapter,
            num_trajectories=len(trajectories),
            num_action_tokens=sum(len(tr.action) for t in trajectories for tr in t.transitions),
            reward_std=std,
            trace_ids=tuple(t.trace_id for t in trajectories),
        )
        self.started = now
        self.history.append(metrics)
        if saved is not None:
            self.version = saved.number
        append_jsonl(self.metrics_path, metrics.as_dict())
        if self._progress is not None and self._task is not None:
            self._progress.update(
                self._task, advance=1, info=f"reward {mean:.3f}  loss {metrics.loss:.3f}  v{metrics.version_saved}"
            )
        return metrics

    def snapshot_metrics(self, groups: Sequence[Sequence[SampledTrajectory]]) -> dict[str, float]:
        rewards = [t.total_reward for group in groups for t in group]
        return {"mean_reward": math.fsum(rewards) / len(rewards)} if rewards else {}


def _split(items: Sequence[SampledTrajectory], size: int) -> list[list[SampledTrajectory]]:
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


def _save(training: TrainingClient) -> Program[Version]:
    """The snapshot a run starts from (step 1 samples it)."""
    version: Version = yield from call(training.save_snapshot, training.save_snapshot_async, metrics={})
    return version


def _update(
    run: _Run, groups: Sequence[Sequence[SampledTrajectory]]
) -> Program[tuple[int, ForwardBackwardOutput | None, Version | None]]:
    datums, trace_ids = run.datums(groups)
    if not datums:
        return 0, None, None
    config = run.config
    training = run.training
    output: ForwardBackwardOutput = yield from call(
        training.forward_backward,
        training.forward_backward_async,
        datums,
        config.loss_fn,
        config.loss_fn_config,
        trace_ids=trace_ids,
    )
    yield from call(training.optim_step, training.optim_step_async, config.adam)
    metrics = run.snapshot_metrics(groups)
    saved: Version = yield from call(training.save_snapshot, training.save_snapshot_async, metrics=metrics)
    return len(datums), output, saved


# Single-agent RL


def _single_plan(run: _Run, group: EnvGroup, step: int) -> tuple[list[Env], list[str]]:
    envs: list[Env] = []
    trace_ids: list[str] = []
    for g in range(run.config.groups_per_step):
        envs += group.make(run.config.task_seed(step, g))
        trace_ids += group.trace_ids(run.trace_prefix(step, g))
    return envs, trace_ids


def single_agent_rl(
    service: ServiceClient,
    adapter: str,
    env_factory: EnvFactory,
    config: RLConfig,
    lora: LoraConfig | None,
    training_client: TrainingClient | None,
    metrics_path: Path | str | None,
    progress: bool | Progress,
    run_id: str | None,
) -> Program[list[StepMetrics]]:
    """The core of train_rl and train_rl_async."""
    if training_client is None:
        training: TrainingClient = yield from call(
            service.create_training_client, service.create_training_client_async, adapter, lora, seed=config.seed
        )
    else:
        training = training_client
    run = _Run(training, config, metrics_path, run_id)
    group = EnvGroup(env_factory, config.group_size, normalize_std=config.normalize_std)
    with progress_display(progress) as display:
        run.attach(display)
        run.begin((yield from _save(training)))
        for step in range(1, config.steps + 1):
            envs, trace_ids = _single_plan(run, group, step)
            client = service.create_sampling_client(run.reference)
            trajectories: list[SampledTrajectory] = yield from call(
                rollout_group,
                rollout_group_async,
                envs,
                client,
                config.sampling,
                trace_ids,
                max_turns=config.max_turns,
            )
            run.check_versions(trajectories)
            groups = _split(trajectories, config.group_size)
            num_datums, output, saved = yield from _update(run, groups)
            run.record(step, groups, num_datums, output, saved)
    return run.history


# Multi-agent RL


def _multi_plan(
    runs: Mapping[str, _Run], env_factory: MultiAgentEnvFactory, config: RLConfig, step: int
) -> tuple[list[MultiAgentEnv], list[str]]:
    any_run = next(iter(runs.values()))
    envs: list[MultiAgentEnv] = []
    trace_ids: list[str] = []
    for g in range(config.groups_per_step):
        envs += [env_factory(config.task_seed(step, g)) for _ in range(config.group_size)]
        trace_ids += [f"{any_run.run_id}:s{step}:g{g}/{i}" for i in range(config.group_size)]
    return envs, trace_ids


def _role_groups(
    episodes: Sequence[Mapping[str, SampledTrajectory]], role: str, group_size: int
) -> list[list[SampledTrajectory]]:
    return _split([episode[role] for episode in episodes], group_size)


def _multi_runs(
    trainings: Mapping[str, TrainingClient], config: RLConfig, metrics_path: Path | str | None, run_id: str | None
) -> dict[str, _Run]:
    run_id = run_id or uuid.uuid4().hex[:8]
    return {
        role: _Run(training, config, metrics_path, run_id, label=f"{role} ({training.adapter})")
        for role, training in trainings.items()
    }


def multi_agent_rl(
    service: ServiceClient,
    adapters: Mapping[str, str],
    env_factory: MultiAgentEnvFactory,
    config: RLConfig,
    lora: LoraConfig | None,
    training_clients: Mapping[str, TrainingClient] | None,
    metrics_path: Path | str | None,
    progress: bool | Progress,
    run_id: str | None,
) -> Program[dict[str, list[StepMetrics]]]:
    """The core of train_multi_agent_rl and its async twin: the roles' adapters are created, start and
    update together (concurrently under the async driver); every role's versions are checked before any
    role trains."""
    trainings = dict(training_clients or {})
    if not trainings:
        created: list[TrainingClient] = yield from gather(
            call(service.create_training_client, service.create_training_client_async, name, lora, seed=config.seed)
            for name in adapters.values()
        )
        trainings = dict(zip(adapters, created, strict=True))
    runs = _multi_runs(trainings, config, metrics_path, run_id)
    with progress_display(progress) as display:
        for run in runs.values():
            run.attach(display)
        versions = yield from gather(_save(run.training) for run in runs.values())
        for run, version in zip(runs.values(), versions, strict=True):
            run.begin(version)
        for step in range(1, config.steps + 1):
            envs, trace_ids = _multi_plan(runs, env_factory, config, step)
            clients = {role: service.create_sampling_client(run.reference) for role, run in runs.items()}
            episodes: list[dict[str, SampledTrajectory]] = yield from call(
                rollout_multi_agent_group,
                rollout_multi_agent_group_async,
                envs,
                clients,
                config.sampling,
                trace_ids,
                max_turns=config.max_turns,
            )
            role_groups = {role: _role_groups(episodes, role, config.group_size) for role in runs}
            for role, run in runs.items():
                run.check_versions([t for g in role_groups[role] for t in g])
            updates = yield from gather(_update(run, role_groups[role]) for role, run in runs.items())
            for (role, run), (num_datums, output, saved) in zip(runs.items(), updates, strict=True):
                run.record(step, role_groups[role], num_datums, output, saved)
    return {role: run.history for role, run in runs.items()}
