"""Where the gateway keeps what a tinker client holds on to: sessions, sampling sessions, training runs (model ids),
each model's last accepted seq_id, and the ``tinker://`` checkpoint table.

`MemoryState` keeps nothing beyond the process (a restart forgets every session, model id and path). `RedisState`
(``--redis-url``) writes each change before the request that made it answers, and `load` reads everything back at
startup, so that a tinker client goes on after a gateway restart with the same model ids and checkpoint paths.
Requests in flight when the gateway stops are lost (their futures are not kept): the client's next request goes on.

Keys live under ``otgw:`` (the registry's are under ``ot:``): one gateway deployment per Redis.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis

from opentinker.gateway.state_store import PREFIX, unavailable
from opentinker.gateway.tinker.checkpoints import Checkpoint
from opentinker.gateway.tinker.runs import TrainingRun
from opentinker.gateway.tinker.sessions import SamplingSession, Session

log = logging.getLogger(__name__)

SESSIONS, SAMPLERS, RUNS, SEQ, CHECKPOINTS = (
    f"{PREFIX}{n}" for n in ("sessions", "samplers", "runs", "seq", "checkpoints")
)

# HSET only when the new seq_id is higher: the chunks of one forward_backward are recorded concurrently.
_SEQ_MAX = """
local current = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if tonumber(ARGV[2]) > current then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
return 1
"""


@dataclass(slots=True)
class Saved:
    """Everything read back at startup."""

    sessions: list[Session] = field(default_factory=list)
    samplers: list[SamplingSession] = field(default_factory=list)
    runs: list[TrainingRun] = field(default_factory=list)
    seq: dict[str, int] = field(default_factory=dict)  # model_id -> the highest seq_id accepted
    checkpoints: list[Checkpoint] = field(default_factory=list)


class MemoryState:
    """No store: the gateway's tables are all there is."""

    durable = False
    where = "memory only"

    async def put_session(self, session: Session) -> None:
        return None

    async def put_sampler(self, sampler: SamplingSession) -> None:
        return None

    async def forget_sessions(self, session_ids: Iterable[str], sampler_ids: Iterable[str]) -> None:
        return None

    async def put_run(self, run: TrainingRun) -> None:
        return None

    async def put_seq(self, model_id: str, seq_id: int) -> None:
        return None

    async def put_checkpoint(self, checkpoint: Checkpoint) -> None:
        return None

    async def drop_checkpoint(self, key: str) -> None:
        return None

    async def load(self) -> Saved:
        return Saved()

    async def close(self) -> None:
        return None


def redacted(url: str) -> str:
    """The URL without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname or ''}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class RedisState(MemoryState):
    durable = True

    def __init__(self, url: str) -> None:
        self.where = f"Redis at {redacted(url)}"
        self._redis = aioredis.Redis.from_url(url, decode_responses=True, socket_timeout=10, socket_connect_timeout=5)
        self._seq_max = self._redis.register_script(_SEQ_MAX)

    @property
    def client(self) -> aioredis.Redis:
        """The connection, shared with the episode store (episodes.py)."""
        return self._redis

    async def _hset(self, key: str, name: str, record: dict[str, object]) -> None:
        async with unavailable():
            await self._redis.hset(key, name, json.dumps(record, separators=(",", ":")))

    async def put_session(self, session: Session) -> None:
        await self._hset(SESSIONS, session.session_id, session.to_json())

    async def put_sampler(self, sampler: SamplingSession) -> None:
        await self._hset(SAMPLERS, sampler.sampling_session_id, sampler.to_json())

    async def forget_sessions(self, session_ids: Iterable[str], sampler_ids: Iterable[str]) -> None:
        sessions, samplers = list(session_ids), list(sampler_ids)
        async with unavailable():
            if sessions:
                await self._redis.hdel(SESSIONS, *sessions)
            if samplers:
                await self._redis.hdel(SAMPLERS, *samplers)

    async def put_run(self, run: TrainingRun) -> None:
        await self._hset(RUNS, run.model_id, run.to_json())

    async def put_seq(self, model_id: str, seq_id: int) -> None:
        async with unavailable():
            await self._seq_max(keys=[SEQ], args=[model_id, seq_id])

    async def put_checkpoint(self, checkpoint: Checkpoint) -> None:
        await self._hset(CHECKPOINTS, checkpoint.key, checkpoint.to_json())

    async def drop_checkpoint(self, key: str) -> None:
        async with unavailable():
            await self._redis.hdel(CHECKPOINTS, key)

    async def load(self) -> Saved:
        """Everything saved; raises redis errors as they are (the gateway does not start without its state)."""
        saved = Saved()
        for raw in (await self._redis.hgetall(SESSIONS)).values():
            saved.sessions.append(Session.from_json(json.loads(raw)))
        for raw in (await self._redis.hgetall(SAMPLERS)).values():
            saved.samplers.append(SamplingSession.from_json(json.loads(raw)))
        for raw in (await self._redis.hgetall(RUNS)).values():
            saved.runs.append(TrainingRun.from_json(json.loads(raw)))
        saved.seq = {str(model_id): int(seq) for model_id, seq in (await self._redis.hgetall(SEQ)).items()}
        for raw in (await self._redis.hgetall(CHECKPOINTS)).values():
            saved.checkpoints.append(Checkpoint.from_json(json.loads(raw)))
        return saved

    async def close(self) -> None:
        await self._redis.aclose()


StateStore = MemoryState  # the interface; RedisState is the durable one
