"""The fleet's records to and from the wire (registry_pb2.Replica and friends)."""

from __future__ import annotations

from datetime import UTC

from opentinker.client.fleet_types import Replica, ReplicaChange, ReplicaLoad, ReplicaRole, ReplicaState
from opentinker.v1 import registry_pb2

_ROLES: dict[int, ReplicaRole] = {
    registry_pb2.REPLICA_ROLE_SAMPLER: "sampler",
    registry_pb2.REPLICA_ROLE_TRAINER: "trainer",
}
_STATES: dict[int, ReplicaState] = {registry_pb2.REPLICA_STATE_DRAINING: "draining"}


def role_to_proto(role: ReplicaRole | None) -> registry_pb2.ReplicaRole:
    """None: every role."""
    if role is None:
        return registry_pb2.REPLICA_ROLE_UNSPECIFIED
    return registry_pb2.REPLICA_ROLE_TRAINER if role == "trainer" else registry_pb2.REPLICA_ROLE_SAMPLER


def load_from_proto(proto: registry_pb2.ReplicaLoad) -> ReplicaLoad:
    return ReplicaLoad(
        slots_used=proto.slots_used,
        slots_total=proto.slots_total,
        waiting_sequences=proto.waiting_sequences,
        running_sequences=proto.running_sequences,
        kv_blocks_used=proto.kv_blocks_used,
        kv_blocks_total=proto.kv_blocks_total,
        tokens_per_second=proto.tokens_per_second,
    )


def replica_from_proto(proto: registry_pb2.Replica) -> Replica:
    return Replica(
        replica_id=proto.replica_id,
        role=_ROLES.get(proto.role, "sampler"),
        address=proto.address,
        state=_STATES.get(proto.state, "serving"),
        base_fingerprint=proto.base_fingerprint,
        max_slots=proto.max_slots,
        zone=proto.zone,
        load=load_from_proto(proto.load),
        resident=tuple(proto.resident),
        lease_seconds=proto.lease_seconds,
        register_time=proto.register_time.ToDatetime(tzinfo=UTC) if proto.HasField("register_time") else None,
        heartbeat_time=proto.heartbeat_time.ToDatetime(tzinfo=UTC) if proto.HasField("heartbeat_time") else None,
    )


def change_from_proto(proto: registry_pb2.WatchReplicasResponse) -> ReplicaChange:
    return ReplicaChange(
        snapshot=proto.snapshot,
        replicas=tuple(replica_from_proto(r) for r in proto.replicas),
        left=tuple(proto.left),
    )
