"""One Redis stream reader per registry process, fanned out to every open WatchEvents stream.

A blocking XREAD holds a Redis connection for as long as it waits, so a reader per watch would let one
tenant's watches take the whole connection budget (and the registry with it). Here one task reads the stream
and hands each batch to every subscriber's bounded queue; a watch catches up from its own cursor with short
non-blocking reads, then follows the shared feed, skipping what it already saw (ids are ordered). A watch
whose queue overflows (a client that stops reading) drops back to catching up from its cursor, so a slow
consumer costs only itself. When Redis goes away the reader ends every subscriber with the error (UNAVAILABLE)
and stops; the next watch starts a new reader.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from opentinker.registry.event_store import EventRecord
from opentinker.registry.store import RegistryStore
from opentinker.rpc.serving.errors import ServiceError

log = logging.getLogger(__name__)

CATCH_UP_PAGE = 256
QUEUE_LIMIT = 4096  # batches per subscriber before it falls back to reading from its cursor


class _Overflow:
    """Queue marker: the subscriber missed batches and must catch up from Redis."""


_OVERFLOW = _Overflow()
_Item = list[EventRecord] | ServiceError | _Overflow


def event_key(event_id: str) -> tuple[int, int]:
    ms, _, seq = event_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass(eq=False, slots=True)
class _Subscriber:
    queue: asyncio.Queue[_Item] = field(default_factory=lambda: asyncio.Queue(QUEUE_LIMIT + 1))


class EventHub:
    def __init__(self, store: RegistryStore, *, block_ms: int = 1000) -> None:
        self.store = store
        self.block_ms = block_ms  # bounds how long the reader lingers once the last watch is gone
        self._subscribers: set[_Subscriber] = set()
        self._reader: asyncio.Task[None] | None = None
        self._position = "0-0"  # id of the last event handed to subscribers
        self._starting = asyncio.Lock()

    @property
    def subscriber_count(self) -> int:
        return len(self._subscribers)

    async def events(self, cursor: str) -> AsyncGenerator[EventRecord, None]:
        """Every event after `cursor`, in order, live until the caller stops iterating."""
        while True:
            subscriber = await self._subscribe()
            try:
                # Subscribed first: whatever the reader hands out from now on is queued, and whatever it
                # handed out before is already in Redis for the catch-up reads: no gap between the two.
                while True:
                    page = await self.store.read_events(cursor, None, CATCH_UP_PAGE)
                    for record in page:
                        cursor = record.event_id
                        yield record
                    if len(page) < CATCH_UP_PAGE:
                        break
                while True:
                    item = await subscriber.queue.get()
                    if isinstance(item, _Overflow):
                        break
                    if isinstance(item, ServiceError):
                        raise item
                    for record in item:
                        if event_key(record.event_id) > event_key(cursor):
                            cursor = record.event_id
                            yield record
            finally:
                self._subscribers.discard(subscriber)

    async def _subscribe(self) -> _Subscriber:
        subscriber = _Subscriber()
        async with self._starting:
            if self._reader is None or self._reader.done():
                # The reader starts at the stream's end as of now; older events come from catch-up reads.
                self._position = await self.store.last_event_id()
                self._subscribers.add(subscriber)
                self._reader = asyncio.create_task(self._read(), name="registry-event-hub")
            else:
                self._subscribers.add(subscriber)
        return subscriber

    async def _read(self) -> None:
        while self._subscribers:
            try:
                records = await self.store.read_events(self._position, self.block_ms, CATCH_UP_PAGE)
            except ServiceError as error:
                log.warning("event reader stopped: %s", error.message)
                for subscriber in self._take_all():
                    subscriber.queue.put_nowait(error)
                return
            if not records:
                continue
            self._position = records[-1].event_id
            for subscriber in list(self._subscribers):
                self._deliver(subscriber, records)

    def _deliver(self, subscriber: _Subscriber, records: list[EventRecord]) -> None:
        if subscriber.queue.qsize() >= QUEUE_LIMIT:
            self._subscribers.discard(subscriber)
            subscriber.queue.put_nowait(_OVERFLOW)  # the one slot kept free for it
            return
        subscriber.queue.put_nowait(records)

    def _take_all(self) -> list[_Subscriber]:
        taken = list(self._subscribers)
        self._subscribers.clear()
        return taken

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
