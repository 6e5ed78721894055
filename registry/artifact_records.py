"""The registry store's artifact accounting: garbage-collection claims, publish leases, who uploaded which
bytes and how much each tenant stores, and the listings the collector walks."""

from __future__ import annotations

from typing import Any

from opentinker.registry.store_base import (
    DELETING_KEY,
    EVENTS_KEY,
    TENANT_PREFIX,
    UPLOADS_KEY,
    StoreBase,
    adapter_key,
    leases_key,
    now_ms,
    redis_errors,
    refs_key,
    tenant_reserved_key,
    tenant_uploads_key,
    text,
    uploaders_key,
    version_prefix,
)
from opentinker.v1 import registry_pb2


class ArtifactRecords(StoreBase):
    # Garbage collection: deciding that bytes go and releasing their accounting is one script (a claim);
    # the caller then deletes the bytes and removes the tombstone (finish_deletion).

    async def collect_version(
        self, version: registry_pb2.Version, actor: str, cutoff_ms: int
    ) -> tuple[int, bool] | None:
        """Marks the version's artifact collected; returns (versions still using the artifact, whether its bytes
        are now claimed for deletion), or None if an alias points at it now (skipped). cutoff_ms: an upload of
        the same bytes after it keeps them (it may be about to be published)."""
        name = version.adapter
        sha = version.artifact_sha256
        keys = [
            f"{version_prefix(name)}{version.version}",
            f"{adapter_key(name)}:aliases",
            EVENTS_KEY,
            refs_key(sha),
            adapter_key(name),
            uploaders_key(sha),
            leases_key(sha),
            DELETING_KEY,
            UPLOADS_KEY,
        ]
        args = [name, version.version, now_ms(), actor, self.events_maxlen, cutoff_ms, TENANT_PREFIX]
        remaining, claimed = await self._run("COLLECT_VERSION", keys, args)
        return None if int(remaining) < 0 else (int(remaining), bool(int(claimed)))

    async def claim_upload(self, sha256: str, cutoff_ms: int) -> bool:
        """The sweep's decision on an unpublished upload: True when its bytes are claimed for deletion."""
        keys = [refs_key(sha256), uploaders_key(sha256), leases_key(sha256), DELETING_KEY, UPLOADS_KEY]
        return int(await self._run("CLAIM_UPLOAD", keys, [sha256, now_ms(), cutoff_ms, TENANT_PREFIX])) == 1

    async def claim_orphan(self, sha256: str, cutoff_ms: int) -> bool:
        """The bucket sweep's decision on objects nobody published: True when claimed for deletion."""
        keys = [refs_key(sha256), uploaders_key(sha256), leases_key(sha256), DELETING_KEY, UPLOADS_KEY]
        return int(await self._run("CLAIM_ORPHAN", keys, [sha256, now_ms(), cutoff_ms, TENANT_PREFIX])) == 1

    async def finish_deletion(self, sha256: str) -> None:
        """The claimed bytes are gone: the digest may be uploaded and published again."""
        with redis_errors():
            await self.redis.zrem(DELETING_KEY, sha256)

    async def deletions_before(self, before_ms: int) -> list[str]:
        """Claims older than before_ms that nobody finished (the deleting process died)."""
        with redis_errors():
            digests: Any = await self.redis.zrangebyscore(DELETING_KEY, "-inf", before_ms, start=0, num=1000)
        return [text(d) for d in digests]

    async def lease_artifact(self, sha256: str, lease_id: str, ttl_ms: int) -> bool:
        """Keeps the artifact from being claimed until release_lease (or ttl_ms); False while its deletion is
        under way."""
        keys = [leases_key(sha256), DELETING_KEY]
        return int(await self._run("LEASE_ARTIFACT", keys, [sha256, lease_id, now_ms() + ttl_ms])) == 1

    async def release_lease(self, sha256: str, lease_id: str) -> None:
        with redis_errors():
            await self.redis.zrem(leases_key(sha256), lease_id)

    async def artifact_users(self, sha256: str) -> list[str]:
        """Adapters with a live version that uses this artifact."""
        with redis_errors():
            members: Any = await self.redis.smembers(refs_key(sha256))
        return sorted({text(m).rsplit("@", 1)[0] for m in members})

    # Uploads: who sent which bytes (publishing needs it), how much each tenant stores, what is unpublished

    async def reserve_quota(
        self, tenant: str, upload_id: str, size_bytes: int, quota: int, ttl_ms: int
    ) -> tuple[bool, int]:
        """Counts an upload in progress to the tenant's quota, checked in the same step. Returns (reserved,
        bytes the tenant's stored artifacts and other uploads in progress hold). A live reservation of
        upload_id is renewed without a check (the bytes are then -1: not read)."""
        keys = [tenant_uploads_key(tenant), tenant_reserved_key(tenant)]
        now = now_ms()
        result = await self._run("RESERVE_QUOTA", keys, [upload_id, size_bytes, quota, now, now + ttl_ms])
        ok, counted = int(result[0]), int(result[1])
        return bool(ok), (counted - size_bytes if ok and counted >= 0 else counted)

    async def release_reservation(self, tenant: str, upload_id: str) -> None:
        with redis_errors():
            await self.redis.hdel(tenant_reserved_key(tenant), upload_id)

    async def record_upload(self, sha256: str, tenant: str, size_bytes: int, lease_id: str, upload_id: str) -> None:
        """tenant: the uploader's tenant ("" with auth off). Releases the lease and the reservation (upload_id,
        "" if none) in the same step."""
        keys = [
            uploaders_key(sha256),
            tenant_uploads_key(tenant),
            UPLOADS_KEY,
            leases_key(sha256),
            tenant_reserved_key(tenant),
        ]
        await self._run("RECORD_UPLOAD", keys, [sha256, tenant, size_bytes, now_ms(), lease_id, upload_id])

    async def uploaded_by(self, sha256: str, tenant: str) -> bool:
        with redis_errors():
            return bool(await self.redis.sismember(uploaders_key(sha256), tenant))

    async def uploads_before(self, before_ms: int, count: int = 1000) -> list[str]:
        """Digests uploaded (last) before before_ms that the sweep has not looked at yet, oldest first."""
        with redis_errors():
            digests: Any = await self.redis.zrangebyscore(UPLOADS_KEY, "-inf", before_ms, start=0, num=count)
        return [text(d) for d in digests]

    async def all_version_numbers(self, name: str) -> list[int]:
        with redis_errors():
            numbers: Any = await self.redis.zrevrange(f"{adapter_key(name)}:versions", 0, -1)
        return [int(n) for n in numbers]

    async def all_adapter_names(self) -> list[str]:
        """Every adapter with versions, deleted ones included (their versions still hold artifacts)."""
        with redis_errors():
            names = [text(n) async for n in self.redis.scan_iter(match="ot:adapter:*:versions", count=1000)]
        return sorted(n.removeprefix("ot:adapter:").removesuffix(":versions") for n in names)
