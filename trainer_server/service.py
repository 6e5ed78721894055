"""TrainerService: validate and authorize in the handler, compute through the scheduler, publish through
the registry. Handlers read top to bottom: check input -> queue on the adapter's lane -> build the reply; they
are grouped by what they serve: adapter_handlers.py, training_handlers.py, snapshot_handlers.py, pool_handlers.py
(the trainer pool)."""

from __future__ import annotations

from typing import Any

from opentinker.rpc.serving.membership import FleetMember
from opentinker.trainer_server.adapter_handlers import AdapterHandlers
from opentinker.trainer_server.admission import DEFAULT_MAX_QUEUED_PER_TENANT, QueueAdmission
from opentinker.trainer_server.batch import DEFAULT_MAX_BATCH_POSITIONS
from opentinker.trainer_server.handler_base import Context
from opentinker.trainer_server.lineage_locks import LineageLocks
from opentinker.trainer_server.losses import LOSS_FNS
from opentinker.trainer_server.micro_batch import DEFAULT_MICRO_BATCH_POSITIONS
from opentinker.trainer_server.pool import PoolLeases
from opentinker.trainer_server.pool_handlers import PoolHandlers
from opentinker.trainer_server.quota import DEFAULT_MAX_ADAPTERS_PER_TENANT, DEFAULT_MAX_TENANT_MEMORY_MB, TenantQuota
from opentinker.trainer_server.scheduler import AdapterScheduler
from opentinker.trainer_server.snapshot_handlers import SnapshotHandlers
from opentinker.trainer_server.start_point import DEFAULT_MAX_SERVING_RANK
from opentinker.trainer_server.trainer import Trainer
from opentinker.trainer_server.training_handlers import TrainingHandlers
from opentinker.trainer_server.wire import base_model_info
from opentinker.v1 import registry_pb2_grpc, trainer_pb2


class TrainerServicer(AdapterHandlers, TrainingHandlers, SnapshotHandlers, PoolHandlers):
    def __init__(
        self,
        trainer: Trainer,
        scheduler: AdapterScheduler,
        registry: registry_pb2_grpc.RegistryServiceStub,
        *,
        registry_metadata: list[tuple[str, str]] | None = None,
        max_batch_tokens: int = 1 << 20,
        max_batch_positions: int = DEFAULT_MAX_BATCH_POSITIONS,
        max_adapters_per_tenant: int = DEFAULT_MAX_ADAPTERS_PER_TENANT,
        micro_batch_positions: int = DEFAULT_MICRO_BATCH_POSITIONS,
        max_tenant_memory_mb: int = DEFAULT_MAX_TENANT_MEMORY_MB,
        max_queued_per_tenant: int = DEFAULT_MAX_QUEUED_PER_TENANT,
        max_serving_rank: int = DEFAULT_MAX_SERVING_RANK,
        persist_state: bool = False,
        member: FleetMember | None = None,
        autosave_every: int = 50,
    ) -> None:
        self.trainer = trainer
        self.scheduler = scheduler
        self.registry = registry
        self.metadata = registry_metadata
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_positions = max_batch_positions
        self.quota = TenantQuota(max_adapters_per_tenant, max_tenant_memory_mb)
        self.admission = QueueAdmission(max_queued_per_tenant)
        self.micro_batch_positions = micro_batch_positions
        self.max_serving_rank = max_serving_rank
        self.persist_state = persist_state
        self.lineage = LineageLocks()
        self.member = member  # None: not in a pool (no --registry fleet membership)
        self.pool = PoolLeases(member.lease_s if member is not None else 3.0)
        self.autosave_every = autosave_every
        self.autosaves = {}

    async def GetTrainerInfo(self, request: trainer_pb2.GetTrainerInfoRequest, context: Context) -> Any:
        return trainer_pb2.GetTrainerInfoResponse(
            base_model=base_model_info(self.trainer.base),
            loss_fns=sorted(LOSS_FNS),
            max_resident_adapters=self.trainer.max_resident,
        )
