"""RegistryService handlers for artifacts: garbage collection of old versions and unpublished uploads, the
deletion of one version, and the upload and download streams."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

from prometheus_client import Counter

from opentinker.registry.artifact_backend import UploadWriter
from opentinker.registry.handler_base import Context, Handlers
from opentinker.registry.uploads import (
    UploadHold,
    check_file_count,
    check_upload,
    delete_claimed,
    expected_artifact,
    keep_uploads_after_ms,
    quota_of,
    sweep_unpublished,
)
from opentinker.rpc.serving.auth import current_principal, require_access, require_admin
from opentinker.rpc.serving.errors import FailedPrecondition, InvalidArgument, PermissionDenied, ServiceError
from opentinker.v1 import registry_pb2
from opentinker.weights.artifact_manifest import BLOCK_SIZE, ArtifactFile, format_uri, parse_uri
from opentinker.weights.artifact_stream import ArtifactReceiver, StreamViolation, Violation, WriterSink, chunked
from opentinker.weights.names import check_adapter_name

# Artifact bytes through this process. With a bucket store, trainers and samplers move the bytes themselves and
# this stays 0 unless a client without store credentials imports or exports through the registry.
ARTIFACT_BYTES = Counter(
    "opentinker_registry_artifact_bytes", "Artifact bytes the registry received or sent.", ["direction"]
)
_ENDED_EARLY = "upload ended before every declared byte arrived"
_UPLOAD_PROBLEMS: dict[Violation, str] = {
    "chunk_first": "chunk before manifest",
    "header_twice": "the manifest must be sent once, first",
    "no_header": "empty upload: no manifest",
    "extra_bytes": "more bytes than the manifest declares",
    "ended_inside": _ENDED_EARLY,
    "ended_before": _ENDED_EARLY,
}


MAX_GRACE_S = 10 * 365 * 86400.0  # a longer grace is a mistake; and the cutoff in ms must stay a finite integer


class ArtifactHandlers(Handlers):
    async def GarbageCollect(self, request: registry_pb2.GarbageCollectRequest, context: Context) -> Any:
        principal = require_admin("GarbageCollect")
        grace_s = request.grace_s if request.HasField("grace_s") else self.limits.upload_grace_s
        if not 0 <= grace_s <= MAX_GRACE_S:  # also false for NaN
            raise InvalidArgument(
                f"grace_s must be between 0 and {MAX_GRACE_S:.0f} seconds (ten years), not {grace_s}",
                reason="INVALID_GRACE",
            )
        keep_last = request.keep_last or 5
        names = [check_adapter_name(request.adapter)] if request.adapter else await self.store.all_adapter_names()
        response = registry_pb2.GarbageCollectResponse()
        for name in names:
            numbers = await self.store.all_version_numbers(name)
            for number in numbers[keep_last:]:  # numbers are newest first
                version = await self.store.get_version(name, number)
                if version.artifact_deleted or version.aliases:
                    continue
                freed = 0
                if not request.dry_run:
                    cutoff = keep_uploads_after_ms(self.limits.upload_grace_s)
                    collected = await self.store.collect_version(version, principal.actor, cutoff)
                    if collected is None:
                        continue  # an alias moved onto it meanwhile
                    if collected[1]:
                        freed = await delete_claimed(self.store, self.artifacts, version.artifact_sha256)
                response.collected.append(
                    registry_pb2.CollectedVersion(
                        adapter=name,
                        version=number,
                        artifact_sha256=version.artifact_sha256,
                        size_bytes=version.artifact_size_bytes,
                    )
                )
                response.bytes_freed += freed if not request.dry_run else version.artifact_size_bytes
        if not request.dry_run and not request.adapter:
            # Uploads nobody published within the grace period: no version references them.
            _count, freed = await sweep_unpublished(self.store, self.artifacts, grace_s, bucket_orphans=True)
            response.bytes_freed += freed
        return response

    async def DeleteVersion(self, request: registry_pb2.DeleteVersionRequest, context: Context) -> Any:
        """One version collected on its tenant's request (an expired or deleted checkpoint of the gateway)."""
        name = check_adapter_name(request.adapter)
        principal = require_access(name)
        if request.version < 1:
            raise InvalidArgument("version numbers start at 1", reason="INVALID_VERSION")
        await self.store.get_adapter(name)
        version = await self.store.get_version(name, request.version)
        freed = 0
        if not version.artifact_deleted:
            held_by = ", ".join(version.aliases)
            cutoff = keep_uploads_after_ms(self.limits.upload_grace_s)
            collected = None if held_by else await self.store.collect_version(version, principal.actor, cutoff)
            if collected is None:  # checked again atomically by the store: an alias may have moved onto it
                raise FailedPrecondition(
                    f"{name}@{request.version} is kept while an alias points to it ({held_by or 'just moved'})",
                    reason="VERSION_ALIASED",
                )
            if collected[1]:
                freed = await delete_claimed(self.store, self.artifacts, version.artifact_sha256)
            version = await self.store.get_version(name, request.version)
        return registry_pb2.DeleteVersionResponse(version=version, bytes_freed=freed)

    async def UploadArtifact(self, request_iterator: AsyncIterator[Any], context: Context) -> Any:
        principal = current_principal()
        hold = UploadHold(self.store, principal.tenant or "", quota_of(self.limits, principal))
        self.sweeper.ensure_running()
        writers: list[UploadWriter] = []
        digest = ""

        def open_sink(files: Sequence[ArtifactFile]) -> WriterSink:
            writers.append(self.artifacts.begin())
            return WriterSink(writers[0])

        receiver = ArtifactReceiver(open_sink)
        try:
            try:
                # Creating, writing and fsyncing files happens in a worker thread, never on the event loop
                # that every other tenant's calls share. One message at a time: the receiver is not shared.
                async for message in request_iterator:
                    kind = message.WhichOneof("message")
                    if kind == "manifest":
                        check_file_count(self.limits, len(message.manifest.files))  # before building a list
                        files = [ArtifactFile(h.path, h.sha256, h.size_bytes) for h in message.manifest.files]
                        check_upload(self.limits, files)
                        digest, size = expected_artifact(files)
                        # Checked and counted in one step, before the first file is created: two uploads in
                        # flight can never both fit into what only one of them fits into.
                        await hold.reserve(size)
                        await asyncio.to_thread(receiver.header, files)
                    elif kind == "chunk":
                        ARTIFACT_BYTES.labels("upload").inc(len(message.chunk))
                        await hold.keep()
                        await asyncio.to_thread(receiver.chunk, message.chunk)
                await asyncio.to_thread(receiver.close)
            except StreamViolation as violation:
                raise InvalidArgument(_UPLOAD_PROBLEMS[violation.kind], reason="INVALID_UPLOAD") from None
            # Before the commit: committing onto stored bytes keeps them, so they must not be claimed meanwhile.
            await hold.lease(digest)
            ref = await asyncio.to_thread(writers[0].commit)
            await hold.record(ref)
        except BaseException:
            for writer in writers:
                writer.abort()
            with contextlib.suppress(ServiceError):  # the store is unreachable: both expire on their own
                await asyncio.shield(hold.release())
            raise
        return registry_pb2.UploadArtifactResponse(
            artifact_uri=ref.uri, artifact_sha256=ref.sha256, artifact_size_bytes=ref.size_bytes
        )

    async def DownloadArtifact(self, request: registry_pb2.DownloadArtifactRequest, context: Context) -> Any:
        digest = parse_uri(request.artifact_uri)
        uri = format_uri(digest)
        principal = current_principal()
        if not principal.is_admin and not any(map(principal.can_access, await self.store.artifact_users(digest))):
            # Content addresses are guessable only in theory; still, tenants read only their own versions.
            raise PermissionDenied("no version you can access uses this artifact", artifact=uri)
        files = await asyncio.to_thread(self.artifacts.manifest, uri)
        yield registry_pb2.DownloadArtifactResponse(
            manifest=registry_pb2.ArtifactManifest(
                files=[registry_pb2.ArtifactFileHeader(path=f.path, size_bytes=f.size, sha256=f.sha256) for f in files]
            )
        )
        # Read in a worker thread, one block at a time: a slow disk or bucket never stalls the event loop that
        # every other tenant's calls share.
        blocks = chunked((chunk for _file, chunk in self.artifacts.iter_chunks(uri)), BLOCK_SIZE)
        while (chunk := await asyncio.to_thread(next, blocks, None)) is not None:
            ARTIFACT_BYTES.labels("download").inc(len(chunk))
            yield registry_pb2.DownloadArtifactResponse(chunk=chunk)
