"""OpenTinker Python SDK: `RegistryClient` for the adapter registry, its result types and its error."""

from opentinker.client.errors import OpenTinkerError, from_rpc_error
from opentinker.client.registry_client import (
    Adapter,
    AliasMove,
    ArtifactInfo,
    BatchRecord,
    Event,
    GarbageCollection,
    Lineage,
    Reconcile,
    RegistryClient,
    Version,
)

__all__ = [
    "Adapter",
    "AliasMove",
    "ArtifactInfo",
    "BatchRecord",
    "Event",
    "GarbageCollection",
    "Lineage",
    "OpenTinkerError",
    "Reconcile",
    "RegistryClient",
    "Version",
    "from_rpc_error",
]
