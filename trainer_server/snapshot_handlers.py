"""TrainerService handlers for snapshots and states: SaveSnapshot (write, publish to the registry, record the
lineage), SaveState, LoadState, DeleteState and ResetAdapter (to a published version)."""

from __future__ import annotations

import asyncio
from typing import Any

from opentinker.rpc.process.faults import fault_point
from opentinker.rpc.serving.auth import current_principal
from opentinker.rpc.serving.errors import InvalidArgument, NotFound
from opentinker.rpc.serving.registry_link import registry_call
from opentinker.trainer_server.adapter import AdapterState
from opentinker.trainer_server.admission import queued
from opentinker.trainer_server.handler_base import Context, follow
from opentinker.trainer_server.ownership import state_owner
from opentinker.trainer_server.pool_handlers import PoolHandlers
from opentinker.trainer_server.wire import adapter_message, batch_record_message, lora_message
from opentinker.v1 import registry_pb2, trainer_pb2
from opentinker.weights.artifact_transfer import push_artifact


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Takes a detached task's outcome, so an error after its client left is not reported as never retrieved."""
    if not task.cancelled():
        task.exception()


class SnapshotHandlers(PoolHandlers):
    @queued
    async def SaveSnapshot(self, request: trainer_pb2.SaveSnapshotRequest, context: Context) -> Any:
        name = request.adapter
        epoch = await self._training(name)
        aliases = list(request.aliases)
        owner = state_owner(name, current_principal())

        def write() -> tuple[Any, registry_pb2.Lineage]:
            self.pool.check(name)
            state = self.trainer.get(name)
            ref = self.trainer.write_snapshot(name)
            # In the same lane job as the snapshot: the state is exactly the version's weights, plus optimizer.
            saved = self.trainer.save_state(name, "snapshot", owner=owner) if self.persist_state else None
            lineage = registry_pb2.Lineage(
                parent_version=state.last_snapshot_version,
                trainer_step=state.step,
                tokens_trained=state.ledger.tokens_trained,
                datums_trained=state.ledger.datums_trained,
                batches=[batch_record_message(b) for b in state.ledger.batches],
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
                if (bucket := self.trainer.bucket) is not None:
                    # Into the bucket before the registry hears of it, off the compute thread; a store that is
                    # down or refuses fails the save here (UNAVAILABLE, PERMISSION_DENIED): nothing is published
                    # and the adapter keeps its weights, so the save can be retried.
                    if lineage.state_id:
                        await bucket.run(bucket.push, lineage.state_id, "state")
                    await bucket.run(bucket.push, ref.uri)
                fault_point("save_snapshot/before_publish")
                publish = registry_pb2.PublishVersionRequest(
                    adapter=name,
                    artifact_uri=ref.uri,
                    artifact_sha256=ref.sha256,
                    artifact_size_bytes=ref.size_bytes,
                    lora_config=lora_message(self.trainer.get(name).lora),
                    lineage=lineage,
                    aliases=aliases,
                    skip_latest=request.skip_latest,
                    request_id=request.request_id,
                    owner_epoch=epoch,  # the registry refuses it if another trainer owns the adapter now
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
                    follow(state, response.version)

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
        epoch = self.pool.epoch(name)
        ref, step = await self.scheduler.run(
            name, lambda: (self.trainer.save_state(name, label, owner=owner), self.trainer.get(name).step)
        )
        if epoch:  # a pool adapter's next owner resumes from here (and the SDK's journal starts again here)
            await self._record_state(name, epoch, ref.uri, step)
        else:
            await self._push_state(ref.uri)  # off the compute thread: a slow store delays only this call
        fault_point("save_state/before_reply")
        return trainer_pb2.SaveStateResponse(state_id=ref.uri, step=step, size_bytes=ref.size_bytes)

    async def LoadState(self, request: trainer_pb2.LoadStateRequest, context: Context) -> Any:
        name = self._known(request.adapter)
        if not request.state_id:
            raise InvalidArgument("state_id is required", reason="INVALID_STATE_ID", field="state_id")
        principal = current_principal()
        await self._state_here(request.state_id)
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
        await self._state_here(request.state_id)  # the owner check reads the state's own record
        freed = await asyncio.to_thread(self.trainer.delete_state, request.state_id, principal)
        if (bucket := self.trainer.bucket) is not None:
            await bucket.run(bucket.delete, request.state_id, "state")
        return trainer_pb2.DeleteStateResponse(bytes_freed=freed)

    async def ResetAdapter(self, request: trainer_pb2.ResetAdapterRequest, context: Context) -> Any:
        name = self._known(request.adapter)
        if not request.reference:
            raise InvalidArgument("reference is required (e.g. name@5)", reason="INVALID_REFERENCE", field="reference")
        version = await self._fitting_version(request.reference, self.trainer.get(name).lora)

        def reset() -> AdapterState:
            state = self.trainer.reset_to_snapshot(name, version.artifact_uri, keep_optimizer=request.keep_optimizer)
            follow(state, version)
            return state

        async with self.lineage.hold(name):  # as LoadState: the lineage moves only between two saves
            state = await self.scheduler.run(name, reset)
        return trainer_pb2.ResetAdapterResponse(
            adapter=adapter_message(state), version=version, optimizer_kept=request.keep_optimizer
        )
