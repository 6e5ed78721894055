"""Uploads as a shared resource: a file-count bound per artifact, a storage quota per tenant, and the sweep that
collects uploads nobody published within a grace period (an upload is otherwise kept forever: nothing
references it, so the version GC never sees it)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence

from opentinker.registry.limits import RegistryLimits
from opentinker.registry.store import RegistryStore
from opentinker.rpc.auth import Principal
from opentinker.rpc.errors import InvalidArgument, ResourceExhausted, ServiceError
from opentinker.weights.artifact_manifest import ArtifactFile, format_uri
from opentinker.weights.artifact_store import ArtifactStore

log = logging.getLogger(__name__)


def check_file_count(limits: RegistryLimits, count: int) -> None:
    if count > limits.max_artifact_files:
        raise InvalidArgument(
            f"artifact of {count} files: at most {limits.max_artifact_files}",
            reason="TOO_MANY_FILES",
            limit=limits.max_artifact_files,
        )


def check_upload(limits: RegistryLimits, files: Sequence[ArtifactFile], used_bytes: int | None) -> None:
    """The declared files against the bounds, before anything is created. used_bytes: the tenant's stored
    bytes (None: not subject to the quota: admins, i.e. the servers' service tokens, and auth off)."""
    check_file_count(limits, len(files))
    size = sum(f.size for f in files)
    if size > limits.max_artifact_bytes:
        raise InvalidArgument(f"artifact larger than {limits.max_artifact_bytes} bytes", reason="ARTIFACT_TOO_LARGE")
    quota = limits.tenant_storage_quota_bytes
    if quota and used_bytes is not None and used_bytes + size > quota:
        raise ResourceExhausted(
            f"this upload of {size} bytes would take the tenant's stored artifacts to {used_bytes + size} bytes, "
            f"beyond its quota of {quota} (delete adapters and collect garbage, or ask an admin)",
            reason="STORAGE_QUOTA_EXCEEDED",
            limit=quota,
        )


async def stored_bytes(store: RegistryStore, principal: Principal) -> int | None:
    if principal.tenant is None or principal.is_admin:
        return None
    return await store.tenant_usage(principal.tenant)


async def sweep_unpublished(store: RegistryStore, artifacts: ArtifactStore, grace_s: float) -> tuple[int, int]:
    """Deletes uploads older than grace_s that no version uses; returns (artifacts, bytes) freed."""
    cutoff = int((time.time() - grace_s) * 1000)
    collected = freed = 0
    for digest in await store.uploads_before(cutoff):
        if await store.artifact_in_use(digest):
            await store.settle_upload(digest)
            continue
        freed += await asyncio.to_thread(artifacts.delete, format_uri(digest))
        await store.forget_upload(digest)
        collected += 1
    return collected, freed


class UploadSweeper:
    """Runs sweep_unpublished every quarter of the grace period (at most every 5 minutes) while the server runs;
    started by the first upload, so a registry nobody uploads to runs no task."""

    def __init__(self, store: RegistryStore, artifacts: ArtifactStore, grace_s: float) -> None:
        self.store, self.artifacts, self.grace_s = store, artifacts, grace_s
        self._task: asyncio.Task[None] | None = None

    def ensure_running(self) -> None:
        if self.grace_s > 0 and (self._task is None or self._task.done()):
            self._task = asyncio.create_task(self._run(), name="registry-upload-sweeper")

    async def _run(self) -> None:
        interval = min(max(self.grace_s / 4, 0.5), 300.0)
        while True:
            await asyncio.sleep(interval)
            try:
                collected, freed = await sweep_unpublished(self.store, self.artifacts, self.grace_s)
            except (ServiceError, OSError) as error:
                log.warning("upload sweep failed (next try in %.0fs): %s", interval, error)
                continue
            if collected:
                log.info("collected %d unpublished uploads (%d bytes)", collected, freed)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
