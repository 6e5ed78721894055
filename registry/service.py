"""RegistryService: validate, authorize, then one store call. The store holds the truth.

Artifact files never pass through Redis: they live in the content-addressed ArtifactStore, and a version
is only published after the store has verified every file of its artifact.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import re
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from opentinker.registry.event_hub import EventHub
from opentinker.registry.limits import RegistryLimits, WatchSlots, check_metadata
from opentinker.registry.store import RegistryStore, lora_or_default
from opentinker.registry.uploads import (
    LEASE_TTL_MS,
    UploadHold,
    UploadSweeper,
    check_file_count,
    check_upload,
    delete_claimed,
    expected_artifact,
    keep_uploads_after_ms,
    quota_of,
    sweep_unpublished,
)
from opentinker.rpc.auth import Principal, current_principal, require_access, require_admin
from opentinker.rpc.errors import FailedPrecondition, InvalidArgument, PermissionDenied, ServiceError
from opentinker.v1 import common_pb2, registry_pb2, registry_pb2_grpc
from opentinker.weights.artifact_manifest import BLOCK_SIZE, ArtifactFile, format_uri, not_found, parse_uri
from opentinker.weights.artifact_store import ArtifactStore
from opentinker.weights.artifact_stream import ArtifactReceiver, StreamViolation, Violation, WriterSink, chunked
from opentinker.weights.artifact_writer import ArtifactWriter
from opentinker.weights.names import LATEST, check_adapter_name, check_alias, parse_reference
from opentinker.weights.peft import MAX_RANK

_EVENT_ID_RE = re.compile(r"^\d+(-\d+)?$")
_TARGET_RE = re.compile(r"^[a-z_][a-z0-9_.-]{0,127}$")
MAX_REQUEST_ID = 128
_ENDED_EARLY = "upload ended before every declared byte arrived"
_UPLOAD_PROBLEMS: dict[Violation, str] = {
    "chunk_first": "chunk before manifest",
    "header_twice": "the manifest must be sent once, first",
    "no_header": "empty upload: no manifest",
    "extra_bytes": "more bytes than the manifest declares",
    "ended_inside": _ENDED_EARLY,
    "ended_before": _ENDED_EARLY,
}

Context = Any  # grpc.aio.ServicerContext; untyped in the generated stubs


def check_lora_config(config: common_pb2.LoraConfig) -> None:
    if config.rank > MAX_RANK:
        raise InvalidArgument(f"LoRA rank {config.rank} exceeds {MAX_RANK}", reason="INVALID_LORA_CONFIG")
    if config.alpha < 0 or not 0 <= config.dropout < 1:
        raise InvalidArgument("LoRA alpha must be >= 0 and dropout in [0, 1)", reason="INVALID_LORA_CONFIG")
    for target in config.target_modules:
        if not _TARGET_RE.match(target):
            raise InvalidArgument(f"invalid LoRA target module {target!r}", reason="INVALID_LORA_CONFIG")


def _check_event_id(event_id: str) -> str:
    if event_id and not _EVENT_ID_RE.match(event_id):
        raise InvalidArgument(f"invalid event id {event_id!r}: expected '<ms>-<seq>'", reason="INVALID_EVENT_ID")
    return event_id


def _check_watch_pattern(pattern: str) -> str:
    check_adapter_name(pattern.removesuffix("/*") if pattern.endswith("/*") else pattern)
    return pattern


def _watch_filter(principal: Principal, patterns: list[str]) -> Any:
    def visible(adapter: str) -> bool:
        if not principal.can_access(adapter):
            return False
        return not patterns or any(fnmatch.fnmatchcase(adapter, p) for p in patterns)

    return visible


class RegistryServicer(registry_pb2_grpc.RegistryServiceServicer):
    def __init__(self, store: RegistryStore, artifacts: ArtifactStore, limits: RegistryLimits | None = None) -> None:
        self.store = store
        self.artifacts = artifacts
        self.limits = limits or RegistryLimits()
        self.max_artifact_bytes = self.limits.max_artifact_bytes
        self.events = EventHub(store)
        self.sweeper = UploadSweeper(store, artifacts, self.limits.upload_grace_s)
        self.watches = WatchSlots(self.limits.max_watches_per_tenant)

    # Adapters

    async def CreateAdapter(self, request: registry_pb2.CreateAdapterRequest, context: Context) -> Any:
        name = check_adapter_name(request.name)
        principal = require_access(name)
        if principal.tenant is not None and not principal.is_admin and "/" not in name:
            raise PermissionDenied(f"tenant {principal.tenant!r} must create adapters as '{principal.tenant}/...'")
        check_lora_config(request.lora_config)
        check_metadata(self.limits, request.description, request.labels)
        adapter = registry_pb2.Adapter(
            name=name,
            lora_config=lora_or_default(request.lora_config),
            base_model_digest=request.base_model_digest,
            labels=dict(request.labels),
            description=request.description,
        )
        created, event_id = await self.store.create_adapter(adapter, principal.actor)
        return registry_pb2.CreateAdapterResponse(adapter=created, event_id=event_id)

    async def GetAdapter(self, request: registry_pb2.GetAdapterRequest, context: Context) -> Any:
        name = check_adapter_name(request.name)
        require_access(name)
        return registry_pb2.GetAdapterResponse(adapter=await self.store.get_adapter(name))

    async def ListAdapters(self, request: registry_pb2.ListAdaptersRequest, context: Context) -> Any:
        principal = current_principal()
        prefix = request.prefix
        if principal.tenant is not None and not principal.is_admin:
            own = principal.tenant + "/"
            if not prefix.startswith(own):
                if not own.startswith(prefix):
                    return registry_pb2.ListAdaptersResponse()
                prefix = own
        adapters, token = await self.store.list_adapters(
            prefix, request.page_size, request.page_token, max_bytes=self.limits.max_page_bytes
        )
        return registry_pb2.ListAdaptersResponse(adapters=adapters, next_page_token=token)

    async def DeleteAdapter(self, request: registry_pb2.DeleteAdapterRequest, context: Context) -> Any:
        name = check_adapter_name(request.name)
        principal = require_access(name)  # a tenant deletes its own adapters; garbage collection stays admin
        return registry_pb2.DeleteAdapterResponse(event_id=await self.store.delete_adapter(name, principal.actor))

    # Versions

    async def PublishVersion(self, request: registry_pb2.PublishVersionRequest, context: Context) -> Any:
        name = check_adapter_name(request.adapter)
        principal = require_access(name)
        digest = parse_uri(request.artifact_uri)
        if request.artifact_sha256 and request.artifact_sha256 != digest:
            raise InvalidArgument("artifact_sha256 does not match artifact_uri", reason="INVALID_ARTIFACT_URI")
        aliases = [check_alias(a) for a in request.aliases]
        if len(request.request_id) > MAX_REQUEST_ID:
            raise InvalidArgument(f"request_id longer than {MAX_REQUEST_ID}", reason="INVALID_REQUEST_ID")
        check_lora_config(request.lora_config)
        adapter = await self.store.get_adapter(name)
        if request.lineage.parent_adapter and request.lineage.parent_adapter != name:
            # A fork (init_from) of a version the caller could read; its source may be deleted later: not looked up.
            require_access(check_adapter_name(request.lineage.parent_adapter))
        elif request.lineage.parent_version:
            await self.store.get_version(name, request.lineage.parent_version)
        if not await self._may_publish(principal, digest):
            raise not_found(digest)  # the answer for a digest that does not exist: no existence oracle
        # The lease keeps GC from deleting the bytes between the verification and the publish script (which
        # refuses if a claim took the lease); refused outright while their deletion is under way.
        lease_id = uuid.uuid4().hex
        if not await self.store.lease_artifact(digest, lease_id, LEASE_TTL_MS):
            raise not_found(digest)
        try:
            return await self._publish_leased(request, principal, name, adapter, aliases, digest, lease_id)
        finally:
            await self.store.release_lease(digest, lease_id)

    async def _publish_leased(
        self,
        request: registry_pb2.PublishVersionRequest,
        principal: Principal,
        name: str,
        adapter: registry_pb2.Adapter,
        aliases: list[str],
        digest: str,
        lease_id: str,
    ) -> Any:
        # Verifies every file: the registry never references a partial or corrupt artifact.
        ref = await asyncio.to_thread(self.artifacts.ref, format_uri(digest))
        version = registry_pb2.Version(
            adapter=name,
            artifact_uri=ref.uri,
            artifact_sha256=ref.sha256,
            artifact_size_bytes=ref.size_bytes,
            lora_config=request.lora_config if request.HasField("lora_config") else adapter.lora_config,
            lineage=request.lineage,
        )
        published, event_id, _replayed = await self.store.publish_version(
            version,
            actor=principal.actor,
            aliases=aliases,
            skip_latest=request.skip_latest,
            request_id=request.request_id,
            expected_latest=request.expected_latest_version if request.HasField("expected_latest_version") else None,
            lease_id=lease_id,
        )
        return registry_pb2.PublishVersionResponse(version=published, event_id=event_id)

    async def _may_publish(self, principal: Principal, digest: str) -> bool:
        """A digest is not a bearer key: a user tenant publishes only bytes it uploaded itself or that a
        version it can access already uses (what the trainer produced for it). Admins (the trainer's and
        sampler's service tokens, operators) and the auth-off local principal may publish any stored artifact."""
        if principal.tenant is None or principal.is_admin:
            return True
        if await self.store.uploaded_by(digest, principal.tenant):
            return True
        return any(map(principal.can_access, await self.store.artifact_users(digest)))

    async def GetVersion(self, request: registry_pb2.GetVersionRequest, context: Context) -> Any:
        name = check_adapter_name(request.adapter)
        require_access(name)
        if request.version < 1:
            raise InvalidArgument("version numbers start at 1", reason="INVALID_VERSION")
        await self.store.get_adapter(name)
        return registry_pb2.GetVersionResponse(version=await self.store.get_version(name, request.version))

    async def ListVersions(self, request: registry_pb2.ListVersionsRequest, context: Context) -> Any:
        name = check_adapter_name(request.adapter)
        require_access(name)
        versions, token = await self.store.list_versions(name, request.page_size, request.page_token)
        return registry_pb2.ListVersionsResponse(versions=versions, next_page_token=token)

    async def Resolve(self, request: registry_pb2.ResolveRequest, context: Context) -> Any:
        ref = parse_reference(request.reference)
        require_access(ref.adapter)
        version = await self.store.resolve(request.reference)
        resolved = common_pb2.ResolvedVersion(
            adapter=version.adapter,
            version=version.version,
            reference=request.reference,
            artifact_sha256=version.artifact_sha256,
        )
        return registry_pb2.ResolveResponse(version=version, resolved=resolved)

    # Aliases

    async def SetAlias(self, request: registry_pb2.SetAliasRequest, context: Context) -> Any:
        name = check_adapter_name(request.adapter)
        alias = check_alias(request.alias)
        principal = require_access(name)
        if request.version < 1:
            raise InvalidArgument("version numbers start at 1", reason="INVALID_VERSION")
        expected = request.expected_version if request.HasField("expected_version") else None
        previous, version, event_id = await self.store.move_alias(
            name, alias, request.version, expected, principal.actor, "set"
        )
        return registry_pb2.SetAliasResponse(previous_version=previous, version=version, event_id=event_id)

    async def DeleteAlias(self, request: registry_pb2.DeleteAliasRequest, context: Context) -> Any:
        name = check_adapter_name(request.adapter)
        alias = check_alias(request.alias)
        principal = require_access(name)
        if alias == LATEST:
            raise FailedPrecondition("'latest' is managed by publishes and cannot be deleted", reason="ALIAS_MANAGED")
        expected = request.expected_version if request.HasField("expected_version") else None
        previous, event_id = await self.store.delete_alias(name, alias, expected, principal.actor)
        return registry_pb2.DeleteAliasResponse(previous_version=previous, event_id=event_id)

    async def SetServingAlias(self, request: registry_pb2.SetServingAliasRequest, context: Context) -> Any:
        name = check_adapter_name(request.adapter)
        alias = check_alias(request.alias or LATEST)
        principal = require_access(name)
        previous, version, event_id = await self.store.set_serving_alias(name, alias, principal.actor)
        return registry_pb2.SetServingAliasResponse(
            previous_alias=previous, alias=alias, version=version, event_id=event_id
        )

    async def Rollback(self, request: registry_pb2.RollbackRequest, context: Context) -> Any:
        name = check_adapter_name(request.adapter)
        alias = check_alias(request.alias or LATEST)
        principal = require_access(name)
        expected = request.expected_version if request.HasField("expected_version") else None
        if request.HasField("to_version"):
            if request.to_version < 1:
                raise InvalidArgument("version numbers start at 1", reason="INVALID_VERSION")
            move = await self.store.move_alias(
                name, alias, request.to_version, expected, principal.actor, "rollback-to"
            )
        else:
            move = await self.store.move_alias(name, alias, 0, expected, principal.actor, "rollback")
        previous, version, event_id = move
        return registry_pb2.RollbackResponse(alias=alias, from_version=previous, to_version=version, event_id=event_id)

    async def GetLineage(self, request: registry_pb2.GetLineageRequest, context: Context) -> Any:
        ref = parse_reference(request.reference)
        require_access(ref.adapter)
        return registry_pb2.GetLineageResponse(chain=await self.store.lineage(request.reference, request.max_depth))

    # Events

    async def WatchEvents(self, request: registry_pb2.WatchEventsRequest, context: Context) -> AsyncIterator[Any]:
        after = _check_event_id(request.after_event_id)
        patterns = [_check_watch_pattern(p) for p in request.adapters]
        principal = current_principal()
        with self.watches.hold(principal):
            async for message in self._watch(after, request.send_snapshot, _watch_filter(principal, patterns)):
                yield message

    async def _watch(self, after: str, send_snapshot: bool, visible: Any) -> AsyncIterator[Any]:
        if after in ("0", "0-0"):
            cursor = "0-0"
            reconcile_reason = "requested" if send_snapshot else ""
        elif after == "":
            cursor = await self.store.last_event_id()
            reconcile_reason = "requested" if send_snapshot else ""
        elif await self.store.event_exists(after):
            cursor = after
            reconcile_reason = "requested" if send_snapshot else ""
        else:
            # The id is gone (trimmed, or from another store): events may be missing. Never a silent gap.
            cursor = ""
            reconcile_reason = "trimmed"
        if reconcile_reason:
            # Take the id before the snapshot: events after it may repeat what the snapshot shows,
            # which absolute-state events make harmless.
            cursor = await self.store.last_event_id()
            adapters = [a for a in await self.store.alias_snapshot() if visible(a.adapter)]
            yield registry_pb2.WatchEventsResponse(
                reconcile=registry_pb2.Reconcile(event_id=cursor, adapters=adapters, reason=reconcile_reason)
            )
        # One shared Redis reader for every watch of this process (event_hub.py), not a connection each.
        async for record in self.events.events(cursor):
            if visible(record.event.adapter):
                yield registry_pb2.WatchEventsResponse(event=record.event)

    # Garbage collection and artifacts

    async def GarbageCollect(self, request: registry_pb2.GarbageCollectRequest, context: Context) -> Any:
        principal = require_admin("GarbageCollect")
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
            _count, freed = await sweep_unpublished(self.store, self.artifacts, self.limits.upload_grace_s)
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
        writers: list[ArtifactWriter] = []
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
        for chunk in chunked((chunk for _file, chunk in self.artifacts.iter_chunks(uri)), BLOCK_SIZE):
            yield registry_pb2.DownloadArtifactResponse(chunk=chunk)
