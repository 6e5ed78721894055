"""Bearer-token auth: the interceptor maps tokens to tenants and roles, and handlers enforce tenancy."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serverproc import ServerProcess

from opentinker.rpc.serving.auth import Principal, Role, TokenTable
from opentinker.rpc.serving.errors import InvalidArgument, error_info
from opentinker.v1 import registry_pb2, registry_pb2_grpc

TOY = str(Path(__file__).with_name("toy_server.py"))


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    workdir = tmp_path_factory.mktemp("secured")
    tokens = workdir / "tokens.json"
    import hashlib

    tokens.write_text(
        json.dumps(
            {
                "tokens": [
                    {"token": "tok-a", "tenant": "team-a", "role": "user"},
                    {"token": "tok-b", "tenant": "team-b"},
                    {"token_sha256": hashlib.sha256(b"tok-admin").hexdigest(), "tenant": "ops", "role": "admin"},
                ]
            }
        )
    )
    server = ServerProcess([sys.executable, TOY, "--tokens-file", str(tokens)], workdir, timeout=30)
    yield server
    server.kill()


@pytest.fixture(scope="module")
def stub(secured: ServerProcess) -> Iterator[registry_pb2_grpc.RegistryServiceStub]:
    with grpc.insecure_channel(secured.address) as channel:
        yield registry_pb2_grpc.RegistryServiceStub(channel)


def call_get(stub: registry_pb2_grpc.RegistryServiceStub, name: str, token: str | None) -> registry_pb2.Adapter:
    metadata = [("authorization", f"Bearer {token}")] if token is not None else None
    response: registry_pb2.GetAdapterResponse = stub.GetAdapter(
        registry_pb2.GetAdapterRequest(name=name), metadata=metadata
    )
    return response.adapter


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_missing_or_invalid_token_is_unauthenticated(
    stub: registry_pb2_grpc.RegistryServiceStub, token: str | None
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        call_get(stub, "team-a/known", token)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    info = error_info(caught.value)
    assert info is not None and info.reason == "UNAUTHENTICATED"


def test_malformed_authorization_header(stub: registry_pb2_grpc.RegistryServiceStub) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        stub.GetAdapter(registry_pb2.GetAdapterRequest(name="team-a/known"), metadata=[("authorization", "tok-a")])
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_valid_token_puts_tenant_in_context(stub: registry_pb2_grpc.RegistryServiceStub) -> None:
    adapter = call_get(stub, "team-a/known", "tok-a")
    assert adapter.created_by == "team-a:user"
    assert call_get(stub, "team-a/known", "tok-admin").created_by == "ops:admin"


def test_other_tenant_is_denied(stub: registry_pb2_grpc.RegistryServiceStub) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        call_get(stub, "team-a/known", "tok-b")
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    info = error_info(caught.value)
    assert info is not None and info.metadata["adapter"] == "team-a/known"


def test_admin_only_action(stub: registry_pb2_grpc.RegistryServiceStub) -> None:
    request = registry_pb2.DeleteAdapterRequest(name="team-a/known")
    with pytest.raises(grpc.RpcError) as caught:
        stub.DeleteAdapter(request, metadata=[("authorization", "Bearer tok-a")])
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert stub.DeleteAdapter(request, metadata=[("authorization", "Bearer tok-admin")]).event_id == "0-1"


def test_health_needs_no_token(secured: ServerProcess) -> None:
    with grpc.insecure_channel(secured.address) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_token_spec_parsing() -> None:
    table = TokenTable.from_spec("t1=team-a, t2=ops:admin")
    assert len(table) == 2
    assert table.lookup("t1") == Principal("team-a", Role.USER)
    assert table.lookup("t2") == Principal("ops", Role.ADMIN)
    assert table.lookup("t3") is None
    with pytest.raises(InvalidArgument):
        TokenTable.from_spec("no-tenant")


def test_tenant_visibility_rules() -> None:
    user = Principal("team-a", Role.USER)
    assert user.can_access("team-a/policy")
    assert not user.can_access("team-ab/policy")
    assert not user.can_access("policy")
    assert Principal("ops", Role.ADMIN).can_access("team-a/policy")
