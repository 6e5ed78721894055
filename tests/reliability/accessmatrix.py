"""The access matrix of the security tests (test_security_matrix.py): the principals, their stubs over TLS, the
tenants' resources, and every operation on one tenant's resource with whether it is admin only."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from serverproc import ServerProcess
from trainerutil import adam, lora, model_input, sft_batch

from opentinker.v1 import registry_pb2, registry_pb2_grpc, sampler_pb2, sampler_pb2_grpc, trainer_pb2, trainer_pb2_grpc

TENANTS = ("team-a", "team-b")
ADMIN = "ops"


@dataclass
class Client:
    """Stubs of the three services over TLS, calling as one principal (token None: no metadata)."""

    registry: registry_pb2_grpc.RegistryServiceStub
    trainer: trainer_pb2_grpc.TrainerServiceStub
    sampler: sampler_pb2_grpc.SamplerServiceStub
    metadata: list[tuple[str, str]] | None


@dataclass
class Resource:
    """An adapter of one tenant with two published versions and a saved training state."""

    name: str
    artifact_uri: str = ""
    state_id: str = ""


@dataclass
class Secured:
    servers: dict[str, ServerProcess]
    channels: dict[str, grpc.Channel]
    tokens: dict[str, str]  # principal -> token ("svc" is the trainer's and sampler's own)
    cert: Path
    resources: dict[str, Resource] = field(default_factory=dict)

    def client(self, who: str | None, token: str | None = None) -> Client:
        token = token if token is not None else (self.tokens[who] if who else None)
        return Client(
            registry_pb2_grpc.RegistryServiceStub(self.channels["registry"]),
            trainer_pb2_grpc.TrainerServiceStub(self.channels["trainer"]),
            sampler_pb2_grpc.SamplerServiceStub(self.channels["sampler"]),
            [("authorization", f"Bearer {token}")] if token is not None else None,
        )


def train_step(c: Client, name: str) -> None:
    c.trainer.ForwardBackward(
        trainer_pb2.ForwardBackwardRequest(adapter=name, datums=sft_batch(3), loss_fn="cross_entropy"),
        metadata=c.metadata,
    )
    c.trainer.OptimStep(trainer_pb2.OptimStepRequest(adapter=name, adam_params=adam()), metadata=c.metadata)


# --- operations on one tenant's resource: each raises grpc.RpcError when refused ------------------------------

Operation = Callable[[Client, Resource, Secured], object]


def _registry_aliases(c: Client, r: Resource, s: Secured) -> None:
    m = c.metadata
    c.registry.SetAlias(registry_pb2.SetAliasRequest(adapter=r.name, alias="stable", version=2), metadata=m)
    c.registry.SetServingAlias(registry_pb2.SetServingAliasRequest(adapter=r.name, alias="stable"), metadata=m)
    c.registry.SetServingAlias(registry_pb2.SetServingAliasRequest(adapter=r.name, alias="latest"), metadata=m)
    c.registry.Rollback(registry_pb2.RollbackRequest(adapter=r.name, alias="stable", to_version=1), metadata=m)
    c.registry.DeleteAlias(registry_pb2.DeleteAliasRequest(adapter=r.name, alias="stable"), metadata=m)


def _registry_create(c: Client, r: Resource, s: Secured) -> None:
    name = f"{r.name.split('/')[0]}/new-{uuid.uuid4().hex[:8]}"
    c.registry.CreateAdapter(registry_pb2.CreateAdapterRequest(name=name, lora_config=lora()), metadata=c.metadata)


def _registry_delete(c: Client, r: Resource, s: Secured) -> None:
    """The owner or an admin: on a throwaway adapter the admin makes (and removes if refused)."""
    admin = s.client(ADMIN)
    name = f"{r.name.split('/')[0]}/doomed-{uuid.uuid4().hex[:8]}"
    admin.registry.CreateAdapter(registry_pb2.CreateAdapterRequest(name=name), metadata=admin.metadata)
    try:
        c.registry.DeleteAdapter(registry_pb2.DeleteAdapterRequest(name=name), metadata=c.metadata)
    except grpc.RpcError:
        admin.registry.DeleteAdapter(registry_pb2.DeleteAdapterRequest(name=name), metadata=admin.metadata)
        raise


def _trainer_create_delete(c: Client, r: Resource, s: Secured) -> None:
    name = f"{r.name.split('/')[0]}/scratch-{uuid.uuid4().hex[:8]}"
    request = trainer_pb2.TrainerServiceCreateAdapterRequest(name=name, lora_config=lora(), init_from=f"{r.name}@1")
    c.trainer.CreateAdapter(request, metadata=c.metadata)
    c.trainer.DeleteAdapter(trainer_pb2.TrainerServiceDeleteAdapterRequest(name=name), metadata=c.metadata)


def _sample(c: Client, r: Resource, s: Secured) -> None:
    params = sampler_pb2.SamplingParams(max_tokens=3, temperature=0.0)
    request = sampler_pb2.SampleRequest(model=f"{r.name}@1", prompt=model_input([1, 2, 3]), sampling_params=params)
    assert list(c.sampler.Sample(request, metadata=c.metadata, timeout=60))


def _load_unload(c: Client, r: Resource, s: Secured) -> None:
    c.sampler.LoadAdapter(sampler_pb2.LoadAdapterRequest(reference=f"{r.name}@2"), metadata=c.metadata)
    c.sampler.UnloadAdapter(sampler_pb2.UnloadAdapterRequest(reference=f"{r.name}@2"), metadata=c.metadata)


def _delete_version(c: Client, r: Resource, s: Secured) -> None:
    """The owner or an admin: a version the admin publishes for it (not latest), sharing v1's artifact."""
    admin = s.client(ADMIN)
    publish = registry_pb2.PublishVersionRequest(adapter=r.name, artifact_uri=r.artifact_uri, skip_latest=True)
    number = admin.registry.PublishVersion(publish, metadata=admin.metadata).version.version
    deleted = c.registry.DeleteVersion(
        registry_pb2.DeleteVersionRequest(adapter=r.name, version=number), metadata=c.metadata
    )
    assert deleted.version.artifact_deleted and deleted.bytes_freed == 0  # v1 still uses the artifact


# (service, operation, admin only)
OPERATIONS: dict[str, tuple[Operation, bool]] = {
    "registry.GetAdapter": (
        lambda c, r, s: c.registry.GetAdapter(registry_pb2.GetAdapterRequest(name=r.name), metadata=c.metadata),
        False,
    ),
    "registry.ListVersions": (
        lambda c, r, s: c.registry.ListVersions(registry_pb2.ListVersionsRequest(adapter=r.name), metadata=c.metadata),
        False,
    ),
    "registry.GetVersion": (
        lambda c, r, s: c.registry.GetVersion(
            registry_pb2.GetVersionRequest(adapter=r.name, version=1), metadata=c.metadata
        ),
        False,
    ),
    "registry.Resolve": (
        lambda c, r, s: c.registry.Resolve(
            registry_pb2.ResolveRequest(reference=f"{r.name}@latest"), metadata=c.metadata
        ),
        False,
    ),
    "registry.GetLineage": (
        lambda c, r, s: c.registry.GetLineage(
            registry_pb2.GetLineageRequest(reference=f"{r.name}@2"), metadata=c.metadata
        ),
        False,
    ),
    "registry.PublishVersion": (
        lambda c, r, s: c.registry.PublishVersion(
            registry_pb2.PublishVersionRequest(adapter=r.name, artifact_uri=r.artifact_uri, skip_latest=True),
            metadata=c.metadata,
        ),
        False,
    ),
    "registry.SetAlias+SetServingAlias+Rollback+DeleteAlias": (_registry_aliases, False),
    "registry.DownloadArtifact": (
        lambda c, r, s: list(
            c.registry.DownloadArtifact(
                registry_pb2.DownloadArtifactRequest(artifact_uri=r.artifact_uri), metadata=c.metadata
            )
        ),
        False,
    ),
    "registry.CreateAdapter": (_registry_create, False),
    "registry.DeleteAdapter": (_registry_delete, False),
    "registry.DeleteVersion": (_delete_version, False),
    "registry.GarbageCollect": (
        lambda c, r, s: c.registry.GarbageCollect(
            registry_pb2.GarbageCollectRequest(adapter=r.name, dry_run=True), metadata=c.metadata
        ),
        True,
    ),
    "trainer.GetAdapter": (
        lambda c, r, s: c.trainer.GetAdapter(
            trainer_pb2.TrainerServiceGetAdapterRequest(name=r.name), metadata=c.metadata
        ),
        False,
    ),
    "trainer.ForwardBackward+OptimStep": (lambda c, r, s: train_step(c, r.name), False),
    "trainer.Forward": (
        lambda c, r, s: c.trainer.Forward(
            trainer_pb2.ForwardRequest(adapter=r.name, datums=sft_batch(4), loss_fn="cross_entropy"),
            metadata=c.metadata,
        ),
        False,
    ),
    "trainer.SaveSnapshot": (
        lambda c, r, s: c.trainer.SaveSnapshot(
            trainer_pb2.SaveSnapshotRequest(adapter=r.name, skip_latest=True), metadata=c.metadata
        ),
        False,
    ),
    "trainer.SaveState": (
        lambda c, r, s: c.trainer.SaveState(trainer_pb2.SaveStateRequest(adapter=r.name), metadata=c.metadata),
        False,
    ),
    "trainer.LoadState": (
        lambda c, r, s: c.trainer.LoadState(
            trainer_pb2.LoadStateRequest(adapter=r.name, state_id=r.state_id), metadata=c.metadata
        ),
        False,
    ),
    "trainer.CreateAdapter(init_from)+DeleteAdapter": (_trainer_create_delete, False),
    "trainer.ResetAdapter": (
        lambda c, r, s: c.trainer.ResetAdapter(
            trainer_pb2.ResetAdapterRequest(adapter=r.name, reference=f"{r.name}@1"), metadata=c.metadata
        ),
        False,
    ),
    "sampler.Sample": (_sample, False),
    "sampler.ComputeLogprobs": (
        lambda c, r, s: c.sampler.ComputeLogprobs(
            sampler_pb2.ComputeLogprobsRequest(model=f"{r.name}@2", inputs=[model_input([1, 2, 3])]),
            metadata=c.metadata,
            timeout=60,
        ),
        False,
    ),
    "sampler.LoadAdapter+UnloadAdapter": (_load_unload, False),
}
PRINCIPALS = (*TENANTS, ADMIN)
MATRIX = [(who, op, owner) for who in PRINCIPALS for op in OPERATIONS for owner in TENANTS]
