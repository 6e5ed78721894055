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

`train_rl_async` is the same loop on the ``*_async`` SDK methods (each sync/async pair runs one core,
`opentinker.client.rl_loop`): run several adapters concurrently with
``asyncio.gather(train_rl_async(...), train_rl_async(...))``. `train_multi_agent_rl` trains one adapter per
role of a `MultiAgentEnv`. `train_sft` (`opentinker.client.sft`) runs cross-entropy steps over conversations
(rendered by a Renderer) or ready-made datums and saves a snapshot at the end.

``metrics_path``: one JSON object per step is appended (`StepMetrics.as_dict`). ``progress``: True shows a
rich progress bar; pass a started ``rich.progress.Progress`` to show several concurrent runs in one display.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TypedDict, Unpack

from rich.progress import Progress

from opentinker.client.envs import DEFAULT_MAX_TURNS, EnvFactory, MultiAgentEnvFactory
from opentinker.client.rl_loop import RLConfig, StepMetrics, multi_agent_rl, single_agent_rl
from opentinker.client.sampling_types import SamplingParams
from opentinker.client.sansio import Program, run, run_async
from opentinker.client.service_client import ServiceClient
from opentinker.client.sft import SFTStepMetrics, train_sft
from opentinker.client.training_client import TrainingClient
from opentinker.client.training_types import AdamParams, LoraConfig

__all__ = [
    "SFTStepMetrics",
    "StepMetrics",
    "train_multi_agent_rl",
    "train_multi_agent_rl_async",
    "train_rl",
    "train_rl_async",
    "train_sft",
]


class RLOptions(TypedDict, total=False):
    """The keyword options every RL loop takes (single- and multi-agent, sync and async), declared once;
    the defaults are `_resolve`'s."""

    group_size: int  # episodes per group (8)
    groups_per_step: int  # groups per step (4)
    sampling: SamplingParams | None  # None: SamplingParams(); logprobs are forced on
    adam: AdamParams | None  # None: the adapter's defaults
    loss_fn: str  # "importance_sampling" (default), "ppo", "cispo"
    loss_fn_config: Mapping[str, float] | None  # e.g. clip thresholds
    lora: LoraConfig | None  # of the adapter(s) the loop creates
    normalize_std: bool  # divide group advantages by their standard deviation (False)
    max_turns: int  # turns per episode at most (DEFAULT_MAX_TURNS)
    seed: int  # task seeds and the adapters' initialisation (0)
    metrics_path: Path | str | None  # one JSON line per step appended here
    progress: bool | Progress  # True: a rich progress bar; or a started Progress shared by several runs
    run_id: str | None  # part of every trace id (None: a fresh one)


def _resolve(steps: int, options: RLOptions) -> tuple[RLConfig, RLOptions]:
    """The loop's config from the options, with their defaults; refuses a name that is no option (a typo
    would otherwise be ignored: type checkers see it, plain Python does not)."""
    unknown = sorted(set(options) - set(RLOptions.__annotations__))
    if unknown:
        raise TypeError(f"unknown option(s) {unknown}; the options are {sorted(RLOptions.__annotations__)}")
    config = RLConfig(
        steps=steps,
        group_size=options.get("group_size", 8),
        groups_per_step=options.get("groups_per_step", 4),
        sampling=options.get("sampling") or SamplingParams(),
        adam=options.get("adam"),
        loss_fn=options.get("loss_fn", "importance_sampling"),
        loss_fn_config=options.get("loss_fn_config"),
        normalize_std=options.get("normalize_std", False),
        max_turns=options.get("max_turns", DEFAULT_MAX_TURNS),
        seed=options.get("seed", 0),
    )
    return config, options


def _single_agent(
    service: ServiceClient,
    adapter: str,
    env_factory: EnvFactory,
    steps: int,
    training_client: TrainingClient | None,
    options: RLOptions,
) -> Program[list[StepMetrics]]:
    config, o = _resolve(steps, options)
    return single_agent_rl(
        service,
        adapter,
        env_factory,
        config,
        o.get("lora"),
        training_client,
        o.get("metrics_path"),
        o.get("progress", False),
        o.get("run_id"),
    )


def _multi_agent(
    service: ServiceClient,
    adapters: Mapping[str, str],
    env_factory: MultiAgentEnvFactory,
    steps: int,
    training_clients: Mapping[str, TrainingClient] | None,
    options: RLOptions,
) -> Program[dict[str, list[StepMetrics]]]:
    config, o = _resolve(steps, options)
    return multi_agent_rl(
        service,
        adapters,
        env_factory,
        config,
        o.get("lora"),
        training_clients,
        o.get("metrics_path"),
        o.get("progress", False),
        o.get("run_id"),
    )


# Single-agent RL


def train_rl(
    service: ServiceClient,
    adapter: str,
    env_factory: EnvFactory,
    *,
    steps: int,
    training_client: TrainingClient | None = None,
    **options: Unpack[RLOptions],
) -> list[StepMetrics]:
    """On-policy RL of ``adapter`` on ``env_factory``'s tasks for ``steps`` steps; returns each step's metrics.

    Creates the adapter on the trainer (``lora``; ``seed`` also seeds its initialisation) unless
    ``training_client`` is given (then ``adapter`` is ignored and that adapter continues). Each step plays
    ``groups_per_step`` groups of ``group_size`` episodes (group g of step s: task seed
    ``seed + (s - 1) * groups_per_step + g``), with ``sampling`` (logprobs forced on) for at most
    ``max_turns`` turns each; trace ids are ``{adapter}:{run_id}:s{step}:g{group}/{i}``. ``loss_fn``:
    "importance_sampling", "ppo", "cispo" (``loss_fn_config`` e.g. clip thresholds). ``adam`` None: the
    adapter's defaults. The options and their defaults: `RLOptions`.
    """
    return run(_single_agent(service, adapter, env_factory, steps, training_client, options))


async def train_rl_async(
    service: ServiceClient,
    adapter: str,
    env_factory: EnvFactory,
    *,
    steps: int,
    training_client: TrainingClient | None = None,
    **options: Unpack[RLOptions],
) -> list[StepMetrics]:
    """train_rl on the async SDK methods (a step's rollout requests are sent concurrently); run several
    adapters at once with asyncio.gather."""
    return await run_async(_single_agent(service, adapter, env_factory, steps, training_client, options))


# Multi-agent RL


def train_multi_agent_rl(
    service: ServiceClient,
    adapters: Mapping[str, str],
    env_factory: MultiAgentEnvFactory,
    *,
    steps: int,
    training_clients: Mapping[str, TrainingClient] | None = None,
    **options: Unpack[RLOptions],
) -> dict[str, list[StepMetrics]]:
    """RL of one adapter per role of a MultiAgentEnv (``adapters``: role -> adapter name, each created on
    the trainer; or ``training_clients``: role -> an existing client). Each step plays the groups with every
    role sampled from its adapter's exact current version, then trains each role's adapter on its own
    trajectories (group advantages per role). Returns each role's step metrics (all roles' lines go to
    metrics_path, told apart by "adapter"). The options and their defaults: `RLOptions`."""
    return run(_multi_agent(service, adapters, env_factory, steps, training_clients, options))


async def train_multi_agent_rl_async(
    service: ServiceClient,
    adapters: Mapping[str, str],
    env_factory: MultiAgentEnvFactory,
    *,
    steps: int,
    training_clients: Mapping[str, TrainingClient] | None = None,
    **options: Unpack[RLOptions],
) -> dict[str, list[StepMetrics]]:
    """train_multi_agent_rl on the async SDK methods; the roles' updates run concurrently."""
    return await run_async(_multi_agent(service, adapters, env_factory, steps, training_clients, options))
