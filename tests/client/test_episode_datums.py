"""Captured episodes -> datums without servers: the gateway's JSON (episodes.py's own records) parsed into typed
records, one datum per segment holding exactly the segment's tokens, weights 1 on completion tokens, the sampler's
logprobs, group-centred advantages; a re-rendered history gives two datums."""

from __future__ import annotations

import pytest

from opentinker.client import Episode, EpisodeClient, episode_datums
from opentinker.gateway.episodes import Episode as Recorded
from opentinker.gateway.episodes import Turn


def turn(prompt: list[int], completion: list[int], i: int) -> Turn:
    return Turn(prompt, completion, [-0.25 * (k + 1) for k in range(len(completion))], "t/a@2", "stop", f"r{i}", 0, 1)


def recorded(episode_id: str, *turns: Turn, reward: float | None = None) -> Episode:
    rewards = {} if reward is None else {"episode": reward}
    return Episode.from_json(Recorded(episode_id, list(turns), rewards, 0.0).to_json())


def game(episode_id: str, reward: float, edit: bool = False) -> Episode:
    first = turn([5, 6, 7], [20, 21], 0)
    second = turn([5, 6, 7, 20, 21, 8], [22], 1)
    third = turn([5, 6, 7, 20, 99 if edit else 21, 8, 22, 9], [23, 24], 2)
    return recorded(episode_id, first, second, third, reward=reward)


def test_one_datum_per_segment_with_the_exact_tokens() -> None:
    episode = game("g0", 1.0)
    assert episode.mismatches == 0 and episode.total_reward == 1.0 and len(episode.turns) == 3
    (segment,) = episode.segments
    (datum,) = episode_datums([episode], [0.5])
    tokens = [*datum.model_input.to_ints(), datum.loss_fn_inputs["target_tokens"].data[-1]]
    assert tokens == list(segment.token_ids) == [5, 6, 7, 20, 21, 8, 22, 9, 23, 24]
    inputs = {k: list(v.data) for k, v in datum.loss_fn_inputs.items()}
    assert inputs["target_tokens"] == tokens[1:]
    assert inputs["weights"] == [float(m) for m in segment.mask[1:]] == [0, 0, 1, 1, 0, 1, 0, 1, 1]
    assert inputs["logprobs"] == list(segment.logprobs[1:]) == [0, 0, -0.25, -0.5, 0, -0.25, 0, -0.25, -0.5]
    assert inputs["advantages"] == [0.5 * m for m in segment.mask[1:]]


def test_group_advantages_and_a_rerendered_history() -> None:
    episodes = [game("a", 1.0), game("b", 0.0, edit=True)]
    assert episodes[1].mismatches == 1 and [s.turns for s in episodes[1].segments] == [(0, 1), (2,)]
    datums = episode_datums(episodes)  # one group: advantages +0.5 and -0.5
    assert len(datums) == 3
    for datum, segment in zip(datums, [episodes[0].segments[0], *episodes[1].segments], strict=True):
        assert [*datum.model_input.to_ints(), datum.loss_fn_inputs["target_tokens"].data[-1]] == list(segment.token_ids)
    assert max(datums[0].loss_fn_inputs["advantages"].data) == 0.5
    assert min(datums[2].loss_fn_inputs["advantages"].data) == -0.5
    with pytest.raises(ValueError):
        episode_datums(episodes, [1.0])


def test_client_accepts_the_openai_base_url() -> None:
    assert EpisodeClient("http://127.0.0.1:7073/v1/", "k").base_url == "http://127.0.0.1:7073"
    assert EpisodeClient("http://127.0.0.1:7073", "k").base_url == "http://127.0.0.1:7073"
