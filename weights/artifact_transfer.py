"""Artifact moves between a local ArtifactStore and the registry's, in 1 MiB chunks on the shared stream
(artifact_stream.py).

The trainer and the sampler normally share the registry's store directory or bucket; when they run elsewhere
without one they fetch snapshots with `fetch_artifact` and send new ones with `push_artifact`. The receiving
store verifies every digest.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from opentinker.rpc.serving.errors import DataLoss
from opentinker.rpc.serving.registry_link import Metadata, registry_call, registry_stream
from opentinker.v1 import registry_pb2, registry_pb2_grpc
from opentinker.weights.artifact_bucket import Bucket
from opentinker.weights.artifact_manifest import ArtifactFile
from opentinker.weights.artifact_store import ArtifactStore
from opentinker.weights.artifact_stream import ArtifactReceiver, StreamViolation, Violation, WriterSink, chunked

CHUNK = 1 << 20
_FETCH_PROBLEMS: dict[Violation, str] = {
    "chunk_first": "bytes before the manifest",
    "header_twice": "a second manifest",
    "no_header": "no manifest",
    "extra_bytes": "more bytes than the manifest declares",
    "ended_inside": "the stream ended inside a file",
    "ended_before": "the stream ended before a file",
}


async def fetch_artifact(
    registry: registry_pb2_grpc.RegistryServiceStub,
    store: ArtifactStore,
    uri: str,
    metadata: Metadata,
    *,
    bucket: Bucket | None = None,
    guess: Sequence[str] = (),
    size_hint: int = 0,
) -> None:
    """Downloads uri into store unless it is already there (then nothing moves): from the bucket when the
    process has one (the registry moves no bytes), else from the registry. A stream that breaks its
    protocol (bytes past the declared files, a short file, no manifest first) is DataLoss(DIGEST_MISMATCH),
    like a file whose digest is wrong. ``guess``, ``size_hint``: the files the caller expects and the artifact's
    size, which let a bucket fetch a small artifact's files with its manifest (artifact_remote.pull)."""
    if bucket is not None:
        await bucket.run(functools.partial(bucket.pull, uri, guess=guess, size_hint=size_hint))
        return
    if await asyncio.to_thread(store.exists, uri):
        return
    writer = store.begin()
    receiver = ArtifactReceiver(lambda files: WriterSink(writer))
    try:
        stream: AsyncIterator[Any] = registry.DownloadArtifact(
            registry_pb2.DownloadArtifactRequest(artifact_uri=uri), metadata=metadata
        )
        try:
            async for message in registry_stream(stream):
                if message.WhichOneof("message") == "manifest":
                    receiver.header([ArtifactFile(h.path, h.sha256, h.size_bytes) for h in message.manifest.files])
                else:
                    receiver.chunk(message.chunk)
            receiver.close()
        except StreamViolation as violation:
            where = {"path": violation.path} if violation.path else {}
            raise DataLoss(
                f"download of {uri}: {_FETCH_PROBLEMS[violation.kind]}", reason="DIGEST_MISMATCH", uri=uri, **where
            ) from None
        await asyncio.to_thread(writer.commit)
    finally:
        writer.abort()


def upload_messages(store: ArtifactStore, uri: str) -> Iterator[registry_pb2.UploadArtifactRequest]:
    """The manifest, then the files' bytes (verified while they stream) in chunks of CHUNK."""
    files = store.manifest(uri)
    headers = [registry_pb2.ArtifactFileHeader(path=f.path, size_bytes=f.size, sha256=f.sha256) for f in files]
    yield registry_pb2.UploadArtifactRequest(manifest=registry_pb2.ArtifactManifest(files=headers))
    for chunk in chunked((chunk for _file, chunk in store.iter_chunks(uri, CHUNK)), CHUNK):
        yield registry_pb2.UploadArtifactRequest(chunk=chunk)


async def push_artifact(
    registry: registry_pb2_grpc.RegistryServiceStub, store: ArtifactStore, uri: str, metadata: Metadata
) -> None:
    """Uploads uri from store to the registry's store."""
    messages = await asyncio.to_thread(lambda: list(upload_messages(store, uri)))
    await registry_call(registry.UploadArtifact(iter(messages), metadata=metadata))
