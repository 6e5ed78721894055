"""ServiceClient: the SDK's entry point, holding the addresses of the OpenTinker services.

    from opentinker.client import LoraConfig, ServiceClient

    with ServiceClient(trainer="127.0.0.1:7071", registry="127.0.0.1:7070", token="s3cret") as service:
        service.get_trainer_info().vocab_size
        training = service.create_training_client("team-a/agent", LoraConfig(rank=16))
        ...  # training.forward_backward / optim_step / save_snapshot (see TrainingClient)
        service.registry_client().resolve("team-a/agent@latest")
        sampling = service.create_sampling_client("team-a/agent@latest")  # sampler=, or the registry's fleet
        sampling.sample("Hello", SamplingParams(max_tokens=16)).sequences[0].text

Each service is optional: a method that needs one the client was not given an address for raises
ValueError. Without a sampler address, sampling goes through the registry's fleet (fleet_sampling.py): each
request routed by adapter, retried or continued on another replica when one fails. Without a trainer address,
create_training_client and training_client go through the registry's trainer pool (trainer_pool.py): the
registry places the adapter, and a dead trainer's adapter continues on another with no step lost.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

from opentinker.client.fleet_router import FleetRouter
from opentinker.client.fleet_sampling import FleetConnection
from opentinker.client.registry_client import RegistryClient
from opentinker.client.sampling_client import SamplerConnection, SamplingClient
from opentinker.client.trainer_pool import (
    DEFAULT_JOURNAL_MAX_BYTES,
    DEFAULT_JOURNAL_MAX_STEPS,
    CreateArgs,
    Move,
    PoolConnections,
    move_adapter,
)
from opentinker.client.training_client import TrainerConnection, TrainingClient
from opentinker.client.training_types import (
    AdamParams,
    LoraConfig,
    ResetResult,
    SavedState,
    TrainerInfo,
    TrainingAdapterInfo,
)
from opentinker.client.wire import (
    adam_params_to_proto,
    lora_config_to_proto,
    started_from_proto,
    trainer_info_from_proto,
    training_adapter_from_proto,
)
from opentinker.v1 import trainer_pb2

__all__ = ["ServiceClient"]


def _create_request(
    adapter: str,
    lora: LoraConfig | None,
    adam: AdamParams | None,
    seed: int,
    init_from: str,
    resume_state: str,
    attach_existing: bool,
    labels: Mapping[str, str] | None,
    fresh: bool,
) -> trainer_pb2.TrainerServiceCreateAdapterRequest:
    return trainer_pb2.TrainerServiceCreateAdapterRequest(
        name=adapter,
        lora_config=lora_config_to_proto(lora or LoraConfig()),
        adam_params=adam_params_to_proto(adam) if adam is not None else None,
        seed=seed,
        init_from=init_from,
        resume_state=resume_state,
        attach_existing=attach_existing,
        labels=dict(labels or {}),
        fresh=fresh,
    )


class ServiceClient:
    """Connections to a trainer, a sampler and a registry (each optional), authenticated by one token.

    ``token`` is sent as ``authorization: Bearer <token>`` to every service. ``timeout`` (seconds) bounds
    each trainer and sampler call (a whole Sample stream included); None (the default) sets no deadline,
    since a training step or a long generation can take long. ``ca_cert`` (a PEM file of root certificates)
    switches every connection to TLS verified against it. ``fleet_router``: how sampling picks a replica when
    there is a registry and no sampler address (default: FleetRouter(), docs/fleet.md). Channels
    connect lazily. Thread-safe. Use as a context manager (``with`` or ``async with``), or call close()
    (aclose() from async code, which also closes the running loop's async channel cleanly).
    """

    def __init__(
        self,
        trainer: str | None = None,
        sampler: str | None = None,
        registry: str | None = None,
        token: str | None = None,
        *,
        timeout: float | None = None,
        ca_cert: Path | None = None,
        fleet_router: FleetRouter | None = None,
        journal_max_steps: int = DEFAULT_JOURNAL_MAX_STEPS,
        journal_max_bytes: int = DEFAULT_JOURNAL_MAX_BYTES,
    ) -> None:
        self.trainer_address = trainer
        self.sampler_address = sampler
        self.registry_address = registry
        self.timeout = timeout
        self._token = token
        self.ca_cert = ca_cert
        self._trainer = TrainerConnection(trainer, token, timeout=timeout, ca_cert=ca_cert) if trainer else None
        self._sampler = SamplerConnection(sampler, token, timeout=timeout, ca_cert=ca_cert) if sampler else None
        self._registry: RegistryClient | None = None
        self._fleet: FleetConnection | None = None  # the fleet, when there is a registry and no sampler
        self._fleet_router = fleet_router  # None: FleetRouter() (rendezvous with bounded load, eps 0.25)
        # Without a trainer address, training goes through the registry's trainer pool (trainer_pool.py).
        self._pool: PoolConnections | None = None
        self._journal = (journal_max_steps, journal_max_bytes)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"ServiceClient(trainer={self.trainer_address!r}, sampler={self.sampler_address!r}, "
            f"registry={self.registry_address!r})"
        )

    def _pool_connections(self) -> PoolConnections | None:
        """The trainer pool's channels when training goes through the registry (no trainer address)."""
        if self._trainer is not None or self.registry_address is None:
            return None
        with self._lock:
            if self._pool is None:
                self._pool = PoolConnections(
                    self.registry_address, self._token, timeout=self.timeout, ca_cert=self.ca_cert
                )
            return self._pool

    def _trainer_connection(self) -> TrainerConnection:
        if self._trainer is None:
            raise ValueError("this ServiceClient has no trainer address: pass trainer=HOST:PORT")
        return self._trainer

    # Training

    def create_training_client(
        self,
        adapter: str,
        lora: LoraConfig | None = None,
        *,
        adam: AdamParams | None = None,
        seed: int = 0,
        init_from: str = "",
        resume_state: str = "",
        attach_existing: bool = False,
        labels: Mapping[str, str] | None = None,
        fresh: bool = False,
    ) -> TrainingClient:
        """Creates ``adapter`` on the trainer (which registers it in the registry) and returns its client.

        lora None: LoraConfig() (rank 32, all linear modules). adam: the defaults optim_step uses when
        called without AdamParams (None: Tinker's). seed: LoRA initialisation and dropout. init_from: start
        from a registry version's weights ("name@N", "name@stable"); resume_state: resume exactly from a
        save_state id. attach_existing: train a name the registry already has instead of ALREADY_EXISTS,
        continuing from its latest version (from the state a --persist-state trainer saved with it: exactly,
        optimizer included); fresh: with attach_existing, fresh weights instead. The client's
        ``started_from`` says what the adapter started from; its next snapshot's parent is that version.
        """
        request = _create_request(adapter, lora, adam, seed, init_from, resume_state, attach_existing, labels, fresh)
        if (pool := self._pool_connections()) is not None:
            route = pool.route(
                adapter, CreateArgs(request.lora_config, request.adam_params, seed, dict(labels or {})), *self._journal
            )
            response = route.create_adapter(request)
            assert route.connection is not None
            return TrainingClient(adapter, route.connection, started_from_proto(response.started_from), pool=route)
        connection = self._trainer_connection()
        response = connection.unary("CreateAdapter", request, trainer_pb2.TrainerServiceCreateAdapterResponse)
        return TrainingClient(adapter, connection, started_from_proto(response.started_from))

    async def create_training_client_async(
        self,
        adapter: str,
        lora: LoraConfig | None = None,
        *,
        adam: AdamParams | None = None,
        seed: int = 0,
        init_from: str = "",
        resume_state: str = "",
        attach_existing: bool = False,
        labels: Mapping[str, str] | None = None,
        fresh: bool = False,
    ) -> TrainingClient:
        """create_training_client on the async channel (in the trainer pool: on a worker thread)."""
        if self._pool_connections() is not None:
            return await asyncio.to_thread(
                self.create_training_client,
                adapter,
                lora,
                adam=adam,
                seed=seed,
                init_from=init_from,
                resume_state=resume_state,
                attach_existing=attach_existing,
                labels=labels,
                fresh=fresh,
            )
        connection = self._trainer_connection()
        request = _create_request(adapter, lora, adam, seed, init_from, resume_state, attach_existing, labels, fresh)
        response = await connection.unary_async(
            "CreateAdapter", request, trainer_pb2.TrainerServiceCreateAdapterResponse
        )
        return TrainingClient(adapter, connection, started_from_proto(response.started_from))

    def training_client(self, adapter: str) -> TrainingClient:
        """A client of an adapter the trainer already holds (NOT_FOUND otherwise); in the trainer pool, of a
        placed adapter, on its owner (resumed there from its recorded state if the owner lacks it)."""
        if (pool := self._pool_connections()) is not None:
            route = pool.route(adapter, CreateArgs(pool.adapter_lora(adapter), None, 0), *self._journal)
            route.attach()
            assert route.connection is not None
            return TrainingClient(adapter, route.connection, pool=route)
        connection = self._trainer_connection()
        request = trainer_pb2.TrainerServiceGetAdapterRequest(name=adapter)
        connection.unary("GetAdapter", request, trainer_pb2.TrainerServiceGetAdapterResponse)
        return TrainingClient(adapter, connection)

    def move_training_adapter(self, adapter: str, to: str = "") -> Move:
        """Trainer pool: hands ``adapter`` to the trainer ``to`` (an address or replica id; "": the registry
        chooses) with no step lost: saved on its owner, fenced by the registry, loaded on the new one."""
        pool = self._pool_connections()
        if pool is None:
            raise ValueError("moving an adapter needs the registry's trainer pool: pass registry= without trainer=")
        return move_adapter(pool, adapter, to)

    def get_trainer_info(self) -> TrainerInfo:
        """The trainer's base model and the loss functions it offers."""
        response = self._trainer_connection().unary(
            "GetTrainerInfo", trainer_pb2.GetTrainerInfoRequest(), trainer_pb2.GetTrainerInfoResponse
        )
        return trainer_info_from_proto(response)

    def list_training_adapters(self, prefix: str = "") -> list[TrainingAdapterInfo]:
        """The adapters the trainer holds (that this token may access) whose names start with ``prefix``."""
        request = trainer_pb2.TrainerServiceListAdaptersRequest(prefix=prefix)
        response = self._trainer_connection().unary(
            "ListAdapters", request, trainer_pb2.TrainerServiceListAdaptersResponse
        )
        return [training_adapter_from_proto(a) for a in response.adapters]

    def get_training_adapter(self, adapter: str) -> TrainingAdapterInfo:
        """``adapter``'s training state in the trainer (NOT_FOUND when the trainer does not hold it)."""
        return TrainingClient(adapter, self._trainer_connection()).get_info()

    def reset_training_adapter(self, adapter: str, to: str, *, keep_optimizer: bool = False) -> ResetResult:
        """TrainingClient.reset for an adapter the trainer holds: load version ``to`` ("5", "stable",
        "team-a/other@3") into it, so its next snapshot's parent is that version."""
        return TrainingClient(adapter, self._trainer_connection()).reset(to, keep_optimizer=keep_optimizer)

    def save_training_state(self, adapter: str, label: str = "") -> SavedState:
        """TrainingClient.save_state for an adapter the trainer holds: its full state, for an exact resume."""
        return TrainingClient(adapter, self._trainer_connection()).save_state(label)

    def delete_training_adapter(self, adapter: str) -> None:
        """Drops ``adapter``'s training state from the trainer: its memory and its place in the tenant's quota
        (the trainer's --max-adapters-per-tenant) are given back; its registry versions stay."""
        request = trainer_pb2.TrainerServiceDeleteAdapterRequest(name=adapter)
        self._trainer_connection().unary("DeleteAdapter", request, trainer_pb2.TrainerServiceDeleteAdapterResponse)

    async def delete_training_adapter_async(self, adapter: str) -> None:
        """delete_training_adapter on the async channel."""
        request = trainer_pb2.TrainerServiceDeleteAdapterRequest(name=adapter)
        await self._trainer_connection().unary_async(
            "DeleteAdapter", request, trainer_pb2.TrainerServiceDeleteAdapterResponse
        )

    # Sampling

    def create_sampling_client(self, reference: str) -> SamplingClient:
        """A client sampling from ``reference`` ("base", "name", "name@alias" or "name@N") on this client's
        sampler, sharing its channels. No call is made: an unknown reference fails at the first request
        (NOT_FOUND)."""
        if self._sampler is not None:
            return SamplingClient._on(reference, self._sampler)
        if self.registry_address is None:
            raise ValueError("this ServiceClient has no sampler or registry address: pass sampler= or registry=")
        return SamplingClient._on(reference, self._fleet_connection())

    def _fleet_connection(self) -> FleetConnection:
        """Without a sampler address: every replica of the registry's fleet, routed by adapter (fleet_sampling)."""
        registry = self.registry_client()
        with self._lock:
            if self._fleet is None:
                self._fleet = FleetConnection(
                    registry, self._token, timeout=self.timeout, ca_cert=self.ca_cert, router=self._fleet_router
                )
            return self._fleet

    # Registry

    def registry_client(self) -> RegistryClient:
        """The registry's client (created on first use, with this client's token; closed with it)."""
        if self.registry_address is None:
            raise ValueError("this ServiceClient has no registry address: pass registry=HOST:PORT")
        with self._lock:
            if self._registry is None:
                self._registry = RegistryClient(self.registry_address, token=self._token, ca_cert=self.ca_cert)
            return self._registry

    # Lifetime

    def close(self) -> None:
        """Closes every channel; Training- and SamplingClients made by this client stop working."""
        if self._trainer is not None:
            self._trainer.close()
        if self._sampler is not None:
            self._sampler.close()
        with self._lock:
            fleet, self._fleet = self._fleet, None
            registry, self._registry = self._registry, None
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()
        if fleet is not None:
            fleet.close()
        if registry is not None:
            registry.close()

    async def aclose(self) -> None:
        """close(), awaiting the close of the running event loop's async channel."""
        if self._trainer is not None:
            await self._trainer.aclose()
        if self._sampler is not None:
            await self._sampler.aclose()
        if self._fleet is not None:
            await self._fleet.aclose()
        self.close()

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    async def __aenter__(self) -> ServiceClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
