"""A model server (a sampler or a trainer) as a member of the fleet: it registers with the registry once it
serves, renews its lease every beat with its load and resident adapters, and on SIGTERM says DRAINING before its
health flips, so routers stop sending to it first. A beat answered NOT_FOUND (the lease ran out, or the
registry came back on an empty Redis) registers again at once: the fleet is whole again within one beat of the
registry's return."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol

import grpc

from opentinker.v1 import registry_pb2, registry_pb2_grpc

log = logging.getLogger("opentinker.membership")

DRAIN_BEAT_TIMEOUT_S: Final = 2.0  # SIGTERM waits this long at most for the registry to hear DRAINING
MAX_BACKOFF_S: Final = 30.0


@dataclass(frozen=True, slots=True)
class MemberInfo:
    """What the replica registers once: who it is and what it serves."""

    role: registry_pb2.ReplicaRole  # REPLICA_ROLE_SAMPLER or REPLICA_ROLE_TRAINER
    address: str  # host:port clients use
    base_fingerprint: str  # BaseModelInfo.model_digest
    max_slots: int  # adapter slots (a sampler) or resident adapters (a trainer; 0: no limit)
    zone: str = ""
    heartbeat_s: float = 1.0
    lease_beats: int = 3


@dataclass(frozen=True, slots=True)
class Beat:
    """What the replica reports every beat."""

    load: registry_pb2.ReplicaLoad
    resident: list[str]  # "adapter@N" (a sampler's slots) or "adapter" (a trainer's resident adapters)


def advertised(advertise: str, bound: str) -> str:
    """The address to register: ``--advertise`` when given, else the bound one, with a wildcard host (0.0.0.0,
    ::) replaced by this machine's name, since no client can dial a wildcard."""
    if advertise:
        return advertise
    host, _, port = bound.rpartition(":")
    if host in ("0.0.0.0", "[::]", "::"):
        host = socket.getfqdn()
    return f"{host}:{port}"


BeatHook = Callable[[registry_pb2.HeartbeatResponse, float], None]  # (the answer, time.monotonic() when sent)


class Membership:
    """Registers and beats from the server's event loop; ``beat`` reads the engine's figures (cheap, no lock)."""

    def __init__(
        self,
        registry: registry_pb2_grpc.RegistryServiceStub,
        metadata: list[tuple[str, str]] | None,
        info: MemberInfo,
        beat: Callable[[], Beat],
        on_beat: BeatHook | None = None,
    ) -> None:
        self.registry = registry
        self.metadata = metadata
        self.info = info
        self.beat = beat
        self.on_beat = on_beat
        kind = "trainer" if info.role == registry_pb2.REPLICA_ROLE_TRAINER else "sampler"
        self.replica_id = f"{kind}-{uuid.uuid4().hex[:16]}"
        self.state: registry_pb2.ReplicaState = registry_pb2.REPLICA_STATE_SERVING
        self.registered = False
        self._task: asyncio.Task[None] | None = None
        self._last_error = ""

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="fleet-membership")

    async def drain(self) -> None:
        """DRAINING in the registry now (bounded wait): called before the health service flips."""
        self.state = registry_pb2.REPLICA_STATE_DRAINING
        if not self.registered:
            return
        try:
            await self._heartbeat(timeout=DRAIN_BEAT_TIMEOUT_S)
        except grpc.RpcError as error:
            log.warning("could not tell the registry this replica drains: %s", _describe(error))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        backoff = self.info.heartbeat_s
        while True:
            try:
                if not self.registered:
                    await self._register()
                    self.registered = True
                    log.info("registered with the registry as %s at %s", self.replica_id, self.info.address)
                else:
                    await self._heartbeat(timeout=self.info.heartbeat_s * self.info.lease_beats)
                self._last_error = ""
                backoff = self.info.heartbeat_s
                await asyncio.sleep(self.info.heartbeat_s)
            except grpc.RpcError as error:
                if error.code() == grpc.StatusCode.NOT_FOUND:
                    log.info("the registry lost this replica's lease; registering again")
                    self.registered = False
                    continue
                message = _describe(error)
                if message != self._last_error:  # once per distinct failure, not every beat
                    log.warning("fleet membership: %s (retrying)", message)
                    self._last_error = message
                if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    # The registry is away: try every beat, so a restarted one has this replica back within a
                    # lease. Any other refusal (a token without the admin role) will not pass sooner: back off.
                    await asyncio.sleep(self.info.heartbeat_s)
                    continue
                await asyncio.sleep(backoff)
                backoff = min(MAX_BACKOFF_S, backoff * 2)

    async def _register(self) -> None:
        beat = self.beat()
        replica = registry_pb2.Replica(
            replica_id=self.replica_id,
            role=self.info.role,
            address=self.info.address,
            state=self.state,
            base_fingerprint=self.info.base_fingerprint,
            max_slots=self.info.max_slots,
            zone=self.info.zone,
            load=beat.load,
            resident=beat.resident,
            lease_seconds=self.info.heartbeat_s * self.info.lease_beats,
        )
        await self.registry.RegisterReplica(
            registry_pb2.RegisterReplicaRequest(replica=replica),
            timeout=self.info.heartbeat_s * self.info.lease_beats,
            metadata=self.metadata,
        )

    async def beat_now(self) -> bool:
        """One beat now, registering again first when the registry lost this replica (a trainer checking a lease
        that ran out: after a SIGSTOP, say); False when the registry could not be reached or refused."""
        timeout = self.info.heartbeat_s * self.info.lease_beats
        try:
            if not self.registered:
                await self._register()
                self.registered = True
            try:
                await self._heartbeat(timeout=timeout)
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                await self._register()
                await self._heartbeat(timeout=timeout)
            return True
        except grpc.RpcError as error:
            log.warning("fleet membership: an immediate beat failed: %s", _describe(error))
            return False

    async def _heartbeat(self, *, timeout: float) -> None:
        beat = self.beat()
        request = registry_pb2.HeartbeatRequest(
            replica_id=self.replica_id, state=self.state, load=beat.load, resident=beat.resident
        )
        sent = time.monotonic()
        response = await self.registry.Heartbeat(request, timeout=timeout, metadata=self.metadata)
        if self.on_beat is not None:
            self.on_beat(response, sent)


class FleetFlags(Protocol):
    """The fleet flags both model servers take (ModelServerSetup has them)."""

    @property
    def advertise(self) -> str: ...
    @property
    def zone(self) -> str: ...
    @property
    def heartbeat_s(self) -> float: ...
    @property
    def lease_beats(self) -> int: ...


class FleetMember:
    """A server's place in the fleet over its life, for its ServerHooks: ``join`` once it serves (registers and
    beats), ``drain`` on SIGTERM, ``leave`` on stop; drain and leave do nothing before join."""

    def __init__(
        self,
        role: registry_pb2.ReplicaRole,
        base_fingerprint: str,
        max_slots: int,
        beat: Callable[[], Beat],
        flags: FleetFlags,
        on_beat: BeatHook | None = None,
    ) -> None:
        self.role, self.base_fingerprint, self.max_slots, self.beat = role, base_fingerprint, max_slots, beat
        self.flags, self.on_beat = flags, on_beat
        self.membership: Membership | None = None

    @property
    def lease_s(self) -> float:
        return self.flags.heartbeat_s * self.flags.lease_beats

    @property
    def replica_id(self) -> str:
        """ "" before join."""
        return self.membership.replica_id if self.membership is not None else ""

    async def beat_now(self) -> bool:
        return self.membership is not None and await self.membership.beat_now()

    def join(
        self, registry: registry_pb2_grpc.RegistryServiceStub, metadata: list[tuple[str, str]] | None, bound: str
    ) -> str:
        """Starts registering from the running event loop; returns the address registered."""
        f = self.flags
        address = advertised(f.advertise, bound)
        info = MemberInfo(
            self.role, address, self.base_fingerprint, self.max_slots, f.zone, f.heartbeat_s, f.lease_beats
        )
        self.membership = Membership(registry, metadata, info, self.beat, self.on_beat)
        self.membership.start()
        return address

    async def drain(self) -> None:
        if self.membership is not None:
            await self.membership.drain()

    async def leave(self) -> None:
        if self.membership is not None:
            await self.membership.stop()


def _describe(error: grpc.RpcError) -> str:
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else str(error)
    return f"{code.name if code else 'error'}: {details}"
