"""The registry's state in Redis: adapters, versions, aliases, artifact accounting and the event stream.

Hashes are the truth; every change and its event are written by one Lua script (registry/scripts.py).
The store's parts turn requests into script calls and Redis records back into protos: adapter_store.py,
alias_store.py, artifact_records.py, event_store.py, replica_store.py, placement_store.py (the trainer pool;
store_base.py holds the keys and the script runner). It knows nothing about gRPC besides raising
`ServiceError`s the interceptor maps to statuses.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from opentinker.registry.adapter_store import AdapterStore
from opentinker.registry.alias_store import AliasStore
from opentinker.registry.artifact_records import ArtifactRecords
from opentinker.registry.event_store import EventStore
from opentinker.registry.placement_store import PlacementStore
from opentinker.registry.store_base import redis_errors


class RegistryStore(AdapterStore, AliasStore, ArtifactRecords, EventStore, PlacementStore):
    @classmethod
    def from_url(cls, url: str, *, events_maxlen: int = 100_000) -> RegistryStore:
        client = aioredis.Redis.from_url(url, decode_responses=False, socket_timeout=10, socket_connect_timeout=5)
        return cls(client, events_maxlen=events_maxlen)

    async def close(self) -> None:
        await self.redis.aclose()

    async def ping(self) -> bool:
        with redis_errors():
            return bool(await self.redis.ping())
