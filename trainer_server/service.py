"""TrainerService: validate and authorize in the handler, compute through the scheduler, publish through
the registry. Handlers read top to bottom: check input -> queue on the adapter's lane -> build the reply."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from opentinker.rpc.auth import Principal, current_principal, require_access
from opentinker.rpc.errors import (
    AlreadyExists,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from opentinker.rpc.faults import fault_point
from opentinker.rpc.registry_link import registry_call
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
from opentinker.trainer_server.start_point import (
    DEFAULT_MAX_SERVING_RANK,
    StartPlan,
    check_serving_rank,
    check_start,
    started_from,
)
from opentinker.trainer_server.trainer import GradientMark, StepOutput, Trainer, check_adam, check_lora
from opentinker.v1 import common_pb2, registry_pb2, registry_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from opentinker.weights.artifact_transfer import fetch_artifact, push_artifact
from opentinker.weights.names import check_adapter_name, parse_reference

Context = Any  # grpc.aio.ServicerContext; untyped in the generated stubs


def adapter_message(state: AdapterState) -> trainer_pb2.TrainingAdapter:
    message = trainer_pb2.TrainingAdapter(
        name=state.name,
        lora_config=state.lora,
        adam_params=state.adam,
        seed=state.seed,
        step=state.step,
        tokens_trained=state.ledger.tokens_trained,
        datums_trained=state.ledger.datums_trained,
        pending_batches=len(state.ledger.pending),
        last_snapshot_version=state.last_snapshot_version,
        num_parameters=state.num_parameters,
        resident=state.resident,
        parent_adapter=state.parent_adapter,
    )
    message.create_time.FromSeconds(int(state.create_time))
    return message


def _follow(state: AdapterState, version: registry_pb2.Version) -> None:
    """The adapter's weights are now `version`'s: its next snapshot's parent."""
    state.last_snapshot_version = version.version
    state.parent_adapter = "" if version.adapter == state.name else version.adapter


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Takes a detached task's outcome, so an error after its client left is not reported as never retrieved."""
    if not task.cancelled():
        task.exception()


def _outputs(result: StepOutput) -> list[trainer_pb2.LossFnOutput]:
    return [
        trainer_pb2.LossFnOutput(
            tensors={
                "logprobs": common_pb2.TensorData(dtype=common_pb2.D_TYPE_FLOAT32, shape=[len(row)], float32_values=row)
            }
        )
        for row in result.logprobs
    ]


class LineageLocks:
    """One lock per adapter for what moves its lineage (last_snapshot_version, parent_adapter, ledger.batches):
    SaveSnapshot holds it from the snapshot's write across the publish to its bookkeeping, so a second save of
    the adapter writes only after the first one's version is its parent (two at once would both name the same
    parent and both claim the same batches). A lock lives while someone holds or awaits it."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}  # adapter -> (lock, holders and waiters)

    @contextlib.asynccontextmanager
    async def hold(self, adapter: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(adapter, (asyncio.Lock(), 0))
        self._locks[adapter] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[adapter]
            if users == 1:
                del self._locks[adapter]
            else:
                self._locks[adapter] = (lock, users - 1)

    def __len__(self) -> int:
        return len(self._locks)


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
        max_serving_rank: int = DEFAULT_MAX_SERVING_RANK,
        persist_state: bool = False,
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
        self.persist_state = persist_state  # a full state with every snapshot (lineage.state_id)
        self.lineage = LineageLocks()

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
        check_serving_rank(request.lora_config.rank, self.max_serving_rank)
        check_start(request)
        targets = self.trainer.base.resolve_targets(list(request.lora_config.target_modules))
        adam = request.adam_params if request.HasField("adam_params") else None
        if adam is not None:
            check_adam(adam)
        if name in self.trainer.adapters:
            raise AlreadyExists(
                f"adapter {name!r} already exists in this trainer: continue it (training_client), or drop it first "
                f"(`opentinker trainer delete {name}`)",
                reason="ADAPTER_EXISTS",
            )
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
        plan = StartPlan()
        # Before the registry record exists: a snapshot or state that does not fit creates nothing.
        if request.init_from:
            plan = StartPlan(
                snapshot=await self._fitting_version(request.init_from, request.lora_config), how="init_from"
            )
        if request.resume_state:
            await asyncio.to_thread(self.trainer.check_state, request.resume_state, request.lora_config, principal)
            plan = StartPlan(snapshot=plan.snapshot, state_id=request.resume_state, how=plan.how)
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
                    f"adapter {name!r} exists in the registry; pass attach_existing to continue it here from its "
                    "latest version (with fresh for fresh weights)",
                    reason="ADAPTER_EXISTS",
                ) from None
            existing = await registry_call(
                self.registry.GetAdapter(registry_pb2.GetAdapterRequest(name=name), metadata=self.metadata)
            )
            if existing.adapter.base_model_digest and existing.adapter.base_model_digest != base_digest:
                raise FailedPrecondition(
                    f"adapter {name!r} was trained on another base model", reason="BASE_MODEL_MISMATCH"
                ) from None
            if plan.snapshot is None and not plan.state_id and not request.fresh:
                plan = await self._attach_plan(name, request.lora_config, principal)
        state = await self.scheduler.run(
            name, lambda: self.trainer.create(name, request.lora_config, adam, request.seed)
        )

        def start() -> None:
            if plan.snapshot is not None:
                self.trainer.load_snapshot(name, plan.snapshot.artifact_uri)
                _follow(state, plan.snapshot)
                if plan.snapshot.adapter == name:  # its own history goes on: step and totals as at that version
                    lineage = plan.snapshot.lineage
                    state.step = lineage.trainer_step
                    state.ledger.tokens_trained = lineage.tokens_trained
                    state.ledger.datums_trained = lineage.datums_trained
            if plan.state_id:
                self.trainer.load_state(name, plan.state_id, principal=principal)
            if plan.at_version is not None:  # saved with this version, before its publish: history from there
                _follow(state, plan.at_version)
                state.ledger.batches.clear()  # they are that version's lineage

        try:
            await self.scheduler.run(name, start)
        except BaseException:
            await self.scheduler.run(name, lambda: self.trainer.delete(name))
            raise
        return trainer_pb2.TrainerServiceCreateAdapterResponse(
            adapter=adapter_message(state), started_from=started_from(plan, request.seed, state.step)
        )

    async def _fitting_version(self, reference: str, lora: common_pb2.LoraConfig) -> registry_pb2.Version:
        """The version `reference` names, its artifact in this trainer's store and checked to fit `lora`."""
        version = await self._resolve_init(reference)
        await fetch_artifact(self.registry, self.trainer.artifacts, version.artifact_uri, self.metadata)
        await asyncio.to_thread(self.trainer.check_snapshot, version.artifact_uri, lora)
        return version

    async def _attach_plan(self, name: str, lora: common_pb2.LoraConfig, principal: Principal) -> StartPlan:
        """Attaching to an existing adapter: its latest version (its persisted state when loadable here), or
        fresh weights when it has no version yet."""
        try:
            latest = await self._resolve_init(name)
        except NotFound as exc:
            if exc.reason != "ALIAS_NOT_FOUND":
                raise
            return StartPlan()  # no version published yet: nothing to lose
        note = ""
        if latest.lineage.state_id:
            try:
                await asyncio.to_thread(self.trainer.check_state, latest.lineage.state_id, lora, principal)
                return StartPlan(state_id=latest.lineage.state_id, at_version=latest, how="latest")
            except (NotFound, DataLoss):
                note = f"its saved state {latest.lineage.state_id} is not loadable in this trainer's store"
        return StartPlan(snapshot=await self._fitting_version(name, lora), how="latest", note=note)

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
        batch = build_batch(
            list(datums),
            loss_fn,
            vocab_size=base.vocab_size,
            max_positions=base.max_positions,
            pad_id=self.trainer.pad_id,
            max_batch_positions=self.max_batch_positions,
        )
        if batch.num_tokens > self.max_batch_tokens:
            raise ResourceExhausted(
                f"batch has {batch.num_tokens} tokens; the limit is {self.max_batch_tokens}",
                reason="BATCH_TOO_LARGE",
                field="datums",
            )
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
        owner = state_owner(name, current_principal())

        def write() -> tuple[Any, registry_pb2.Lineage]:
            state = self.trainer.get(name)
            ref = self.trainer.write_snapshot(name)
            # In the same lane job as the snapshot: the state is exactly the version's weights, plus optimizer.
            saved = self.trainer.save_state(name, "snapshot", owner=owner) if self.persist_state else None
            lineage = registry_pb2.Lineage(
                parent_version=state.last_snapshot_version,
                trainer_step=state.step,
                tokens_trained=state.ledger.tokens_trained,
                datums_trained=state.ledger.datums_trained,
                batches=list(state.ledger.batches),
                metrics=dict(request.metrics),
                base_model_digest=self.trainer.base.digest,
                parent_adapter=state.parent_adapter,
                state_id=saved.uri if saved is not None else "",
            )
            return ref, lineage

        written = asyncio.Event()

        async def save() -> registry_pb2.PublishVersionResponse:
            async with self.lineage.hold(name):
                ref, lineage = await self.scheduler.run(name, write)
                written.set()
                fault_point("save_snapshot/before_publish")
                publish = registry_pb2.PublishVersionRequest(
                    adapter=name,
                    artifact_uri=ref.uri,
                    artifact_sha256=ref.sha256,
                    artifact_size_bytes=ref.size_bytes,
                    lora_config=self.trainer.get(name).lora,
                    lineage=lineage,
                    aliases=aliases,
                    skip_latest=request.skip_latest,
                    request_id=request.request_id,
                )
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
                    _follow(state, response.version)

                await self.scheduler.run(name, record)
                published: registry_pb2.PublishVersionResponse = response
                return published

        # Once its snapshot is written, a save runs to its end even if its client goes: a version published
        # without its bookkeeping would leave the next save naming the same parent.
        task = asyncio.ensure_future(save())
        task.add_done_callback(_retrieve)
        try:
            response = await asyncio.shield(task)
        except asyncio.CancelledError:
            if not written.is_set():
                task.cancel()
            raise
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
        async with self.lineage.hold(name):  # it sets last_snapshot_version: not between a save's write and its record
            state = await self.scheduler.run(
                name,
                lambda: self.trainer.load_state(
                    name, request.state_id, weights_only=request.weights_only, principal=principal
                ),
            )
        return trainer_pb2.LoadStateResponse(adapter=adapter_message(state))

    async def DeleteState(self, request: trainer_pb2.DeleteStateRequest, context: Context) -> Any:
        if not request.state_id:
            raise InvalidArgument("state_id is required", reason="INVALID_STATE_ID", field="state_id")
        principal = current_principal()
        freed = await asyncio.to_thread(self.trainer.delete_state, request.state_id, principal)
        return trainer_pb2.DeleteStateResponse(bytes_freed=freed)

    async def ResetAdapter(self, request: trainer_pb2.ResetAdapterRequest, context: Context) -> Any:
        name = self._known(request.adapter)
        if not request.reference:
            raise InvalidArgument("reference is required (e.g. name@5)", reason="INVALID_REFERENCE", field="reference")
        version = await self._fitting_version(request.reference, self.trainer.get(name).lora)

        def reset() -> AdapterState:
            state = self.trainer.reset_to_snapshot(name, version.artifact_uri, keep_optimizer=request.keep_optimizer)
            _follow(state, version)
            return state

        async with self.lineage.hold(name):  # as LoadState: the lineage moves only between two saves
            state = await self.scheduler.run(name, reset)
        return trainer_pb2.ResetAdapterResponse(
            adapter=adapter_message(state), version=version, optimizer_kept=request.keep_optimizer
        )
