"""The registry store's adapters and versions: create, read, page and delete adapters; publish, read and page
versions; resolve a reference; walk a version's lineage."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from opentinker.registry.store_base import (
    ADAPTERS_KEY,
    EVENTS_KEY,
    UPLOADS_KEY,
    StoreBase,
    adapter_key,
    check_page_size,
    decode_token,
    encode_token,
    leases_key,
    now_ms,
    placement_key,
    redis_errors,
    refs_key,
    text,
    timestamp,
    version_prefix,
)
from opentinker.rpc.serving.errors import (
    InvalidArgument,
    NotFound,
)
from opentinker.v1 import registry_pb2
from opentinker.weights.names import LATEST, parse_reference, tenant_of


class AdapterStore(StoreBase):
    async def create_adapter(self, adapter: registry_pb2.Adapter, actor: str) -> tuple[registry_pb2.Adapter, str]:
        name = adapter.name
        record = registry_pb2.Adapter()
        record.CopyFrom(adapter)
        record.tenant = tenant_of(name)
        record.created_by = actor
        now = now_ms()
        record.create_time.CopyFrom(timestamp(now))
        keys = [adapter_key(name), ADAPTERS_KEY, f"{adapter_key(name)}:aliases", EVENTS_KEY]
        event_id = await self._run(
            "CREATE_ADAPTER", keys, [name, record.SerializeToString(), now, actor, self.events_maxlen]
        )
        return await self.get_adapter(name), text(event_id)

    async def get_adapter(self, name: str) -> registry_pb2.Adapter:
        key = adapter_key(name)
        with redis_errors():
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
            adapter.aliases[text(alias)] = int(version)
        adapter.latest_version = int(seq or 0)
        adapter.version_count = int(count)
        adapter.serving_alias = text(serving) if serving else ""
        return adapter

    async def list_adapters(
        self, prefix: str, page_size: int, page_token: str, *, max_bytes: int = 8 << 20
    ) -> tuple[list[registry_pb2.Adapter], str]:
        """One page by name; it ends early once its records pass max_bytes, so a page always fits a message
        (records written before descriptions and labels were bounded may be large)."""
        size = check_page_size(page_size)
        low = f"({decode_token(page_token)}" if page_token else f"[{prefix}"
        high = f"[{prefix}\xff" if prefix else "+"
        with redis_errors():
            names = await self.redis.zrangebylex(ADAPTERS_KEY, low, high, start=0, num=size + 1)
        page = [text(n) for n in names[:size]]
        adapters: list[registry_pb2.Adapter] = []
        total = 0
        for index, name in enumerate(page):
            if adapters and total >= max_bytes:
                return adapters, encode_token(page[index - 1])
            with contextlib.suppress(NotFound):  # deleted between the two reads
                adapters.append(await self.get_adapter(name))
                total += adapters[-1].ByteSize()
        next_token = encode_token(page[-1]) if len(names) > size else ""
        return adapters, next_token

    async def delete_adapter(self, name: str, actor: str) -> str:
        key = adapter_key(name)
        keys = [key, ADAPTERS_KEY, f"{key}:aliases", EVENTS_KEY]
        event_id = text(await self._run("DELETE_ADAPTER", keys, [name, now_ms(), actor, self.events_maxlen]))
        await self._run("DROP_PLACEMENT", [placement_key(name)], [name])  # a trainer pool's owner lets go
        return event_id

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
        owner_epoch: int = 0,
    ) -> tuple[registry_pb2.Version, str, bool]:
        """Returns (version, event id, replayed): replayed when request_id was already published.
        lease_id: a lease on the artifact (lease_artifact), taken before its bytes were verified.
        owner_epoch: a pool trainer's placement epoch (0: unfenced); FailedPrecondition(STALE_EPOCH) if stale."""
        name = version.adapter
        record = registry_pb2.Version()
        record.CopyFrom(version)
        record.published_by = actor
        key = adapter_key(name)
        keys = [
            key,
            f"{key}:seq",
            f"{key}:versions",
            f"{key}:aliases",
            f"{key}:requests",
            EVENTS_KEY,
            refs_key(version.artifact_sha256),
            version_prefix(name),
            f"{key}:history:",
            leases_key(version.artifact_sha256),
            UPLOADS_KEY,
            placement_key(name),
        ]
        args: list[str | bytes | int] = [
            name,
            record.SerializeToString(),
            version.artifact_sha256,
            now_ms(),
            actor,
            self.events_maxlen,
            request_id,
            "1" if skip_latest else "0",
            "" if expected_latest is None else expected_latest,
            lease_id,
            owner_epoch,
            *aliases,
        ]
        result = await self._run("PUBLISH_VERSION", keys, args)
        assert isinstance(result, list)
        status, payload = text(result[0]), text(result[1])
        number, event_id = payload.split(" ")
        return await self.get_version(name, int(number)), event_id, status == "REPLAY"

    async def get_version(self, name: str, number: int) -> registry_pb2.Version:
        with redis_errors():
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hmget(f"{version_prefix(name)}{number}", ["proto", "publish_ms", "deleted"])
                pipe.hgetall(f"{adapter_key(name)}:aliases")
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
        version.publish_time.CopyFrom(timestamp(int(publish_ms)))
        version.artifact_deleted = deleted == b"1"
        version.aliases.extend(sorted(text(a) for a, v in aliases.items() if int(v) == number))
        return version

    async def list_versions(self, name: str, page_size: int, page_token: str) -> tuple[list[registry_pb2.Version], str]:
        await self.get_adapter(name)
        size = check_page_size(page_size)
        high = "+inf"
        if page_token:
            cursor = decode_token(page_token)
            if not cursor.isdigit():
                raise InvalidArgument(f"invalid page token {page_token!r}", reason="INVALID_PAGE_TOKEN")
            high = f"({cursor}"
        with redis_errors():
            numbers = await self.redis.zrevrangebyscore(
                f"{adapter_key(name)}:versions", high, "-inf", start=0, num=size + 1
            )
        page = [int(text(n)) for n in numbers[:size]]
        versions = [await self.get_version(name, n) for n in page]
        return versions, (encode_token(str(page[-1])) if len(numbers) > size else "")

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
