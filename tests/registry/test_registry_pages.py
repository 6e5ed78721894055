"""Listing pages stay bounded in bytes: records written before descriptions and labels were bounded (here
written straight into the store) end a page early, and following next_page_token still yields every adapter
once, in order."""

from __future__ import annotations

import asyncio

from registryutil import unique_name

from opentinker.registry.embedded_redis import EmbeddedRedis
from opentinker.registry.store import RegistryStore
from opentinker.v1 import registry_pb2


def test_a_page_ends_early_past_its_byte_bound(redis_server: EmbeddedRedis) -> None:
    prefix = f"{unique_name('legacy')}-"
    names = [f"{prefix}{i:02d}" for i in range(12)]

    async def run() -> list[list[str]]:
        store = RegistryStore.from_url(redis_server.url)
        try:
            for name in names:
                await store.create_adapter(registry_pb2.Adapter(name=name, description="x" * 100_000), "test")
            pages: list[list[str]] = []
            token = ""
            while True:
                adapters, token = await store.list_adapters(prefix, 100, token, max_bytes=250_000)
                pages.append([a.name for a in adapters])
                if not token:
                    return pages
        finally:
            await store.close()

    pages = asyncio.run(run())
    assert [len(p) for p in pages] == [3, 3, 3, 3]  # 100 KB records, pages end once past 250 KB
    assert [n for p in pages for n in p] == names
