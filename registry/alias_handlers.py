"""RegistryService handlers for aliases: set, delete, the serving alias, and rollback."""

from __future__ import annotations

from typing import Any

from opentinker.registry.handler_base import Context, Handlers
from opentinker.rpc.serving.auth import require_access
from opentinker.rpc.serving.errors import FailedPrecondition, InvalidArgument
from opentinker.v1 import registry_pb2
from opentinker.weights.names import LATEST, check_adapter_name, check_alias


class AliasHandlers(Handlers):
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
