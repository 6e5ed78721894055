"""TrainerService: validate and authorize in the handler, compute through the scheduler, publish through
the registry. Handlers read top to bottom: check input -> queue on the adapter's lane -> build the reply."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

from opentinker.rpc.auth import Principal, current_principal, require_access
from opentinker.rpc.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from opentinker.rpc.faults import fault_point
from opentinker.rpc.registry_link import fetch_artifact, push_artifact, registry_call
from opentinker.trainer_server.adapter import AdapterState
from opentinker.trainer_server.admission import DEFAULT_MAX_QUEUED_PER_TENANT, QueueAdmission, queued
from opentinker.trainer_server.batch import DEFAULT_MAX_BATCH_POSITIONS, build_batch, split_batch
from opentinker.trainer_server.losses import LOSS_FNS, resolve_config
from opentinker.trainer_server.micro_batch import DEFAULT_MICRO_BATCH_POSITIONS, merge_outputs, release_after
from opentinker.trainer_server.ownership import state_owner
from opentinker.trainer_server.quota import (
    DEFAULT_MAX_ADAPTERS_PER_TENANT,
    DEFAULT_MAX_TENANT_MEMORY_MB,
    TenantQuota,
    lora_parameters,
)
from opentinker.trainer_server.scheduler import AdapterScheduler
from opentinker.trainer_server.trainer import GradientMark, StepOutput, Trainer, check_adam, check_lora
from opentinker.v1 import common_pb2, registry_pb2, registry_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from opentinker.weights.names import check_adapter_name, parse_reference

Context = Any  # grpc.aio.ServicerContext; untyped in the generated stubs


def adapter_message(state: AdapterState) -> trainer_pb2.TrainingAdapter:
    message = trainer_pb2.TrainingAdapter(
        name=state.name, lora_config=state.lora, adam_params=state.adam, seed=state.seed, step=state.step,
        tokens_trained=state.ledger.tokens_trained, datums_trained=state.ledger.datums_trained,
        pending_batches=len(state.ledger.pending), last_snapshot_version=state.last_snapshot_version,
        num_parameters=state.num_parameters, resident=state.resident,
    )  # fmt: skip
    message.create_time.FromSeconds(int(state.create_time))
    return message


def _outputs(result: StepOutput) -> list[trainer_pb2.LossFnOutput]:
    return [
        trainer_pb2.LossFnOutput(
            tensors={
                "logprobs": common_pb2.TensorData(dtype=common_pb2.D_TYPE_FLOAT32, shape=[len(row)], float32_values=row)
            }
        )
        for row in result.logprobs
    ]


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
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

    def _known(self, name: str) -> str:
        check_adapter_name(name)
        require_access(name)
        self.trainer.get(name)
        return name

    async def GetTrainerInfo(self, request: trainer_pb2.GetTrainerInfoRequest, context: Context) -> Any:
        return trainer_pb2.GetTrainerInfoResponse(
            base_model=self.trainer.base.info(),
            loss_fns=sorted(LOSS_FNS),
            max_resident_adapters=self.trainer.max_resident,
        )

    # Adapters

    async def CreateAdapter(self, request: trainer_pb2.TrainerServiceCreateAdapterRequest, context: Context) -> Any:
        name = check_adapter_name(request.name)
        principal = require_access(name)
        check_lora(request.lora_config)
        targets = self.trainer.base.resolve_targets(list(request.lora_config.target_modules))
        adam = request.adam_params if request.HasField("adam_params") else None
        if adam is not None:
            check_adam(adam)
        if name in self.trainer.adapters:
            raise AlreadyExists(f"adapter {name!r} already exists in this trainer", reason="ADAPTER_EXISTS")
        shapes = self.trainer.base.module_shapes()  # weighed before anything is allocated
        num_parameters = lora_parameters(request.lora_config.rank, [shapes[t] for t in targets])
        with self.quota.reserve(principal, name, self.trainer.adapters, num_parameters):
            return await self._create(name, principal, request, adam)

    async def _create(
        self,
        name: str,
        principal: Principal,
        request: trainer_pb2.TrainerServiceCreateAdapterRequest,
        adam: common_pb2.AdamParams | None,
    ) -> trainer_pb2.TrainerServiceCreateAdapterResponse:
        base_digest = self.trainer.base.digest
        init_version = await self._resolve_init(request.init_from) if request.init_from else None
        # Before the registry record exists: a snapshot or state that does not fit creates nothing.
        if init_version is not None:
            await fetch_artifact(self.registry, self.trainer.artifacts, init_version.artifact_uri, self.metadata)
            await asyncio.to_thread(self.trainer.check_snapshot, init_version.artifact_uri, request.lora_config)
        if request.resume_state:
            await asyncio.to_thread(self.trainer.check_state, request.resume_state, request.lora_config, principal)
        create = registry_pb2.CreateAdapterRequest(
            name=name,
            lora_config=request.lora_config,
            base_model_digest=base_digest,
            labels=dict(request.labels),
        )
        try:
            await registry_call(self.registry.CreateAdapter(create, metadata=self.metadata))
        except AlreadyExists:
            if not request.attach_existing:
                raise AlreadyExists(
                    f"adapter {name!r} exists in the registry; pass attach_existing to train it here",
                    reason="ADAPTER_EXISTS",
                ) from None
            existing = await registry_call(
                self.registry.GetAdapter(registry_pb2.GetAdapterRequest(name=name), metadata=self.metadata)
            )
            if existing.adapter.base_model_digest and existing.adapter.base_model_digest != base_digest:
                raise FailedPrecondition(f"adapter {name!r} was trained on another base model",
                                         reason="BASE_MODEL_MISMATCH") from None  # fmt: skip
        state = await self.scheduler.run(
            name, lambda: self.trainer.create(name, request.lora_config, adam, request.seed)
        )
        try:
            if init_version is not None:
                await self.scheduler.run(name, lambda: self.trainer.load_snapshot(name, init_version.artifact_uri))
                if init_version.adapter == name:
                    state.last_snapshot_version = init_version.version
            if request.resume_state:
                await self.scheduler.run(
                    name, lambda: self.trainer.load_state(name, request.resume_state, principal=principal)
                )
        except BaseException:
            await self.scheduler.run(name, lambda: self.trainer.delete(name))
            raise
        return trainer_pb2.TrainerServiceCreateAdapterResponse(adapter=adapter_message(state))

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

    async def GetAdapter(self, request: trainer_pb2.TrainerServiceGetAdapterRequest, context: Context) -> Any:
        name = self._known(request.name)
        return trainer_pb2.TrainerServiceGetAdapterResponse(adapter=adapter_message(self.trainer.get(name)))

    async def ListAdapters(self, request: trainer_pb2.TrainerServiceListAdaptersRequest, context: Context) -> Any:
        principal = current_principal()
        states = [
            s
            for n, s in sorted(self.trainer.adapters.items())
            if n.startswith(request.prefix) and principal.can_access(n)
        ]
        return trainer_pb2.TrainerServiceListAdaptersResponse(adapters=[adapter_message(s) for s in states])

    async def DeleteAdapter(self, request: trainer_pb2.TrainerServiceDeleteAdapterRequest, context: Context) -> Any:
        name = self._known(request.name)
        await self.scheduler.run(name, lambda: self.trainer.delete(name))
        return trainer_pb2.TrainerServiceDeleteAdapterResponse()

    # Training

    def _batch(self, datums: Iterable[common_pb2.Datum], loss_fn: str, config: dict[str, float]) -> Any:
        base = self.trainer.base
        batch = build_batch(list(datums), loss_fn, vocab_size=base.vocab_size, max_positions=base.max_positions,
                            pad_id=self.trainer.pad_id, max_batch_positions=self.max_batch_positions)  # fmt: skip
        if batch.num_tokens > self.max_batch_tokens:
            raise ResourceExhausted(f"batch has {batch.num_tokens} tokens; the limit is {self.max_batch_tokens}",
                                    reason="BATCH_TOO_LARGE", field="datums")  # fmt: skip
        return batch

    @queued
    async def ForwardBackward(self, request: trainer_pb2.ForwardBackwardRequest, context: Context) -> Any:
        name = self._known(request.adapter)
        config = resolve_config(request.loss_fn, dict(request.loss_fn_config))
        batch = await asyncio.to_thread(self._batch, request.datums, request.loss_fn, config)
        trace_ids = list(request.trace_ids)

        parts = split_batch(batch, self.micro_batch_positions)

        # One micro-batch per turn of the lane; the first takes the undo mark, the last records the request's batch
        # in the ledger and reads the step (in the adapter's lane: after the reply, a pipelined OptimStep may run).
        def part(index: int) -> Callable[[], tuple[GradientMark | None, StepOutput, int]]:
            def run() -> tuple[GradientMark | None, StepOutput, int]:
                mark = self.trainer.gradient_mark(name) if index == 0 else None
                output = self.trainer.accumulate(name, parts[index], request.loss_fn, config)
                release_after(parts[index])
                if index < len(parts) - 1:
                    return mark, output, 0
                self.trainer.record_batch(name, batch, request.loss_fn, trace_ids)
                return mark, output, self.trainer.get(name).step + 1

            return run

        def undo(done: list[tuple[GradientMark | None, StepOutput, int]]) -> None:
            mark = done[0][0]
            assert mark is not None
            self.trainer.undo_forward_backward(name, mark)

        done = await self.scheduler.run_parts(name, [part(i) for i in range(len(parts))], undo=undo)
        result, step = merge_outputs(parts, [output for _, output, _ in done]), done[-1][2]
        return trainer_pb2.ForwardBackwardResponse(
            loss_fn_outputs=_outputs(result), metrics=result.metrics, batch_digest=batch.digest, step=step
        )

    @queued
    async def Forward(self, request: trainer_pb2.ForwardRequest, context: Context) -> Any:
        name = self._known(request.adapter)
        loss_fn = request.loss_fn or "cross_entropy"
        config = resolve_config(loss_fn, dict(request.loss_fn_config))
        batch = await asyncio.to_thread(self._batch, request.datums, loss_fn, config)
        parts = split_batch(batch, self.micro_batch_positions)

        def part(index: int) -> Callable[[], StepOutput]:
            def run() -> StepOutput:
                output = self.trainer.forward(name, parts[index], loss_fn, config)
                release_after(parts[index])
                return output

            return run

        outputs = await self.scheduler.run_parts(name, [part(i) for i in range(len(parts))])
        result = merge_outputs(parts, outputs)
        return trainer_pb2.ForwardResponse(loss_fn_outputs=_outputs(result), metrics=result.metrics)

    @queued
    async def OptimStep(self, request: trainer_pb2.OptimStepRequest, context: Context) -> Any:
        name = self._known(request.adapter)
        adam = request.adam_params if request.HasField("adam_params") else None
        if adam is not None:
            check_adam(adam)
        step, metrics = await self.scheduler.run(name, lambda: self.trainer.optim_step(name, adam))
        return trainer_pb2.OptimStepResponse(step=step, metrics=metrics)

    # Snapshots and states

    @queued
    async def SaveSnapshot(self, request: trainer_pb2.SaveSnapshotRequest, context: Context) -> Any:
        name = self._known(request.adapter)
        aliases = list(request.aliases)

        def write() -> tuple[Any, registry_pb2.Lineage]:
            state = self.trainer.get(name)
            ref = self.trainer.write_snapshot(name)
            lineage = registry_pb2.Lineage(
                parent_version=state.last_snapshot_version, trainer_step=state.step,
                tokens_trained=state.ledger.tokens_trained, datums_trained=state.ledger.datums_trained,
                batches=list(state.ledger.batches), metrics=dict(request.metrics),
                base_model_digest=self.trainer.base.digest,
            )  # fmt: skip
            return ref, lineage

        ref, lineage = await self.scheduler.run(name, write)
        fault_point("save_snapshot/before_publish")
        publish = registry_pb2.PublishVersionRequest(
            adapter=name, artifact_uri=ref.uri, artifact_sha256=ref.sha256, artifact_size_bytes=ref.size_bytes,
            lora_config=self.trainer.get(name).lora, lineage=lineage, aliases=aliases,
            skip_latest=request.skip_latest, request_id=request.request_id,
        )  # fmt: skip
        try:
            response = await registry_call(self.registry.PublishVersion(publish, metadata=self.metadata))
        except NotFound as exc:
            if exc.reason != "ARTIFACT_NOT_FOUND":
                raise
            await push_artifact(self.registry, self.trainer.artifacts, ref.uri, self.metadata)  # another store
            response = await registry_call(self.registry.PublishVersion(publish, metadata=self.metadata))
        fault_point("save_snapshot/after_publish")

        def record() -> None:
            state = self.trainer.get(name)
            del state.ledger.batches[: len(lineage.batches)]  # those now belong to the version's lineage
            state.last_snapshot_version = response.version.version

        await self.scheduler.run(name, record)
        return trainer_pb2.SaveSnapshotResponse(version=response.version, event_id=response.event_id)

    @queued
    async def SaveState(self, request: trainer_pb2.SaveStateRequest, context: Context) -> Any:
        name = self._known(request.adapter)
        label = request.label or "state"
        owner = state_owner(name, current_principal())
        ref, step = await self.scheduler.run(
            name, lambda: (self.trainer.save_state(name, label, owner=owner), self.trainer.get(name).step)
        )
        fault_point("save_state/before_reply")
        return trainer_pb2.SaveStateResponse(state_id=ref.uri, step=step, size_bytes=ref.size_bytes)

    async def LoadState(self, request: trainer_pb2.LoadStateRequest, context: Context) -> Any:
        name = self._known(request.adapter)
        if not request.state_id:
            raise InvalidArgument("state_id is required", reason="INVALID_STATE_ID", field="state_id")
        principal = current_principal()
        state = await self.scheduler.run(
            name,
            lambda: self.trainer.load_state(
                name, request.state_id, weights_only=request.weights_only, principal=principal
            ),
        )
        return trainer_pb2.LoadStateResponse(adapter=adapter_message(state))
