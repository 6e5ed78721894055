"""Replica records for tests of the routing rules (client/fleet_router.py, cli/fleet_haproxy.py)."""

from __future__ import annotations

from opentinker.client.fleet_types import Replica, ReplicaLoad

BASE = "base-digest"


def replica(address: str, *, state: str = "serving", base: str = BASE, waiting: int = 0) -> Replica:
    return Replica(
        replica_id=f"id-{address}",
        role="sampler",
        address=address,
        state=state,  # type: ignore[arg-type]
        base_fingerprint=base,
        max_slots=8,
        zone="",
        load=ReplicaLoad(waiting_sequences=waiting),
        resident=(),
        lease_seconds=3.0,
        register_time=None,
        heartbeat_time=None,
    )
