"""Connections to the trainer, sampler and registry, one set per bearer token (the SDK's own connections:
they attach the token and turn gRPC failures into `OpenTinkerError`)."""

from __future__ import annotations

from dataclasses import dataclass

from opentinker.client.connection import Connection
from opentinker.client.fleet_sampling import FleetConnection
from opentinker.client.registry_client import RegistryClient
from opentinker.client.sampling_client import SamplerConnection, SampleTransport
from opentinker.client.training_client import TrainerConnection
from opentinker.v1 import registry_pb2_grpc, trainer_pb2


@dataclass(frozen=True, slots=True)
class Backend:
    trainer: TrainerConnection
    sampler: SampleTransport  # one sampler, or the registry's fleet (--sampler fleet)
    registry: Connection[registry_pb2_grpc.RegistryServiceStub]


@dataclass(frozen=True, slots=True)
class BaseModelInfo:
    """What the trainer serves: the SDK's ``base_model`` must name it."""

    model: str  # its public name (weights/served_name.py): what clients see, and the tokenizer id
    started_as: str  # the name or path the trainer was started with
    architecture: str
    max_positions: int
    loss_fns: frozenset[str]

    def matches(self, name: str) -> bool:
        """The public name (`org/name`), or the name/path the trainer was started with or its last component."""
        return name in (self.model, self.started_as, self.started_as.rstrip("/").rsplit("/", 1)[-1])


FLEET = "fleet"  # --sampler fleet: every replica of the registry's fleet, routed by adapter (client/fleet_sampling.py)


def _sampler(sampler: str, registry: str, token: str | None) -> SampleTransport:
    if sampler == FLEET:
        return FleetConnection(RegistryClient(registry, token), token, owns_registry=True)
    return SamplerConnection(sampler, token)


class Backends:
    def __init__(self, trainer: str, sampler: str, registry: str) -> None:
        self.addresses = (trainer, sampler, registry)
        self._by_token: dict[str | None, Backend] = {}
        self.base: BaseModelInfo | None = None

    def for_token(self, token: str | None) -> Backend:
        backend = self._by_token.get(token)
        if backend is None:
            trainer, sampler, registry = self.addresses
            backend = Backend(
                trainer=TrainerConnection(trainer, token),
                sampler=_sampler(sampler, registry, token),
                registry=Connection(registry, registry_pb2_grpc.RegistryServiceStub, token, timeout=30.0),
            )
            self._by_token[token] = backend
        return backend

    async def base_model(self, token: str | None) -> BaseModelInfo:
        """The trainer's base model and losses, asked once (with the first caller's token)."""
        if self.base is None:
            info = await self.for_token(token).trainer.unary_async(
                "GetTrainerInfo", trainer_pb2.GetTrainerInfoRequest(), trainer_pb2.GetTrainerInfoResponse
            )
            self.base = BaseModelInfo(
                model=info.base_model.served_name or info.base_model.model,  # an older trainer: no served_name
                started_as=info.base_model.model,
                architecture=info.base_model.architecture,
                max_positions=info.base_model.max_position_embeddings,
                loss_fns=frozenset(info.loss_fns),
            )
        return self.base

    async def close(self) -> None:
        for backend in self._by_token.values():
            await backend.trainer.aclose()
            await backend.sampler.aclose()
            await backend.registry.aclose()
        self._by_token.clear()
