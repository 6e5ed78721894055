"""TrainerService handlers for adapters: create one (from fresh weights, a version, a saved state, or an existing
registry adapter's latest), get, list and delete. Protos are turned into records (wire.py) on the way in."""

from __future__ import annotations

import asyncio
from typing import Any

from opentinker.rpc.serving.auth import Principal, current_principal, require_access
from opentinker.rpc.serving.errors import AlreadyExists, DataLoss, FailedPrecondition, NotFound
from opentinker.rpc.serving.registry_link import registry_call
from opentinker.trainer_server.adapter_config import AdamParams, LoraConfig, check_adam, check_lora
from opentinker.trainer_server.handler_base import Context, follow
from opentinker.trainer_server.pool_handlers import PoolHandlers
from opentinker.trainer_server.quota import lora_parameters
from opentinker.trainer_server.start_point import StartPlan, check_serving_rank, check_start, started_from
from opentinker.trainer_server.wire import adam_of, adapter_message, lora_of
from opentinker.v1 import registry_pb2, trainer_pb2
from opentinker.weights.names import check_adapter_name


class AdapterHandlers(PoolHandlers):
    async def CreateAdapter(self, request: trainer_pb2.TrainerServiceCreateAdapterRequest, context: Context) -> Any:
        name = check_adapter_name(request.name)
        principal = require_access(name)
        lora = lora_of(request.lora_config)
        check_lora(lora)
        check_serving_rank(lora.rank, self.max_serving_rank)
        check_start(request)
        targets = self.trainer.base.resolve_targets(list(lora.target_modules))
        adam = adam_of(request.adam_params) if request.HasField("adam_params") else None
        if adam is not None:
            check_adam(adam)
        if name in self.trainer.adapters:
            raise AlreadyExists(
                f"adapter {name!r} already exists in this trainer: continue it (training_client), or drop it first "
                f"(`opentinker trainer delete {name}`)",
                reason="ADAPTER_EXISTS",
            )
        if request.placement_epoch:
            await self._confirm_placement(name, request.placement_epoch)
        shapes = self.trainer.base.module_shapes()  # weighed before anything is allocated
        num_parameters = lora_parameters(lora.rank, [shapes[t] for t in targets])
        with self.quota.reserve(principal, name, self.trainer.adapters, num_parameters):
            response = await self._create(name, principal, request, lora, adam)
        if request.placement_epoch:
            await self._join_pool(name, request.placement_epoch, resumed=bool(request.resume_state))
        return response

    async def _join_pool(self, name: str, epoch: int, *, resumed: bool) -> None:
        """A pool adapter: leased here from now on; one that did not resume from a state saves one at once, so a
        failover before its first autosave has a state to resume from."""
        self.pool.grant(name, epoch)
        if self.member is not None:
            await self.member.beat_now()
        if not resumed:
            try:
                await self._save_and_record(name, epoch, "autosave")
            except BaseException:
                self.pool.forget(name)
                await self.scheduler.run(name, lambda: self.trainer.delete(name))
                raise

    async def _create(
        self,
        name: str,
        principal: Principal,
        request: trainer_pb2.TrainerServiceCreateAdapterRequest,
        lora: LoraConfig,
        adam: AdamParams | None,
    ) -> trainer_pb2.TrainerServiceCreateAdapterResponse:
        base_digest = self.trainer.base.digest
        plan = StartPlan()
        # Before the registry record exists: a snapshot or state that does not fit creates nothing.
        if request.init_from:
            plan = StartPlan(snapshot=await self._fitting_version(request.init_from, lora), how="init_from")
        if request.resume_state:
            await self._state_here(request.resume_state)
            await asyncio.to_thread(self.trainer.check_state, request.resume_state, lora, principal)
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
                plan = await self._attach_plan(name, lora, principal)
        state = await self.scheduler.run(name, lambda: self.trainer.create(name, lora, adam, request.seed))

        def start() -> None:
            if plan.snapshot is not None:
                self.trainer.load_snapshot(name, plan.snapshot.artifact_uri)
                follow(state, plan.snapshot)
                if plan.snapshot.adapter == name:  # its own history goes on: step and totals as at that version
                    lineage = plan.snapshot.lineage
                    state.step = lineage.trainer_step
                    state.ledger.tokens_trained = lineage.tokens_trained
                    state.ledger.datums_trained = lineage.datums_trained
            if plan.state_id:
                self.trainer.load_state(name, plan.state_id, principal=principal)
            if plan.at_version is not None:  # saved with this version, before its publish: history from there
                follow(state, plan.at_version)
                state.ledger.batches.clear()  # they are that version's lineage

        try:
            await self.scheduler.run(name, start)
        except BaseException:
            await self.scheduler.run(name, lambda: self.trainer.delete(name))
            raise
        return trainer_pb2.TrainerServiceCreateAdapterResponse(
            adapter=adapter_message(state), started_from=started_from(plan, request.seed, state.step)
        )

    async def _attach_plan(self, name: str, lora: LoraConfig, principal: Principal) -> StartPlan:
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
                await self._state_here(latest.lineage.state_id)
                await asyncio.to_thread(self.trainer.check_state, latest.lineage.state_id, lora, principal)
                return StartPlan(state_id=latest.lineage.state_id, at_version=latest, how="latest")
            except (NotFound, DataLoss):
                note = f"its saved state {latest.lineage.state_id} is not loadable in this trainer's store"
        return StartPlan(snapshot=await self._fitting_version(name, lora), how="latest", note=note)

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
        self.pool.forget(name)
        self.autosaves.pop(name, None)
        return trainer_pb2.TrainerServiceDeleteAdapterResponse()
