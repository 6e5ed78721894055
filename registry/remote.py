"""The registry as seen from the trainer and the sampler: calls whose failures keep their status and
reason, and artifact moves between a local ArtifactStore and the registry's, in 1 MiB chunks.

The trainer and the sampler normally share the registry's store directory; when they run elsewhere they
fetch snapshots with `fetch_artifact` and send new ones with `push_artifact`. The receiving store verifies
every digest.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc

from opentinker.rpc.errors import ServiceError, Unavailable, error_info
from opentinker.v1 import registry_pb2, registry_pb2_grpc
from opentinker.weights.artifact_store import ArtifactStore

CHUNK = 1 << 20
Metadata = list[tuple[str, str]] | None
T = TypeVar("T")

_BY_CODE: dict[grpc.StatusCode, type[ServiceError]] = {cls.code: cls for cls in ServiceError.__subclasses__()}


def registry_error(exc: grpc.aio.AioRpcError) -> ServiceError:
    """A failed registry call as our own error: same code, reason and metadata; UNAVAILABLE if unreachable."""
    if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return Unavailable(f"registry unavailable: {exc.details()}", reason="REGISTRY_UNAVAILABLE")
    info = error_info(exc)
    metadata = dict(info.metadata) if info else {}
    return _BY_CODE.get(exc.code(), Unavailable)(
        f"registry: {exc.details()}", reason=info.reason if info else None, **metadata
    )


def registry_channel(address: str, ca: Path | None) -> grpc.aio.Channel:
    """A channel to the registry (open it inside the server's event loop): TLS verified against `ca` when given."""
    if ca is None:
        return grpc.aio.insecure_channel(address)
    return grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca.read_bytes()))


async def registry_call(call: Awaitable[T]) -> T:
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        raise registry_error(exc) from None


async def fetch_artifact(
    registry: registry_pb2_grpc.RegistryServiceStub, store: ArtifactStore, uri: str, metadata: Metadata
) -> None:
    """Downloads uri into store unless it is already there (then nothing moves)."""
    if await asyncio.to_thread(store.exists, uri):
        return
    writer = store.begin()
    try:
        headers: list[registry_pb2.ArtifactFileHeader] = []
        index, remaining = -1, 0
        stream: AsyncIterator[Any] = registry.DownloadArtifact(
            registry_pb2.DownloadArtifactRequest(artifact_uri=uri), metadata=metadata
        )
        async for message in _stream(stream):
            if message.WhichOneof("message") == "manifest":
                headers = list(message.manifest.files)
                continue
            data: bytes = message.chunk
            while data:
                while remaining == 0:  # next file (skipping empty ones)
                    index += 1
                    writer.add_file(headers[index].path, headers[index].size_bytes, headers[index].sha256)
                    remaining = headers[index].size_bytes
                take = min(remaining, len(data))
                writer.write(data[:take])
                data, remaining = data[take:], remaining - take
        for header in headers[index + 1 :]:  # trailing empty files carry no chunk
            writer.add_file(header.path, header.size_bytes, header.sha256)
        await asyncio.to_thread(writer.commit)
    finally:
        writer.abort()


def upload_messages(store: ArtifactStore, uri: str) -> Iterator[registry_pb2.UploadArtifactRequest]:
    files = store.manifest(uri)
    headers = [registry_pb2.ArtifactFileHeader(path=f.path, size_bytes=f.size, sha256=f.sha256) for f in files]
    yield registry_pb2.UploadArtifactRequest(manifest=registry_pb2.ArtifactManifest(files=headers))
    for _file, chunk in store.iter_chunks(uri, CHUNK):
        if chunk:
            yield registry_pb2.UploadArtifactRequest(chunk=chunk)


async def push_artifact(
    registry: registry_pb2_grpc.RegistryServiceStub, store: ArtifactStore, uri: str, metadata: Metadata
) -> None:
    """Uploads uri from store to the registry's store."""
    messages = await asyncio.to_thread(lambda: list(upload_messages(store, uri)))
    await registry_call(registry.UploadArtifact(iter(messages), metadata=metadata))


async def _stream(stream: AsyncIterator[T]) -> AsyncIterator[T]:
    try:
        async for message in stream:
            yield message
    except grpc.aio.AioRpcError as exc:
        raise registry_error(exc) from None
