"""The shared server scaffolding, exercised through a toy servicer in its own process."""

from __future__ import annotations

import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from serverproc import ServerProcess

from opentinker.rpc.serving.errors import error_info
from opentinker.v1 import registry_pb2, registry_pb2_grpc

TOY = str(Path(__file__).with_name("toy_server.py"))


def start_toy(workdir: Path, *extra: str) -> ServerProcess:
    return ServerProcess([sys.executable, TOY, *extra], workdir, timeout=30)


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_toy(tmp_path_factory.mktemp("toy"))
    yield server
    server.kill()


@pytest.fixture(scope="module")
def registry_stub(toy: ServerProcess) -> Iterator[registry_pb2_grpc.RegistryServiceStub]:
    with grpc.insecure_channel(toy.address) as channel:
        yield registry_pb2_grpc.RegistryServiceStub(channel)


def test_bad_input_is_invalid_argument_with_error_info(
    registry_stub: registry_pb2_grpc.RegistryServiceStub,
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        registry_stub.GetAdapter(registry_pb2.GetAdapterRequest(name="Not A Name!"))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "invalid adapter name" in (caught.value.details() or "")
    info = error_info(caught.value)
    assert info is not None
    assert info.reason == "INVALID_ADAPTER_NAME"
    assert info.domain == "opentinker"
    assert info.metadata["name"] == "Not A Name!"


def test_not_found_carries_reason(registry_stub: registry_pb2_grpc.RegistryServiceStub) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        registry_stub.GetAdapter(registry_pb2.GetAdapterRequest(name="team-a/missing"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    info = error_info(caught.value)
    assert info is not None and info.reason == "ADAPTER_NOT_FOUND"


def test_unexpected_exception_is_internal_without_traceback(
    registry_stub: registry_pb2_grpc.RegistryServiceStub, toy: ServerProcess
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        registry_stub.ListAdapters(registry_pb2.ListAdaptersRequest())
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    details = caught.value.details() or ""
    assert "secret" not in details and "Traceback" not in details
    info = error_info(caught.value)
    assert info is not None and info.reason == "INTERNAL"
    # The incident id in the message points at the traceback in the server log.
    assert info.metadata["incident"] in details
    assert "secret internal detail" in toy.log()


def test_stream_error_after_messages(registry_stub: registry_pb2_grpc.RegistryServiceStub) -> None:
    received = []
    with pytest.raises(grpc.RpcError) as caught:
        for message in registry_stub.WatchEvents(registry_pb2.WatchEventsRequest()):
            received.append(message.event.event_id)
    assert received == ["0-1", "0-2"]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    info = error_info(caught.value)
    assert info is not None and info.reason == "TOY_STREAM_ERROR"


def test_reflection_lists_services(toy: ServerProcess) -> None:
    with grpc.insecure_channel(toy.address) as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"opentinker.v1.RegistryService", "grpc.health.v1.Health"} <= services


def test_metrics_endpoint_counts_rpcs(registry_stub: registry_pb2_grpc.RegistryServiceStub, toy: ServerProcess) -> None:
    with pytest.raises(grpc.RpcError):
        registry_stub.GetAdapter(registry_pb2.GetAdapterRequest(name="team-a/missing"))
    assert toy.metrics_address is not None
    body = urllib.request.urlopen(f"http://{toy.metrics_address}/metrics", timeout=10).read().decode()
    line = next(
        l
        for l in body.splitlines()
        if l.startswith("opentinker_rpc_requests_total{")
        and 'method="/opentinker.v1.RegistryService/GetAdapter"' in l
        and 'code="NOT_FOUND"' in l
    )
    assert float(line.rsplit(" ", 1)[1]) >= 1


def test_health_serving_then_not_serving_on_sigterm(tmp_path: Path) -> None:
    server = start_toy(tmp_path, "--drain-seconds", "2")
    try:
        with grpc.insecure_channel(server.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            serving = health_pb2.HealthCheckResponse.SERVING
            assert health.Check(health_pb2.HealthCheckRequest(service="")).status == serving
            name = "opentinker.v1.RegistryService"
            assert health.Check(health_pb2.HealthCheckRequest(service=name)).status == serving
            watch = health.Watch(health_pb2.HealthCheckRequest(service=name), timeout=20)
            assert next(watch).status == serving
            server.process.send_signal(15)
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            watch.cancel()
        assert server.process.wait(30) == 0
        assert "toy stopped" in server.log()
    finally:
        server.kill()


def test_public_bind_without_tokens_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"refusing to bind 0\.0\.0\.0 without authentication"):
        start_toy(tmp_path, "--host", "0.0.0.0")


def test_public_bind_with_insecure_public_flag(tmp_path: Path) -> None:
    server = start_toy(tmp_path, "--host", "0.0.0.0", "--insecure-public")
    try:
        port = server.address.rsplit(":", 1)[1]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert response.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        assert server.terminate() == 0
