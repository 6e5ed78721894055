"""RegistryService trainer-pool handlers: place an adapter on a trainer, read its placement (the adapter's own
tenant), and the owner's own moves and state records (admin: the trainers' service token), each fenced by the
adapter's epoch (placement_store.py)."""

from __future__ import annotations

from typing import Any, Final

from opentinker.registry.handler_base import Context, Handlers
from opentinker.rpc.serving.auth import require_access, require_admin
from opentinker.rpc.serving.errors import InvalidArgument, NotFound
from opentinker.v1 import registry_pb2
from opentinker.weights.names import check_adapter_name

MAX_RANK: Final = 4096
MAX_STATE_ID: Final = 200  # "sha256:" and 64 hex digits, with room


def _bad(message: str) -> InvalidArgument:
    return InvalidArgument(message, reason="INVALID_PLACEMENT")


def _check_state(state_id: str) -> str:
    if len(state_id) > MAX_STATE_ID or not state_id.isprintable():
        raise _bad(f"state_id must be a SaveState id (at most {MAX_STATE_ID} printable characters)")
    return state_id


def _check_epoch(epoch: int) -> int:
    if epoch < 1:
        raise _bad("epoch starts at 1 (Placement.epoch)")
    return epoch


class PlacementHandlers(Handlers):
    async def PlaceAdapter(self, request: registry_pb2.PlaceAdapterRequest, context: Context) -> Any:
        name = check_adapter_name(request.adapter)
        require_access(name)
        if request.rank > MAX_RANK:
            raise _bad(f"rank is at most {MAX_RANK}")
        if len(request.base_fingerprint) > 128:
            raise _bad("base_fingerprint is at most 128 characters (the base model's digest)")
        base = request.base_fingerprint
        if not base:
            try:  # an adapter the registry knows goes to a trainer of its own base
                base = (await self.store.get_adapter(name)).base_model_digest
            except NotFound:
                base = ""
        placement, placed = await self.store.place_adapter(name, request.rank, base)
        return registry_pb2.PlaceAdapterResponse(placement=placement, placed=placed)

    async def GetPlacement(self, request: registry_pb2.GetPlacementRequest, context: Context) -> Any:
        name = check_adapter_name(request.adapter)
        require_access(name)
        placement = await self.store.get_placement(name)
        if placement is None:
            raise NotFound(f"adapter {name!r} is not placed on a trainer", reason="PLACEMENT_NOT_FOUND")
        return registry_pb2.GetPlacementResponse(placement=placement)

    async def MovePlacement(self, request: registry_pb2.MovePlacementRequest, context: Context) -> Any:
        require_admin("MovePlacement")
        name = check_adapter_name(request.adapter)
        epoch = _check_epoch(request.expected_epoch)
        if len(request.to_replica_id) > 64:
            raise _bad("to_replica_id is at most 64 characters")
        placement = await self.store.move_placement(
            name, epoch, request.to_replica_id, _check_state(request.state_id), request.state_step
        )
        return registry_pb2.MovePlacementResponse(placement=placement)

    async def RecordPlacementState(self, request: registry_pb2.RecordPlacementStateRequest, context: Context) -> Any:
        require_admin("RecordPlacementState")
        name = check_adapter_name(request.adapter)
        if not request.state_id:
            raise _bad("state_id is required")
        placement = await self.store.record_placement_state(
            name, _check_epoch(request.epoch), _check_state(request.state_id), request.state_step
        )
        return registry_pb2.RecordPlacementStateResponse(placement=placement)
