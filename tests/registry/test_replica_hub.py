"""The shared fleet reader (registry/replica_hub.py) on an in-memory fleet: one read per poll however many watch,
each watch sees the newest listing, and any store failure (not only a ServiceError) ends every watch with
UNAVAILABLE instead of leaving it waiting; the next watch starts a fresh reader."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from opentinker.registry.replica_hub import Listing, ReplicaHub
from opentinker.rpc.serving.errors import Unavailable
from opentinker.v1 import registry_pb2


class FakeFleet:
    """The part of RegistryStore the hub uses; `failure` is raised by the next reads when set."""

    def __init__(self) -> None:
        self.replicas: Listing = []
        self.reads = 0
        self.failure: Exception | None = None

    async def list_replicas(self) -> Listing:
        self.reads += 1
        if self.failure is not None:
            raise self.failure
        return list(self.replicas)


def _hub(fleet: FakeFleet) -> ReplicaHub:
    store: Any = fleet  # duck-typed: the hub calls list_replicas only
    return ReplicaHub(store, poll_s=0.01)


async def _next(watch: AsyncGenerator[Listing, None]) -> Listing:
    return await asyncio.wait_for(watch.__anext__(), 5)


def test_watches_share_one_reader_and_see_the_newest_listing() -> None:
    async def run() -> None:
        fleet = FakeFleet()
        hub = _hub(fleet)
        watches = [hub.listings() for _ in range(8)]
        for watch in watches:
            assert await _next(watch) == []
        fleet.replicas = [registry_pb2.Replica(replica_id="r1", address="127.0.0.1:1")]
        for watch in watches:
            assert [r.replica_id for r in await _next(watch)] == ["r1"]
        reads_before = fleet.reads
        await asyncio.sleep(0.2)  # about 20 polls
        polled = fleet.reads - reads_before
        assert 1 <= polled <= 30, polled  # one reader for the 8 watches (20 polls at most), not 8 per poll
        for watch in watches:
            await watch.aclose()
        await hub.close()

    asyncio.run(run())


@pytest.mark.parametrize("failure", [Unavailable("redis down"), ConnectionResetError("reset by peer"), KeyError("x")])
def test_any_read_failure_ends_every_watch_with_unavailable(failure: Exception) -> None:
    async def run() -> None:
        fleet = FakeFleet()
        hub = _hub(fleet)
        watches = [hub.listings() for _ in range(3)]
        for watch in watches:
            await _next(watch)
        fleet.failure = failure
        for watch in watches:
            with pytest.raises(Unavailable):
                while True:
                    await _next(watch)  # a listing read before the failure may still come first
        fleet.failure = None
        fleet.replicas = [registry_pb2.Replica(replica_id="r2")]
        fresh = hub.listings()
        assert [r.replica_id for r in await _next(fresh)] == ["r2"]
        fleet.replicas = [registry_pb2.Replica(replica_id="r3")]
        assert [r.replica_id for r in await _next(fresh)] == ["r3"]  # a new reader polls again
        await fresh.aclose()
        await hub.close()

    asyncio.run(run())
