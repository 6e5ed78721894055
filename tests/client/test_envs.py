"""Envs, tasks and rollouts (opentinker.client.envs / tasks): reward functions by hand, the rollout engine on a
scripted sampler, and single- and multi-agent rollouts against the session trainer, sampler and registry."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import pytest
from registryutil import unique_name
from rolloututil import (
    BASE,
    Conversation,
    ScriptedSampler,
    TwoRoles,
    _BothAct,
    _client,
    _Factory,
    _SlowSampler,
    _trajectory,
)
from serverproc import ServerProcess

from opentinker.client import (
    AdamParams,
    LoraConfig,
    Renderer,
    SampledVersion,
    SamplingClient,
    SamplingParams,
    ServiceClient,
    Trajectory,
    datums_for_group,
    trajectory_to_datums,
)
from opentinker.client.envs import (
    Env,
    EnvGroup,
    MultiAgentEnv,
    MultiStepResult,
    SampledTrajectory,
    StepResult,
    rollout,
    rollout_async,
    rollout_group,
    rollout_group_async,
    rollout_multi_agent,
    rollout_multi_agent_async,
    rollout_multi_agent_group,
    rollout_multi_agent_group_async,
)
from opentinker.client.tasks import (
    TINY_MODEL_SAMPLING,
    DigitsTask,
    EchoGame,
    ShortAnswerTask,
    VowelsTask,
    digits_reward,
    echo_reward,
    short_answer_reward,
    vowels_reward,
)


@pytest.fixture(scope="module")
def service(
    trainer_server: ServerProcess, sampler_server: ServerProcess, registry_server: ServerProcess
) -> Iterator[ServiceClient]:
    with ServiceClient(
        trainer=trainer_server.address, sampler=sampler_server.address, registry=registry_server.address
    ) as client:
        yield client


# Reward functions and tasks (no server)


def test_reward_functions_exact_values() -> None:
    assert digits_reward("a1b2") == 0.5
    assert digits_reward("2024") == 1.0
    assert digits_reward("") == 0.0
    assert digits_reward("x 7") == pytest.approx(1 / 3)
    assert vowels_reward("hello") == 2 / 5
    assert vowels_reward("AEIOU xyz!") == 5 / 8  # letters only: '!' and ' ' are not counted
    assert vowels_reward("1234 ?") == 0.0
    assert short_answer_reward(0, True, 16) == 1.0
    assert short_answer_reward(4, True, 16) == 0.75
    assert short_answer_reward(4, False, 16) == 0.0
    assert short_answer_reward(40, True, 16) == 0.0
    with pytest.raises(ValueError):
        short_answer_reward(1, True, 0)
    assert echo_reward("abcd", "xxab", 4) == 0.5
    assert echo_reward("abcdefgh", "hgfedcba", 8) == 1.0  # order-free
    assert echo_reward("aab", "a", 8) == 1 / 3  # multiplicity counts
    assert echo_reward("abcdefghij", "ij", 8) == 0.0  # only the speaker's first 8 characters count
    assert echo_reward("", "anything") == 0.0


def test_tasks_score_hand_written_responses(renderer: Renderer) -> None:
    digits = DigitsTask(renderer, seed=1)
    assert digits.prompt == DigitsTask.PROMPTS[1]
    observation = digits.initial_observation()
    assert list(observation) == renderer.prompt_tokens([{"role": "user", "content": digits.prompt}])
    assert digits.reward_of("ab12") == 0.5
    assert digits.response == "ab12"
    assert digits.reward_of("ab12", ended=False) == 0.5  # a cut-off response is scored on its text too
    assert DigitsTask(renderer, prompt="Count!").initial_observation() != observation

    # Only the text before the first stop token counts.
    stop = renderer.stop_token_ids[0]
    tokens = renderer.tokenizer.encode("12ab", add_special_tokens=False)
    result = DigitsTask(renderer).step((*tokens, stop, *renderer.tokenizer.encode("zz", add_special_tokens=False)))
    assert result == StepResult(reward=0.5, done=True, next_observation=None)

    assert VowelsTask(renderer).reward_of("banana") == 0.5
    assert VowelsTask(renderer).reward_of("...") == 0.0

    short = ShortAnswerTask(renderer, budget=16)
    n = len(renderer.tokenizer.encode("Yes it is", add_special_tokens=False))
    assert short.reward_of("Yes it is") == 1 - n / 16
    assert short.reward_of("Yes it is", ended=False) == 0.0
    assert short.reward_of("") == 1.0  # stopping at once

    factory = DigitsTask.factory(renderer)
    assert isinstance(factory(3), DigitsTask) and factory(3).seed == 3
    assert isinstance(factory(0), Env)


def test_echo_game_turns_and_rewards(renderer: Renderer) -> None:
    game = EchoGame(renderer, seed=0)
    assert isinstance(game, MultiAgentEnv)
    assert game.roles == ("speaker", "listener")
    assert game.current_role() == "speaker"
    with pytest.raises(ValueError):
        game.observation("listener")  # nothing to listen to yet
    with pytest.raises(ValueError):
        game.step("listener", (1,))
    encode = renderer.tokenizer.encode
    stop = renderer.stop_token_ids[0]
    first = game.step("speaker", (*encode("abcd", add_special_tokens=False), stop))
    assert first == MultiStepResult({}, done=False)
    assert game.current_role() == "listener"
    heard = renderer.prompt_tokens([{"role": "user", "content": "Repeat: abcd"}])
    assert list(game.observation("listener")) == heard
    last = game.step("listener", (*encode("cdxx", add_special_tokens=False), stop))
    assert last.done and dict(last.rewards) == {"speaker": 0.5, "listener": 0.5}
    assert game.rewards == {"speaker": 0.5, "listener": 0.5}


# EnvGroup and the rollout engine on a scripted sampler (no server)


def test_env_group_advantages_and_datums(renderer: Renderer) -> None:
    group = EnvGroup(DigitsTask.factory(renderer), group_size=4)
    envs = group.make(seed=2)
    assert len(envs) == 4 and len({id(e) for e in envs}) == 4
    assert len({e.initial_observation() for e in envs}) == 1  # copies of one task instance
    assert group.trace_ids("s1/g0") == ["s1/g0/0", "s1/g0/1", "s1/g0/2", "s1/g0/3"]

    trajectories = [_trajectory(r, f"t{i}") for i, r in enumerate([1.0, 0.0, 0.5, 0.5])]
    assert group.advantages(trajectories) == [0.5, -0.5, 0.0, 0.0]
    datums, trace_ids = group.datums(trajectories)
    assert trace_ids == ["t0", "t1", "t2", "t3"]  # every trajectory is traced, zero advantage or not
    assert [d.loss_fn_inputs["advantages"].tolist()[-1] for d in datums] == [0.5, -0.5]

    normalized = EnvGroup(DigitsTask.factory(renderer), group_size=4, normalize_std=True)
    std = math.sqrt((0.25 + 0.25) / 4)
    assert normalized.advantages(trajectories) == pytest.approx([0.5 / std, -0.5 / std, 0.0, 0.0], rel=1e-5)
    assert EnvGroup(DigitsTask.factory(renderer), 2).advantages([_trajectory(1, "a"), _trajectory(1, "b")]) == [0, 0]
    with pytest.raises(ValueError):
        EnvGroup(DigitsTask.factory(renderer), 0)


def test_multi_turn_rollout_records_full_contexts() -> None:
    sampler = ScriptedSampler(SampledVersion("team/a", 3, "team/a@3", "abc"))
    trajectory = rollout(Conversation(3), _client(sampler), SamplingParams(logprobs=False), "ep")
    assert isinstance(trajectory, SampledTrajectory) and isinstance(trajectory, Trajectory)
    assert trajectory.trace_id == "ep" and trajectory.done
    assert [t.reward for t in trajectory.transitions] == [1.0, 2.0, 3.0]
    assert trajectory.version_numbers == (3, 3, 3) and trajectory.versions[0].exact == "team/a@3"
    first, second, third = trajectory.transitions
    assert first.observation == (1, 2, 3) and first.action == (100, 203)
    assert second.observation == (1, 2, 3, 100, 203, 7, 8)  # full context: previous + action + new tokens
    assert third.observation == (*second.observation, 100, 207, 7, 8)
    assert first.action_logprobs == (-0.5, -0.25)
    (datum,) = trajectory_to_datums(trajectory, 1.0)  # the turns merge into one datum
    assert datum.model_input.to_ints() == [*third.observation, 100]

    # max_turns cuts the episode off.
    cut = rollout(Conversation(5), _client(ScriptedSampler()), SamplingParams(), "cut", max_turns=2)
    assert len(cut.transitions) == 2 and not cut.done


def test_group_rollout_batches_shared_observations() -> None:
    sampler = ScriptedSampler()
    envs: list[Env] = [Conversation(2) for _ in range(4)]
    trajectories = rollout_group(envs, _client(sampler), SamplingParams(), ["a", "b", "c", "d"])
    # Turn 1: one request for the 4 identical prompts; turn 2: contexts differ (sample i answered 100 + i).
    assert [n for _, n in sampler.requests] == [4, 1, 1, 1, 1]
    assert [t.transitions[0].action[0] for t in trajectories] == [100, 101, 102, 103]
    assert [t.total_reward for t in trajectories] == [3.0] * 4
    with pytest.raises(ValueError):
        rollout_group(envs, _client(sampler), SamplingParams(), ["only-one"])

    again = asyncio.run(rollout_group_async([Conversation(2)], _client(ScriptedSampler()), SamplingParams(), ["x"]))
    assert len(again[0].transitions) == 2


def test_multi_agent_rewards_land_on_each_roles_turns() -> None:
    clients = {"a": _client(ScriptedSampler()), "b": _client(ScriptedSampler())}
    trajectories = rollout_multi_agent(TwoRoles(), clients, SamplingParams(), "game")
    a, b = trajectories["a"], trajectories["b"]
    assert (a.trace_id, b.trace_id) == ("game/a", "game/b")
    assert [t.reward for t in a.transitions] == [1.0, 4.0]
    assert [t.reward for t in b.transitions] == [2.25]
    assert a.transitions[1].observation == (1, 100, 201, 9)  # a's own full context
    with pytest.raises(ValueError, match="no SamplingClient"):
        rollout_multi_agent(TwoRoles(), {"a": clients["a"]}, SamplingParams())


# The sync and async twins come from one core: same trajectories, same requests, same errors.


def test_rollout_twins_play_the_same_episodes() -> None:
    def both(
        play: Callable[[SamplingClient], object], play_async: Callable[[SamplingClient], Coroutine[Any, Any, object]]
    ) -> None:
        plain, twin = ScriptedSampler(), ScriptedSampler()
        assert play(_client(plain)) == asyncio.run(play_async(_client(twin)))
        assert plain.requests == twin.requests and plain.requests

    params = SamplingParams(logprobs=False)
    both(
        lambda c: rollout(Conversation(3), c, params, "ep", max_turns=2),
        lambda c: rollout_async(Conversation(3), c, params, "ep", max_turns=2),
    )
    both(
        lambda c: rollout_group([Conversation(2) for _ in range(3)], c, params, ["a", "b", "c"]),
        lambda c: rollout_group_async([Conversation(2) for _ in range(3)], c, params, ["a", "b", "c"]),
    )
    group = EnvGroup(_Factory(), group_size=3)
    both(
        lambda c: group.rollout(c, params, 0, trace_prefix="g"),
        lambda c: group.rollout_async(c, params, 0, trace_prefix="g"),
    )
    both(
        lambda c: rollout_multi_agent(TwoRoles(), {"a": c, "b": c}, params, "game"),
        lambda c: rollout_multi_agent_async(TwoRoles(), {"a": c, "b": c}, params, "game"),
    )
    both(
        lambda c: rollout_multi_agent_group(
            [TwoRoles(), TwoRoles()], {"a": c, "b": c}, {"a": params, "b": params}, ["x", "y"]
        ),
        lambda c: rollout_multi_agent_group_async(
            [TwoRoles(), TwoRoles()], {"a": c, "b": c}, {"a": params, "b": params}, ["x", "y"]
        ),
    )


def test_rollout_twins_raise_the_same_errors() -> None:
    client = _client(ScriptedSampler())
    cases: list[tuple[Callable[[], object], Callable[[], Coroutine[Any, Any, object]], type[Exception], str]] = [
        (
            lambda: rollout_group([Conversation(1)], client, SamplingParams(), ["a", "b"]),
            lambda: rollout_group_async([Conversation(1)], client, SamplingParams(), ["a", "b"]),
            ValueError,
            "1 envs but 2 trace ids",
        ),
        (
            lambda: rollout(Conversation(1), client, SamplingParams(), "a", max_turns=0),
            lambda: rollout_async(Conversation(1), client, SamplingParams(), "a", max_turns=0),
            ValueError,
            "max_turns must be at least 1",
        ),
        (
            lambda: rollout_multi_agent(TwoRoles(), {"a": client}, SamplingParams()),
            lambda: rollout_multi_agent_async(TwoRoles(), {"a": client}, SamplingParams()),
            ValueError,
            "no SamplingClient for role 'b'",
        ),
        (
            lambda: rollout_multi_agent(TwoRoles(), {"a": client, "b": client}, {"a": SamplingParams()}),
            lambda: rollout_multi_agent_async(TwoRoles(), {"a": client, "b": client}, {"a": SamplingParams()}),
            ValueError,
            "no SamplingParams for role 'b'",
        ),
        (
            lambda: rollout_group([Conversation(1)], client, SamplingParams(), "a"),
            lambda: rollout_group_async([Conversation(1)], client, SamplingParams(), "a"),
            TypeError,
            "not a single string",
        ),
    ]
    for plain, twin, error, message in cases:
        with pytest.raises(error, match=message):
            plain()
        with pytest.raises(error, match=message):
            asyncio.run(twin())


def test_async_rollouts_send_a_turns_requests_concurrently() -> None:
    log: list[str] = []
    clients = {"a": _client(_SlowSampler(log, "a")), "b": _client(_SlowSampler(log, "b"))}
    asyncio.run(rollout_multi_agent_group_async([_BothAct("a"), _BothAct("b")], clients, SamplingParams(), ["1", "2"]))
    assert log == ["start a", "start b", "end a", "end b"]


# Against the session servers


def test_rollout_against_the_sampler(service: ServiceClient, renderer: Renderer) -> None:
    base = service.create_sampling_client("base")
    group = EnvGroup(DigitsTask.factory(renderer), group_size=4)
    trajectories = group.rollout(base, TINY_MODEL_SAMPLING, seed=0, trace_prefix="digits")
    assert [t.trace_id for t in trajectories] == group.trace_ids("digits")
    for trajectory in trajectories:
        (step,) = trajectory.transitions
        assert step.observation == DigitsTask(renderer, 0).initial_observation()
        assert 1 <= len(step.action) <= TINY_MODEL_SAMPLING.max_tokens
        assert len(step.action_logprobs) == len(step.action) and all(lp <= 0 for lp in step.action_logprobs)
        text, _ended = renderer.parse_response(step.action)
        assert step.reward == digits_reward(text)
        assert trajectory.versions == (BASE,)


def test_echo_game_with_an_adapter_per_role(service: ServiceClient, renderer: Renderer) -> None:
    names = {"speaker": unique_name("echo-speaker"), "listener": unique_name("echo-listener")}
    training = {role: service.create_training_client(name, LoraConfig(rank=4), seed=1) for role, name in names.items()}
    versions = {role: client.save_snapshot().number for role, client in training.items()}
    clients = {role: service.create_sampling_client(f"{names[role]}@{versions[role]}") for role in names}

    game = EchoGame(renderer, seed=1)
    episode = rollout_multi_agent(game, clients, TINY_MODEL_SAMPLING, "echo")
    assert set(episode) == {"speaker", "listener"}
    expected = echo_reward(game.speaker_text or "", game.listener_text or "")
    for role, trajectory in episode.items():
        assert len(trajectory.transitions) == 1 and trajectory.done
        assert trajectory.total_reward == pytest.approx(expected)
        (version,) = trajectory.versions
        assert (version.adapter, version.version) == (names[role], versions[role])  # each role's own adapter
    assert episode["listener"].transitions[0].observation == game.observation("listener")

    # A group of episodes trains each role's adapter on that role's trajectories only.
    episodes = rollout_multi_agent_group(
        [EchoGame(renderer, seed=1) for _ in range(4)], clients, TINY_MODEL_SAMPLING, [f"g/{i}" for i in range(4)]
    )
    registry = service.registry_client()
    for role, client in training.items():
        datums, trace_ids = datums_for_group([e[role] for e in episodes])
        assert trace_ids == [f"g/{i}/{role}" for i in range(4)]
        if not datums:  # all four rewards equal: nothing to learn from this group
            continue
        client.forward_backward(datums, "importance_sampling", trace_ids=trace_ids)
        client.optim_step(AdamParams(learning_rate=1e-2))
        saved = client.save_snapshot()
        (lineage, *_) = registry.get_lineage(saved.reference, max_depth=1)
        assert [t for b in lineage.lineage.batches for t in b.trace_ids] == trace_ids
