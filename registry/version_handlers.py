"""RegistryService handlers for versions: publish (of an artifact the caller may publish, leased against GC
until the version holds it), get, list, resolve a reference, and a version's lineage."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from opentinker.registry.handler_base import Context, Handlers
from opentinker.registry.lora_config import check_lora_config
from opentinker.registry.uploads import (
    LEASE_TTL_MS,
)
from opentinker.rpc.serving.auth import Principal, require_access
from opentinker.rpc.serving.errors import InvalidArgument
from opentinker.v1 import common_pb2, registry_pb2
from opentinker.weights.artifact_manifest import format_uri, not_found, parse_uri
from opentinker.weights.names import check_adapter_name, check_alias, parse_reference

MAX_REQUEST_ID = 128


class VersionHandlers(Handlers):
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
            owner_epoch=request.owner_epoch,
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

    async def GetLineage(self, request: registry_pb2.GetLineageRequest, context: Context) -> Any:
        ref = parse_reference(request.reference)
        require_access(ref.adapter)
        return registry_pb2.GetLineageResponse(chain=await self.store.lineage(request.reference, request.max_depth))
