"""The registry's state in Redis: adapters, versions, aliases and the event stream.

Hashes are the truth; every change and its event are written by one Lua script (registry/scripts.py).
This module turns requests into script calls and Redis records back into protos. It knows nothing about
gRPC besides raising `ServiceError`s the interceptor maps to statuses.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis
from google.protobuf.timestamp_pb2 import Timestamp

from opentinker.registry import scripts
from opentinker.rpc.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ServiceError,
    Unavailable,
)
from opentinker.v1 import common_pb2, registry_pb2
from opentinker.weights.names import LATEST, parse_reference, tenant_of
from opentinker.weights.peft import alpha_or_rank

EVENTS_KEY = "ot:events"
ADAPTERS_KEY = "ot:adapters"

_ERRORS: dict[str, type[ServiceError]] = {
    "ADAPTER_NOT_FOUND": NotFound,
    "VERSION_NOT_FOUND": NotFound,
    "ALIAS_NOT_FOUND": NotFound,
    "ADAPTER_EXISTS": AlreadyExists,
    "VERSION_CONFLICT": FailedPrecondition,
    "NO_PREVIOUS_VERSION": FailedPrecondition,
    "NOT_OLDER": FailedPrecondition,
    "ARTIFACT_DELETED": FailedPrecondition,
    "ALIAS_SERVING": FailedPrecondition,
    "ARTIFACT_NOT_FOUND": NotFound,
    "ARTIFACT_LEASE_EXPIRED": Unavailable,
}

_EVENT_TYPES = {
    name.removeprefix("EVENT_TYPE_"): number
    for name, number in registry_pb2.EventType.items()
    if name != "EVENT_TYPE_UNSPECIFIED"
}


def _adapter_key(name: str) -> str:
    return f"ot:adapter:{name}"


def _version_prefix(name: str) -> str:
    return f"ot:version:{name}:"


def _refs_key(sha256: str) -> str:
    return f"ot:artifact:{sha256}:refs"


def _uploaders_key(sha256: str) -> str:
    return f"ot:artifact:{sha256}:uploaders"


def _leases_key(sha256: str) -> str:
    return f"ot:artifact:{sha256}:leases"


TENANT_PREFIX = "ot:tenant:"


def _tenant_uploads_key(tenant: str) -> str:
    return f"{TENANT_PREFIX}{tenant}:uploads"


def _tenant_reserved_key(tenant: str) -> str:
    return f"{TENANT_PREFIX}{tenant}:reserved"


UPLOADS_KEY = "ot:uploads"
DELETING_KEY = "ot:artifacts:deleting"


def _timestamp(ms: int) -> Timestamp:
    stamp = Timestamp()
    stamp.FromMilliseconds(ms)
    return stamp


def _now_ms() -> int:
    return int(time.time() * 1000)


@contextlib.contextmanager
def _redis_errors() -> Iterator[None]:
    """Script errors -> precise statuses; a lost connection -> UNAVAILABLE (the script did not run)."""
    try:
        yield
    except redis.ResponseError as exc:
        reason, _, message = str(exc).partition(" ")
        error = _ERRORS.get(reason)
        if error is None:
            raise
        raise error(message, reason=reason) from None
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise Unavailable(
            "the registry's database is unavailable; retry shortly, and if it persists ask the operator to check "
            "the registry's Redis",
            reason="STORE_UNAVAILABLE",
        ).logged_with(f"Redis: {type(exc).__name__}: {exc}") from None


def _encode_token(value: str) -> str:
    return base64.urlsafe_b64encode(value.encode()).decode()


def _decode_token(token: str) -> str:
    try:
        return base64.urlsafe_b64decode(token.encode()).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise InvalidArgument(f"invalid page token {token!r}", reason="INVALID_PAGE_TOKEN") from None


def _page_size(requested: int) -> int:
    if requested > 1000:
        raise InvalidArgument("page_size is at most 1000", reason="INVALID_PAGE_SIZE")
    return requested or 100


@dataclass(frozen=True, slots=True)
class EventRecord:
    event_id: str
    event: registry_pb2.Event


class RegistryStore:
    def __init__(self, client: aioredis.Redis, *, events_maxlen: int = 100_000) -> None:
        self.redis = client
        self.events_maxlen = events_maxlen
        self._scripts = {
            name: client.register_script(getattr(scripts, name))
            for name in (
                "CREATE_ADAPTER",
                "DELETE_ADAPTER",
                "PUBLISH_VERSION",
                "SET_ALIAS",
                "DELETE_ALIAS",
                "COLLECT_VERSION",
                "SET_SERVING_ALIAS",
                "CLAIM_UPLOAD",
                "LEASE_ARTIFACT",
                "RESERVE_QUOTA",
                "RECORD_UPLOAD",
            )
        }

    @classmethod
    def from_url(cls, url: str, *, events_maxlen: int = 100_000) -> RegistryStore:
        client = aioredis.Redis.from_url(url, decode_responses=False, socket_timeout=10, socket_connect_timeout=5)
        return cls(client, events_maxlen=events_maxlen)

    async def close(self) -> None:
        await self.redis.aclose()

    async def _run(self, script: str, keys: Sequence[str], args: Sequence[object]) -> Any:
        with _redis_errors():
            return await self._scripts[script](keys=list(keys), args=list(args))  # type: ignore[arg-type]

    # Adapters

    async def create_adapter(self, adapter: registry_pb2.Adapter, actor: str) -> tuple[registry_pb2.Adapter, str]:
        name = adapter.name
        record = registry_pb2.Adapter()
        record.CopyFrom(adapter)
        record.tenant = tenant_of(name)
        record.created_by = actor
        now = _now_ms()
        record.create_time.CopyFrom(_timestamp(now))
        keys = [_adapter_key(name), ADAPTERS_KEY, f"{_adapter_key(name)}:aliases", EVENTS_KEY]
        event_id = await self._run(
            "CREATE_ADAPTER", keys, [name, record.SerializeToString(), now, actor, self.events_maxlen]
        )
        return await self.get_adapter(name), _text(event_id)

    async def get_adapter(self, name: str) -> registry_pb2.Adapter:
        key = _adapter_key(name)
        with _redis_errors():
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hmget(key, ["proto", "deleted", "serving"])
                pipe.hgetall(f"{key}:aliases")
                pipe.get(f"{key}:seq")
                pipe.zcard(f"{key}:versions")
                (proto, deleted, serving), aliases, seq, count = await pipe.execute()
        if proto is None or deleted == b"1":
            raise NotFound(f"adapter {name!r} not found", reason="ADAPTER_NOT_FOUND", adapter=name)
        adapter = registry_pb2.Adapter.FromString(proto)
        for alias, version in aliases.items():
            adapter.aliases[_text(alias)] = int(version)
        adapter.latest_version = int(seq or 0)
        adapter.version_count = int(count)
        adapter.serving_alias = _text(serving) if serving else ""
        return adapter

    async def list_adapters(
        self, prefix: str, page_size: int, page_token: str, *, max_bytes: int = 8 << 20
    ) -> tuple[list[registry_pb2.Adapter], str]:
        """One page by name; it ends early once its records pass max_bytes, so a page always fits a message
        (records written before descriptions and labels were bounded may be large)."""
        size = _page_size(page_size)
        low = f"({_decode_token(page_token)}" if page_token else f"[{prefix}"
        high = f"[{prefix}\xff" if prefix else "+"
        with _redis_errors():
            names = await self.redis.zrangebylex(ADAPTERS_KEY, low, high, start=0, num=size + 1)
        page = [_text(n) for n in names[:size]]
        adapters: list[registry_pb2.Adapter] = []
        total = 0
        for index, name in enumerate(page):
            if adapters and total >= max_bytes:
                return adapters, _encode_token(page[index - 1])
            with contextlib.suppress(NotFound):  # deleted between the two reads
                adapters.append(await self.get_adapter(name))
                total += adapters[-1].ByteSize()
        next_token = _encode_token(page[-1]) if len(names) > size else ""
        return adapters, next_token

    async def delete_adapter(self, name: str, actor: str) -> str:
        key = _adapter_key(name)
        keys = [key, ADAPTERS_KEY, f"{key}:aliases", EVENTS_KEY]
        return _text(await self._run("DELETE_ADAPTER", keys, [name, _now_ms(), actor, self.events_maxlen]))

    # Versions

    async def publish_version(
        self,
        version: registry_pb2.Version,
        *,
        actor: str,
        aliases: Sequence[str],
        skip_latest: bool,
        request_id: str,
        expected_latest: int | None,
        lease_id: str,
    ) -> tuple[registry_pb2.Version, str, bool]:
        """Returns (version, event id, replayed): replayed when request_id was already published.
        lease_id: a lease on the artifact (lease_artifact), taken before its bytes were verified."""
        name = version.adapter
        record = registry_pb2.Version()
        record.CopyFrom(version)
        record.published_by = actor
        key = _adapter_key(name)
        keys = [
            key,
            f"{key}:seq",
            f"{key}:versions",
            f"{key}:aliases",
            f"{key}:requests",
            EVENTS_KEY,
            _refs_key(version.artifact_sha256),
            _version_prefix(name),
            f"{key}:history:",
            _leases_key(version.artifact_sha256),
            UPLOADS_KEY,
        ]
        args: list[str | bytes | int] = [
            name,
            record.SerializeToString(),
            version.artifact_sha256,
            _now_ms(),
            actor,
            self.events_maxlen,
            request_id,
            "1" if skip_latest else "0",
            "" if expected_latest is None else expected_latest,
            lease_id,
            *aliases,
        ]
        result = await self._run("PUBLISH_VERSION", keys, args)
        assert isinstance(result, list)
        status, payload = _text(result[0]), _text(result[1])
        number, event_id = payload.split(" ")
        return await self.get_version(name, int(number)), event_id, status == "REPLAY"

    async def get_version(self, name: str, number: int) -> registry_pb2.Version:
        with _redis_errors():
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hmget(f"{_version_prefix(name)}{number}", ["proto", "publish_ms", "deleted"])
                pipe.hgetall(f"{_adapter_key(name)}:aliases")
                (proto, publish_ms, deleted), aliases = await pipe.execute()
        if proto is None:
            raise NotFound(
                f"version {number} of {name!r} not found",
                reason="VERSION_NOT_FOUND",
                adapter=name,
                version=number,
            )
        version = registry_pb2.Version.FromString(proto)
        version.version = number
        version.publish_time.CopyFrom(_timestamp(int(publish_ms)))
        version.artifact_deleted = deleted == b"1"
        version.aliases.extend(sorted(_text(a) for a, v in aliases.items() if int(v) == number))
        return version

    async def list_versions(self, name: str, page_size: int, page_token: str) -> tuple[list[registry_pb2.Version], str]:
        await self.get_adapter(name)
        size = _page_size(page_size)
        high = "+inf"
        if page_token:
            cursor = _decode_token(page_token)
            if not cursor.isdigit():
                raise InvalidArgument(f"invalid page token {page_token!r}", reason="INVALID_PAGE_TOKEN")
            high = f"({cursor}"
        with _redis_errors():
            numbers = await self.redis.zrevrangebyscore(
                f"{_adapter_key(name)}:versions", high, "-inf", start=0, num=size + 1
            )
        page = [int(_text(n)) for n in numbers[:size]]
        versions = [await self.get_version(name, n) for n in page]
        return versions, (_encode_token(str(page[-1])) if len(numbers) > size else "")

    async def resolve(self, reference: str) -> registry_pb2.Version:
        ref = parse_reference(reference)
        if ref.is_base:
            raise InvalidArgument("'base' is the base model, not a registry adapter", reason="INVALID_REFERENCE")
        if ref.version is not None:
            await self.get_adapter(ref.adapter)
            return await self.get_version(ref.adapter, ref.version)
        adapter = await self.get_adapter(ref.adapter)
        alias = (adapter.serving_alias or LATEST) if ref.bare else (ref.alias or LATEST)
        if alias not in adapter.aliases:
            raise NotFound(
                f"alias {alias!r} of {ref.adapter!r} is not set"
                + (" (no version published yet)" if alias == LATEST else ""),
                reason="ALIAS_NOT_FOUND",
                adapter=ref.adapter,
                alias=alias,
            )
        return await self.get_version(ref.adapter, adapter.aliases[alias])

    async def lineage(self, reference: str, max_depth: int) -> list[registry_pb2.Version]:
        version = await self.resolve(reference)
        chain = [version]
        while version.lineage.parent_version and (max_depth == 0 or len(chain) < max_depth):
            version = await self.get_version(
                version.lineage.parent_adapter or version.adapter, version.lineage.parent_version
            )
            chain.append(version)
        return chain

    # Aliases

    async def move_alias(
        self, name: str, alias: str, version: int, expected: int | None, actor: str, mode: str
    ) -> tuple[int, int, str]:
        """mode: 'set', 'rollback-to' (version must be older) or 'rollback' (one step back in history)."""
        key = _adapter_key(name)
        keys = [
            key,
            f"{key}:versions",
            f"{key}:aliases",
            f"{key}:history:{alias}",
            EVENTS_KEY,
            _version_prefix(name),
        ]
        args = [
            name,
            alias,
            version,
            "" if expected is None else expected,
            _now_ms(),
            actor,
            self.events_maxlen,
            mode,
        ]
        result = await self._run("SET_ALIAS", keys, args)
        assert isinstance(result, list)
        return int(result[0]), int(result[1]), _text(result[2])

    async def delete_alias(self, name: str, alias: str, expected: int | None, actor: str) -> tuple[int, str]:
        key = _adapter_key(name)
        keys = [key, f"{key}:aliases", f"{key}:history:{alias}", EVENTS_KEY]
        args: list[str | bytes | int] = [
            name,
            alias,
            "" if expected is None else expected,
            _now_ms(),
            actor,
            self.events_maxlen,
        ]
        result = await self._run("DELETE_ALIAS", keys, args)
        assert isinstance(result, list)
        return int(result[0]), _text(result[1])

    async def set_serving_alias(self, name: str, alias: str, actor: str) -> tuple[str, int, str]:
        """Returns (previous serving alias, version a bare name resolves to now, event id)."""
        key = _adapter_key(name)
        keys = [key, f"{key}:aliases", EVENTS_KEY]
        result = await self._run("SET_SERVING_ALIAS", keys, [name, alias, _now_ms(), actor, self.events_maxlen])
        assert isinstance(result, list)
        return _text(result[0]), int(result[1]), _text(result[2])

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
            f"{_version_prefix(name)}{version.version}",
            f"{_adapter_key(name)}:aliases",
            EVENTS_KEY,
            _refs_key(sha),
            _adapter_key(name),
            _uploaders_key(sha),
            _leases_key(sha),
            DELETING_KEY,
            UPLOADS_KEY,
        ]
        args = [name, version.version, _now_ms(), actor, self.events_maxlen, cutoff_ms, TENANT_PREFIX]
        remaining, claimed = await self._run("COLLECT_VERSION", keys, args)
        return None if int(remaining) < 0 else (int(remaining), bool(int(claimed)))

    async def claim_upload(self, sha256: str, cutoff_ms: int) -> bool:
        """The sweep's decision on an unpublished upload: True when its bytes are claimed for deletion."""
        keys = [_refs_key(sha256), _uploaders_key(sha256), _leases_key(sha256), DELETING_KEY, UPLOADS_KEY]
        return int(await self._run("CLAIM_UPLOAD", keys, [sha256, _now_ms(), cutoff_ms, TENANT_PREFIX])) == 1

    async def finish_deletion(self, sha256: str) -> None:
        """The claimed bytes are gone: the digest may be uploaded and published again."""
        with _redis_errors():
            await self.redis.zrem(DELETING_KEY, sha256)

    async def deletions_before(self, before_ms: int) -> list[str]:
        """Claims older than before_ms that nobody finished (the deleting process died)."""
        with _redis_errors():
            digests: Any = await self.redis.zrangebyscore(DELETING_KEY, "-inf", before_ms, start=0, num=1000)
        return [_text(d) for d in digests]

    async def lease_artifact(self, sha256: str, lease_id: str, ttl_ms: int) -> bool:
        """Keeps the artifact from being claimed until release_lease (or ttl_ms); False while its deletion is
        under way."""
        keys = [_leases_key(sha256), DELETING_KEY]
        return int(await self._run("LEASE_ARTIFACT", keys, [sha256, lease_id, _now_ms() + ttl_ms])) == 1

    async def release_lease(self, sha256: str, lease_id: str) -> None:
        with _redis_errors():
            await self.redis.zrem(_leases_key(sha256), lease_id)

    async def artifact_users(self, sha256: str) -> list[str]:
        """Adapters with a live version that uses this artifact."""
        with _redis_errors():
            members: Any = await self.redis.smembers(_refs_key(sha256))
        return sorted({_text(m).rsplit("@", 1)[0] for m in members})

    # Uploads: who sent which bytes (publishing needs it), how much each tenant stores, what is unpublished

    async def reserve_quota(
        self, tenant: str, upload_id: str, size_bytes: int, quota: int, ttl_ms: int
    ) -> tuple[bool, int]:
        """Counts an upload in progress to the tenant's quota, checked in the same step. Returns (reserved,
        bytes the tenant's stored artifacts and other uploads in progress hold). A live reservation of
        upload_id is renewed without a check (the bytes are then -1: not read)."""
        keys = [_tenant_uploads_key(tenant), _tenant_reserved_key(tenant)]
        now = _now_ms()
        result = await self._run("RESERVE_QUOTA", keys, [upload_id, size_bytes, quota, now, now + ttl_ms])
        ok, counted = int(result[0]), int(result[1])
        return bool(ok), (counted - size_bytes if ok and counted >= 0 else counted)

    async def release_reservation(self, tenant: str, upload_id: str) -> None:
        with _redis_errors():
            await self.redis.hdel(_tenant_reserved_key(tenant), upload_id)

    async def record_upload(self, sha256: str, tenant: str, size_bytes: int, lease_id: str, upload_id: str) -> None:
        """tenant: the uploader's tenant ("" with auth off). Releases the lease and the reservation (upload_id,
        "" if none) in the same step."""
        keys = [
            _uploaders_key(sha256),
            _tenant_uploads_key(tenant),
            UPLOADS_KEY,
            _leases_key(sha256),
            _tenant_reserved_key(tenant),
        ]
        await self._run("RECORD_UPLOAD", keys, [sha256, tenant, size_bytes, _now_ms(), lease_id, upload_id])

    async def uploaded_by(self, sha256: str, tenant: str) -> bool:
        with _redis_errors():
            return bool(await self.redis.sismember(_uploaders_key(sha256), tenant))

    async def tenant_usage(self, tenant: str) -> int:
        """Bytes of the artifacts this tenant uploaded that are still stored."""
        with _redis_errors():
            sizes: Any = await self.redis.hvals(_tenant_uploads_key(tenant))
        return sum(int(size) for size in sizes)

    async def uploads_before(self, before_ms: int, count: int = 1000) -> list[str]:
        """Digests uploaded (last) before before_ms that the sweep has not looked at yet, oldest first."""
        with _redis_errors():
            digests: Any = await self.redis.zrangebyscore(UPLOADS_KEY, "-inf", before_ms, start=0, num=count)
        return [_text(d) for d in digests]

    async def all_version_numbers(self, name: str) -> list[int]:
        with _redis_errors():
            numbers: Any = await self.redis.zrevrange(f"{_adapter_key(name)}:versions", 0, -1)
        return [int(n) for n in numbers]

    async def all_adapter_names(self) -> list[str]:
        """Every adapter with versions, deleted ones included (their versions still hold artifacts)."""
        with _redis_errors():
            names = [_text(n) async for n in self.redis.scan_iter(match="ot:adapter:*:versions", count=1000)]
        return sorted(n.removeprefix("ot:adapter:").removesuffix(":versions") for n in names)

    # Events

    async def last_event_id(self) -> str:
        with _redis_errors():
            entries = await self.redis.xrevrange(EVENTS_KEY, count=1)
        return _text(entries[0][0]) if entries else "0-0"

    async def event_exists(self, event_id: str) -> bool:
        with _redis_errors():
            try:
                return bool(await self.redis.xrange(EVENTS_KEY, event_id, event_id, count=1))
            except redis.ResponseError:
                raise InvalidArgument(f"invalid event id {event_id!r}", reason="INVALID_EVENT_ID") from None

    async def read_events(self, after_id: str, block_ms: int | None, count: int = 256) -> list[EventRecord]:
        """Events after `after_id`, waiting up to block_ms for one (None: answer at once)."""
        with _redis_errors():
            try:
                streams: Any = await self.redis.xread({EVENTS_KEY: after_id}, count=count, block=block_ms)
            except redis.ResponseError:
                raise InvalidArgument(f"invalid event id {after_id!r}", reason="INVALID_EVENT_ID") from None
        records = []
        for _stream, entries in streams or []:
            for entry_id, fields in entries:
                event_id = _text(entry_id)
                records.append(EventRecord(event_id, event_from_fields(event_id, fields)))
        return records

    async def alias_snapshot(self) -> list[registry_pb2.AdapterAliases]:
        with _redis_errors():
            names = [_text(n) for n in await self.redis.zrange(ADAPTERS_KEY, 0, -1)]
            snapshot = []
            for name in names:
                aliases = await self.redis.hgetall(f"{_adapter_key(name)}:aliases")
                serving = await self.redis.hget(_adapter_key(name), "serving")
                entry = registry_pb2.AdapterAliases(adapter=name, serving_alias=_text(serving) if serving else "")
                entry.aliases.update({_text(a): int(v) for a, v in aliases.items()})
                snapshot.append(entry)
        return snapshot

    async def ping(self) -> bool:
        with _redis_errors():
            return bool(await self.redis.ping())


def event_from_fields(event_id: str, fields: dict[bytes, bytes]) -> registry_pb2.Event:
    get = {_text(k): _text(v) for k, v in fields.items()}.get
    event = registry_pb2.Event(
        event_id=event_id,
        type=_EVENT_TYPES.get(get("type") or "", registry_pb2.EVENT_TYPE_UNSPECIFIED),  # type: ignore[arg-type]
        adapter=get("adapter") or "",
        version=int(get("version") or 0),
        alias=get("alias") or "",
        previous_version=int(get("previous") or 0),
        actor=get("actor") or "",
        cause=get("cause") or "",
        artifact_sha256=get("artifact") or "",
        serving_alias=get("serving") or "",
    )
    event.time.CopyFrom(_timestamp(int(get("time") or 0)))
    for alias, version in json.loads(get("aliases") or "{}").items():
        event.aliases[alias] = int(version)
    return event


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def lora_or_default(config: common_pb2.LoraConfig) -> common_pb2.LoraConfig:
    """Fills unset LoRA fields with the Tinker defaults (rank 32, alpha = rank, all-linear)."""
    filled = common_pb2.LoraConfig()
    filled.CopyFrom(config)
    filled.rank = filled.rank or 32
    filled.alpha = alpha_or_rank(filled.alpha, filled.rank)
    if not filled.target_modules:
        filled.target_modules.append("all-linear")
    return filled
