"""What every RegistryService handler group shares: the servicer's parts (service.py RegistryServicer sets them)."""

from __future__ import annotations

from typing import Any

from opentinker.registry.artifact_backend import RegistryArtifacts
from opentinker.registry.event_hub import EventHub
from opentinker.registry.limits import RegistryLimits, WatchSlots
from opentinker.registry.replica_hub import ReplicaHub
from opentinker.registry.store import RegistryStore
from opentinker.registry.uploads import UploadSweeper
from opentinker.v1 import registry_pb2_grpc

Context = Any  # grpc.aio.ServicerContext; untyped in the generated stubs


class Handlers(registry_pb2_grpc.RegistryServiceServicer):
    store: RegistryStore
    artifacts: RegistryArtifacts
    limits: RegistryLimits
    max_artifact_bytes: int
    events: EventHub
    replica_hub: ReplicaHub
    sweeper: UploadSweeper
    watches: WatchSlots
