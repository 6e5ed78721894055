"""The registry store's fleet: each live replica is one Redis key holding its Replica record, expiring with its
lease, plus one sorted set of ids scored by lease end (so a listing reads only live ones and sweeps the rest).

A lease is Redis's own expiry: a replica that stops beating is gone lease_seconds later with no sweeper, and a
registry restarted on an emptied Redis answers the next beat NOT_FOUND, which makes the replica register again
(within one beat). Several registry processes on one Redis see one fleet.
"""

from __future__ import annotations

from opentinker.registry.store_base import StoreBase, now_ms, redis_errors, text, timestamp
from opentinker.rpc.serving.errors import NotFound
from opentinker.v1 import registry_pb2

REPLICAS_KEY = "ot:replicas"  # zset: replica id -> lease end (ms)


def replica_key(replica_id: str) -> str:
    return f"ot:replica:{replica_id}"


def _parse(value: bytes | str) -> registry_pb2.Replica:
    # The client is made with decode_responses=False: values are bytes (redis-py's types allow str too).
    return registry_pb2.Replica.FromString(value if isinstance(value, bytes) else value.encode())


class ReplicaStore(StoreBase):
    async def register_replica(self, replica: registry_pb2.Replica) -> registry_pb2.Replica:
        """Stores ``replica`` (validated by the handler) with its lease; an id registered again is replaced."""
        now = now_ms()
        record = registry_pb2.Replica()
        record.CopyFrom(replica)
        record.register_time.CopyFrom(timestamp(now))
        record.heartbeat_time.CopyFrom(timestamp(now))
        await self._put_replica(record, now)
        return record

    async def heartbeat(
        self,
        replica_id: str,
        state: registry_pb2.ReplicaState,
        load: registry_pb2.ReplicaLoad,
        resident: list[str],
    ) -> registry_pb2.Replica:
        """Renews the lease with the beat's figures; NotFound(REPLICA_NOT_FOUND) once the lease is gone. Only the
        replica itself beats for its id, so reading and then writing its record races with nothing."""
        with redis_errors():
            data = await self.redis.get(replica_key(replica_id))
        if data is None:
            raise NotFound(
                f"replica {replica_id!r} is not registered (its lease expired, or the registry lost it): "
                "register again",
                reason="REPLICA_NOT_FOUND",
            )
        record = _parse(data)
        now = now_ms()
        record.state = state
        record.load.CopyFrom(load)
        del record.resident[:]
        record.resident.extend(sorted(resident))
        record.heartbeat_time.CopyFrom(timestamp(now))
        await self._put_replica(record, now)
        return record

    async def list_replicas(self) -> list[registry_pb2.Replica]:
        """Every replica whose lease has not ended, by id; ids of expired ones are swept from the index."""
        now = now_ms()
        with redis_errors():
            await self.redis.zremrangebyscore(REPLICAS_KEY, "-inf", now)
            ids = [text(i) for i in await self.redis.zrange(REPLICAS_KEY, 0, -1)]
            values = await self.redis.mget([replica_key(i) for i in ids]) if ids else []
        replicas = [_parse(v) for v in values if v is not None]
        return sorted(replicas, key=lambda r: r.replica_id)

    async def _put_replica(self, record: registry_pb2.Replica, now: int) -> None:
        lease_ms = max(1, round(record.lease_seconds * 1000))
        with redis_errors():
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.set(replica_key(record.replica_id), record.SerializeToString(), px=lease_ms)
                pipe.zadd(REPLICAS_KEY, {record.replica_id: now + lease_ms})
                await pipe.execute()
