"""Training through the registry's trainer pool (ServiceClient(registry=...) without trainer=): the registry
places the adapter on a trainer, and a call that finds its trainer gone, or no longer the owner, follows.

The SDK keeps a journal of the calls that change the adapter (ForwardBackward, OptimStep) since the newest full
state it knows of (the trainer's autosave, a save_state): each entry with the adapter's position before it,
(optimizer step, ForwardBackward calls since that step). When the owner dies its lease runs out, PlaceAdapter
puts the adapter on another trainer under a new epoch, that trainer loads the state the registry recorded, the
entries from the state's position on are replayed in order, and the call that failed runs. Replay is the same
arithmetic on the same inputs with the same RNG state, so the weights are bitwise those of a run without the
fault (fp32; docs/lifecycle.md). The journal is bounded (steps and bytes): a call that would overflow it saves a
state first instead.

In pool mode the calls of one TrainingClient run one at a time (the journal is one ordered history); the
``*_async`` methods run them on a worker thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, TypeVar

import grpc
from google.protobuf.message import Message

from opentinker.client.connection import Connection, checked, translated
from opentinker.client.errors import OpenTinkerError
from opentinker.client.training_client import TrainerConnection
from opentinker.v1 import common_pb2, registry_pb2, registry_pb2_grpc, trainer_pb2

__all__ = ["CreateArgs", "Failover", "Move", "PoolConnections", "PoolRoute", "move_adapter"]

M = TypeVar("M", bound=Message)
Position = tuple[int, int]  # (optimizer step, ForwardBackward calls since it)

DEFAULT_JOURNAL_MAX_STEPS: Final = 64  # above the trainers' default --autosave-every (50): autosaves truncate first
DEFAULT_JOURNAL_MAX_BYTES: Final = 256 << 20
DEFAULT_FAILOVER_TIMEOUT_S: Final = 120.0  # a dead owner's lease plus a state load, with room
RETRY_PAUSE_S: Final = 0.2
WATCH_S: Final = 1.0  # how often a call in flight checks that its trainer still owns the adapter
_FOLLOW_CODES: Final = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
_FOLLOW_REASONS: Final = frozenset({"NOT_OWNER", "OWNERSHIP_UNCONFIRMED", "ADAPTER_MOVING", "ADAPTER_NOT_FOUND"})
_JOURNALED: Final = frozenset({"ForwardBackward", "OptimStep"})
_REBASING: Final = frozenset({"LoadState", "ResetAdapter"})  # change the adapter outside the journal


@dataclass(frozen=True, slots=True)
class Failover:
    """One change of trainer under a TrainingClient (TrainingClient.failovers)."""

    from_address: str
    to_address: str
    state_step: int  # the step of the state the new owner resumed from
    calls_replayed: int
    seconds: float  # from the first failed attempt to the replayed journal, made of:
    placed_s: float  # until the registry placed the adapter elsewhere (the old owner's lease running out)
    load_s: float  # the new owner loading the recorded state
    replay_s: float  # replaying the journal's calls since that state


@dataclass(frozen=True, slots=True)
class _Entry:
    method: str
    request: Message
    response_type: type[Message]
    position: Position
    nbytes: int


@dataclass(slots=True)
class CreateArgs:
    """How the adapter was created: what a new owner needs when no state was recorded yet."""

    lora: common_pb2.LoraConfig
    adam: common_pb2.AdamParams | None
    seed: int
    labels: dict[str, str] = field(default_factory=dict)


class PoolRoute:
    """One pool adapter's calls: to its owner, following placements, with the journal that makes a failover
    lose nothing. Made by ServiceClient; TrainingClient sends every call through ``call``."""

    def __init__(
        self,
        adapter: str,
        registry: Connection[registry_pb2_grpc.RegistryServiceStub],
        connect: Callable[[str], TrainerConnection],
        create: CreateArgs,
        *,
        journal_max_steps: int = DEFAULT_JOURNAL_MAX_STEPS,
        journal_max_bytes: int = DEFAULT_JOURNAL_MAX_BYTES,
        failover_timeout_s: float = DEFAULT_FAILOVER_TIMEOUT_S,
    ) -> None:
        self.adapter = adapter
        self.registry = registry
        self.connect = connect
        self.create = create
        self.journal_max_steps = journal_max_steps
        self.journal_max_bytes = journal_max_bytes
        self.failover_timeout_s = failover_timeout_s
        self.connection: TrainerConnection | None = None
        self.epoch = 0
        self.position: Position = (0, 0)
        self.base: Position = (0, 0)  # where the journal starts: the newest state known to hold it
        self.journal: list[_Entry] = []
        self.failovers: list[Failover] = []
        self._lock = threading.Lock()

    @property
    def journal_bytes(self) -> int:
        return sum(e.nbytes for e in self.journal)

    @property
    def journal_steps(self) -> int:
        return sum(1 for e in self.journal if e.method == "OptimStep")

    # Start

    def create_adapter(
        self, request: trainer_pb2.TrainerServiceCreateAdapterRequest
    ) -> trainer_pb2.TrainerServiceCreateAdapterResponse:
        """create_training_client: placed by the registry, created on the owner under its epoch."""
        with self._lock:
            while True:
                placement = self._place(request.lora_config.rank)
                connection = self.connect(placement.address)
                request.placement_epoch = placement.epoch
                try:
                    response = connection.unary(
                        "CreateAdapter", request, trainer_pb2.TrainerServiceCreateAdapterResponse
                    )
                except OpenTinkerError as error:
                    if error.reason != "NOT_OWNER":  # placed again between the two calls: once more
                        raise
                    continue
                self._at(connection, placement.epoch, (response.adapter.step, response.adapter.pending_batches))
                return response

    def attach(self) -> None:
        """training_client(name) of a pool adapter: to its owner, resumed there if the owner lacks it."""
        with self._lock:
            self._follow(None, time.monotonic())

    # Calls

    def call(self, method: str, request: Message, response_type: type[M]) -> M:
        with self._lock:
            if method in _JOURNALED and self._would_overflow(method, request):
                self._call_locked("SaveState", self._save_request(), trainer_pb2.SaveStateResponse)
            response = self._call_locked(method, request, response_type)
            if method in _REBASING:  # the journal cannot replay across it: a state marks the new start
                self._call_locked("SaveState", self._save_request(), trainer_pb2.SaveStateResponse)
            return response

    def _call_locked(self, method: str, request: Message, response_type: type[M]) -> M:
        started: float | None = None
        while True:
            assert self.connection is not None
            try:
                response = self._watched(self.connection, method, request, response_type)
            except OpenTinkerError as error:
                if error.code not in _FOLLOW_CODES and error.reason not in _FOLLOW_REASONS:
                    raise
                started = started if started is not None else time.monotonic()
                if time.monotonic() - started > self.failover_timeout_s:
                    raise
                try:
                    self._follow(error, started)
                except OpenTinkerError as again:  # the new owner failed too: from the top, journal intact
                    if again is error or (again.code not in _FOLLOW_CODES and again.reason not in _FOLLOW_REASONS):
                        raise
                    time.sleep(RETRY_PAUSE_S)
                continue
            self._record(method, request, response)
            return response

    def _watched(self, connection: TrainerConnection, method: str, request: Message, response_type: type[M]) -> M:
        """The call, with the placement checked every WATCH_S while it runs: a trainer that stopped answering
        (SIGSTOP, a hung host) holds a call until its deadline, but the registry hands its adapter on once its
        lease runs out, and then the call is given up here and followed."""
        connection.check_open()
        stub = getattr(connection.stub, method)
        with translated():
            future = stub.future(request, timeout=connection.timeout, metadata=connection.call_metadata(request))
            while True:
                try:
                    return checked(future.result(timeout=WATCH_S), response_type)
                except grpc.FutureTimeoutError:
                    pass
                try:
                    placement = self._place(self.create.lora.rank)
                except OpenTinkerError:
                    continue  # the registry is away: the call itself may still finish
                if placement.epoch != self.epoch:
                    future.cancel()
                    raise OpenTinkerError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"adapter {self.adapter!r} was placed on {placement.address} while {connection.address} "
                        "held the call without answering",
                        "NOT_OWNER",
                    )

    def _record(self, method: str, request: Message, response: Message) -> None:
        if isinstance(response, trainer_pb2.ForwardBackwardResponse):
            if response.saved_state_id:  # the trainer autosaved right before this call
                self._rebase(self.position)
            self._append(method, request, type(response))
            self.position = (self.position[0], self.position[1] + 1)
        elif isinstance(response, trainer_pb2.OptimStepResponse):
            self._append(method, request, type(response))
            self.position = (response.step, 0)
        elif isinstance(response, trainer_pb2.SaveStateResponse):
            self._rebase(self.position)
        elif isinstance(response, trainer_pb2.LoadStateResponse | trainer_pb2.ResetAdapterResponse):
            # Another history from here: nothing journaled before it can be replayed onto it.
            self.journal = []
            self.position = (response.adapter.step, response.adapter.pending_batches)

    def _append(self, method: str, request: Message, response_type: type[Message]) -> None:
        self.journal.append(_Entry(method, request, response_type, self.position, request.ByteSize()))

    def _rebase(self, position: Position) -> None:
        self.base = position
        self.journal = [e for e in self.journal if e.position >= position]

    def _would_overflow(self, method: str, request: Message) -> bool:
        steps = self.journal_steps + (method == "OptimStep")
        return bool(self.journal) and (
            steps > self.journal_max_steps or self.journal_bytes + request.ByteSize() > self.journal_max_bytes
        )

    def _save_request(self) -> trainer_pb2.SaveStateRequest:
        return trainer_pb2.SaveStateRequest(adapter=self.adapter, label="journal")

    # Following the owner

    def _place(self, rank: int = 0) -> registry_pb2.Placement:
        request = registry_pb2.PlaceAdapterRequest(adapter=self.adapter, rank=rank)
        response = self.registry.unary("PlaceAdapter", request, registry_pb2.PlaceAdapterResponse)
        return response.placement

    def _follow(self, error: OpenTinkerError | None, started: float) -> None:
        """To the adapter's owner now: the same one after a pause when nothing changed (it is busy, or dead and
        its lease not yet run out), else the new one, resumed and replayed."""
        previous = self.connection.address if self.connection is not None else ""
        try:
            placement = self._place(self.create.lora.rank)
        except OpenTinkerError as refused:
            if refused.code not in _FOLLOW_CODES:
                raise
            time.sleep(RETRY_PAUSE_S)  # the registry is away: the caller's loop bounds the wait
            return
        if error is not None and placement.address == previous and placement.epoch == self.epoch:
            if error.reason == "ADAPTER_NOT_FOUND":  # its owner does not have it: not ours to re-create
                raise error
            time.sleep(RETRY_PAUSE_S)
            return
        placed = time.monotonic()
        connection = self.connect(placement.address)
        position = self._resume_on(connection, placement)
        if self.connection is None:  # attaching: this client's history starts here, nothing to replay
            self._at(connection, placement.epoch, position)
            self.base = position
            return
        loaded = time.monotonic()
        replayed = self._replay(connection, position)
        self._at(connection, placement.epoch, self.position)
        done = time.monotonic()
        times = (done - started, placed - started, loaded - placed, done - loaded)
        seconds, placed_s, load_s, replay_s = (round(t, 3) for t in times)
        self.failovers.append(
            Failover(previous, placement.address, position[0], replayed, seconds, placed_s, load_s, replay_s)
        )

    def _resume_on(self, connection: TrainerConnection, placement: registry_pb2.Placement) -> Position:
        """The adapter's position on the new owner: as it holds it, or loaded there from the recorded state."""
        get = trainer_pb2.TrainerServiceGetAdapterRequest(name=self.adapter)
        try:
            held = connection.unary("GetAdapter", get, trainer_pb2.TrainerServiceGetAdapterResponse).adapter
            return held.step, held.pending_batches
        except OpenTinkerError as error:
            if error.reason != "ADAPTER_NOT_FOUND":
                raise
        c = self.create
        request = trainer_pb2.TrainerServiceCreateAdapterRequest(
            name=self.adapter,
            lora_config=c.lora,
            adam_params=c.adam,
            seed=c.seed,
            labels=c.labels,
            attach_existing=True,
            resume_state=placement.state_id,
            fresh=not placement.state_id,  # its first trainer died before saving one: fresh from the seed
            placement_epoch=placement.epoch,
        )
        adapter = connection.unary("CreateAdapter", request, trainer_pb2.TrainerServiceCreateAdapterResponse).adapter
        return adapter.step, adapter.pending_batches

    def _replay(self, connection: TrainerConnection, position: Position) -> int:
        if position < self.base or position > self.position:
            raise OpenTinkerError(
                grpc.StatusCode.DATA_LOSS,
                f"adapter {self.adapter!r} resumed at step {position[0]} (+{position[1]} batches) on "
                f"{connection.address}, outside this client's journal ({self.base} to {self.position}): the calls "
                "in between cannot be replayed",
                "JOURNAL_GAP",
            )
        entries = [e for e in self.journal if e.position >= position]
        for entry in entries:
            connection.unary(entry.method, entry.request, entry.response_type)
        return len(entries)

    def _at(self, connection: TrainerConnection, epoch: int, position: Position) -> None:
        self.connection, self.epoch, self.position = connection, epoch, position


class PoolConnections:
    """A ServiceClient's channels to the pool: the registry's, and one per trainer address met (shared by its
    TrainingClients, closed with it)."""

    def __init__(self, registry: str, token: str | None, *, timeout: float | None, ca_cert: Path | None) -> None:
        self.token, self.timeout, self.ca_cert = token, timeout, ca_cert
        # Registry calls are short: a deadline, so a registry that hangs is retried like one that is down.
        self.registry = Connection(
            registry, registry_pb2_grpc.RegistryServiceStub, token, timeout=30.0, ca_cert=ca_cert
        )
        self._trainers: dict[str, TrainerConnection] = {}
        self._lock = threading.Lock()

    def trainer(self, address: str) -> TrainerConnection:
        with self._lock:
            connection = self._trainers.get(address)
            if connection is None:
                connection = TrainerConnection(address, self.token, timeout=self.timeout, ca_cert=self.ca_cert)
                self._trainers[address] = connection
            return connection

    def route(
        self,
        adapter: str,
        create: CreateArgs,
        journal_max_steps: int = DEFAULT_JOURNAL_MAX_STEPS,
        journal_max_bytes: int = DEFAULT_JOURNAL_MAX_BYTES,
    ) -> PoolRoute:
        return PoolRoute(
            adapter,
            self.registry,
            self.trainer,
            create,
            journal_max_steps=journal_max_steps,
            journal_max_bytes=journal_max_bytes,
        )

    def adapter_lora(self, adapter: str) -> common_pb2.LoraConfig:
        """The LoRA config the registry recorded for an adapter (what a new owner creates it with)."""
        request = registry_pb2.GetAdapterRequest(name=adapter)
        lora = self.registry.unary("GetAdapter", request, registry_pb2.GetAdapterResponse).adapter.lora_config
        if list(lora.target_modules) == ["all-linear"]:  # the registry's spelling; trainers take an empty list
            del lora.target_modules[:]
        return lora

    def close(self) -> None:
        with self._lock:
            trainers, self._trainers = list(self._trainers.values()), {}
        for connection in trainers:
            connection.close()
        self.registry.close()


@dataclass(frozen=True, slots=True)
class Move:
    """What `ServiceClient.move_training_adapter` did."""

    adapter: str
    from_address: str
    to_address: str
    epoch: int  # the adapter's epoch on its new owner
    state_id: str  # the state saved for the hand-over and loaded by the new owner
    state_step: int


def move_adapter(pool: PoolConnections, adapter: str, to: str) -> Move:
    """Save, fence, load: the owner saves the adapter's state after every call queued before, the registry hands
    the placement on (compare-and-set on the epoch), the new owner loads the state. A training client of the
    adapter follows on its next call, with nothing to replay."""
    request = registry_pb2.GetPlacementRequest(adapter=adapter)
    owner = pool.registry.unary("GetPlacement", request, registry_pb2.GetPlacementResponse).placement
    move = trainer_pb2.MoveAdapterRequest(adapter=adapter, to=to)
    moved = pool.trainer(owner.address).unary("MoveAdapter", move, trainer_pb2.MoveAdapterResponse).placement
    pool.route(adapter, CreateArgs(pool.adapter_lora(adapter), None, 0)).attach()  # loaded there now
    return Move(adapter, owner.address, moved.address, moved.epoch, moved.state_id, moved.state_step)
