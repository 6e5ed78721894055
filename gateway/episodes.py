"""Trajectory capture: the episode store of the /v1 surface (token in, token out).

A chat or text completion that names an episode (header ``X-OpenTinker-Episode`` or body ``metadata.episode_id``)
appends one `Turn` to it: the exact prompt token ids the sampler saw, the completion token ids with their logprobs,
the exact version that sampled them, the finish reason and times. Nothing is ever re-tokenized.

Segments are computed from the turns in order (`segments`): a turn whose prompt starts with the previous turn's
prompt + completion extends the current segment (its new prompt tokens are the environment's reply), any other turn
starts a new one and counts as a mismatch (the runtime re-rendered or truncated the history). One segment is one
training datum: its tokens, a mask (1 on completion tokens), the sampler's logprobs (0 on prompt tokens).

Stores: `MemoryEpisodes` (no ``--redis-url``: lost on a gateway restart) and `RedisEpisodes` (the gateway's own
Redis connection, tinker/durable.py): per episode a list of turns (one RPUSH per turn inside a Lua script that
checks the bounds first, so concurrent turns of one episode all land and a refused turn writes nothing), a hash of
its token count and rewards, and per tenant a sorted set of episode ids by last write. Every write refreshes the
retention TTL.

A request with an episode id must ask for one choice (n == 1): which of n choices continues the episode is the
runtime's decision, which the gateway cannot see, so it refuses n > 1 rather than guess (400).
"""

from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import asdict, dataclass, field

import redis.asyncio as aioredis

from opentinker.gateway.errors import GatewayError, bad_request, not_found
from opentinker.gateway.state_store import PREFIX, unavailable

EPISODE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")  # as openai/records.episode_id checks a request's
DEFAULT_TTL_SECONDS = 7 * 86400.0
DEFAULT_MAX_TURNS = 256
DEFAULT_MAX_TOKENS = 1 << 20  # prompt + completion tokens stored per episode (prompts repeat each turn)
DEFAULT_MAX_EPISODES = 10_000


@dataclass(frozen=True, slots=True)
class EpisodeLimits:
    ttl_seconds: float = DEFAULT_TTL_SECONDS  # kept this long after its last write
    max_turns: int = DEFAULT_MAX_TURNS
    max_tokens: int = DEFAULT_MAX_TOKENS
    max_episodes: int = DEFAULT_MAX_EPISODES  # live episodes per tenant


@dataclass(frozen=True, slots=True)
class Turn:
    """One finished completion of an episode, exactly as the sampler produced it."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # one per token id: the sampler's logprob of it
    model: str  # the exact version, "tenant/name@12" (or the base model's id)
    finish_reason: str
    request_id: str
    started_at: float  # unix seconds
    finished_at: float
    # The grammar the completion was drawn under ({"kind", "source", "origin"}), its logprobs being of the masked
    # distribution; None: sampled free (and turns stored before constraints were recorded).
    constraint: dict[str, str] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.token_ids)

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, object]) -> Turn:
        return cls(**raw)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Segment:
    """Turns whose prompts extend one another: ``token_ids`` is the first prompt, then each completion and the
    tokens the next prompt adds; ``mask`` 1 on completion tokens; ``logprobs`` the sampler's (0.0 on prompt tokens)."""

    turns: list[int]
    token_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def segments(turns: list[Turn]) -> list[Segment]:
    """The turns cut where a prompt does not start with the previous turn's prompt + completion."""
    out: list[Segment] = []
    context: list[int] = []  # the previous turn's prompt + completion
    for i, turn in enumerate(turns):
        prompt = turn.prompt_token_ids
        if out and len(prompt) >= len(context) and prompt[: len(context)] == context:
            segment, added = out[-1], prompt[len(context) :]
        else:
            segment, added = Segment([]), prompt
            out.append(segment)
        segment.turns.append(i)
        segment.token_ids.extend(added + turn.token_ids)
        segment.mask.extend([0] * len(added) + [1] * len(turn.token_ids))
        segment.logprobs.extend([0.0] * len(added) + turn.logprobs)
        context = prompt + turn.token_ids
    return out


@dataclass(slots=True)
class Episode:
    id: str
    turns: list[Turn]
    rewards: dict[str, float]  # "episode" and/or "turn:{i}"
    updated_at: float

    def to_json(self) -> dict[str, object]:
        cut = segments(self.turns)
        per_turn = {int(k[5:]): v for k, v in self.rewards.items() if k.startswith("turn:")}
        return {
            "id": self.id,
            "object": "episode",
            "turns": [turn.to_json() for turn in self.turns],
            "segments": [segment.to_json() for segment in cut],
            "rewards": {
                "episode": self.rewards.get("episode"),
                "turns": {str(i): r for i, r in sorted(per_turn.items())},
            },
            "mismatches": max(0, len(cut) - 1),
            "updated_at": self.updated_at,
        }


# Input checks (shared by both stores and the routes)


def check_episode_id(value: object, where: str = "episode id") -> str:
    if not isinstance(value, str) or EPISODE_ID.fullmatch(value) is None:
        raise bad_request(
            f"{where} must be 1-128 characters of letters, digits, '.', '_', ':' or '-'",
            "INVALID_EPISODE_ID",
        )
    return value


def check_single_choice(n: int) -> None:
    if n != 1:
        raise bad_request(
            f"a request that records an episode must ask for one choice (n=1), got n={n}: send each choice "
            "you continue as its own request",
            "EPISODE_NEEDS_ONE_CHOICE",
        )


_FLOAT_MAX = sys.float_info.max


def parse_reward(body: dict[str, object], num_turns: int) -> tuple[str, float]:
    """``{"reward": x}`` -> ("episode", x); ``{"turn": i, "reward": x}`` -> ("turn:i", x)."""
    reward = body.get("reward")
    # compared, not math.isfinite: that raises OverflowError for an int beyond float64 (10**400); NaN compares False
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not -_FLOAT_MAX <= reward <= _FLOAT_MAX:
        raise bad_request("reward must be a finite number", "INVALID_REWARD")
    unknown = set(body) - {"reward", "turn"}
    if unknown:
        raise bad_request(f"unknown fields {sorted(unknown)}: send {{'reward': x}} or {{'turn': i, 'reward': x}}")
    turn = body.get("turn")
    if turn is None:
        return "episode", float(reward)
    if isinstance(turn, bool) or not isinstance(turn, int) or not 0 <= turn < num_turns:
        raise bad_request(f"turn must be an integer in [0, {num_turns}) (the episode has {num_turns} turns)")
    return f"turn:{turn}", float(reward)


def _missing(episode_id: str) -> GatewayError:
    return not_found(f"episode {episode_id!r} not found", "EPISODE_NOT_FOUND")


def _too_many_turns(limits: EpisodeLimits) -> GatewayError:
    return GatewayError(
        429, "EPISODE_TOO_LONG", f"the episode already has {limits.max_turns} turns (--episode-max-turns)"
    )


def _too_many_tokens(limits: EpisodeLimits, held: int, adding: int) -> GatewayError:
    return GatewayError(
        429,
        "EPISODE_TOO_LONG",
        f"the episode holds {held} tokens; this turn's {adding} would pass --episode-max-tokens={limits.max_tokens}",
    )


def _too_many_episodes(limits: EpisodeLimits) -> GatewayError:
    return GatewayError(
        429,
        "TOO_MANY_EPISODES",
        f"the tenant holds {limits.max_episodes} episodes (--episode-max-per-tenant): delete some "
        "(DELETE /v1/episodes/{id}) or wait for them to expire",
    )


class MemoryEpisodes:
    """In the gateway's memory: lost on restart. Each method runs without awaiting, so it is atomic on the loop."""

    durable = False

    def __init__(self, limits: EpisodeLimits | None = None) -> None:
        self.limits = limits or EpisodeLimits()
        self._episodes: dict[tuple[str, str], Episode] = {}

    def _live(self, tenant: str, episode_id: str, now: float) -> Episode | None:
        episode = self._episodes.get((tenant, episode_id))
        if episode is not None and now - episode.updated_at > self.limits.ttl_seconds:
            del self._episodes[(tenant, episode_id)]
            return None
        return episode

    async def append(self, tenant: str, episode_id: str, turn: Turn) -> int:
        """Appends the turn; returns its index. 429 beyond a bound, with nothing written."""
        now, limits = time.time(), self.limits
        episode = self._live(tenant, episode_id, now)
        if episode is None:
            held = [k for k in self._episodes if k[0] == tenant and self._live(*k, now) is not None]
            if len(held) >= limits.max_episodes:
                raise _too_many_episodes(limits)
            episode = Episode(episode_id, [], {}, now)
        if len(episode.turns) >= limits.max_turns:
            raise _too_many_turns(limits)
        held_tokens = sum(t.num_tokens for t in episode.turns)
        if held_tokens + turn.num_tokens > limits.max_tokens:
            raise _too_many_tokens(limits, held_tokens, turn.num_tokens)
        episode.turns.append(turn)
        episode.updated_at = now
        self._episodes[(tenant, episode_id)] = episode
        return len(episode.turns) - 1

    async def get(self, tenant: str, episode_id: str) -> Episode:
        episode = self._live(tenant, episode_id, time.time())
        if episode is None:
            raise _missing(episode_id)
        return Episode(episode.id, list(episode.turns), dict(episode.rewards), episode.updated_at)

    async def reward(self, tenant: str, episode_id: str, body: dict[str, object]) -> Episode:
        now = time.time()
        episode = self._live(tenant, episode_id, now)
        if episode is None:
            raise _missing(episode_id)
        key, value = parse_reward(body, len(episode.turns))
        episode.rewards[key] = value
        episode.updated_at = now
        return await self.get(tenant, episode_id)

    async def recent(self, tenant: str, limit: int) -> list[tuple[str, float]]:
        now = time.time()
        live = [e for (t, i), e in list(self._episodes.items()) if t == tenant and self._live(t, i, now) is not None]
        live.sort(key=lambda e: e.updated_at, reverse=True)
        return [(e.id, e.updated_at) for e in live[:limit]]

    async def delete(self, tenant: str, episode_id: str) -> None:
        if self._live(tenant, episode_id, time.time()) is None:
            raise _missing(episode_id)
        del self._episodes[(tenant, episode_id)]


# KEYS: turns list, meta hash, tenant index; ARGV: turn JSON, its tokens, max turns, max tokens, max episodes,
# episode id, now, ttl seconds. Returns {index, 0} or {-1 too many turns | -2 too many tokens | -3 too many
# episodes, what is held}.
_APPEND = """
local n = redis.call('LLEN', KEYS[1])
local now, ttl = tonumber(ARGV[7]), tonumber(ARGV[8])
if n == 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - ttl)
  if not redis.call('ZSCORE', KEYS[3], ARGV[6]) and redis.call('ZCARD', KEYS[3]) >= tonumber(ARGV[5]) then
    return {-3, 0}
  end
end
if n >= tonumber(ARGV[3]) then return {-1, n} end
local held = tonumber(redis.call('HGET', KEYS[2], 'tokens') or '0')
if held + tonumber(ARGV[2]) > tonumber(ARGV[4]) then return {-2, held} end
redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('HINCRBY', KEYS[2], 'tokens', ARGV[2])
redis.call('HSET', KEYS[2], 'updated_at', ARGV[7])
redis.call('ZADD', KEYS[3], now, ARGV[6])
local ms = math.floor(ttl * 1000)
redis.call('PEXPIRE', KEYS[1], ms)
redis.call('PEXPIRE', KEYS[2], ms)
redis.call('PEXPIRE', KEYS[3], ms)
return {n, 0}
"""

# KEYS: turns, meta, index; ARGV: field, value, episode id, now, ttl seconds. 0 when the episode does not exist.
_REWARD = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2], 'updated_at', ARGV[4])
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[3])
local ms = math.floor(tonumber(ARGV[5]) * 1000)
redis.call('PEXPIRE', KEYS[1], ms)
redis.call('PEXPIRE', KEYS[2], ms)
redis.call('PEXPIRE', KEYS[3], ms)
return 1
"""


class RedisEpisodes(MemoryEpisodes):
    """Durable: keys ``otgw:episode:{tenant}:{id}:turns|meta`` and the index ``otgw:episodes:{tenant}``."""

    durable = True

    def __init__(self, client: aioredis.Redis, limits: EpisodeLimits | None = None) -> None:
        super().__init__(limits)
        self._redis = client
        self._append = client.register_script(_APPEND)
        self._reward = client.register_script(_REWARD)

    @staticmethod
    def _keys(tenant: str, episode_id: str) -> list[str]:
        base = f"{PREFIX}episode:{tenant}:{episode_id}"
        return [f"{base}:turns", f"{base}:meta", f"{PREFIX}episodes:{tenant}"]

    async def append(self, tenant: str, episode_id: str, turn: Turn) -> int:
        limits = self.limits
        record = json.dumps(turn.to_json(), separators=(",", ":"))
        args: list[str | int] = [record, turn.num_tokens, limits.max_turns, limits.max_tokens, limits.max_episodes]
        args += [episode_id, repr(time.time()), repr(limits.ttl_seconds)]
        async with unavailable():
            index, held = await self._append(keys=self._keys(tenant, episode_id), args=args)
        if index == -1:
            raise _too_many_turns(limits)
        if index == -2:
            raise _too_many_tokens(limits, int(held), turn.num_tokens)
        if index == -3:
            raise _too_many_episodes(limits)
        return int(index)

    async def get(self, tenant: str, episode_id: str) -> Episode:
        turns_key, meta_key, _ = self._keys(tenant, episode_id)
        async with unavailable(), self._redis.pipeline(transaction=True) as pipe:
            pipe.lrange(turns_key, 0, -1)
            pipe.hgetall(meta_key)
            raw_turns, meta = await pipe.execute()
        if not raw_turns:
            raise _missing(episode_id)
        turns = [Turn.from_json(json.loads(raw)) for raw in raw_turns]
        rewards = {k: float(v) for k, v in meta.items() if k == "episode" or k.startswith("turn:")}
        return Episode(episode_id, turns, rewards, float(meta.get("updated_at", 0.0)))

    async def reward(self, tenant: str, episode_id: str, body: dict[str, object]) -> Episode:
        episode = await self.get(tenant, episode_id)
        key, value = parse_reward(body, len(episode.turns))
        async with unavailable():
            done = await self._reward(
                keys=self._keys(tenant, episode_id),
                args=[key, repr(value), episode_id, repr(time.time()), repr(self.limits.ttl_seconds)],
            )
        if not done:
            raise _missing(episode_id)
        return await self.get(tenant, episode_id)

    async def recent(self, tenant: str, limit: int) -> list[tuple[str, float]]:
        index = self._keys(tenant, "")[2]
        oldest = time.time() - self.limits.ttl_seconds
        async with unavailable():
            found: list[tuple[str, float]] = await self._redis.zrevrangebyscore(  # type: ignore[assignment]
                index, "+inf", oldest, start=0, num=limit, withscores=True
            )
        return [(str(episode_id), float(score)) for episode_id, score in found]

    async def delete(self, tenant: str, episode_id: str) -> None:
        turns_key, meta_key, index = self._keys(tenant, episode_id)
        async with unavailable(), self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(turns_key)
            pipe.delete(meta_key)
            pipe.zrem(index, episode_id)
            deleted, _, _ = await pipe.execute()
        if not deleted:
            raise _missing(episode_id)


EpisodeStore = MemoryEpisodes  # the interface; RedisEpisodes is the durable one
