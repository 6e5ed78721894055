"""RL environments and rollouts: an `Env` gives token observations and rewards, a sampler plays it.

    from opentinker.client import SamplingParams
    from opentinker.client.envs import EnvGroup, rollout
    from opentinker.client.tasks import DigitsTask

    env = DigitsTask(renderer, seed=0)
    sampling = service.create_sampling_client("team-a/agent@3")
    trajectory = rollout(env, sampling, SamplingParams(max_tokens=12), trace_id="episode-0")
    trajectory.total_reward, trajectory.versions  # the exact version of every turn

    group = EnvGroup(DigitsTask.factory(renderer), group_size=8)  # GRPO: 8 copies of one task instance
    trajectories = group.rollout(sampling, params, seed=0, trace_prefix="step-1/group-0")
    datums, trace_ids = group.datums(trajectories)  # advantages: reward - the group's mean

Observations are token ids. A single-agent `Env` starts from ``initial_observation()`` (the full prompt);
``step(action)`` scores the sampled tokens and, when the episode goes on, returns the *full* next context:
the previous observation, the action, then the environment's new tokens (the "full context" convention of
`opentinker.client.trajectory`, under which the turns of one episode merge into one datum).

A `MultiAgentEnv` has several named roles taking turns, each played by its own adapter:
`rollout_multi_agent` returns one trajectory per role, so that each role's trajectories train its adapter.
Rewards are per role; a reward given to a role lands on that role's latest turn (or on its first turn, when
it has not acted yet).

Rollouts of a group are batched: turns of several episodes that share a role and an observation (the G
copies of a GRPO group, on their first turn) go to the sampler as one request with ``num_samples`` = their
count. The ``*_async`` variants send the turn's requests concurrently.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

from opentinker.client.datum import Datum
from opentinker.client.environments import (
    Env,
    EnvFactory,
    MultiAgentEnv,
    MultiAgentEnvFactory,
    MultiStepResult,
    StepResult,
)
from opentinker.client.rollout_engine import play
from opentinker.client.sampling_client import SamplingClient
from opentinker.client.sampling_types import SamplingParams
from opentinker.client.sansio import Program, run, run_async
from opentinker.client.trajectory import SampledTrajectory, Trajectory, datums_for_group, group_advantages

__all__ = [
    "POLICY_ROLE",
    "Env",
    "EnvFactory",
    "EnvGroup",
    "MultiAgentEnv",
    "MultiAgentEnvFactory",
    "MultiStepResult",
    "SampledTrajectory",
    "StepResult",
    "rollout",
    "rollout_async",
    "rollout_group",
    "rollout_group_async",
    "rollout_multi_agent",
    "rollout_multi_agent_async",
    "rollout_multi_agent_group",
    "rollout_multi_agent_group_async",
]

POLICY_ROLE: Final = "policy"
"""The role name of a single-agent Env's player (used internally by the multi-agent machinery)."""
DEFAULT_MAX_TURNS: Final = 8


# GRPO groups


class EnvGroup:
    """Makes GRPO-style groups: ``group_size`` copies of one task instance, whose trajectories are scored
    against each other (advantage = total reward - the group's mean, divided by the group's std when
    ``normalize_std``)."""

    def __init__(self, env_factory: EnvFactory, group_size: int, *, normalize_std: bool = False) -> None:
        if group_size < 1:
            raise ValueError(f"group_size must be at least 1, got {group_size}")
        self.env_factory = env_factory
        self.group_size = group_size
        self.normalize_std = normalize_std

    def __repr__(self) -> str:
        return f"EnvGroup({self.env_factory!r}, group_size={self.group_size}, normalize_std={self.normalize_std})"

    def make(self, seed: int) -> list[Env]:
        """``group_size`` fresh envs of task instance ``seed``."""
        return [self.env_factory(seed) for _ in range(self.group_size)]

    def trace_ids(self, trace_prefix: str) -> list[str]:
        return [f"{trace_prefix}/{i}" for i in range(self.group_size)]

    def advantages(self, trajectories: Sequence[Trajectory]) -> list[float]:
        """Each trajectory's advantage within the group."""
        return group_advantages([t.total_reward for t in trajectories], normalize_std=self.normalize_std)

    def datums(self, trajectories: Sequence[Trajectory]) -> tuple[list[Datum], list[str]]:
        """The group's policy-gradient datums (zero-advantage ones dropped) and every trajectory's trace id."""
        return datums_for_group([t for t in trajectories if t.transitions], normalize_std=self.normalize_std)

    def rollout(
        self,
        sampling_client: SamplingClient,
        params: SamplingParams,
        seed: int,
        *,
        trace_prefix: str = "episode",
        max_turns: int = DEFAULT_MAX_TURNS,
    ) -> list[SampledTrajectory]:
        """Plays the group of task instance ``seed``; trace ids ``{trace_prefix}/{i}``."""
        return run(_group(self.make(seed), sampling_client, params, self.trace_ids(trace_prefix), max_turns))

    async def rollout_async(
        self,
        sampling_client: SamplingClient,
        params: SamplingParams,
        seed: int,
        *,
        trace_prefix: str = "episode",
        max_turns: int = DEFAULT_MAX_TURNS,
    ) -> list[SampledTrajectory]:
        core = _group(self.make(seed), sampling_client, params, self.trace_ids(trace_prefix), max_turns)
        return await run_async(core)


# The rollout cores: one per sync/async pair of rollout functions (sans-IO, see opentinker.client.sansio).


class _SingleAgent:
    """An Env seen as a MultiAgentEnv of one role (POLICY_ROLE)."""

    roles: Final = (POLICY_ROLE,)

    def __init__(self, env: Env) -> None:
        self.env = env
        self.context = tuple(int(t) for t in env.initial_observation())

    def current_role(self) -> str:
        return POLICY_ROLE

    def observation(self, role: str) -> tuple[int, ...]:
        return self.context

    def step(self, role: str, action: tuple[int, ...]) -> MultiStepResult:
        result = self.env.step(action)
        if not result.done:
            if result.next_observation is None:
                raise ValueError("Env.step returned done=False without a next_observation")
            self.context = tuple(int(t) for t in result.next_observation)
        return MultiStepResult({POLICY_ROLE: result.reward}, result.done)


def _check_ids(trace_ids: Sequence[str], count: int) -> list[str]:
    if isinstance(trace_ids, str):
        raise TypeError("trace_ids must be a sequence of strings, not a single string")
    ids = list(trace_ids)
    if len(ids) != count:
        raise ValueError(f"{count} envs but {len(ids)} trace ids")
    return ids


def _group(
    envs: Sequence[Env],
    sampling_client: SamplingClient,
    params: SamplingParams,
    trace_ids: Sequence[str],
    max_turns: int,
) -> Program[list[SampledTrajectory]]:
    """The core of every single-agent rollout."""
    ids = _check_ids(trace_ids, len(envs))
    players = [_SingleAgent(e) for e in envs]
    records = yield from play(players, max_turns, {POLICY_ROLE: sampling_client}, params)
    return [record.trajectory(POLICY_ROLE, trace_id) for record, trace_id in zip(records, ids, strict=True)]


def _multi_agent_group(
    envs: Sequence[MultiAgentEnv],
    sampling_clients: Mapping[str, SamplingClient],
    params: SamplingParams | Mapping[str, SamplingParams],
    trace_ids: Sequence[str],
    max_turns: int,
) -> Program[list[dict[str, SampledTrajectory]]]:
    """The core of every multi-agent rollout: one trajectory per role, trace id ``{trace_id}/{role}``."""
    ids = _check_ids(trace_ids, len(envs))
    records = yield from play(envs, max_turns, sampling_clients, params)
    return [
        {role: record.trajectory(role, f"{trace_id}/{role}") for role in record.roles}
        for record, trace_id in zip(records, ids, strict=True)
    ]


# Single-agent rollouts


def rollout(
    env: Env,
    sampling_client: SamplingClient,
    params: SamplingParams,
    trace_id: str,
    *,
    max_turns: int = DEFAULT_MAX_TURNS,
) -> SampledTrajectory:
    """Plays one episode of ``env`` (up to ``max_turns`` turns), sampling every turn from ``sampling_client``.

    Each turn becomes a Transition with the sampler's logprobs (logprobs are always requested) and the turn's
    reward; the result also records the exact version of every turn.
    """
    return run(_group([env], sampling_client, params, [trace_id], max_turns))[0]


async def rollout_async(
    env: Env,
    sampling_client: SamplingClient,
    params: SamplingParams,
    trace_id: str,
    *,
    max_turns: int = DEFAULT_MAX_TURNS,
) -> SampledTrajectory:
    return (await run_async(_group([env], sampling_client, params, [trace_id], max_turns)))[0]


def rollout_group(
    envs: Sequence[Env],
    sampling_client: SamplingClient,
    params: SamplingParams,
    trace_ids: Sequence[str],
    *,
    max_turns: int = DEFAULT_MAX_TURNS,
) -> list[SampledTrajectory]:
    """Plays several episodes turn by turn; the turns that share an observation are sampled as one request."""
    return run(_group(envs, sampling_client, params, trace_ids, max_turns))


async def rollout_group_async(
    envs: Sequence[Env],
    sampling_client: SamplingClient,
    params: SamplingParams,
    trace_ids: Sequence[str],
    *,
    max_turns: int = DEFAULT_MAX_TURNS,
) -> list[SampledTrajectory]:
    """rollout_group with each turn's requests sent concurrently."""
    return await run_async(_group(envs, sampling_client, params, trace_ids, max_turns))


# Multi-agent rollouts


def rollout_multi_agent(
    env: MultiAgentEnv,
    sampling_clients: Mapping[str, SamplingClient],
    params: SamplingParams | Mapping[str, SamplingParams],
    trace_id: str = "episode",
    *,
    max_turns: int = DEFAULT_MAX_TURNS,
) -> dict[str, SampledTrajectory]:
    """Plays one episode of ``env``, each role sampled from its own client (``params`` one for all roles or
    one per role); returns one trajectory per role (trace id ``{trace_id}/{role}``; a role that never acted
    gets one without transitions)."""
    return run(_multi_agent_group([env], sampling_clients, params, [trace_id], max_turns))[0]


async def rollout_multi_agent_async(
    env: MultiAgentEnv,
    sampling_clients: Mapping[str, SamplingClient],
    params: SamplingParams | Mapping[str, SamplingParams],
    trace_id: str = "episode",
    *,
    max_turns: int = DEFAULT_MAX_TURNS,
) -> dict[str, SampledTrajectory]:
    return (await run_async(_multi_agent_group([env], sampling_clients, params, [trace_id], max_turns)))[0]


def rollout_multi_agent_group(
    envs: Sequence[MultiAgentEnv],
    sampling_clients: Mapping[str, SamplingClient],
    params: SamplingParams | Mapping[str, SamplingParams],
    trace_ids: Sequence[str],
    *,
    max_turns: int = DEFAULT_MAX_TURNS,
) -> list[dict[str, SampledTrajectory]]:
    """Several episodes turn by turn (turns sharing a role and an observation are sampled as one request)."""
    return run(_multi_agent_group(envs, sampling_clients, params, trace_ids, max_turns))


async def rollout_multi_agent_group_async(
    envs: Sequence[MultiAgentEnv],
    sampling_clients: Mapping[str, SamplingClient],
    params: SamplingParams | Mapping[str, SamplingParams],
    trace_ids: Sequence[str],
    *,
    max_turns: int = DEFAULT_MAX_TURNS,
) -> list[dict[str, SampledTrajectory]]:
    return await run_async(_multi_agent_group(envs, sampling_clients, params, trace_ids, max_turns))
