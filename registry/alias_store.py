"""The registry store's aliases: move one (set or rollback), delete one, choose the serving alias, and the
snapshot of every adapter's aliases a watch starts from."""

from __future__ import annotations

from opentinker.registry.store_base import (
    ADAPTERS_KEY,
    EVENTS_KEY,
    StoreBase,
    adapter_key,
    now_ms,
    redis_errors,
    text,
    version_prefix,
)
from opentinker.v1 import registry_pb2


class AliasStore(StoreBase):
    async def move_alias(
        self, name: str, alias: str, version: int, expected: int | None, actor: str, mode: str
    ) -> tuple[int, int, str]:
        """mode: 'set', 'rollback-to' (version must be older) or 'rollback' (one step back in history)."""
        key = adapter_key(name)
        keys = [
            key,
            f"{key}:versions",
            f"{key}:aliases",
            f"{key}:history:{alias}",
            EVENTS_KEY,
            version_prefix(name),
        ]
        args = [
            name,
            alias,
            version,
            "" if expected is None else expected,
            now_ms(),
            actor,
            self.events_maxlen,
            mode,
        ]
        result = await self._run("SET_ALIAS", keys, args)
        assert isinstance(result, list)
        return int(result[0]), int(result[1]), text(result[2])

    async def delete_alias(self, name: str, alias: str, expected: int | None, actor: str) -> tuple[int, str]:
        key = adapter_key(name)
        keys = [key, f"{key}:aliases", f"{key}:history:{alias}", EVENTS_KEY]
        args: list[str | bytes | int] = [
            name,
            alias,
            "" if expected is None else expected,
            now_ms(),
            actor,
            self.events_maxlen,
        ]
        result = await self._run("DELETE_ALIAS", keys, args)
        assert isinstance(result, list)
        return int(result[0]), text(result[1])

    async def set_serving_alias(self, name: str, alias: str, actor: str) -> tuple[str, int, str]:
        """Returns (previous serving alias, version a bare name resolves to now, event id)."""
        key = adapter_key(name)
        keys = [key, f"{key}:aliases", EVENTS_KEY]
        result = await self._run("SET_SERVING_ALIAS", keys, [name, alias, now_ms(), actor, self.events_maxlen])
        assert isinstance(result, list)
        return text(result[0]), int(result[1]), text(result[2])

    async def alias_snapshot(self) -> list[registry_pb2.AdapterAliases]:
        with redis_errors():
            names = [text(n) for n in await self.redis.zrange(ADAPTERS_KEY, 0, -1)]
            snapshot = []
            for name in names:
                aliases = await self.redis.hgetall(f"{adapter_key(name)}:aliases")
                serving = await self.redis.hget(adapter_key(name), "serving")
                entry = registry_pb2.AdapterAliases(adapter=name, serving_alias=text(serving) if serving else "")
                entry.aliases.update({text(a): int(v) for a, v in aliases.items()})
                snapshot.append(entry)
        return snapshot
