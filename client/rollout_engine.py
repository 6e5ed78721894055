"""The rollout engine: plays episodes turn by turn and asks for the samples each turn needs.

`play` is a sans-IO core (`opentinker.client.sansio`): it yields the turn's sample requests, one per
(role, observation) pair that the turn's episodes share (the G copies of a GRPO group go out as one request
with ``num_samples`` = G), and steps every episode with what comes back. `run` sends a turn's requests in
turn, `run_async` concurrently. Logprobs are always requested: the policy-gradient losses need them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from opentinker.client.environments import MultiAgentEnv
from opentinker.client.sampling_client import SamplingClient
from opentinker.client.sampling_types import SampledSequence, SamplingParams
from opentinker.client.sansio import Program, call, gather
from opentinker.client.trajectory import SampledTrajectory, Transition

__all__ = ["EpisodeRecord", "play"]


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
class EpisodeRecord:
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


def play(
    envs: Sequence[MultiAgentEnv],
    max_turns: int,
    clients: Mapping[str, SamplingClient],
    params: SamplingParams | Mapping[str, SamplingParams],
) -> Program[list[EpisodeRecord]]:
    """Plays ``envs`` for at most ``max_turns`` turns, each role sampled from its client with its params (one
    SamplingParams for all roles or one per role); returns every episode's record."""
    if max_turns < 1:
        raise ValueError(f"max_turns must be at least 1, got {max_turns}")
    records = [EpisodeRecord(tuple(env.roles)) for env in envs]
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
        requests = [_Request(role, observation, len(waiting[role, observation])) for role, observation in keys]
        results = yield from gather(_sample(request, clients, params) for request in requests)
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


def _sample(
    request: _Request, clients: Mapping[str, SamplingClient], params: SamplingParams | Mapping[str, SamplingParams]
) -> Program[Sequence[SampledSequence]]:
    client = _client_for(clients, request.role)
    params_ = _params_for(params, request.role)
    result = yield from call(client.sample, client.sample_async, request.observation, params_, request.num_samples)
    return result.sequences


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
