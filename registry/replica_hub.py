"""One reader of the fleet per registry process, shared by every open WatchReplicas stream.

The fleet lives in Redis as one key per replica; a watch learns of changes by reading it again. A read per
watch every poll would make Redis work grow with the number of watchers (a tenant opening hundreds of watches
would slow every registry call). Here one task reads the whole listing every poll while at least one watch is
open, and each watch takes the newest listing when it is ready for it (a watch that falls behind skips to the
newest: the fleet is a state, not a log). Each watch then filters the listing for its caller and diffs it with
what it sent, in memory. A failed read ends every watch with the error (UNAVAILABLE) and stops the reader; the
next watch starts a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from typing import Final

from opentinker.registry.store import RegistryStore
from opentinker.rpc.serving.errors import ServiceError, Unavailable
from opentinker.v1 import registry_pb2

log = logging.getLogger(__name__)

Listing = list[registry_pb2.Replica]

POLL_S: Final = 0.25  # how often the fleet is read while a watch is open: a change reaches watchers this late


class ReplicaHub:
    def __init__(self, store: RegistryStore, poll_s: float = POLL_S) -> None:
        self.store = store
        self.poll_s = poll_s
        self._listing: Listing | ServiceError = []
        self._generation = 0  # bumped on every read
        self._fresh = asyncio.Condition()
        self._watchers = 0
        self._reader: asyncio.Task[None] | None = None

    async def listings(self) -> AsyncGenerator[Listing, None]:
        """A listing read now, then each newer one as the shared reader gets it (the newest when this
        consumer was slower than the poll), until the caller stops iterating."""
        self._watchers += 1
        try:
            yield await self.store.list_replicas()  # the snapshot: fresh, not the reader's last (up to a poll old)
            if self._reader is None or self._reader.done():
                self._reader = asyncio.create_task(self._poll(), name="registry-replica-hub")
            seen = self._generation
            while True:
                async with self._fresh:
                    while self._generation == seen:
                        await self._fresh.wait()
                    seen, listing = self._generation, self._listing
                if isinstance(listing, ServiceError):
                    raise listing
                yield listing
        finally:
            self._watchers -= 1

    async def _poll(self) -> None:
        while self._watchers:
            await asyncio.sleep(self.poll_s)
            try:
                listing: Listing | ServiceError = await self.store.list_replicas()
            except ServiceError as error:
                log.warning("fleet reader stopped: %s", error.message)
                listing = error
            except Exception as error:  # any failure must end the watches: a dead reader would leave them waiting
                log.exception("fleet reader failed")
                listing = Unavailable(f"the registry could not read the fleet: {type(error).__name__}")
            async with self._fresh:
                self._listing, self._generation = listing, self._generation + 1
                self._fresh.notify_all()
            if isinstance(listing, ServiceError):
                return

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
