"""RegistryService fleet handlers: replicas register and beat (admin: the samplers' service token), anyone
authenticated lists or watches them, a user tenant seeing only its own adapters among the resident versions."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterable
from typing import Any, Final

from opentinker.registry.handler_base import Context, Handlers
from opentinker.rpc.serving.auth import Principal, current_principal, require_admin
from opentinker.rpc.serving.errors import InvalidArgument, ServiceError
from opentinker.v1 import registry_pb2
from opentinker.weights.names import check_adapter_name

DEFAULT_LEASE_S: Final = 3.0  # three missed beats of one second
MIN_LEASE_S, MAX_LEASE_S = 0.1, 60.0
MAX_RESIDENT: Final = 4096  # far above any --max-slots

_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_ADDRESS_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]{1,253}):(\d{1,5})$")
_FINGERPRINT_RE = re.compile(r"^[A-Za-z0-9:._-]{1,128}$")
_ROLES = (registry_pb2.REPLICA_ROLE_SAMPLER, registry_pb2.REPLICA_ROLE_TRAINER)


def _bad(message: str) -> InvalidArgument:
    return InvalidArgument(message, reason="INVALID_REPLICA")


def _check_id(replica_id: str) -> str:
    if not _ID_RE.match(replica_id):
        raise _bad(f"replica_id {replica_id[:80]!r} must match [A-Za-z0-9._-]{{1,64}}")
    return replica_id


def _check_state(state: registry_pb2.ReplicaState) -> registry_pb2.ReplicaState:
    if state == registry_pb2.REPLICA_STATE_UNSPECIFIED:
        return registry_pb2.REPLICA_STATE_SERVING
    if state not in (registry_pb2.REPLICA_STATE_SERVING, registry_pb2.REPLICA_STATE_DRAINING):
        raise _bad(f"unknown replica state {state}")
    return state


def _check_resident(resident: Iterable[str]) -> list[str]:
    versions = list(resident)
    if len(versions) > MAX_RESIDENT:
        raise _bad(f"{len(versions)} resident versions are more than {MAX_RESIDENT}")
    for entry in versions:
        adapter, at, number = entry.rpartition("@")
        if not at:  # a trainer's: an adapter it holds, at no published version
            adapter = entry
        elif not number.isdigit() or int(number) < 1:
            raise _bad(f"resident version {entry[:300]!r} is not 'adapter@N' or 'adapter'")
        try:
            check_adapter_name(adapter)
        except ServiceError as error:
            raise _bad(f"resident version {entry[:300]!r}: {error.message}") from None
    return versions


def _check_role_filter(role: int) -> int:
    if role != registry_pb2.REPLICA_ROLE_UNSPECIFIED and role not in _ROLES:
        raise InvalidArgument(f"unknown replica role {role}", reason="INVALID_REPLICA_ROLE")
    return role


def check_replica(replica: registry_pb2.Replica) -> registry_pb2.Replica:
    """A RegisterReplica record, checked field by field (times are the registry's to set)."""
    _check_id(replica.replica_id)
    if replica.role not in _ROLES:
        raise _bad("role must be REPLICA_ROLE_SAMPLER or REPLICA_ROLE_TRAINER")
    match = _ADDRESS_RE.match(replica.address)
    if match is None or not 0 < int(match.group(2)) < 65536:
        raise _bad(f"address {replica.address[:300]!r} is not host:port")
    if not _FINGERPRINT_RE.match(replica.base_fingerprint):
        raise _bad("base_fingerprint must be 1 to 128 characters of [A-Za-z0-9:._-] (the base model's digest)")
    if len(replica.zone.encode()) > 64:
        raise _bad("zone is at most 64 bytes")
    lease = replica.lease_seconds or DEFAULT_LEASE_S
    if not MIN_LEASE_S <= lease <= MAX_LEASE_S:  # also refuses NaN
        raise _bad(f"lease_seconds must be within {MIN_LEASE_S} and {MAX_LEASE_S}")
    checked = registry_pb2.Replica()
    checked.CopyFrom(replica)
    checked.lease_seconds = lease
    checked.state = _check_state(replica.state)
    checked.ClearField("register_time")
    checked.ClearField("heartbeat_time")
    del checked.resident[:]
    checked.resident.extend(sorted(_check_resident(replica.resident)))
    return checked


def visible_replica(principal: Principal, replica: registry_pb2.Replica) -> registry_pb2.Replica:
    """The record as ``principal`` may see it: other tenants' resident versions left out (they would tell who
    serves what); address, state and load are everyone's, since routing needs them."""
    if principal.tenant is None or principal.is_admin:
        return replica
    shown = registry_pb2.Replica()
    shown.CopyFrom(replica)
    del shown.resident[:]
    shown.resident.extend(v for v in replica.resident if principal.can_access(v.partition("@")[0]))
    return shown


def _shown(principal: Principal, role: int, listing: Iterable[registry_pb2.Replica]) -> list[registry_pb2.Replica]:
    """The replicas of ``role`` (0: every role) as ``principal`` may see them."""
    return [visible_replica(principal, r) for r in listing if not role or r.role == role]


def _comparable(replica: registry_pb2.Replica, include_load: bool) -> bytes:
    """What a watcher is told about when it changes: the beat time never, load and resident with include_load."""
    copy = registry_pb2.Replica()
    copy.CopyFrom(replica)
    copy.ClearField("heartbeat_time")
    if not include_load:
        copy.ClearField("load")
        del copy.resident[:]
    return copy.SerializeToString(deterministic=True)


class ReplicaHandlers(Handlers):
    async def RegisterReplica(self, request: registry_pb2.RegisterReplicaRequest, context: Context) -> Any:
        require_admin("RegisterReplica")
        record = await self.store.register_replica(check_replica(request.replica))
        return registry_pb2.RegisterReplicaResponse(replica=record)

    async def Heartbeat(self, request: registry_pb2.HeartbeatRequest, context: Context) -> Any:
        require_admin("Heartbeat")
        replica_id = _check_id(request.replica_id)
        state = _check_state(request.state)
        resident = _check_resident(request.resident)
        record = await self.store.heartbeat(replica_id, state, request.load, resident)
        placements = (
            await self.store.placements_of(replica_id) if record.role == registry_pb2.REPLICA_ROLE_TRAINER else []
        )
        return registry_pb2.HeartbeatResponse(heartbeat_time=record.heartbeat_time, placements=placements)

    async def ListReplicas(self, request: registry_pb2.ListReplicasRequest, context: Context) -> Any:
        role = _check_role_filter(request.role)
        listing = await self.store.list_replicas()
        return registry_pb2.ListReplicasResponse(replicas=_shown(current_principal(), role, listing))

    async def WatchReplicas(self, request: registry_pb2.WatchReplicasRequest, context: Context) -> AsyncIterator[Any]:
        role = _check_role_filter(request.role)
        principal = current_principal()
        with self.watches.hold(principal):
            sent: dict[str, bytes] | None = None
            async for listing in self.replica_hub.listings():  # one reader of Redis for every watch
                now = {r.replica_id: r for r in _shown(principal, role, listing)}
                if sent is None:
                    yield registry_pb2.WatchReplicasResponse(snapshot=True, replicas=list(now.values()))
                else:
                    changed = [r for i, r in now.items() if sent.get(i) != _comparable(r, request.include_load)]
                    left = sorted(set(sent) - set(now))
                    if not (changed or left):
                        continue
                    yield registry_pb2.WatchReplicasResponse(replicas=changed, left=left)
                sent = {i: _comparable(r, request.include_load) for i, r in now.items()}
