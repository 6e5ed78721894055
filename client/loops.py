"""Training loops on the SDK: on-policy RL (GRPO-style groups), multi-agent RL and supervised fine-tuning.

    from opentinker.client import AdamParams, LoraConfig, SamplingParams, ServiceClient
    from opentinker.client.loops import train_rl
    from opentinker.client.tasks import DigitsTask

    with ServiceClient(trainer=..., sampler=..., registry=...) as service:
        history = train_rl(
            service, "team-a/digits", DigitsTask.factory(renderer),
            steps=12, group_size=8, groups_per_step=4,
            sampling=SamplingParams(max_tokens=12), adam=AdamParams(learning_rate=3e-2),
            lora=LoraConfig(rank=8), metrics_path=Path("digits.jsonl"), progress=True,
        )

One RL step: sample every group from the *exact* version saved by the previous step (``name@N``; step 1 samples
a snapshot saved before it), score the trajectories, turn them into policy-gradient datums with group
advantages (`datums_for_group`), forward_backward them (trace ids = the rollouts' ids, so the registry's
lineage of the next version lists them), optim_step, save_snapshot (the next version). Every sample's
version is checked against the one asked for. A step whose groups all have equal rewards has no datum: it
trains nothing and saves no version (``version_saved == version_sampled``).

`train_rl_async` is the same loop on the ``*_async`` SDK methods: run several adapters concurrently with
``asyncio.gather(train_rl_async(...), train_rl_async(...))``. `train_multi_agent_rl` trains one adapter per
role of a `MultiAgentEnv`. `train_sft` runs cross-entropy steps over conversations (rendered by a Renderer)
or ready-made datums and saves a snapshot at the end.

``metrics_path``: one JSON object per step is appended (`StepMetrics.as_dict`). ``progress``: True shows a
rich progress bar; pass a started ``rich.progress.Progress`` to show several concurrent runs in one display.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from opentinker.client.envs import (
    DEFAULT_MAX_TURNS,
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
from opentinker.client.registry_client import Version
from opentinker.client.renderer import Renderer, TrainOn
from opentinker.client.sampling_client import SamplingClient
from opentinker.client.service_client import ServiceClient
from opentinker.client.training_client import TrainingClient
from opentinker.client.trajectory import datums_for_group
from opentinker.client.types import AdamParams, Datum, ForwardBackwardOutput, LoraConfig, SamplingParams

__all__ = [
    "SFTStepMetrics",
    "StepMetrics",
    "train_multi_agent_rl",
    "train_multi_agent_rl_async",
    "train_rl",
    "train_rl_async",
    "train_sft",
]

Conversation = Sequence[Mapping[str, str]]


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


@dataclass(frozen=True, slots=True)
class SFTStepMetrics:
    """One supervised step: ``loss`` is the mean cross-entropy per trained token ("loss:sum" / "weights:sum"),
    ``loss_sum`` the batch's summed loss; ``version_saved`` the version saved after this step (0: none)."""

    step: int
    epoch: int
    loss: float
    loss_sum: float
    num_datums: int
    num_tokens: float
    version_saved: int
    seconds: float
    adapter: str = ""
    trace_ids: tuple[str, ...] = field(default=(), repr=False)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["trace_ids"]
        return out


# Progress and metrics files


@contextmanager
def _progress_display(progress: bool | Progress) -> Iterator[Progress | None]:
    if isinstance(progress, Progress):
        yield progress
        return
    if not progress:
        yield None
        return
    display = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
    )
    with display:
        yield display


def _append_jsonl(path: Path | None, record: Mapping[str, Any]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as out:
        out.write(json.dumps(record, sort_keys=True) + "\n")


# RL


@dataclass(frozen=True, slots=True)
class _RLConfig:
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
        config: _RLConfig,
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
        _append_jsonl(self.metrics_path, metrics.as_dict())
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


def _update(
    run: _Run, groups: Sequence[Sequence[SampledTrajectory]]
) -> tuple[int, ForwardBackwardOutput | None, Version | None]:
    datums, trace_ids = run.datums(groups)
    if not datums:
        return 0, None, None
    config = run.config
    output = run.training.forward_backward(datums, config.loss_fn, config.loss_fn_config, trace_ids=trace_ids)
    run.training.optim_step(config.adam)
    saved = run.training.save_snapshot(metrics=run.snapshot_metrics(groups))
    return len(datums), output, saved


async def _update_async(
    run: _Run, groups: Sequence[Sequence[SampledTrajectory]]
) -> tuple[int, ForwardBackwardOutput | None, Version | None]:
    datums, trace_ids = run.datums(groups)
    if not datums:
        return 0, None, None
    config = run.config
    training = run.training
    output = await training.forward_backward_async(datums, config.loss_fn, config.loss_fn_config, trace_ids=trace_ids)
    await training.optim_step_async(config.adam)
    saved = await training.save_snapshot_async(metrics=run.snapshot_metrics(groups))
    return len(datums), output, saved


def _single_plan(run: _Run, group: EnvGroup, step: int) -> tuple[list[Env], list[str]]:
    envs: list[Env] = []
    trace_ids: list[str] = []
    for g in range(run.config.groups_per_step):
        envs += group.make(run.config.task_seed(step, g))
        trace_ids += group.trace_ids(run.trace_prefix(step, g))
    return envs, trace_ids


def _rl_config(
    steps: int,
    group_size: int,
    groups_per_step: int,
    sampling: SamplingParams | None,
    adam: AdamParams | None,
    loss_fn: str,
    loss_fn_config: Mapping[str, float] | None,
    normalize_std: bool,
    max_turns: int,
    seed: int,
) -> _RLConfig:
    return _RLConfig(
        steps=steps,
        group_size=group_size,
        groups_per_step=groups_per_step,
        sampling=sampling or SamplingParams(),
        adam=adam,
        loss_fn=loss_fn,
        loss_fn_config=loss_fn_config,
        normalize_std=normalize_std,
        max_turns=max_turns,
        seed=seed,
    )


def train_rl(
    service: ServiceClient,
    adapter: str,
    env_factory: EnvFactory,
    *,
    steps: int,
    group_size: int = 8,
    groups_per_step: int = 4,
    sampling: SamplingParams | None = None,
    adam: AdamParams | None = None,
    loss_fn: str = "importance_sampling",
    loss_fn_config: Mapping[str, float] | None = None,
    lora: LoraConfig | None = None,
    normalize_std: bool = False,
    max_turns: int = DEFAULT_MAX_TURNS,
    seed: int = 0,
    training_client: TrainingClient | None = None,
    metrics_path: Path | str | None = None,
    progress: bool | Progress = False,
    run_id: str | None = None,
) -> list[StepMetrics]:
    """On-policy RL of ``adapter`` on ``env_factory``'s tasks for ``steps`` steps; returns each step's metrics.

    Creates the adapter on the trainer (``lora``; ``seed`` also seeds its initialisation) unless
    ``training_client`` is given (then ``adapter`` is ignored and that adapter continues). Each step plays
    ``groups_per_step`` groups of ``group_size`` episodes (group g of step s: task seed
    ``seed + (s - 1) * groups_per_step + g``), with ``sampling`` (logprobs forced on) for at most
    ``max_turns`` turns each; trace ids are ``{adapter}:{run_id}:s{step}:g{group}/{i}``. ``loss_fn``:
    "importance_sampling", "ppo", "cispo" (``loss_fn_config`` e.g. clip thresholds). ``adam`` None: the
    adapter's defaults.
    """
    config = _rl_config(
        steps, group_size, groups_per_step, sampling, adam, loss_fn, loss_fn_config, normalize_std, max_turns, seed
    )
    training = training_client or service.create_training_client(adapter, lora, seed=seed)
    run = _Run(training, config, metrics_path, run_id)
    group = EnvGroup(env_factory, group_size, normalize_std=normalize_std)
    with _progress_display(progress) as display:
        run.attach(display)
        run.begin(training.save_snapshot(metrics={}))
        for step in range(1, steps + 1):
            envs, trace_ids = _single_plan(run, group, step)
            client = service.create_sampling_client(run.reference)
            trajectories = rollout_group(envs, client, config.sampling, trace_ids, max_turns=max_turns)
            run.check_versions(trajectories)
            groups = _split(trajectories, group_size)
            num_datums, output, saved = _update(run, groups)
            run.record(step, groups, num_datums, output, saved)
    return run.history


async def train_rl_async(
    service: ServiceClient,
    adapter: str,
    env_factory: EnvFactory,
    *,
    steps: int,
    group_size: int = 8,
    groups_per_step: int = 4,
    sampling: SamplingParams | None = None,
    adam: AdamParams | None = None,
    loss_fn: str = "importance_sampling",
    loss_fn_config: Mapping[str, float] | None = None,
    lora: LoraConfig | None = None,
    normalize_std: bool = False,
    max_turns: int = DEFAULT_MAX_TURNS,
    seed: int = 0,
    training_client: TrainingClient | None = None,
    metrics_path: Path | str | None = None,
    progress: bool | Progress = False,
    run_id: str | None = None,
) -> list[StepMetrics]:
    """train_rl on the async SDK methods (a step's rollout requests are sent concurrently); run several
    adapters at once with asyncio.gather."""
    config = _rl_config(
        steps, group_size, groups_per_step, sampling, adam, loss_fn, loss_fn_config, normalize_std, max_turns, seed
    )
    if training_client is None:
        training = await service.create_training_client_async(adapter, lora, seed=seed)
    else:
        training = training_client
    run = _Run(training, config, metrics_path, run_id)
    group = EnvGroup(env_factory, group_size, normalize_std=normalize_std)
    with _progress_display(progress) as display:
        run.attach(display)
        run.begin(await training.save_snapshot_async(metrics={}))
        for step in range(1, steps + 1):
            envs, trace_ids = _single_plan(run, group, step)
            client = service.create_sampling_client(run.reference)
            trajectories = await rollout_group_async(envs, client, config.sampling, trace_ids, max_turns=max_turns)
            run.check_versions(trajectories)
            groups = _split(trajectories, group_size)
            num_datums, output, saved = await _update_async(run, groups)
            run.record(step, groups, num_datums, output, saved)
    return run.history


# Multi-agent RL


def _multi_plan(
    runs: Mapping[str, _Run], env_factory: MultiAgentEnvFactory, config: _RLConfig, step: int
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
    trainings: Mapping[str, TrainingClient], config: _RLConfig, metrics_path: Path | str | None, run_id: str | None
) -> dict[str, _Run]:
    run_id = run_id or uuid.uuid4().hex[:8]
    return {
        role: _Run(training, config, metrics_path, run_id, label=f"{role} ({training.adapter})")
        for role, training in trainings.items()
    }


def train_multi_agent_rl(
    service: ServiceClient,
    adapters: Mapping[str, str],
    env_factory: MultiAgentEnvFactory,
    *,
    steps: int,
    group_size: int = 8,
    groups_per_step: int = 4,
    sampling: SamplingParams | None = None,
    adam: AdamParams | None = None,
    loss_fn: str = "importance_sampling",
    loss_fn_config: Mapping[str, float] | None = None,
    lora: LoraConfig | None = None,
    normalize_std: bool = False,
    max_turns: int = DEFAULT_MAX_TURNS,
    seed: int = 0,
    training_clients: Mapping[str, TrainingClient] | None = None,
    metrics_path: Path | str | None = None,
    progress: bool | Progress = False,
    run_id: str | None = None,
) -> dict[str, list[StepMetrics]]:
    """RL of one adapter per role of a MultiAgentEnv (``adapters``: role -> adapter name, each created on
    the trainer; or ``training_clients``: role -> an existing client). Each step plays the groups with every
    role sampled from its adapter's exact current version, then trains each role's adapter on its own
    trajectories (group advantages per role). Returns each role's step metrics (all roles' lines go to
    metrics_path, told apart by "adapter")."""
    config = _rl_config(
        steps, group_size, groups_per_step, sampling, adam, loss_fn, loss_fn_config, normalize_std, max_turns, seed
    )
    trainings = dict(training_clients or {})
    if not trainings:
        trainings = {role: service.create_training_client(name, lora, seed=seed) for role, name in adapters.items()}
    runs = _multi_runs(trainings, config, metrics_path, run_id)
    with _progress_display(progress) as display:
        for run in runs.values():
            run.attach(display)
            run.begin(run.training.save_snapshot(metrics={}))
        for step in range(1, steps + 1):
            envs, trace_ids = _multi_plan(runs, env_factory, config, step)
            clients = {role: service.create_sampling_client(run.reference) for role, run in runs.items()}
            episodes = rollout_multi_agent_group(envs, clients, config.sampling, trace_ids, max_turns=max_turns)
            for role, run in runs.items():
                groups = _role_groups(episodes, role, group_size)
                run.check_versions([t for g in groups for t in g])
                num_datums, output, saved = _update(run, groups)
                run.record(step, groups, num_datums, output, saved)
    return {role: run.history for role, run in runs.items()}


async def train_multi_agent_rl_async(
    service: ServiceClient,
    adapters: Mapping[str, str],
    env_factory: MultiAgentEnvFactory,
    *,
    steps: int,
    group_size: int = 8,
    groups_per_step: int = 4,
    sampling: SamplingParams | None = None,
    adam: AdamParams | None = None,
    loss_fn: str = "importance_sampling",
    loss_fn_config: Mapping[str, float] | None = None,
    lora: LoraConfig | None = None,
    normalize_std: bool = False,
    max_turns: int = DEFAULT_MAX_TURNS,
    seed: int = 0,
    training_clients: Mapping[str, TrainingClient] | None = None,
    metrics_path: Path | str | None = None,
    progress: bool | Progress = False,
    run_id: str | None = None,
) -> dict[str, list[StepMetrics]]:
    """train_multi_agent_rl on the async SDK methods; the roles' updates run concurrently."""
    config = _rl_config(
        steps, group_size, groups_per_step, sampling, adam, loss_fn, loss_fn_config, normalize_std, max_turns, seed
    )
    trainings = dict(training_clients or {})
    if not trainings:
        created = await asyncio.gather(
            *(service.create_training_client_async(name, lora, seed=seed) for name in adapters.values())
        )
        trainings = dict(zip(adapters, created, strict=True))
    runs = _multi_runs(trainings, config, metrics_path, run_id)
    with _progress_display(progress) as display:
        for run in runs.values():
            run.attach(display)
        versions = await asyncio.gather(*(run.training.save_snapshot_async(metrics={}) for run in runs.values()))
        for run, version in zip(runs.values(), versions, strict=True):
            run.begin(version)
        for step in range(1, steps + 1):
            envs, trace_ids = _multi_plan(runs, env_factory, config, step)
            clients: dict[str, SamplingClient] = {
                role: service.create_sampling_client(run.reference) for role, run in runs.items()
            }
            episodes = await rollout_multi_agent_group_async(
                envs, clients, config.sampling, trace_ids, max_turns=max_turns
            )
            role_groups = {role: _role_groups(episodes, role, group_size) for role in runs}
            for role, run in runs.items():
                run.check_versions([t for g in role_groups[role] for t in g])
            updates = await asyncio.gather(*(_update_async(run, role_groups[role]) for role, run in runs.items()))
            for (role, run), (num_datums, output, saved) in zip(runs.items(), updates, strict=True):
                run.record(step, role_groups[role], num_datums, output, saved)
    return {role: run.history for role, run in runs.items()}


# Supervised fine-tuning


def _sft_datums(
    data: Sequence[Conversation] | Sequence[Datum], renderer: Renderer | None, train_on: TrainOn
) -> list[Datum]:
    datums: list[Datum] = []
    for i, item in enumerate(data):
        if isinstance(item, Datum):
            datums.append(item)
            continue
        if renderer is None:
            raise ValueError(f"data[{i}] is a conversation: pass renderer= to render it")
        datums.append(renderer.sft_datum(cast("Conversation", item), train_on))
    return datums


def _batches(count: int, batch_size: int, steps: int | None, epochs: int, seed: int) -> list[tuple[int, list[int]]]:
    """(epoch, datum indices) per step: each epoch a fresh shuffle cut into batches of ``batch_size``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if steps is None and epochs < 1:
        raise ValueError(f"epochs must be at least 1, got {epochs}")
    if steps is not None and steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    plan: list[tuple[int, list[int]]] = []
    epoch = 0
    while (steps is None and epoch < epochs) or (steps is not None and len(plan) < steps):
        order = list(range(count))
        random.Random(seed + epoch).shuffle(order)
        for start in range(0, count, batch_size):
            plan.append((epoch + 1, order[start : start + batch_size]))
        epoch += 1
    return plan if steps is None else plan[:steps]


def train_sft(
    service: ServiceClient,
    adapter: str,
    data: Sequence[Conversation] | Sequence[Datum],
    *,
    steps: int | None = None,
    epochs: int = 1,
    batch_size: int = 8,
    adam: AdamParams | None = None,
    lora: LoraConfig | None = None,
    renderer: Renderer | None = None,
    train_on: TrainOn = "all_assistant",
    save_every: int = 0,
    seed: int = 0,
    training_client: TrainingClient | None = None,
    metrics_path: Path | str | None = None,
    progress: bool | Progress = False,
    run_id: str | None = None,
) -> list[SFTStepMetrics]:
    """Supervised fine-tuning (cross_entropy) of ``adapter`` on ``data``: chat conversations (rendered with
    ``renderer``, weights per ``train_on``) or Datums. ``epochs`` passes over the data in shuffled batches of
    ``batch_size``, or exactly ``steps`` steps when given (the data repeats as needed). Saves a snapshot every
    ``save_every`` steps (0: never) and after the last step. Creates the adapter (``lora``, ``seed``) unless
    ``training_client`` is given. Trace ids: ``{adapter}:{run_id}:sft:{index of the example}``."""
    datums = _sft_datums(data, renderer, train_on)
    if not datums:
        raise ValueError("no training data")
    plan = _batches(len(datums), batch_size, steps, epochs, seed)
    training = training_client or service.create_training_client(adapter, lora, seed=seed)
    run_id = run_id or uuid.uuid4().hex[:8]
    path = Path(metrics_path) if metrics_path is not None else None
    history: list[SFTStepMetrics] = []
    with _progress_display(progress) as display:
        task = display.add_task(f"sft {training.adapter}", total=len(plan), info="") if display else None
        started = time.perf_counter()
        for step, (epoch, indices) in enumerate(plan, start=1):
            trace_ids = [f"{training.adapter}:{run_id}:sft:{i}" for i in indices]
            output = training.forward_backward([datums[i] for i in indices], "cross_entropy", trace_ids=trace_ids)
            training.optim_step(adam)
            saved = 0
            if step == len(plan) or (save_every > 0 and step % save_every == 0):
                saved = training.save_snapshot(metrics={"loss": output.loss}).number
            tokens = output.metrics.get("weights:sum", 0.0)
            now = time.perf_counter()
            metrics = SFTStepMetrics(
                step=step,
                epoch=epoch,
                loss=output.loss / tokens if tokens > 0 else 0.0,
                loss_sum=output.loss,
                num_datums=len(indices),
                num_tokens=tokens,
                version_saved=saved,
                seconds=now - started,
                adapter=training.adapter,
                trace_ids=tuple(trace_ids),
            )
            started = now
            history.append(metrics)
            _append_jsonl(path, metrics.as_dict())
            if display is not None and task is not None:
                display.update(task, advance=1, info=f"loss {metrics.loss:.3f}")
    return history
