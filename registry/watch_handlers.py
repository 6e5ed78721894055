"""RegistryService WatchEvents: the event stream of the adapters a caller may see, a snapshot first when asked
for or when the caller's cursor is gone."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import AsyncIterator
from typing import Any

from opentinker.registry.handler_base import Context, Handlers
from opentinker.rpc.serving.auth import Principal, current_principal
from opentinker.rpc.serving.errors import InvalidArgument
from opentinker.v1 import registry_pb2
from opentinker.weights.names import check_adapter_name

_EVENT_ID_RE = re.compile(r"^\d+(-\d+)?$")


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


class WatchHandlers(Handlers):
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
