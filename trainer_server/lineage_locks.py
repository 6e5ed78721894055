"""One lock per adapter for what moves its lineage (last_snapshot_version, parent_adapter, ledger.batches).

SaveSnapshot holds it from the snapshot's write across the publish to its bookkeeping, so a second save of the
adapter writes only after the first one's version is its parent (two at once would both name the same parent and
both claim the same batches); LoadState and ResetAdapter hold it too. A lock lives while someone holds or awaits it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class LineageLocks:
    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}  # adapter -> (lock, holders and waiters)

    @contextlib.asynccontextmanager
    async def hold(self, adapter: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(adapter, (asyncio.Lock(), 0))
        self._locks[adapter] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[adapter]
            if users == 1:
                del self._locks[adapter]
            else:
                self._locks[adapter] = (lock, users - 1)

    def __len__(self) -> int:
        return len(self._locks)
