"""Uploads as a shared resource: a file-count bound per artifact, a storage quota per tenant, and the sweep that
collects uploads nobody published within a grace period (an upload is otherwise kept forever: nothing
references it, so the version GC never sees it).

Deleting an artifact's bytes is decided by one script (a claim, registry/scripts.py) that also takes the
artifact out of every tenant's quota and leaves a tombstone; the bytes are deleted only after it. Uploads and
publishes hold a lease on the digest while they write or verify the bytes, which a claim respects."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import uuid
from collections.abc import Sequence

from opentinker.registry.artifact_backend import BucketArtifacts, RegistryArtifacts
from opentinker.registry.limits import RegistryLimits
from opentinker.registry.store import RegistryStore
from opentinker.rpc.serving.auth import Principal
from opentinker.rpc.serving.errors import Internal, InvalidArgument, ResourceExhausted, ServiceError, Unavailable
from opentinker.weights.artifact_manifest import ArtifactFile, ArtifactRef, format_uri, manifest_bytes

log = logging.getLogger(__name__)

# Longer than committing or verifying the largest artifact takes; a lease only outlives its holder when the
# registry dies, and then it merely postpones a collection.
LEASE_TTL_MS = 10 * 60 * 1000
# Renewed while the upload's messages arrive, so only an upload stalled this long (or a dead registry) lets its
# reservation lapse; it is then checked again.
RESERVATION_TTL_MS = 10 * 60 * 1000
RENEW_EVERY_S = 60.0
# A claim's bytes are renamed away within milliseconds; a tombstone this old means its deleter died.
STALE_DELETION_MS = 5 * 60 * 1000
# An upload of bytes whose deletion is under way waits for it (milliseconds) rather than racing it.
DELETION_WAIT_S = 30.0


def check_file_count(limits: RegistryLimits, count: int) -> None:
    if count > limits.max_artifact_files:
        raise InvalidArgument(
            f"artifact of {count} files: at most {limits.max_artifact_files}",
            reason="TOO_MANY_FILES",
            limit=limits.max_artifact_files,
        )


def check_upload(limits: RegistryLimits, files: Sequence[ArtifactFile]) -> None:
    """The declared files against the bounds, before anything is created or reserved."""
    check_file_count(limits, len(files))
    size = sum(f.size for f in files)
    if size > limits.max_artifact_bytes:
        raise InvalidArgument(f"artifact larger than {limits.max_artifact_bytes} bytes", reason="ARTIFACT_TOO_LARGE")


def expected_artifact(files: Sequence[ArtifactFile]) -> tuple[str, int]:
    """The digest and stored size (manifest included) that the declared files commit to if they arrive intact:
    the lease and the reservation need them before the first byte."""
    canonical = [ArtifactFile(f.path, f.sha256.lower(), f.size) for f in files]
    manifest = manifest_bytes(canonical)
    return hashlib.sha256(manifest).hexdigest(), sum(f.size for f in files) + len(manifest)


def quota_of(limits: RegistryLimits, principal: Principal) -> int | None:
    """None: not subject to the quota (admins, i.e. the servers' service tokens, auth off, or no quota)."""
    if principal.tenant is None or principal.is_admin or not limits.tenant_storage_quota_bytes:
        return None
    return limits.tenant_storage_quota_bytes


def keep_uploads_after_ms(grace_s: float) -> int:
    """Uploads after this are kept by the version GC: they may be about to be published (0 grace: all are)."""
    return int((time.time() - grace_s) * 1000) if grace_s > 0 else 0


async def lease_for_commit(store: RegistryStore, digest: str, lease_id: str) -> None:
    """A lease for an upload about to commit. If the digest's deletion is under way, the commit must come after
    the old bytes are gone (committing onto them would keep bytes that are about to be deleted)."""
    deadline = time.monotonic() + DELETION_WAIT_S
    while not await store.lease_artifact(digest, lease_id, LEASE_TTL_MS):
        if time.monotonic() > deadline:
            raise Unavailable(
                f"artifact {format_uri(digest)} is being deleted by garbage collection; upload it again",
                reason="ARTIFACT_BEING_DELETED",
                uri=format_uri(digest),
            )
        await asyncio.sleep(0.02)


class UploadHold:
    """What an upload in progress holds in the store: a quota reservation from its manifest on (tenants subject
    to the quota), and a lease on its digest from just before the commit. record() turns both into the stored
    upload in one step; release() gives them back when the upload fails."""

    def __init__(self, store: RegistryStore, tenant: str, quota: int | None) -> None:
        self.store, self.tenant, self.quota = store, tenant, quota
        self.id = uuid.uuid4().hex
        self.size = 0
        self.reserved = False
        self.leased = ""
        self._renew_at = 0.0

    async def reserve(self, size: int) -> None:
        if self.quota is None:
            return
        self.size = size
        ok, used = await self.store.reserve_quota(self.tenant, self.id, size, self.quota, RESERVATION_TTL_MS)
        if not ok:
            raise ResourceExhausted(
                f"this upload of {size} bytes would take the tenant's stored artifacts and uploads in progress to "
                f"{used + size} bytes, beyond its quota of {self.quota} (delete adapters and collect garbage, or "
                "ask an admin)",
                reason="STORAGE_QUOTA_EXCEEDED",
                limit=self.quota,
            )
        self.reserved = True
        self._renew_at = time.monotonic() + RENEW_EVERY_S

    async def keep(self) -> None:
        if self.reserved and time.monotonic() >= self._renew_at:
            await self.reserve(self.size)

    async def lease(self, digest: str) -> None:
        await lease_for_commit(self.store, digest, self.id)
        self.leased = digest

    async def record(self, ref: ArtifactRef) -> None:
        if ref.sha256 != self.leased:  # the digest was predicted from the manifest; anything else is a bug
            raise Internal(f"committed {ref.uri}, leased sha256:{self.leased}", reason="UPLOAD_DIGEST_CHANGED")
        await self.store.record_upload(
            ref.sha256, self.tenant, ref.size_bytes, self.id, self.id if self.reserved else ""
        )
        self.reserved, self.leased = False, ""

    async def release(self) -> None:
        if self.leased:
            await self.store.release_lease(self.leased, self.id)
            self.leased = ""
        if self.reserved:
            await self.store.release_reservation(self.tenant, self.id)
            self.reserved = False


async def delete_claimed(store: RegistryStore, artifacts: RegistryArtifacts, digest: str) -> int:
    """Deletes bytes a claim decided to delete; returns the bytes freed. The tombstone goes only once they are
    gone: if deleting fails, the stale-claim sweep tries again."""
    freed = await asyncio.to_thread(artifacts.delete, format_uri(digest))
    await store.finish_deletion(digest)
    return freed


async def sweep_unpublished(
    store: RegistryStore, artifacts: RegistryArtifacts, grace_s: float, *, bucket_orphans: bool = False
) -> tuple[int, int]:
    """Deletes uploads older than grace_s (> 0) that no version uses, and finishes deletions whose deleter died;
    bucket_orphans (`opentinker registry gc` only: it lists the bucket): also objects pushed to a bucket store
    and never published. Returns (artifacts, bytes) freed."""
    now = time.time()
    cutoff = int((now - grace_s) * 1000)
    collected = freed = 0
    for digest in await store.uploads_before(cutoff) if grace_s > 0 else ():  # 0: none are deleted
        if await store.claim_upload(digest, cutoff):
            freed += await delete_claimed(store, artifacts, digest)
            collected += 1
    if bucket_orphans and grace_s > 0 and isinstance(artifacts, BucketArtifacts):
        # Pushed straight to the bucket by a trainer that never published them (killed, or its publish refused):
        # the registry has no record, only the objects' own timestamps say how old they are.
        for digest in await asyncio.to_thread(artifacts.written_before, now - grace_s):
            if await store.claim_orphan(digest, cutoff):
                freed += await delete_claimed(store, artifacts, digest)
                collected += 1
    for digest in await store.deletions_before(int(now * 1000) - STALE_DELETION_MS):
        freed += await delete_claimed(store, artifacts, digest)
    return collected, freed


class UploadSweeper:
    """Runs sweep_unpublished every quarter of the grace period (at most every 5 minutes) while the server runs;
    started by the first upload, so a registry nobody uploads to runs no task."""

    def __init__(self, store: RegistryStore, artifacts: RegistryArtifacts, grace_s: float) -> None:
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
