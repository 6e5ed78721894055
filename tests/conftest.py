"""Shared fixtures: private Redis servers, tiny models, server processes (session-scoped where heavy)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import grpc
import pytest
from serverproc import ServerProcess, opentinker_command

from opentinker.registry.embedded_redis import EmbeddedRedis
from opentinker.v1 import registry_pb2_grpc

# Nothing in the test suite may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """A private Redis on a free port (never the machine's 6379)."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis")).start()
    assert server.port != 6379
    yield server
    server.stop()


@pytest.fixture(scope="session")
def registry_server(
    redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """One registry process for the session, on the private Redis, with its own artifact store."""
    workdir = tmp_path_factory.mktemp("registry")
    server = ServerProcess(
        opentinker_command(
            "registry", "serve", "--redis-url", redis_server.url, "--store", str(workdir / "artifacts"),
            "--port", "0", "--data-dir", str(workdir),
        ),
        workdir,
    )  # fmt: skip
    yield server
    assert server.terminate() == 0, server.log()


@pytest.fixture(scope="session")
def registry_channel(registry_server: ServerProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(registry_server.address) as channel:
        yield channel


@pytest.fixture(scope="session")
def registry(registry_channel: grpc.Channel) -> registry_pb2_grpc.RegistryServiceStub:
    return registry_pb2_grpc.RegistryServiceStub(registry_channel)
