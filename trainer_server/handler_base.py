"""What every TrainerService handler group shares: the servicer's parts, the adapter-name check, and the lookup
of a registry version (a start point or a reset target) fetched into this trainer's store and checked to fit."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from opentinker.rpc.serving.auth import require_access
from opentinker.rpc.serving.errors import FailedPrecondition, InvalidArgument, NotFound
from opentinker.rpc.serving.registry_link import registry_call
from opentinker.trainer_server.adapter import AdapterState
from opentinker.trainer_server.adapter_config import LoraConfig
from opentinker.trainer_server.admission import QueueAdmission
from opentinker.trainer_server.lineage_locks import LineageLocks
from opentinker.trainer_server.quota import TenantQuota
from opentinker.trainer_server.scheduler import AdapterScheduler
from opentinker.trainer_server.trainer import Trainer
from opentinker.v1 import registry_pb2, registry_pb2_grpc, trainer_pb2_grpc
from opentinker.weights.artifact_transfer import fetch_artifact
from opentinker.weights.names import check_adapter_name, parse_reference

Context = Any  # grpc.aio.ServicerContext; untyped in the generated stubs


def follow(state: AdapterState, version: registry_pb2.Version) -> None:
    """The adapter's weights are now `version`'s: its next snapshot's parent."""
    state.last_snapshot_version = version.version
    state.parent_adapter = "" if version.adapter == state.name else version.adapter


class Handlers(trainer_pb2_grpc.TrainerServiceServicer):
    """Set up by service.py TrainerServicer."""

    trainer: Trainer
    scheduler: AdapterScheduler
    registry: registry_pb2_grpc.RegistryServiceStub
    metadata: list[tuple[str, str]] | None
    max_batch_tokens: int
    max_batch_positions: int
    quota: TenantQuota
    admission: QueueAdmission
    micro_batch_positions: int
    max_serving_rank: int
    persist_state: bool  # a full state with every snapshot (lineage.state_id)
    lineage: LineageLocks

    def _known(self, name: str) -> str:
        check_adapter_name(name)
        require_access(name)
        self.trainer.get(name)
        return name

    async def _fitting_version(self, reference: str, lora: LoraConfig) -> registry_pb2.Version:
        """The version `reference` names, its artifact in this trainer's store and checked to fit `lora`."""
        version = await self._resolve_init(reference)
        await fetch_artifact(
            self.registry, self.trainer.artifacts, version.artifact_uri, self.metadata, bucket=self.trainer.bucket
        )
        await asyncio.to_thread(self.trainer.check_snapshot, version.artifact_uri, lora)
        return version

    async def _state_here(self, uri: str) -> None:
        """With a bucket, a saved state is pulled into this trainer's cache (verified) before it is checked or
        loaded: it may have been saved by another trainer, or evicted from the cache since. A state that is not
        there (or an id that is no state) is left to that check, which says so precisely."""
        if (bucket := self.trainer.bucket) is not None:
            with contextlib.suppress(NotFound, InvalidArgument):
                await bucket.run(bucket.pull, uri, "state")

    async def _push_state(self, uri: str) -> None:
        """With a bucket, a state is acknowledged only once it is there: the cache may evict it later."""
        if (bucket := self.trainer.bucket) is not None:
            await bucket.run(bucket.push, uri, "state")

    async def _resolve_init(self, reference: str) -> registry_pb2.Version:
        ref = parse_reference(reference)
        require_access(ref.adapter)
        response = await registry_call(
            self.registry.Resolve(registry_pb2.ResolveRequest(reference=reference), metadata=self.metadata)
        )
        if response.version.artifact_deleted:
            raise FailedPrecondition(f"{reference} was garbage-collected", reason="ARTIFACT_DELETED")
        version: registry_pb2.Version = response.version
        return version
