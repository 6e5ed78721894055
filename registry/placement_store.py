"""The registry store's trainer pool: which trainer owns each adapter, under which fencing epoch, and where its
newest full state is (placement_scripts.py has the layout and the scripts).

Placing reads the fleet (replica_store.py), picks the serving trainer of the adapter's base with the least rank
placed on it and room left (fewer placements than its max_slots, when it has a limit), and hands the adapter over
in one compare-and-set script; a script that finds the world changed since the read ("RACE") makes it read again.
An adapter stays with its owner while the owner's lease lives (sticky): a dead trainer's adapters move on the
first PlaceAdapter after its lease ran out, never before, so a trainer that still beats is never fenced by it.
"""

from __future__ import annotations

from typing import Final

from opentinker.registry.replica_store import ReplicaStore, replica_key
from opentinker.registry.store_base import now_ms, placement_key, placements_key, redis_errors, text, timestamp
from opentinker.rpc.serving.errors import FailedPrecondition, NotFound
from opentinker.v1 import registry_pb2

DEFAULT_RANK: Final = 32  # LoraConfig()'s
MAX_TRIES: Final = 8  # compare-and-set rounds before giving up (each lost to a concurrent change of the fleet)


def _placement(adapter: str, fields: dict[str, str]) -> registry_pb2.Placement:
    """A placement hash (placement_scripts.py) as its proto."""
    placement = registry_pb2.Placement(
        adapter=adapter,
        replica_id=fields.get("replica_id", ""),
        address=fields.get("address", ""),
        epoch=int(fields.get("epoch", "0")),
        state_id=fields.get("state_id", ""),
        state_step=int(fields.get("state_step", "0") or 0),
        rank=int(fields.get("rank", "0") or 0),
        base_fingerprint=fields.get("base", ""),
    )
    placement.place_time.CopyFrom(timestamp(int(fields.get("place_ms", "0") or 0)))
    return placement


def _from_script(adapter: str, flat: object) -> registry_pb2.Placement:
    """A script's HGETALL reply (a flat list of fields and values) as the placement."""
    assert isinstance(flat, list)
    return _placement(adapter, {text(flat[i]): text(flat[i + 1]) for i in range(0, len(flat), 2)})


def _no_trainer(adapter: str, base: str) -> FailedPrecondition:
    of_base = f" of base {base[:80]}" if base else ""
    return FailedPrecondition(
        f"no serving trainer{of_base} has room for adapter {adapter!r}: start one with --registry, or raise "
        "--max-resident-adapters",
        reason="NO_TRAINER",
    )


class PlacementStore(ReplicaStore):
    async def get_placement(self, adapter: str) -> registry_pb2.Placement | None:
        with redis_errors():
            found = await self.redis.hgetall(placement_key(adapter))
        return _placement(adapter, {text(k): text(v) for k, v in found.items()}) if found else None

    async def placements_of(self, replica_id: str) -> list[registry_pb2.Placement]:
        """What is placed on one trainer (its beat's answer), by adapter; index entries of adapters that moved
        on since are left out."""
        with redis_errors():
            adapters = sorted(text(a) for a in await self.redis.hkeys(placements_key(replica_id)))
            async with self.redis.pipeline(transaction=False) as pipe:  # one round trip per beat, not one each
                for adapter in adapters:
                    pipe.hgetall(placement_key(adapter))
                hashes = await pipe.execute() if adapters else []
        pairs = zip(adapters, hashes, strict=True)
        found = [_placement(a, {text(k): text(v) for k, v in h.items()}) for a, h in pairs if h]
        return [p for p in found if p.replica_id == replica_id]

    async def place_adapter(self, adapter: str, rank: int, base: str) -> tuple[registry_pb2.Placement, bool]:
        """(placement, placed): the live owner's (placed False), else a new one on the least loaded trainer."""
        for _ in range(MAX_TRIES):
            current = await self.get_placement(adapter)
            if current is not None and await self._alive(current.replica_id):
                return current, False
            target = await self._least_loaded(base, exclude="")
            if target is None:
                raise _no_trainer(adapter, base)
            old = current.replica_id if current is not None else ""
            keys = [placement_key(adapter), placements_key(old), placements_key(target.replica_id)]
            keys += [replica_key(old), replica_key(target.replica_id)]
            args = [adapter, current.epoch if current else 0, target.replica_id, target.address, rank or DEFAULT_RANK]
            result = await self._run("PLACE_ADAPTER", keys, [*args, now_ms(), target.base_fingerprint])
            if result not in (b"RACE", "RACE"):
                return _from_script(adapter, result), True
        raise FailedPrecondition(f"adapter {adapter!r}'s placement kept changing; retry", reason="PLACEMENT_RACE")

    async def move_placement(
        self, adapter: str, expected_epoch: int, to_replica_id: str, state_id: str, state_step: int
    ) -> registry_pb2.Placement:
        """Hands the adapter to `to_replica_id` (a live serving trainer; "": the least loaded other one), of the
        base it was placed for: its state loads only onto that base."""
        for _ in range(MAX_TRIES):
            current = await self.get_placement(adapter)
            if current is None:
                raise NotFound(f"adapter {adapter!r} is not placed", reason="PLACEMENT_NOT_FOUND")
            if to_replica_id:
                trainers = await self._trainers(current.base_fingerprint)
                target = next((r for r in trainers if r.replica_id == to_replica_id), None)
                if target is None or to_replica_id == current.replica_id:
                    raise FailedPrecondition(
                        f"{to_replica_id!r} is not a serving trainer of the adapter's base other than its owner",
                        reason="NO_TRAINER",
                    )
            else:
                target = await self._least_loaded(current.base_fingerprint, exclude=current.replica_id)
                if target is None:
                    raise _no_trainer(adapter, current.base_fingerprint)
            keys = [placement_key(adapter), placements_key(current.replica_id), placements_key(target.replica_id)]
            args = [adapter, expected_epoch, target.replica_id, target.address, now_ms(), state_id, state_step]
            result = await self._run("MOVE_PLACEMENT", [*keys, replica_key(target.replica_id)], args)
            if result not in (b"RACE", "RACE"):
                return _from_script(adapter, result)
        raise FailedPrecondition(f"adapter {adapter!r}'s placement kept changing; retry", reason="PLACEMENT_RACE")

    async def record_placement_state(
        self, adapter: str, epoch: int, state_id: str, state_step: int
    ) -> registry_pb2.Placement:
        args = [adapter, epoch, state_id, state_step]
        return _from_script(adapter, await self._run("RECORD_PLACEMENT_STATE", [placement_key(adapter)], args))

    async def _alive(self, replica_id: str) -> bool:
        with redis_errors():
            return bool(await self.redis.exists(replica_key(replica_id)))

    async def _trainers(self, base: str) -> list[registry_pb2.Replica]:
        return [
            r
            for r in await self.list_replicas()
            if r.role == registry_pb2.REPLICA_ROLE_TRAINER
            and r.state == registry_pb2.REPLICA_STATE_SERVING
            and (not base or r.base_fingerprint == base)
        ]

    async def _least_loaded(self, base: str, *, exclude: str) -> registry_pb2.Replica | None:
        best: tuple[int, int, str] | None = None
        chosen = None
        for replica in await self._trainers(base):
            if replica.replica_id == exclude:
                continue
            with redis_errors():
                ranks = [int(v) for v in await self.redis.hvals(placements_key(replica.replica_id))]
            if replica.max_slots and len(ranks) >= replica.max_slots:
                continue  # full
            score = (sum(ranks), len(ranks), replica.replica_id)
            if best is None or score < best:
                best, chosen = score, replica
        return chosen
