"""Deleting an artifact's bytes vs. a publish or upload of the same bytes, each interleaving forced at the one
point where it used to go wrong (issue 33, item 1). The registry runs in this process on a private Redis; the
artifact store holds one step (a verification, a commit onto stored bytes) until the test has made the competing
call."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from registryutil import artifact_files, unique_name, upload_requests

from opentinker.registry.embedded_redis import EmbeddedRedis
from opentinker.registry.limits import RegistryLimits
from opentinker.registry.service import RegistryServicer
from opentinker.registry.store import RegistryStore
from opentinker.registry.uploads import sweep_unpublished
from opentinker.v1 import common_pb2, registry_pb2
from opentinker.weights.artifact_manifest import ArtifactRef
from opentinker.weights.artifact_store import ArtifactStore


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """Its own Redis: the sweeps here (grace 0) would otherwise collect other tests' uploads."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("gc-redis"), appendonly=False).start()
    yield server
    server.stop()


class HeldStore(ArtifactStore):
    """Holds the next pass through `point` ("ref": just after a verification, or a fault point of the store)
    until `release` is set; `entered` tells the test it is there."""

    def __init__(self, root: Path) -> None:
        self.point = ""
        self.entered = threading.Event()
        self.release = threading.Event()
        super().__init__(root, fault_hook=self._at)

    def hold(self, point: str) -> None:
        self.point = point
        self.entered.clear()
        self.release.clear()

    def _at(self, point: str) -> None:
        if point == self.point:
            self.point = ""
            self.entered.set()
            assert self.release.wait(30)

    def ref(self, uri: str) -> ArtifactRef:
        verified = super().ref(uri)
        self._at("ref")  # after the verification: the bytes were all there when the caller looked
        return verified


class Registry:
    def __init__(self, store: RegistryStore, artifacts: HeldStore) -> None:
        self.store, self.artifacts = store, artifacts
        # A long grace: nothing here is collected for being an old upload unless a test sweeps with 0.
        self.servicer = RegistryServicer(store, artifacts, RegistryLimits(upload_grace_s=3600))
        self.adapter = unique_name("gc-race")

    async def upload(self, files: dict[str, bytes]) -> str:
        async def requests() -> AsyncIterator[registry_pb2.UploadArtifactRequest]:
            for message in upload_requests(files):
                yield message

        response = await self.servicer.UploadArtifact(requests(), None)
        return str(response.artifact_uri)

    async def publish(self, uri: str, *, skip_latest: bool = False) -> registry_pb2.Version:
        request = registry_pb2.PublishVersionRequest(adapter=self.adapter, artifact_uri=uri, skip_latest=skip_latest)
        response = await self.servicer.PublishVersion(request, None)
        version: registry_pb2.Version = response.version
        return version

    async def delete_version(self, number: int) -> registry_pb2.DeleteVersionResponse:
        request = registry_pb2.DeleteVersionRequest(adapter=self.adapter, version=number)
        response: registry_pb2.DeleteVersionResponse = await self.servicer.DeleteVersion(request, None)
        return response

    async def while_held(self, point: str, held: Awaitable[Any], meanwhile: Callable[[], Awaitable[Any]]) -> Any:
        """Runs `held` until the store is at `point`, then `meanwhile` to completion, then lets `held` go on;
        returns what `held` returned."""
        self.artifacts.hold(point)
        task = asyncio.ensure_future(held)
        assert await asyncio.to_thread(self.artifacts.entered.wait, 30)
        try:
            await meanwhile()
        finally:
            self.artifacts.release.set()
        return await task


def scenario(redis_server: EmbeddedRedis, tmp_path: Path, body: Callable[[Registry], Awaitable[None]]) -> None:
    async def run() -> None:
        store = RegistryStore.from_url(redis_server.url)
        registry = Registry(store, HeldStore(tmp_path / "artifacts"))
        try:
            create = registry_pb2.CreateAdapterRequest(name=registry.adapter, lora_config=common_pb2.LoraConfig(rank=8))
            await registry.servicer.CreateAdapter(create, None)
            await body(registry)
        finally:
            await registry.servicer.sweeper.close()
            await store.close()

    asyncio.run(run())


def fresh_files() -> dict[str, bytes]:
    return artifact_files(int.from_bytes(os.urandom(4), "little"))


def test_a_publish_verifying_the_bytes_keeps_delete_version_from_deleting_them(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """v1 holds the only reference; a second publish of the same bytes verifies them while v1 is deleted. The
    deletion used to see no reference left and delete the bytes under the publish, which then made v2 visible."""

    async def body(registry: Registry) -> None:
        uri = await registry.upload(fresh_files())
        first = await registry.publish(uri, skip_latest=True)
        deleted: list[registry_pb2.DeleteVersionResponse] = []

        async def delete_v1() -> None:
            deleted.append(await registry.delete_version(first.version))

        second = await registry.while_held("ref", registry.publish(uri), delete_v1)
        assert deleted[0].version.artifact_deleted and deleted[0].bytes_freed == 0
        assert registry.artifacts.ref(uri).uri == uri  # v2 is visible and its bytes are all there
        resolved = await registry.store.resolve(registry.adapter)
        assert (resolved.version, resolved.artifact_deleted) == (second.version, False)

    scenario(redis_server, tmp_path, body)


def test_a_publish_verifying_the_bytes_keeps_the_upload_sweep_from_deleting_them(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """An upload past its grace period (0 here) is swept while its publish verifies it: the sweep used to find
    no reference, delete the bytes, and the publish landed after."""

    async def body(registry: Registry) -> None:
        uri = await registry.upload(fresh_files())
        swept: list[tuple[int, int]] = []

        async def sweep() -> None:
            swept.append(await sweep_unpublished(registry.store, registry.artifacts, 0))

        published = await registry.while_held("ref", registry.publish(uri), sweep)
        assert registry.artifacts.ref(uri).uri == uri
        assert not published.artifact_deleted
        # Published now: the sweep leaves it to the version GC.
        assert await sweep_unpublished(registry.store, registry.artifacts, 0) == (0, 0)
        assert registry.artifacts.exists(uri)

    scenario(redis_server, tmp_path, body)


def test_an_upload_committing_onto_stored_bytes_keeps_gc_from_deleting_them(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """The same bytes uploaded again while the last version using them is deleted: the upload's commit finds
    them stored and keeps them. The deletion used to delete them after that, so the acknowledged upload was lost
    (its publish then answered NOT_FOUND)."""

    async def body(registry: Registry) -> None:
        files = fresh_files()
        uri = await registry.upload(files)
        first = await registry.publish(uri, skip_latest=True)

        async def delete_v1() -> None:
            assert (await registry.delete_version(first.version)).bytes_freed == 0

        again = await registry.while_held("already_committed", registry.upload(files), delete_v1)
        assert again == uri and registry.artifacts.ref(uri).uri == uri
        assert not (await registry.publish(uri)).artifact_deleted

    scenario(redis_server, tmp_path, body)
