"""The registry store's event stream: the last event id, whether an id is still in the stream, reading events
after one, and a stream entry turned back into an Event."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import redis

from opentinker.registry.store_base import (
    EVENTS_KEY,
    StoreBase,
    redis_errors,
    text,
    timestamp,
)
from opentinker.rpc.serving.errors import (
    InvalidArgument,
)
from opentinker.v1 import registry_pb2

_EVENT_TYPES = {
    name.removeprefix("EVENT_TYPE_"): number
    for name, number in registry_pb2.EventType.items()
    if name != "EVENT_TYPE_UNSPECIFIED"
}


@dataclass(frozen=True, slots=True)
class EventRecord:
    event_id: str
    event: registry_pb2.Event


class EventStore(StoreBase):
    async def last_event_id(self) -> str:
        with redis_errors():
            entries = await self.redis.xrevrange(EVENTS_KEY, count=1)
        return text(entries[0][0]) if entries else "0-0"

    async def event_exists(self, event_id: str) -> bool:
        with redis_errors():
            try:
                return bool(await self.redis.xrange(EVENTS_KEY, event_id, event_id, count=1))
            except redis.ResponseError:
                raise InvalidArgument(f"invalid event id {event_id!r}", reason="INVALID_EVENT_ID") from None

    async def read_events(self, after_id: str, block_ms: int | None, count: int = 256) -> list[EventRecord]:
        """Events after `after_id`, waiting up to block_ms for one (None: answer at once)."""
        with redis_errors():
            try:
                streams: Any = await self.redis.xread({EVENTS_KEY: after_id}, count=count, block=block_ms)
            except redis.ResponseError:
                raise InvalidArgument(f"invalid event id {after_id!r}", reason="INVALID_EVENT_ID") from None
        records = []
        for _stream, entries in streams or []:
            for entry_id, fields in entries:
                event_id = text(entry_id)
                records.append(EventRecord(event_id, event_from_fields(event_id, fields)))
        return records


def event_from_fields(event_id: str, fields: dict[bytes, bytes]) -> registry_pb2.Event:
    get = {text(k): text(v) for k, v in fields.items()}.get
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
    event.time.CopyFrom(timestamp(int(get("time") or 0)))
    for alias, version in json.loads(get("aliases") or "{}").items():
        event.aliases[alias] = int(version)
    return event
