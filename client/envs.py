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

import asyncio
import math
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Final, Protocol, TypeAlias, runtime_checkable

from opentinker.client.sampling_client import SamplingClient
from opentinker.client.trajectory import Trajectory, Transition, datums_for_group, group_advantages
from opentinker.client.types import Datum, SampledSequence, SampledVersion, SamplingParams, StopReason

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


# Environments


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


# Trajectories with their provenance


@dataclass(frozen=True, slots=True)
class SampledTrajectory(Trajectory):
    """A Trajectory sampled by a rollout, with what produced it: per turn, the exact adapter version
    (``versions[k]`` sampled ``transitions[k]``) and why its sample ended; ``done`` False when the episode
    was cut off at max_turns; ``texts`` the decoded action of every turn."""

    versions: tuple[SampledVersion, ...] = ()
    stop_reasons: tuple[StopReason, ...] = ()
    texts: tuple[str, ...] = ()
    done: bool = True

    def __post_init__(self) -> None:
        Trajectory.__post_init__(self)
        object.__setattr__(self, "versions", tuple(self.versions))
        object.__setattr__(self, "stop_reasons", tuple(self.stop_reasons))
        object.__setattr__(self, "texts", tuple(self.texts))

    @property
    def version_numbers(self) -> tuple[int, ...]:
        """The version number of every turn (0: the base model)."""
        return tuple(v.version for v in self.versions)


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
        return rollout_group(
            self.make(seed), sampling_client, params, self.trace_ids(trace_prefix), max_turns=max_turns
        )

    async def rollout_async(
        self,
        sampling_client: SamplingClient,
        params: SamplingParams,
        seed: int,
        *,
        trace_prefix: str = "episode",
        max_turns: int = DEFAULT_MAX_TURNS,
    ) -> list[SampledTrajectory]:
        envs = self.make(seed)
        return await rollout_group_async(
            envs, sampling_client, params, self.trace_ids(trace_prefix), max_turns=max_turns
        )


# The rollout engine: a generator that asks for samples and plays the turns; sync and async drivers feed it.


@dataclass(frozen=True, slots=True)
class _Request:
    role: str
    observation: tuple[int, ...]
    num_samples: int


@dataclass(slots=True)
class _Turn:
    observation: tuple[int, ...]
    sequence: SampledSequence
    reward: float = 0.0


@dataclass(slots=True)
class _Record:
    """One episode's turns, per role."""

    roles: tuple[str, ...]
    turns: dict[str, list[_Turn]] = field(default_factory=dict)
    early_rewards: dict[str, float] = field(default_factory=dict)  # rewards of roles that had not acted yet
    done: bool = False

    def add(self, role: str, observation: tuple[int, ...], sequence: SampledSequence) -> None:
        turns = self.turns.setdefault(role, [])
        turns.append(_Turn(observation, sequence, self.early_rewards.pop(role, 0.0)))

    def reward(self, role: str, value: float) -> None:
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"the reward of role {role!r} is {value}, not a finite number")
        turns = self.turns.get(role)
        if turns:
            turns[-1].reward += value
        else:
            self.early_rewards[role] = self.early_rewards.get(role, 0.0) + value

    def trajectory(self, role: str, trace_id: str) -> SampledTrajectory:
        turns = self.turns.get(role, [])
        return SampledTrajectory(
            tuple(Transition.from_sampled(t.observation, t.sequence, t.reward) for t in turns),
            trace_id,
            versions=tuple(t.sequence.version for t in turns),
            stop_reasons=tuple(t.sequence.stop_reason for t in turns),
            texts=tuple(t.sequence.text for t in turns),
            done=self.done,
        )


_Engine: TypeAlias = Generator[list[_Request], Sequence[Sequence[SampledSequence]], list[_Record]]


def _play(envs: Sequence[MultiAgentEnv], max_turns: int) -> _Engine:
    """Plays ``envs`` turn by turn: yields the turn's sample requests, is sent their sequences (one list per
    request, in order), returns every episode's record."""
    if max_turns < 1:
        raise ValueError(f"max_turns must be at least 1, got {max_turns}")
    records = [_Record(tuple(env.roles)) for env in envs]
    active = list(range(len(envs)))
    for _turn in range(max_turns):
        if not active:
            break
        waiting: dict[tuple[str, tuple[int, ...]], list[int]] = {}
        for index in active:
            role = envs[index].current_role()
            if role not in records[index].roles:
                raise ValueError(f"current_role() returned {role!r}, not one of the roles {records[index].roles}")
            observation = tuple(int(t) for t in envs[index].observation(role))
            if not observation:
                raise ValueError(f"role {role!r} got an empty observation")
            waiting.setdefault((role, observation), []).append(index)
        keys = list(waiting)
        results = yield [_Request(role, observation, len(waiting[role, observation])) for role, observation in keys]
        if len(results) != len(keys):
            raise RuntimeError(f"{len(keys)} sample requests but {len(results)} results")
        still_active: list[int] = []
        for (role, observation), sequences in zip(keys, results, strict=True):
            indices = waiting[role, observation]
            if len(sequences) != len(indices):
                raise RuntimeError(f"asked for {len(indices)} samples, got {len(sequences)}")
            for index, sequence in zip(indices, sequences, strict=True):
                record = records[index]
                record.add(role, observation, sequence)
                outcome = envs[index].step(role, sequence.tokens)
                for rewarded, value in outcome.rewards.items():
                    if rewarded not in record.roles:
                        raise ValueError(f"a reward for {rewarded!r}, not one of the roles {record.roles}")
                    record.reward(rewarded, value)
                if outcome.done:
                    record.done = True
                else:
                    still_active.append(index)
        active = sorted(still_active)
    return records


def _with_logprobs(params: SamplingParams) -> SamplingParams:
    return params if params.logprobs else replace(params, logprobs=True)


def _params_for(params: SamplingParams | Mapping[str, SamplingParams], role: str) -> SamplingParams:
    if isinstance(params, SamplingParams):
        return _with_logprobs(params)
    if role not in params:
        raise ValueError(f"no SamplingParams for role {role!r}")
    return _with_logprobs(params[role])


def _client_for(clients: Mapping[str, SamplingClient], role: str) -> SamplingClient:
    if role not in clients:
        raise ValueError(f"no SamplingClient for role {role!r} (clients for {sorted(clients)})")
    return clients[role]


def _drive(
    engine: _Engine, clients: Mapping[str, SamplingClient], params: SamplingParams | Mapping[str, SamplingParams]
) -> list[_Record]:
    try:
        requests = next(engine)
        while True:
            results = [
                _client_for(clients, r.role).sample(r.observation, _params_for(params, r.role), r.num_samples).sequences
                for r in requests
            ]
            requests = engine.send(results)
    except StopIteration as stop:
        records: list[_Record] = stop.value
        return records


async def _drive_async(
    engine: _Engine, clients: Mapping[str, SamplingClient], params: SamplingParams | Mapping[str, SamplingParams]
) -> list[_Record]:
    async def one(request: _Request) -> Sequence[SampledSequence]:
        client = _client_for(clients, request.role)
        params_ = _params_for(params, request.role)
        return (await client.sample_async(request.observation, params_, request.num_samples)).sequences

    try:
        requests = next(engine)
        while True:
            results = list(await asyncio.gather(*(one(r) for r in requests)))
            requests = engine.send(results)
    except StopIteration as stop:
        records: list[_Record] = stop.value
        return records


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
    return rollout_group([env], sampling_client, params, [trace_id], max_turns=max_turns)[0]


async def rollout_async(
    env: Env,
    sampling_client: SamplingClient,
    params: SamplingParams,
    trace_id: str,
    *,
    max_turns: int = DEFAULT_MAX_TURNS,
) -> SampledTrajectory:
    return (await rollout_group_async([env], sampling_client, params, [trace_id], max_turns=max_turns))[0]


def rollout_group(
    envs: Sequence[Env],
    sampling_client: SamplingClient,
    params: SamplingParams,
    trace_ids: Sequence[str],
    *,
    max_turns: int = DEFAULT_MAX_TURNS,
) -> list[SampledTrajectory]:
    """Plays several episodes turn by turn; the turns that share an observation are sampled as one request."""
    ids = _check_ids(trace_ids, len(envs))
    records = _drive(_play([_SingleAgent(e) for e in envs], max_turns), {POLICY_ROLE: sampling_client}, params)
    return [record.trajectory(POLICY_ROLE, trace_id) for record, trace_id in zip(records, ids, strict=True)]


async def rollout_group_async(
    envs: Sequence[Env],
    sampling_client: SamplingClient,
    params: SamplingParams,
    trace_ids: Sequence[str],
    *,
    max_turns: int = DEFAULT_MAX_TURNS,
) -> list[SampledTrajectory]:
    """rollout_group with each turn's requests sent concurrently."""
    ids = _check_ids(trace_ids, len(envs))
    engine = _play([_SingleAgent(e) for e in envs], max_turns)
    records = await _drive_async(engine, {POLICY_ROLE: sampling_client}, params)
    return [record.trajectory(POLICY_ROLE, trace_id) for record, trace_id in zip(records, ids, strict=True)]


# Multi-agent rollouts


def _role_trajectories(record: _Record, trace_id: str) -> dict[str, SampledTrajectory]:
    return {role: record.trajectory(role, f"{trace_id}/{role}") for role in record.roles}


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
    return rollout_multi_agent_group([env], sampling_clients, params, [trace_id], max_turns=max_turns)[0]


async def rollout_multi_agent_async(
    env: MultiAgentEnv,
    sampling_clients: Mapping[str, SamplingClient],
    params: SamplingParams | Mapping[str, SamplingParams],
    trace_id: str = "episode",
    *,
    max_turns: int = DEFAULT_MAX_TURNS,
) -> dict[str, SampledTrajectory]:
    groups = await rollout_multi_agent_group_async([env], sampling_clients, params, [trace_id], max_turns=max_turns)
    return groups[0]


def rollout_multi_agent_group(
    envs: Sequence[MultiAgentEnv],
    sampling_clients: Mapping[str, SamplingClient],
    params: SamplingParams | Mapping[str, SamplingParams],
    trace_ids: Sequence[str],
    *,
    max_turns: int = DEFAULT_MAX_TURNS,
) -> list[dict[str, SampledTrajectory]]:
    """Several episodes turn by turn (turns sharing a role and an observation are sampled as one request)."""
    ids = _check_ids(trace_ids, len(envs))
    records = _drive(_play(envs, max_turns), sampling_clients, params)
    return [_role_trajectories(record, trace_id) for record, trace_id in zip(records, ids, strict=True)]


async def rollout_multi_agent_group_async(
    envs: Sequence[MultiAgentEnv],
    sampling_clients: Mapping[str, SamplingClient],
    params: SamplingParams | Mapping[str, SamplingParams],
    trace_ids: Sequence[str],
    *,
    max_turns: int = DEFAULT_MAX_TURNS,
) -> list[dict[str, SampledTrajectory]]:
    ids = _check_ids(trace_ids, len(envs))
    records = await _drive_async(_play(envs, max_turns), sampling_clients, params)
    return [_role_trajectories(record, trace_id) for record, trace_id in zip(records, ids, strict=True)]
