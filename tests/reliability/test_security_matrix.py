"""Token auth and TLS end to end: a registry, a trainer and a sampler behind TLS (a self-signed certificate
made here) and bearer tokens, the trainer and the sampler reaching the registry over TLS with a service
token. Every tenant x operation x resource cell is checked: a tenant reaches only its own adapters in all
three services, admin-only operations are PERMISSION_DENIED to tenants, every RPC of every service answers
UNAUTHENTICATED without a valid token, and no token ever appears in the servers' logs.
(tests/rpc/serving/test_auth.py covers the token table and the interceptor on a toy server.)"""

from __future__ import annotations

import json
import secrets
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serverproc import ServerProcess
from tlsutil import make_certificate
from trainerutil import adam, lora, model_input, sft_batch

from opentinker.client import ModelInput, OpenTinkerError, SamplingParams, ServiceClient
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


@pytest.fixture(scope="module")
def secured(
    start_stack: Callable[..., dict[str, ServerProcess]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Secured]:
    workdir = tmp_path_factory.mktemp("secured")
    cert, key = make_certificate(workdir)
    tokens = {who: f"tok-{who}-{secrets.token_hex(12)}" for who in (*TENANTS, ADMIN, "svc")}
    roles = {ADMIN: "admin", "svc": "admin"}
    tokens_file = workdir / "tokens.json"
    tokens_file.write_text(
        json.dumps(
            {
                "tokens": [
                    {"token": token, "tenant": who, "role": roles.get(who, "user")} for who, token in tokens.items()
                ]
            }
        )
    )
    # DEBUG logging: the strictest setting for "tokens never appear in logs".
    common = ("--tokens-file", str(tokens_file), "--tls-cert", str(cert), "--tls-key", str(key), "--log-level", "DEBUG")
    to_registry = ("--registry-token", tokens["svc"], "--registry-ca", str(cert))
    servers = start_stack(
        "secured", registry_args=common, trainer_args=(*common, *to_registry), sampler_args=(*common, *to_registry)
    )
    credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    channels = {label: grpc.secure_channel(server.address, credentials) for label, server in servers.items()}
    state = Secured(servers, channels, tokens, cert)
    for seed, tenant in enumerate(TENANTS):  # each owner makes its adapter through the trainer (TLS to the registry)
        owner = state.client(tenant)
        name = f"{tenant}/policy"
        owner.trainer.CreateAdapter(
            trainer_pb2.TrainerServiceCreateAdapterRequest(name=name, lora_config=lora(), seed=seed),
            metadata=owner.metadata,
        )
        resource = Resource(name)
        for _ in range(2):
            train_step(owner, name)
            version = owner.trainer.SaveSnapshot(trainer_pb2.SaveSnapshotRequest(adapter=name), metadata=owner.metadata)
            resource.artifact_uri = resource.artifact_uri or version.version.artifact_uri
        saved = owner.trainer.SaveState(trainer_pb2.SaveStateRequest(adapter=name), metadata=owner.metadata)
        resource.state_id = saved.state_id
        state.resources[tenant] = resource
    yield state
    for channel in channels.values():
        channel.close()


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


@pytest.mark.parametrize(("who", "operation", "owner"), MATRIX)
def test_access_matrix(secured: Secured, who: str, operation: str, owner: str) -> None:
    run, admin_only = OPERATIONS[operation]
    allowed = who == ADMIN or (who == owner and not admin_only)
    try:
        run(secured.client(who), secured.resources[owner], secured)
    except grpc.RpcError as error:
        assert not allowed, f"{who} was refused {operation} on {owner}'s adapter: {error}"
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED, f"{who} / {operation} / {owner}: {error}"
    else:
        assert allowed, f"{who} performed {operation} on {owner}'s adapter"


def test_listings_show_only_own_adapters(secured: Secured) -> None:
    for who in PRINCIPALS:
        c = secured.client(who)
        seen = {
            "registry": {
                a.name
                for a in c.registry.ListAdapters(
                    registry_pb2.ListAdaptersRequest(page_size=1000), metadata=c.metadata
                ).adapters
            },
            "trainer": {
                a.name
                for a in c.trainer.ListAdapters(
                    trainer_pb2.TrainerServiceListAdaptersRequest(), metadata=c.metadata
                ).adapters
            },
            "sampler": {
                a.version.adapter
                for a in c.sampler.ListLoaded(sampler_pb2.ListLoadedRequest(), metadata=c.metadata).adapters
            },
        }
        watch = c.registry.WatchEvents(
            registry_pb2.WatchEventsRequest(after_event_id="0", send_snapshot=True), metadata=c.metadata, timeout=30
        )
        seen["events"] = {a.adapter for a in next(watch).reconcile.adapters}
        watch.cancel()
        for listing, names in seen.items():
            tenants = {name.split("/")[0] for name in names}
            if who == ADMIN:
                assert listing == "sampler" or set(TENANTS) <= tenants, (listing, names)
            else:
                assert tenants <= {who}, f"{who} sees {names} in {listing}"
                assert listing == "sampler" or f"{who}/policy" in names, (listing, names)


def test_states_are_deleted_only_by_their_tenant_and_aliased_versions_kept(secured: Secured) -> None:
    owner, other, admin = secured.client("team-a"), secured.client("team-b"), secured.client(ADMIN)
    name = secured.resources["team-a"].name
    state_id = admin.trainer.SaveState(
        trainer_pb2.SaveStateRequest(adapter=name, label="doomed"), metadata=admin.metadata
    ).state_id
    delete = trainer_pb2.DeleteStateRequest(state_id=state_id)
    with pytest.raises(grpc.RpcError) as refused:  # another tenant's state reads as one that does not exist
        other.trainer.DeleteState(delete, metadata=other.metadata)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    owner.trainer.LoadState(trainer_pb2.LoadStateRequest(adapter=name, state_id=state_id), metadata=owner.metadata)
    assert owner.trainer.DeleteState(delete, metadata=owner.metadata).bytes_freed > 0
    with pytest.raises(grpc.RpcError) as gone:
        owner.trainer.LoadState(trainer_pb2.LoadStateRequest(adapter=name, state_id=state_id), metadata=owner.metadata)
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as again:
        owner.trainer.DeleteState(delete, metadata=owner.metadata)
    assert again.value.code() == grpc.StatusCode.NOT_FOUND
    latest = owner.registry.Resolve(registry_pb2.ResolveRequest(reference=f"{name}@latest"), metadata=owner.metadata)
    aliased = registry_pb2.DeleteVersionRequest(adapter=name, version=latest.version.version)
    with pytest.raises(grpc.RpcError) as kept:
        owner.registry.DeleteVersion(aliased, metadata=owner.metadata)
    assert kept.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "latest" in str(kept.value.details())
    assert not owner.registry.GetVersion(
        registry_pb2.GetVersionRequest(adapter=name, version=latest.version.version), metadata=owner.metadata
    ).version.artifact_deleted


def raw(data: bytes) -> bytes:
    return data


def all_rpcs() -> list[tuple[str, str]]:
    services = {
        "registry": registry_pb2.DESCRIPTOR.services_by_name["RegistryService"],
        "trainer": trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"],
        "sampler": sampler_pb2.DESCRIPTOR.services_by_name["SamplerService"],
    }
    return [(label, f"/{s.full_name}/{m.name}") for label, s in services.items() for m in s.methods]


@pytest.mark.parametrize("credential", ["missing", "unknown", "not-bearer", "empty-bearer"])
def test_every_rpc_needs_a_valid_token(secured: Secured, credential: str) -> None:
    metadata: tuple[tuple[str, str | bytes], ...] | None = {
        "missing": None,
        "unknown": (("authorization", "Bearer tok-nobody"),),
        "empty-bearer": (("authorization", "Bearer "),),
        "not-bearer": (("authorization", f"Basic {secured.tokens['team-a']}"),),
    }[credential]
    for label, path in all_rpcs():
        channel = secured.channels[label]
        try:
            if "Upload" in path:
                channel.stream_unary(path, raw, raw)(iter([b""]), metadata=metadata, timeout=30)
            elif path.endswith(("/Sample", "/WatchEvents", "/DownloadArtifact")):
                list(channel.unary_stream(path, raw, raw)(b"", metadata=metadata, timeout=30))
            else:
                channel.unary_unary(path, raw, raw)(b"", metadata=metadata, timeout=30)
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED, f"{path}: {error}"
        else:
            pytest.fail(f"{path} answered without a valid token")


def test_python_sdk_over_tls(secured: Secured) -> None:
    """The SDK's clients (ServiceClient, its training/sampling/registry clients) speak TLS with ca_cert, keep
    the tenant's view, and cannot reach the servers in plaintext."""
    trainer, sampler, registry = (secured.servers[label].address for label in ("trainer", "sampler", "registry"))
    token = secured.tokens["team-a"]
    with ServiceClient(trainer, sampler, registry, token, ca_cert=secured.cert, timeout=60) as client:
        names = {adapter.name for adapter in client.registry_client().list_adapters()}
        assert "team-a/policy" in names and all(name.startswith("team-a/") for name in names), names
        assert client.training_client("team-a/policy").get_info().name == "team-a/policy"
        sampled = client.create_sampling_client("team-a/policy@1").sample(
            ModelInput.from_ints([1, 2, 3]), SamplingParams(max_tokens=3, temperature=0.0)
        )
        assert sampled.sequences[0].version.version == 1 and len(sampled.sequences[0].tokens) == 3
        with pytest.raises(OpenTinkerError) as refused:
            client.create_sampling_client("team-b/policy@1").sample(
                ModelInput.from_ints([1, 2, 3]), SamplingParams(max_tokens=3)
            )
        assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    with ServiceClient(trainer, sampler, registry, token, timeout=10) as plain:
        with pytest.raises(OpenTinkerError) as caught:
            plain.registry_client().list_adapters()
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE


def test_tls_is_required(secured: Secured) -> None:
    for label, server in secured.servers.items():
        with grpc.insecure_channel(server.address) as plain:
            with pytest.raises(grpc.RpcError) as caught:
                health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, label
        check = health_pb2_grpc.HealthStub(secured.channels[label]).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert check.status == health_pb2.HealthCheckResponse.SERVING


def test_tokens_never_appear_in_logs(secured: Secured, figure: Callable[[str, object], None]) -> None:
    # Something must have been logged at all (DEBUG), or this proves nothing.
    logs = {label: server.log() for label, server in secured.servers.items()}
    assert all("serving on" in text for text in logs.values())
    for label, text in logs.items():
        for who, token in secured.tokens.items():
            assert token not in text, f"{who}'s token appears in the {label} log"
    figure(
        "security matrix (tenant x operation x resource)",
        f"{len(PRINCIPALS)} x {len(OPERATIONS)} x {len(TENANTS)}"
        f" = {len(MATRIX)} cells, + {len(all_rpcs())} RPCs x 4 bad credentials",
    )
