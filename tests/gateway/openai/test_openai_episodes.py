"""Trajectory capture through /v1 with the unmodified openai SDK (sync and async), against a real gateway on a
private Redis over real trainer, sampler and registry processes: a 3-turn episode captured token for token (the
datums' tokens are the completions' own token ids, 0 mismatches), a runtime that re-renders history starting a
new segment (counted), rewards, another tenant's 404, n > 1 refused, a gateway killed and restarted on the same
Redis keeping the episodes and a tinker session, and train_on_episodes publishing a version whose lineage holds
the episode ids."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import tinker
from gatewayutil import KEY_A, KEY_B, base_url, start_gateway
from serverproc import ServerProcess

from opentinker.client import (
    AdamParams,
    EpisodeClient,
    EpisodeError,
    LoraConfig,
    ServiceClient,
    TrainingClient,
    episode_datums,
    train_on_episodes,
)
from opentinker.registry.embedded_redis import EmbeddedRedis

AGENT = "gw-a/ep-agent"
HEADER = "X-OpenTinker-Episode"
OBSERVATIONS = ([40, 41, 42, 43], [50, 51], [60, 61, 62])  # what the "environment" appends after each completion


def extra(obj: object, name: str) -> object:
    """A vLLM-style extra field the SDK keeps on its pydantic models."""
    return (getattr(obj, "model_extra", None) or {})[name]


@pytest.fixture(scope="module")
def episode_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("episodes-gateway-redis")).start()
    yield server
    server.stop()


class Gateways:
    """The module's gateway, which test_restart replaces by a second one on the same port and Redis."""

    def __init__(self, workdir: Path, servers: tuple[ServerProcess, ServerProcess, ServerProcess], redis: str) -> None:
        self.workdir, self.servers, self.flags = workdir, servers, ("--redis-url", redis)
        self.current = start_gateway(workdir, *servers, *self.flags)

    def restart(self) -> None:
        port = self.current.address.rpartition(":")[2]
        self.current.kill()  # SIGKILL: nothing is flushed on the way out
        self.current = start_gateway(self.workdir, *self.servers, *self.flags, "--port", port)

    @property
    def url(self) -> str:
        return base_url(self.current)


@pytest.fixture(scope="module")
def gateways(
    trainer_server: ServerProcess,
    sampler_server: ServerProcess,
    registry_server: ServerProcess,
    episode_redis: EmbeddedRedis,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Gateways]:
    gw = Gateways(
        tmp_path_factory.mktemp("episodes-gw"), (trainer_server, sampler_server, registry_server), episode_redis.url
    )
    yield gw
    assert gw.current.terminate() == 0, gw.current.log()


@pytest.fixture(scope="module")
def training(
    trainer_server: ServerProcess, sampler_server: ServerProcess, registry_server: ServerProcess
) -> Iterator[TrainingClient]:
    with ServiceClient(trainer_server.address, sampler_server.address, registry_server.address) as service:
        client = service.create_training_client(AGENT, LoraConfig(rank=4), seed=3)
        client.save_snapshot()  # version 1
        yield client


def oai(gateways: Gateways, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateways.url}/v1", api_key=key, max_retries=0, timeout=120)


def play_exact(client: openai.OpenAI, episode_id: str) -> list[tuple[list[int], list[int]]]:
    """3 turns on /v1/completions with token-id prompts, each the previous prompt + completion + an observation:
    what a token-exact runtime sends. Returns each turn's (prompt_token_ids, token_ids) as the answers gave them."""
    context: list[int] = [3, 4, 5, 6]
    turns = []
    for observation in OBSERVATIONS:
        prompt = context + observation
        answer = client.completions.create(
            model=f"{AGENT}@latest",
            prompt=prompt,
            max_tokens=5,
            temperature=0.0,
            extra_headers={HEADER: episode_id},
            extra_body={"return_token_ids": True},
        )
        choice = answer.choices[0]
        tokens = list(extra(choice, "token_ids"))  # type: ignore[call-overload]
        assert list(extra(choice, "prompt_token_ids")) == prompt  # type: ignore[call-overload]
        assert answer.model == f"{AGENT}@1"
        turns.append((prompt, tokens))
        context = prompt + tokens
    return turns


def test_three_turns_are_captured_token_for_token(gateways: Gateways, training: TrainingClient) -> None:
    with oai(gateways) as client:
        turns = play_exact(client, "exact-1")
    episode = EpisodeClient(f"{gateways.url}/v1", KEY_A).get("exact-1")
    assert episode.mismatches == 0 and len(episode.segments) == 1
    assert [(list(t.prompt_token_ids), list(t.token_ids)) for t in episode.turns] == turns
    assert all(t.model == f"{AGENT}@1" and len(t.logprobs) == len(t.token_ids) for t in episode.turns)
    (datum,) = episode_datums([episode], [1.0])
    fed = [*datum.model_input.to_ints(), datum.loss_fn_inputs["target_tokens"].data[-1]]
    expected = turns[-1][0] + turns[-1][1]  # the last prompt holds every earlier prompt and completion
    assert fed == expected
    weights = datum.loss_fn_inputs["weights"].data
    sampled = [tok for i, tok in enumerate(fed[1:]) if weights[i] == 1.0]
    assert sampled == [tok for _, tokens in turns for tok in tokens]  # exactly the completions' token ids


def test_rerendered_history_starts_a_new_segment_async(gateways: Gateways, training: TrainingClient) -> None:
    async def play() -> None:
        async with openai.AsyncOpenAI(base_url=f"{gateways.url}/v1", api_key=KEY_A, max_retries=0) as client:
            messages: list[dict[str, str]] = [{"role": "user", "content": "Guess a number."}]
            first = await client.chat.completions.create(
                model=AGENT,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=4,
                temperature=0.0,
                extra_body={"metadata": {"episode_id": "rerender-1"}},
            )
            # The runtime edits its own earlier answer: the next prompt no longer extends the last one.
            messages += [{"role": "assistant", "content": "EDITED"}, {"role": "user", "content": "Again."}]
            await client.chat.completions.create(
                model=AGENT,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=4,
                temperature=0.0,
                extra_headers={HEADER: "rerender-1"},
            )
            assert first.model == f"{AGENT}@1"

    asyncio.run(play())
    episode = EpisodeClient(gateways.url, KEY_A).get("rerender-1")
    assert len(episode.turns) == 2 and episode.mismatches == 1
    assert [s.turns for s in episode.segments] == [(0,), (1,)]
    assert len(episode_datums([episode], [1.0])) == 2


def test_rewards_tenants_and_refusals(gateways: Gateways, training: TrainingClient) -> None:
    a, b = EpisodeClient(gateways.url, KEY_A), EpisodeClient(gateways.url, KEY_B)
    with oai(gateways) as client:
        play_exact(client, "rewarded")
        with pytest.raises(openai.BadRequestError) as many:
            client.completions.create(
                model=AGENT, prompt=[3, 4, 5], max_tokens=2, n=2, extra_headers={HEADER: "rewarded"}
            )
        assert "n=1" in str(many.value)
    a.reward("rewarded", 0.75)
    episode = a.reward("rewarded", -0.5, turn=1)
    assert episode.episode_reward == 0.75 and episode.turn_rewards == {1: -0.5} and episode.total_reward == 0.25
    assert len(episode.turns) == 3  # the refused n=2 request recorded nothing
    assert "rewarded" in a.list(limit=50)
    with pytest.raises(EpisodeError) as bad_turn:
        a.reward("rewarded", 1.0, turn=3)
    assert bad_turn.value.status == 400
    # Another tenant: 404 exactly like a missing episode, on every route; its list does not show it.
    for call in (lambda: b.get("rewarded"), lambda: b.reward("rewarded", 1.0), lambda: b.delete("rewarded")):
        with pytest.raises(EpisodeError) as hidden:
            call()
        assert hidden.value.status == 404 and hidden.value.message == "episode 'rewarded' not found"
    assert "rewarded" not in b.list(limit=50)
    with pytest.raises(EpisodeError) as wrong_key:
        EpisodeClient(gateways.url, "tml-not-a-key").get("rewarded")
    assert wrong_key.value.status == 401
    a.delete("rewarded")
    with pytest.raises(EpisodeError) as gone:
        a.get("rewarded")
    assert gone.value.status == 404


def test_restart_keeps_episodes_and_tinker_sessions(
    gateways: Gateways, training: TrainingClient, tiny_model: Path
) -> None:
    service = tinker.ServiceClient(base_url=gateways.url, api_key=KEY_A)
    rest = tinker.RestClient(base_url=gateways.url, api_key=KEY_A)
    tinker_run = service.create_lora_training_client(base_model=tiny_model.name, rank=4, seed=7).result()
    with oai(gateways) as client:
        before = play_exact(client, "survives")
    gateways.restart()
    assert "restored" in gateways.current.log()
    episode = EpisodeClient(gateways.url, KEY_A).get("survives")
    assert [(list(t.prompt_token_ids), list(t.token_ids)) for t in episode.turns] == before
    assert rest.get_training_run(tinker_run.model_id).result().training_run_id == tinker_run.model_id
    # The episode goes on after the restart: a 4th turn extends the same segment.
    prompt, tokens = before[-1]
    with oai(gateways) as client:
        client.completions.create(
            model=AGENT,
            prompt=prompt + tokens + [70],
            max_tokens=3,
            temperature=0.0,
            extra_headers={HEADER: "survives"},
        )
    episode = EpisodeClient(gateways.url, KEY_A).get("survives")
    assert len(episode.turns) == 4 and episode.mismatches == 0
    service.close("success").result()


def test_train_on_episodes_publishes_a_version_with_the_episode_ids(
    gateways: Gateways, training: TrainingClient
) -> None:
    episodes = EpisodeClient(gateways.url, KEY_A)
    ids = ["train-0", "train-1"]
    with oai(gateways) as client:
        for i in ids:
            play_exact(client, i)
    episodes.reward("train-0", 1.0)
    episodes.reward("train-1", 0.0)
    result = train_on_episodes(training, [episodes.get(i) for i in ids], adam=AdamParams(learning_rate=1e-2))
    assert result.version is not None and result.version.number == 2 and result.num_datums == 2
    assert result.mean_reward == 0.5
    traced = [t for batch in result.version.lineage.batches for t in batch.trace_ids]
    assert traced == ids
    with oai(gateways) as client:  # name@latest now samples the new version (the sampler hot-reloads it)
        answer = client.completions.create(model=f"{AGENT}@latest", prompt=[3, 4, 5], max_tokens=2)
    assert answer.model == f"{AGENT}@2"
