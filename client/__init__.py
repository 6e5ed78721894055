"""OpenTinker Python SDK: `ServiceClient` (entry point) and `TrainingClient` for training adapters,
`RegistryClient` for the adapter registry, their data types and the one error type."""

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
from opentinker.client.service_client import ServiceClient
from opentinker.client.training_client import TrainingClient
from opentinker.client.types import (
    AdamParams,
    Datum,
    EncodedTextChunk,
    ForwardBackwardOutput,
    LoraConfig,
    ModelInput,
    OptimStepResult,
    SavedState,
    TensorData,
    TrainerInfo,
    TrainingAdapterInfo,
)

__all__ = [
    "AdamParams",
    "Adapter",
    "AliasMove",
    "ArtifactInfo",
    "BatchRecord",
    "Datum",
    "EncodedTextChunk",
    "Event",
    "ForwardBackwardOutput",
    "GarbageCollection",
    "Lineage",
    "LoraConfig",
    "ModelInput",
    "OpenTinkerError",
    "OptimStepResult",
    "Reconcile",
    "RegistryClient",
    "SavedState",
    "ServiceClient",
    "TensorData",
    "TrainerInfo",
    "TrainingAdapterInfo",
    "TrainingClient",
    "Version",
    "from_rpc_error",
]
