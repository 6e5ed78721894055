"""RL data: sampled trajectories -> policy-gradient datums (Tinker-style).

    from opentinker.client import Trajectory, Transition, datums_for_group

    prompt = renderer.prompt_tokens(messages)
    group = []
    for i, seq in enumerate(sampler.sample(prompt, params, num_samples=4).sequences):
        step = Transition.from_sampled(prompt, seq, reward=score(seq))  # sampled with logprobs=True
        group.append(Trajectory((step,), trace_id=f"episode-{i}"))
    datums, trace_ids = datums_for_group(group)
    training.forward_backward(datums, "importance_sampling", trace_ids=trace_ids)

Observation convention ("full context"): ``Transition.observation`` is the *whole* context the policy was
conditioned on for that turn: the complete prompt it was sampled from, not only the tokens that are new
since its previous action. In a multi-turn episode turn k's observation is typically turn k-1's observation,
then turn k-1's action, then the environment's reply (a tool result, the next user message, the next
assistant header).

Merging: consecutive turns share one datum while each turn's observation starts with the previous turn's
observation followed by its action. The datum's token sequence is then
``S = ob_1 + ac_1 + (ob_2 minus its ob_1 + ac_1 prefix) + ac_2 + ...``, so every token is fed once and the
model sees exactly the context the sampler saw. A turn whose observation does not extend that prefix (the
history was truncated or re-rendered, a sub-agent started afresh) starts a new datum. A datum holds
``model_input = S[:-1]`` and, per position i (predicting ``S[i + 1]``):

* ``target_tokens``: ``S[i + 1]``;
* ``weights``: 1.0 when ``S[i + 1]`` is an action token, else 0.0 (the same datums feed cross_entropy, which
  then imitates the actions only);
* ``advantages``: the advantage of the turn that sampled ``S[i + 1]`` (0.0 on observation tokens);
* ``logprobs``: the sampler's logprob of ``S[i + 1]`` (0.0 on observation tokens); needed by the
  importance_sampling / ppo / cispo losses.

Advantages: within a group of trajectories sampled for the same prompt, advantage = total reward - the
group's mean reward (:func:`group_advantages`, optionally divided by the group's standard deviation).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from opentinker.client.datum import Datum, ModelInput
from opentinker.client.sampling_types import SampledSequence, SampledVersion, StopReason

__all__ = [
    "SampledTrajectory",
    "Trajectory",
    "Transition",
    "datums_for_group",
    "group_advantages",
    "trajectory_to_datums",
]


@dataclass(frozen=True, slots=True)
class Transition:
    """One turn of an episode: the policy saw ``observation`` and sampled ``action``.

    ``observation``: the full context the policy was sampled from this turn (see the module docstring);
    ``action``: the sampled tokens (its stop token included, as the sampler returns it);
    ``action_logprobs``: the sampler's logprob of each action token; ``reward``: the reward of this turn.
    Lists are accepted and stored as tuples.
    """

    observation: tuple[int, ...]
    action: tuple[int, ...]
    action_logprobs: tuple[float, ...]
    reward: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "observation", tuple(int(t) for t in self.observation))
        object.__setattr__(self, "action", tuple(int(t) for t in self.action))
        object.__setattr__(self, "action_logprobs", tuple(float(v) for v in self.action_logprobs))
        object.__setattr__(self, "reward", float(self.reward))

    @classmethod
    def from_sampled(cls, observation: Iterable[int], sequence: SampledSequence, reward: float = 0.0) -> Transition:
        """The turn that sampled ``sequence`` from ``observation`` (sample with SamplingParams.logprobs on)."""
        if len(sequence.logprobs) != len(sequence.tokens):
            raise ValueError(
                f"the sequence has {len(sequence.tokens)} tokens but {len(sequence.logprobs)} logprobs: "
                "sample with logprobs enabled"
            )
        return cls(tuple(observation), sequence.tokens, sequence.logprobs, reward)


@dataclass(frozen=True, slots=True)
class Trajectory:
    """An episode: its turns in order, and the trace id recorded with the batch that trains on it."""

    transitions: tuple[Transition, ...]
    trace_id: str

    def __post_init__(self) -> None:
        transitions = tuple(self.transitions)
        for i, transition in enumerate(transitions):
            if not isinstance(transition, Transition):
                raise TypeError(f"transitions[{i}] must be a Transition, got {type(transition).__name__}")
        object.__setattr__(self, "transitions", transitions)

    @property
    def total_reward(self) -> float:
        """The sum of the turns' rewards."""
        return math.fsum(t.reward for t in self.transitions)


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


def trajectory_to_datums(
    trajectory: Trajectory, advantage: float | Sequence[float], *, include_logprobs: bool = True
) -> list[Datum]:
    """The trajectory's datums: one per run of turns whose observations extend the previous context.

    ``advantage``: one value for every turn, or one per turn. Each datum has "target_tokens", "weights",
    "advantages" and (``include_logprobs``) "logprobs", laid out as the module docstring describes.
    Raises ValueError for a trajectory without turns, an empty observation or action, action_logprobs of
    the wrong length, or a non-finite logprob, reward or advantage.
    """
    transitions = trajectory.transitions
    where = f"trajectory {trajectory.trace_id!r}"
    if not transitions:
        raise ValueError(f"{where} has no transitions")
    advantages = _per_transition(advantage, len(transitions), where)
    for k, transition in enumerate(transitions):
        _validate(transition, f"{where}, transition {k}")

    datums: list[Datum] = []
    segment = _Segment()
    for transition, adv in zip(transitions, advantages, strict=True):
        new_observation = segment.extension(transition.observation)
        if new_observation is None:
            if segment.tokens:
                datums.append(segment.to_datum(include_logprobs))
            segment = _Segment()
            new_observation = transition.observation
        segment.add(new_observation, transition.action, transition.action_logprobs, adv)
    datums.append(segment.to_datum(include_logprobs))
    return datums


def group_advantages(rewards: Sequence[float], *, normalize_std: bool = False, eps: float = 1e-6) -> list[float]:
    """reward - mean(rewards) for each reward of a group; divided by (std + eps) when ``normalize_std``
    (the population standard deviation). A group whose rewards are all equal gets exact zeros."""
    values = [float(r) for r in rewards]
    for i, value in enumerate(values):
        if not math.isfinite(value):
            raise ValueError(f"rewards[{i}] is {value}, not a finite number")
    if not values or min(values) == max(values):
        return [0.0] * len(values)
    mean = math.fsum(values) / len(values)
    centered = [value - mean for value in values]
    if not normalize_std:
        return centered
    std = math.sqrt(math.fsum(c * c for c in centered) / len(centered))
    return [c / (std + eps) for c in centered]


def datums_for_group(
    trajectories: Sequence[Trajectory], *, normalize_std: bool = False, include_logprobs: bool = True
) -> tuple[list[Datum], list[str]]:
    """The datums of a group of trajectories sampled for the same prompt, and the trace ids of all of them.

    Each trajectory's advantage is its total reward minus the group's mean (see :func:`group_advantages`),
    applied to every one of its turns. Datums whose advantages are all zero are dropped: a policy-gradient
    loss gets no gradient from them, so a group whose rewards are all equal yields no datum. The trace ids
    cover every trajectory, dropped or not, in order.
    """
    group = list(trajectories)
    advantages = group_advantages([t.total_reward for t in group], normalize_std=normalize_std)
    datums: list[Datum] = []
    for trajectory, advantage in zip(group, advantages, strict=True):
        for datum in trajectory_to_datums(trajectory, advantage, include_logprobs=include_logprobs):
            if any(value != 0 for value in datum.loss_fn_inputs["advantages"].data):
                datums.append(datum)
    return datums, [t.trace_id for t in group]


class _Segment:
    """The token sequence of one datum being built, with per-token annotations."""

    __slots__ = ("advantages", "is_action", "logprobs", "tokens")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.is_action: list[bool] = []
        self.advantages: list[float] = []
        self.logprobs: list[float] = []

    def extension(self, observation: tuple[int, ...]) -> tuple[int, ...] | None:
        """The tokens ``observation`` adds to this segment; None if it does not start with the segment."""
        n = len(self.tokens)
        if not n or len(observation) < n or list(observation[:n]) != self.tokens:
            return None
        return observation[n:]

    def add(self, observation: Sequence[int], action: Sequence[int], logprobs: Sequence[float], adv: float) -> None:
        self.tokens += [*observation, *action]
        self.is_action += [False] * len(observation) + [True] * len(action)
        self.advantages += [0.0] * len(observation) + [adv] * len(action)
        self.logprobs += [0.0] * len(observation) + list(logprobs)

    def to_datum(self, include_logprobs: bool) -> Datum:
        inputs: dict[str, list[int] | list[float]] = {
            "target_tokens": self.tokens[1:],
            "weights": [1.0 if action else 0.0 for action in self.is_action[1:]],
            "advantages": self.advantages[1:],
        }
        if include_logprobs:
            inputs["logprobs"] = self.logprobs[1:]
        return Datum(model_input=ModelInput.from_ints(self.tokens[:-1]), loss_fn_inputs=inputs)


def _per_transition(advantage: float | Sequence[float], count: int, where: str) -> list[float]:
    if isinstance(advantage, Sequence):
        values = [float(a) for a in advantage]
        if len(values) != count:
            raise ValueError(f"{where}: {len(values)} advantages for {count} transitions")
    else:
        values = [float(advantage)] * count
    for k, value in enumerate(values):
        if not math.isfinite(value):
            raise ValueError(f"{where}: the advantage of transition {k} is {value}, not a finite number")
    return values


def _validate(transition: Transition, where: str) -> None:
    if not transition.observation:
        raise ValueError(f"{where}: the observation is empty (it must hold the full context the policy saw)")
    if not transition.action:
        raise ValueError(f"{where}: the action is empty")
    if len(transition.action_logprobs) != len(transition.action):
        raise ValueError(
            f"{where}: {len(transition.action_logprobs)} action_logprobs for {len(transition.action)} action tokens"
        )
    for i, value in enumerate(transition.action_logprobs):
        if not math.isfinite(value):
            raise ValueError(f"{where}: action_logprobs[{i}] is {value}, not a finite number")
    if not math.isfinite(transition.reward):
        raise ValueError(f"{where}: the reward is {transition.reward}, not a finite number")
