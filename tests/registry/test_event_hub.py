"""The shared event reader (registry/event_hub.py) on an in-memory stream: each watch gets every event after its
own cursor once and in order, however many watch; one that stops reading falls back to its cursor without
losing anything; a store failure ends every watch with it, and the next watch starts a fresh reader."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from opentinker.registry import event_hub
from opentinker.registry.event_hub import EventHub, event_key
from opentinker.registry.event_store import EventRecord
from opentinker.rpc.serving.errors import Unavailable
from opentinker.v1 import registry_pb2


class FakeStream:
    """The part of RegistryStore the hub uses, on a list; counts the blocking reads in flight."""

    def __init__(self) -> None:
        self.events: list[EventRecord] = []
        self.failing = False
        self.blocking = 0
        self.most_blocking = 0

    def add(self, n: int = 1) -> None:
        for _ in range(n):
            event_id = f"{len(self.events) + 1}-0"
            self.events.append(EventRecord(event_id, registry_pb2.Event(event_id=event_id, adapter="a")))

    async def last_event_id(self) -> str:
        return self.events[-1].event_id if self.events else "0-0"

    async def read_events(self, after_id: str, block_ms: int | None, count: int = 256) -> list[EventRecord]:
        if block_ms is not None:
            self.blocking += 1
            self.most_blocking = max(self.most_blocking, self.blocking)
        try:
            for _ in range(1 if block_ms is None else 20):
                if self.failing:
                    raise Unavailable("redis went away", reason="STORE_UNAVAILABLE")
                found = [e for e in self.events if event_key(e.event_id) > event_key(after_id)][:count]
                if found or block_ms is None:
                    return found
                await asyncio.sleep(0.005)
            return []
        finally:
            if block_ms is not None:
                self.blocking -= 1


async def take(events: AsyncIterator[EventRecord], n: int) -> list[str]:
    return [(await anext(events)).event_id for _ in range(n)]


def test_every_watch_gets_its_events_once_in_order_over_one_reader() -> None:
    async def run() -> None:
        stream = FakeStream()
        stream.add(5)
        hub = EventHub(stream, block_ms=50)  # type: ignore[arg-type]
        watches = [hub.events(cursor) for cursor in ("0-0", "3-0", "5-0")]
        firsts = [asyncio.ensure_future(take(w, n)) for w, n in zip(watches, (8, 5, 3), strict=True)]
        await asyncio.sleep(0.05)
        stream.add(3)
        got = await asyncio.wait_for(asyncio.gather(*firsts), 5)
        assert got == [[f"{i}-0" for i in range(1, 9)], [f"{i}-0" for i in range(4, 9)], ["6-0", "7-0", "8-0"]]
        assert stream.most_blocking == 1  # one blocking reader, not one per watch
        for watch in watches:
            await watch.aclose()
        await hub.close()

    asyncio.run(run())


def test_a_watch_that_stops_reading_catches_up_from_its_cursor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(event_hub, "QUEUE_LIMIT", 2)

    async def run() -> None:
        stream = FakeStream()
        hub = EventHub(stream, block_ms=50)  # type: ignore[arg-type]
        slow = hub.events("0-0")
        first = asyncio.ensure_future(take(slow, 1))
        stream.add()
        assert await asyncio.wait_for(first, 5) == ["1-0"]
        for _ in range(6):  # batches the slow watch does not read: its queue overflows
            stream.add()
            await asyncio.sleep(0.03)
        assert hub.subscriber_count == 0  # dropped from the feed, nothing lost
        assert await asyncio.wait_for(take(slow, 6), 5) == [f"{i}-0" for i in range(2, 8)]
        await slow.aclose()
        await hub.close()

    asyncio.run(run())


def test_a_store_failure_ends_every_watch_and_the_next_watch_restarts_the_reader() -> None:
    async def run() -> None:
        stream = FakeStream()
        stream.add()
        hub = EventHub(stream, block_ms=50)  # type: ignore[arg-type]
        watches = [hub.events("1-0") for _ in range(3)]
        pending = [asyncio.ensure_future(take(w, 1)) for w in watches]
        await asyncio.sleep(0.03)
        stream.failing = True
        results = await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), 5)
        assert all(isinstance(r, Unavailable) and r.reason == "STORE_UNAVAILABLE" for r in results), results
        stream.failing = False
        again = hub.events("1-0")
        waiting = asyncio.ensure_future(take(again, 1))
        await asyncio.sleep(0.03)
        stream.add()
        assert await asyncio.wait_for(waiting, 5) == ["2-0"]
        await again.aclose()
        await hub.close()

    asyncio.run(run())
