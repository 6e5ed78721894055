"""Token auth and TLS end to end: a registry, a trainer and a sampler behind TLS (a self-signed certificate
made here) and bearer tokens, the trainer and the sampler reaching the registry over TLS with a service
token. Every tenant x operation x resource cell is checked: a tenant reaches only its own adapters in all
three services, admin-only operations are PERMISSION_DENIED to tenants, every RPC of every service answers
UNAUTHENTICATED without a valid token, and no token ever appears in the servers' logs.
(tests/rpc/serving/test_auth.py covers the token table and the interceptor on a toy server.)"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterator

import grpc
import pytest
from accessmatrix import ADMIN, MATRIX, OPERATIONS, PRINCIPALS, TENANTS, Resource, Secured, train_step
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serverproc import ServerProcess
from tlsutil import make_certificate
from trainerutil import lora

from opentinker.client import ModelInput, OpenTinkerError, SamplingParams, ServiceClient
from opentinker.v1 import registry_pb2, sampler_pb2, trainer_pb2


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
            elif path.endswith(("/Sample", "/WatchEvents", "/DownloadArtifact", "/WatchReplicas")):
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
