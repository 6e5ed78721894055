"""TrainerService handlers and checks of the trainer pool (pool.py has the leases): a pool adapter is created
under the epoch the registry placed it with, trains only while its lease holds, autosaves every
--autosave-every steps (recorded in the registry, fenced by the epoch), and moves to another trainer on purpose
(MoveAdapter, `opentinker trainer move`) or when this trainer drains (SIGTERM)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from opentinker.rpc.serving.auth import current_principal, require_access
from opentinker.rpc.serving.errors import FailedPrecondition, NotFound, ServiceError
from opentinker.rpc.serving.membership import FleetMember
from opentinker.rpc.serving.registry_link import registry_call
from opentinker.trainer_server.handler_base import Context, Handlers
from opentinker.trainer_server.ownership import state_owner
from opentinker.trainer_server.pool import PoolLeases, not_owner
from opentinker.v1 import registry_pb2, trainer_pb2
from opentinker.weights.names import check_adapter_name

log = logging.getLogger("opentinker.trainer.pool")


def _not_placed(adapter: str) -> FailedPrecondition:
    return FailedPrecondition(
        f"adapter {adapter!r} was not placed by the registry (created with an explicit trainer address): there is "
        "no placement to move",
        reason="NOT_PLACED",
    )


class PoolHandlers(Handlers):
    pool: PoolLeases
    member: FleetMember | None
    autosave_every: int
    autosaves: dict[str, tuple[int, str]]  # adapter -> (step, state id) of its newest autosave here

    async def _training(self, name: str) -> int:
        """A call that changes the adapter: its name, the caller's access, this trainer's ownership (the epoch it
        runs under; 0 when not a pool adapter), and that the adapter is here."""
        check_adapter_name(name)
        require_access(name)
        if self.pool.state(name) == "expired" and self.member is not None:
            await self.member.beat_now()  # renews the lease, or finds the adapter taken over
        if self.pool.state(name) == "revoked":
            raise await self._not_owner(name)
        epoch = self.pool.check(name)
        self.trainer.get(name)
        return epoch

    async def _not_owner(self, name: str) -> FailedPrecondition:
        lease = self.pool.leases[name]
        if lease.owner == "?":
            with contextlib.suppress(ServiceError):
                request = registry_pb2.GetPlacementRequest(adapter=name)
                placement = (await registry_call(self.registry.GetPlacement(request, metadata=self.metadata))).placement
                self.pool.revoke(name, placement.address)
        return not_owner(name, lease.owner)

    async def _confirm_placement(self, name: str, epoch: int) -> None:
        """CreateAdapter of a pool adapter: the registry must place it here, at this epoch."""
        mine = self.member.replica_id if self.member is not None else ""
        if not mine:
            raise FailedPrecondition(
                "this trainer is not in a trainer pool (start it with --registry) or has not registered yet",
                reason="NOT_PLACED",
            )
        request = registry_pb2.GetPlacementRequest(adapter=name)
        placement = (await registry_call(self.registry.GetPlacement(request, metadata=self.metadata))).placement
        if placement.replica_id != mine or placement.epoch != epoch:
            raise not_owner(name, placement.address)

    async def _autosave_if_due(self, name: str, epoch: int) -> str:
        """Before a ForwardBackward: a full state every --autosave-every steps, so the state holds only calls
        whose replies went out (a step's reply precedes the next call's save). Returns its id, or ""."""
        state = self.trainer.get(name)
        due = epoch and self.autosave_every > 0 and state.step > 0 and state.step % self.autosave_every == 0
        if not due or state.ledger.pending or self.autosaves.get(name, (-1, ""))[0] == state.step:
            return ""
        return await self._save_and_record(name, epoch, "autosave")

    async def _save_and_record(self, name: str, epoch: int, label: str) -> str:
        owner = state_owner(name, current_principal())

        def save() -> tuple[str, int]:
            self.pool.check(name)
            return self.trainer.save_state(name, label, owner=owner).uri, self.trainer.get(name).step

        uri, step = await self.scheduler.run(name, save)
        await self._record_state(name, epoch, uri, step)
        previous = self.autosaves.get(name)
        self.autosaves[name] = (step, uri)
        if previous is not None and previous[1] != uri:  # one autosave per adapter is kept: the newest
            with contextlib.suppress(ServiceError, OSError):
                await asyncio.to_thread(self.trainer.delete_state, previous[1])
        return uri

    async def _record_state(self, name: str, epoch: int, uri: str, step: int) -> None:
        """The state into the bucket (when there is one), then into the placement: where the next owner resumes.
        A stale epoch means another trainer owns the adapter now: revoked here, NOT_OWNER to the caller."""
        await self._push_state(uri)
        record = registry_pb2.RecordPlacementStateRequest(adapter=name, epoch=epoch, state_id=uri, state_step=step)
        try:
            await registry_call(self.registry.RecordPlacementState(record, metadata=self.metadata))
        except (FailedPrecondition, NotFound) as error:
            if error.reason not in ("STALE_EPOCH", "PLACEMENT_NOT_FOUND"):
                raise
            self.pool.revoke(name, "?")
            raise await self._not_owner(name) from None

    async def MoveAdapter(self, request: trainer_pb2.MoveAdapterRequest, context: Context) -> Any:
        name = request.adapter
        epoch = await self._training(name)
        if not epoch:
            raise _not_placed(name)
        placement = await self._move(name, epoch, await self._trainer_id(request.to))
        return trainer_pb2.MoveAdapterResponse(placement=placement, state_id=placement.state_id)

    async def _trainer_id(self, to: str) -> str:
        """A trainer named by address or replica id ("": the registry chooses)."""
        if not to:
            return ""
        request = registry_pb2.ListReplicasRequest(role=registry_pb2.REPLICA_ROLE_TRAINER)
        replicas = (await registry_call(self.registry.ListReplicas(request, metadata=self.metadata))).replicas
        for replica in replicas:
            if to in (replica.replica_id, replica.address):
                return str(replica.replica_id)
        raise NotFound(
            f"no trainer of the pool is {to[:200]!r} (see `opentinker fleet status`)", reason="TRAINER_NOT_FOUND"
        )

    async def _move(self, name: str, epoch: int, to: str) -> registry_pb2.Placement:
        """Save (after every call queued before), fence (the registry's compare-and-set), drop here."""
        lease = self.pool.leases[name]
        lease.moving = True  # calls arriving from now on wait for the new owner (UNAVAILABLE ADAPTER_MOVING)
        owner = state_owner(name, current_principal())
        try:
            ref, step = await self.scheduler.run(
                name, lambda: (self.trainer.save_state(name, "move", owner=owner), self.trainer.get(name).step)
            )
            await self._push_state(ref.uri)
            move = registry_pb2.MovePlacementRequest(
                adapter=name, expected_epoch=epoch, to_replica_id=to, state_id=ref.uri, state_step=step
            )
            placement = (await registry_call(self.registry.MovePlacement(move, metadata=self.metadata))).placement
        except BaseException:
            lease.moving = False
            raise
        self.pool.revoke(name, placement.address)
        await self.scheduler.run(name, lambda: self.trainer.delete(name))
        self.autosaves.pop(name, None)
        log.info("moved %s to %s (epoch %d, state at step %d)", name, placement.address, placement.epoch, step)
        placed: registry_pb2.Placement = placement
        return placed

    async def move_all_away(self) -> None:
        """SIGTERM: every pool adapter to another trainer; with none to take them, their state is recorded so
        the next owner (after this trainer's lease ends) resumes where they stopped."""
        for name in sorted(self.pool.leases):
            epoch = self.pool.epoch(name)
            if not epoch or name not in self.trainer.adapters:
                continue
            try:
                await self._move(name, epoch, "")
            except FailedPrecondition as error:
                if error.reason != "NO_TRAINER":
                    log.warning("could not move %s away: %s", name, error.message)
                    continue
                with contextlib.suppress(ServiceError):
                    await self._save_and_record(name, epoch, "drain")
            except ServiceError as error:
                log.warning("could not move %s away: %s", name, error.message)

    def on_beat(self, response: registry_pb2.HeartbeatResponse, sent_at: float) -> None:
        """The membership's beat hook: renew the leases; drop what another trainer took over (its memory)."""
        for name in self.pool.on_beat(response.placements, sent_at):
            log.warning("adapter %s was placed on another trainer while this one was unheard of: dropped", name)
            task = asyncio.get_running_loop().create_task(self._drop(name))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _drop(self, name: str) -> None:
        if name in self.trainer.adapters:
            with contextlib.suppress(ServiceError):
                await self.scheduler.run(name, lambda: self.trainer.delete(name))
        self.autosaves.pop(name, None)
