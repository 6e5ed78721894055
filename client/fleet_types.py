"""The fleet's records in the SDK (RegistryClient.list_replicas / watch_replicas): frozen dataclasses, converted
from the wire in fleet_wire."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

__all__ = ["Replica", "ReplicaChange", "ReplicaLoad", "ReplicaRole", "ReplicaState"]

ReplicaRole = Literal["sampler", "trainer"]
ReplicaState = Literal["serving", "draining"]


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """What a replica reported with its last beat (about once a second)."""

    slots_used: int = 0
    slots_total: int = 0
    waiting_sequences: int = 0
    running_sequences: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    tokens_per_second: float = 0.0


@dataclass(frozen=True, slots=True)
class Replica:
    """One live member of the fleet. ``resident``: versions it holds in a slot ("adapter@N"); a user token sees
    only its own tenant's."""

    replica_id: str
    role: ReplicaRole
    address: str
    state: ReplicaState
    base_fingerprint: str
    max_slots: int
    zone: str
    load: ReplicaLoad
    resident: tuple[str, ...]
    lease_seconds: float
    register_time: datetime | None
    heartbeat_time: datetime | None

    @property
    def serving(self) -> bool:
        return self.state == "serving"


@dataclass(frozen=True, slots=True)
class ReplicaChange:
    """One WatchReplicas message: the whole fleet when ``snapshot``, else who joined or changed and who left."""

    snapshot: bool
    replicas: tuple[Replica, ...]
    left: tuple[str, ...]
