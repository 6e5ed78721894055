"""Tests for opentinker.client.trajectory: trajectories -> RL datums, group advantages."""

from __future__ import annotations

import math

import pytest

from opentinker.client.datum import Datum
from opentinker.client.sampling_types import SampledSequence, SampledVersion
from opentinker.client.trajectory import (
    Trajectory,
    Transition,
    datums_for_group,
    group_advantages,
    trajectory_to_datums,
)

LOSS_KEYS = {"target_tokens", "weights", "advantages", "logprobs"}


def _lists(datum: Datum) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {key: value.tolist() for key, value in datum.loss_fn_inputs.items()}
    out["model_input"] = datum.model_input.to_ints()  # type: ignore[assignment]
    return out


def _check_lengths(datums: list[Datum]) -> None:
    for datum in datums:
        n = datum.model_input.length
        assert n > 0
        for key, value in datum.loss_fn_inputs.items():
            assert value.shape == (n,), key


def test_single_turn_alignment() -> None:
    step = Transition(observation=(1, 2, 3), action=(4, 5), action_logprobs=(-0.5, -0.25), reward=1.0)
    datums = trajectory_to_datums(Trajectory((step,), trace_id="t0"), 2.0)
    assert len(datums) == 1
    _check_lengths(datums)
    assert set(datums[0].loss_fn_inputs) == LOSS_KEYS
    assert _lists(datums[0]) == {
        "model_input": [1, 2, 3, 4],
        "target_tokens": [2, 3, 4, 5],
        "weights": [0.0, 0.0, 1.0, 1.0],
        "advantages": [0.0, 0.0, 2.0, 2.0],
        "logprobs": [0.0, 0.0, -0.5, -0.25],
    }
    assert datums[0].loss_fn_inputs["target_tokens"].dtype == "int64"
    assert all(datums[0].loss_fn_inputs[k].dtype == "float32" for k in ("weights", "advantages", "logprobs"))


def test_single_token_observation() -> None:
    step = Transition(observation=(7,), action=(8,), action_logprobs=(-1.0,))
    (datum,) = trajectory_to_datums(Trajectory((step,), "t"), -1.5)
    assert _lists(datum) == {
        "model_input": [7],
        "target_tokens": [8],
        "weights": [1.0],
        "advantages": [-1.5],
        "logprobs": [-1.0],
    }


def test_without_logprobs() -> None:
    step = Transition((1, 2), (3,), (-0.5,))
    (datum,) = trajectory_to_datums(Trajectory((step,), "t"), 1.0, include_logprobs=False)
    assert set(datum.loss_fn_inputs) == LOSS_KEYS - {"logprobs"}


def test_turns_extending_the_context_merge_into_one_datum() -> None:
    first = Transition(observation=(1, 2, 3), action=(4, 5), action_logprobs=(-0.5, -0.25))
    # Turn 2 saw turn 1's context and action, then the environment's new tokens 6, 7.
    second = Transition(observation=(1, 2, 3, 4, 5, 6, 7), action=(8, 9, 10), action_logprobs=(-0.125, -1.0, -2.0))
    datums = trajectory_to_datums(Trajectory((first, second), "t"), 0.5)
    assert len(datums) == 1
    _check_lengths(datums)
    assert _lists(datums[0]) == {
        "model_input": [1, 2, 3, 4, 5, 6, 7, 8, 9],
        "target_tokens": [2, 3, 4, 5, 6, 7, 8, 9, 10],
        "weights": [0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0],
        "advantages": [0.0, 0.0, 0.5, 0.5, 0.0, 0.0, 0.5, 0.5, 0.5],
        "logprobs": [0.0, 0.0, -0.5, -0.25, 0.0, 0.0, -0.125, -1.0, -2.0],
    }


def test_turn_with_no_new_observation_tokens_merges() -> None:
    first = Transition((1, 2), (3,), (-0.5,))
    second = Transition((1, 2, 3), (4,), (-0.25,))  # continues right after the previous action
    (datum,) = trajectory_to_datums(Trajectory((first, second), "t"), 1.0)
    assert _lists(datum)["weights"] == [0.0, 1.0, 1.0]
    assert _lists(datum)["logprobs"] == [0.0, -0.5, -0.25]


def test_turn_not_extending_the_context_starts_a_new_datum() -> None:
    first = Transition((1, 2, 3), (4, 5), (-0.5, -0.25))
    # The history was re-rendered: (1, 2, 6, 7) does not start with (1, 2, 3, 4, 5).
    second = Transition((1, 2, 6, 7), (8,), (-0.125,))
    # A third turn extending the second merges with it.
    third = Transition((1, 2, 6, 7, 8, 9), (10, 11), (-1.0, -2.0))
    datums = trajectory_to_datums(Trajectory((first, second, third), "t"), [1.0, -0.5, 0.25])
    assert len(datums) == 2
    _check_lengths(datums)
    assert _lists(datums[0]) == {
        "model_input": [1, 2, 3, 4],
        "target_tokens": [2, 3, 4, 5],
        "weights": [0.0, 0.0, 1.0, 1.0],
        "advantages": [0.0, 0.0, 1.0, 1.0],
        "logprobs": [0.0, 0.0, -0.5, -0.25],
    }
    assert _lists(datums[1]) == {
        "model_input": [1, 2, 6, 7, 8, 9, 10],
        "target_tokens": [2, 6, 7, 8, 9, 10, 11],
        "weights": [0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0],
        "advantages": [0.0, 0.0, 0.0, -0.5, 0.0, 0.25, 0.25],
        "logprobs": [0.0, 0.0, 0.0, -0.125, 0.0, -1.0, -2.0],
    }


def test_shorter_observation_starts_a_new_datum() -> None:
    first = Transition((1, 2, 3), (4,), (-0.5,))
    second = Transition((1, 2), (5,), (-0.25,))  # a prefix of the context, not an extension
    datums = trajectory_to_datums(Trajectory((first, second), "t"), 1.0)
    assert [d.model_input.to_ints() for d in datums] == [[1, 2, 3], [1, 2]]


def test_per_transition_advantages() -> None:
    first = Transition((1,), (2, 3), (-0.5, -0.5))
    second = Transition((1, 2, 3, 4), (5,), (-0.25,))
    (datum,) = trajectory_to_datums(Trajectory((first, second), "t"), [1.5, -2.0])
    assert _lists(datum)["advantages"] == [1.5, 1.5, 0.0, -2.0]
    assert _lists(datum)["weights"] == [1.0, 1.0, 0.0, 1.0]


def test_lists_are_stored_as_tuples() -> None:
    step = Transition([1, 2], [3], [-1])  # type: ignore[arg-type]
    assert step.observation == (1, 2)
    assert step.action == (3,)
    assert step.action_logprobs == (-1.0,)
    assert isinstance(step.action_logprobs[0], float)
    trajectory = Trajectory([step], "t")  # type: ignore[arg-type]
    assert trajectory.transitions == (step,)
    with pytest.raises(TypeError, match="Transition"):
        Trajectory(((1, 2),), "t")  # type: ignore[arg-type]


def test_total_reward() -> None:
    steps = (
        Transition((1,), (2,), (0.0,), 0.25),
        Transition((1, 2), (3,), (0.0,), 1.5),
        Transition((9,), (3,), (0.0,)),
    )
    assert Trajectory(steps, "t").total_reward == 1.75
    assert Trajectory((), "t").total_reward == 0.0


def test_from_sampled() -> None:
    version = SampledVersion(adapter="a", version=1, reference="a@1", sha256="")
    sequence = SampledSequence(
        tokens=(4, 5), logprobs=(-0.5, -0.25), text="x", stop_reason="stop_token", version=version
    )
    step = Transition.from_sampled([1, 2, 3], sequence, reward=1.0)
    assert step == Transition((1, 2, 3), (4, 5), (-0.5, -0.25), 1.0)
    no_logprobs = SampledSequence(tokens=(4, 5), logprobs=(), text="x", stop_reason="length", version=version)
    with pytest.raises(ValueError, match="logprobs enabled"):
        Transition.from_sampled([1], no_logprobs)


@pytest.mark.parametrize(
    ("transitions", "advantage", "message"),
    [
        ((), 1.0, "no transitions"),
        ((Transition((1,), (), ()),), 1.0, r"transition 0: the action is empty"),
        ((Transition((), (2,), (-1.0,)),), 1.0, r"transition 0: the observation is empty"),
        ((Transition((1,), (2, 3), (-1.0,)),), 1.0, r"transition 0: 1 action_logprobs for 2 action tokens"),
        (
            (Transition((1,), (2,), (-1.0,)), Transition((1, 2), (3, 4), (-1.0, math.nan))),
            1.0,
            r"transition 1: action_logprobs\[1\] is nan",
        ),
        ((Transition((1,), (2,), (-math.inf,)),), 1.0, r"action_logprobs\[0\] is -inf"),
        ((Transition((1,), (2,), (-1.0,), math.inf),), 1.0, "the reward is inf"),
        ((Transition((1,), (2,), (-1.0,)),), math.nan, "advantage of transition 0 is nan"),
        ((Transition((1,), (2,), (-1.0,)),), [1.0, 2.0], "2 advantages for 1 transitions"),
    ],
)
def test_validation(transitions: tuple[Transition, ...], advantage: float | list[float], message: str) -> None:
    with pytest.raises(ValueError, match=message) as excinfo:
        trajectory_to_datums(Trajectory(transitions, "episode-9"), advantage)
    assert "'episode-9'" in str(excinfo.value)


def test_group_advantages() -> None:
    assert group_advantages([1.0, 0.0, 0.0, 1.0]) == [0.5, -0.5, -0.5, 0.5]
    assert group_advantages([3.0]) == [0.0]
    assert group_advantages([]) == []
    assert group_advantages([0.1, 0.1, 0.1]) == [0.0, 0.0, 0.0]  # exact zeros despite rounding
    normalized = group_advantages([1.0, 0.0, 0.0, 1.0], normalize_std=True)
    assert normalized == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)  # std 0.5 (population)
    assert group_advantages([2.0, 4.0], normalize_std=True, eps=0.0) == [-1.0, 1.0]
    assert group_advantages([5.0, 5.0], normalize_std=True) == [0.0, 0.0]
    with pytest.raises(ValueError, match=r"rewards\[1\] is nan"):
        group_advantages([0.0, math.nan])


def _one_turn(reward: float, trace_id: str, action: int = 4) -> Trajectory:
    return Trajectory((Transition((1, 2, 3), (action,), (-0.5,), reward),), trace_id)


def test_datums_for_group() -> None:
    group = [_one_turn(1.0, "a", 4), _one_turn(0.0, "b", 5), _one_turn(0.5, "c", 6)]
    datums, trace_ids = datums_for_group(group)
    assert trace_ids == ["a", "b", "c"]
    _check_lengths(datums)
    # "c" has the mean reward: advantage 0, nothing to learn, dropped.
    assert [_lists(d)["target_tokens"] for d in datums] == [[2, 3, 4], [2, 3, 5]]
    assert [_lists(d)["advantages"] for d in datums] == [[0.0, 0.0, 0.5], [0.0, 0.0, -0.5]]
    normalized, _ = datums_for_group(group, normalize_std=True)
    assert [_lists(d)["advantages"][-1] for d in normalized] == pytest.approx([1.2247, -1.2247], abs=1e-4)


def test_datums_for_group_uses_total_reward_of_multi_turn_trajectories() -> None:
    multi = Trajectory(
        (Transition((1,), (2,), (-0.5,), 0.25), Transition((1, 2, 3), (4,), (-0.5,), 0.75)),
        "multi",
    )
    datums, trace_ids = datums_for_group([multi, _one_turn(0.0, "single")], include_logprobs=False)
    assert trace_ids == ["multi", "single"]
    assert len(datums) == 2
    assert _lists(datums[0])["advantages"] == [0.5, 0.0, 0.5]
    assert "logprobs" not in datums[0].loss_fn_inputs


def test_datums_for_group_drops_a_group_with_equal_rewards() -> None:
    datums, trace_ids = datums_for_group([_one_turn(1.0, "a"), _one_turn(1.0, "b")])
    assert datums == []
    assert trace_ids == ["a", "b"]
    assert datums_for_group([]) == ([], [])
