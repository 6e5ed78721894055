"""Shared fixtures: private Redis and object-store servers, tiny models, server processes (session-scoped where
heavy)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from serverproc import ServerProcess, start_registry, start_sampler, start_trainer
from storeservers import StoreServer, start_azurite, start_moto

from opentinker.registry.embedded_redis import EmbeddedRedis
from opentinker.v1 import registry_pb2_grpc, sampler_pb2_grpc, trainer_pb2_grpc

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
def registry_server(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One registry process for the session, on the private Redis, with its own artifact store."""
    server = start_registry(tmp_path_factory.mktemp("registry"), "--redis-url", redis_server.url)
    yield server
    assert server.terminate() == 0, server.log()


@pytest.fixture(scope="session")
def registry_channel(registry_server: ServerProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(registry_server.address) as channel:
        yield channel


@pytest.fixture(scope="session")
def registry(registry_channel: grpc.Channel) -> registry_pb2_grpc.RegistryServiceStub:
    return registry_pb2_grpc.RegistryServiceStub(registry_channel)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny qwen2 model every server test loads (written once per session)."""
    from opentinker.client.tiny_model import TinyModelSpec, make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", TinyModelSpec(arch="qwen2", seed=0))


@pytest.fixture(scope="session")
def trainer_server(
    tiny_model: Path, registry_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """One trainer process for the session, sharing the registry's artifact store."""
    workdir = tmp_path_factory.mktemp("trainer")
    server = start_trainer(workdir, tiny_model, registry_server)
    yield server
    assert server.terminate() == 0, server.log()


@pytest.fixture(scope="session")
def trainer(trainer_server: ServerProcess) -> Iterator[trainer_pb2_grpc.TrainerServiceStub]:
    with grpc.insecure_channel(trainer_server.address) as channel:
        yield trainer_pb2_grpc.TrainerServiceStub(channel)


@pytest.fixture(scope="session")
def sampler_server(
    tiny_model: Path, registry_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """One sampler process for the session, sharing the registry's artifact store."""
    server = start_sampler(tmp_path_factory.mktemp("sampler"), tiny_model, registry_server, "--max-slots", "8")
    yield server
    assert server.terminate() == 0, server.log()


@pytest.fixture(scope="session")
def sampler(sampler_server: ServerProcess) -> Iterator[sampler_pb2_grpc.SamplerServiceStub]:
    with grpc.insecure_channel(sampler_server.address) as channel:
        yield sampler_pb2_grpc.SamplerServiceStub(channel)


@pytest.fixture(scope="session")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, StoreServer]]:
    """Object-store servers on loopback (moto for S3, Azurite for Azure Blob), started where a test asks."""
    started = {"s3": start_moto(tmp_path_factory.mktemp("moto"))}
    try:
        started["az"] = start_azurite(tmp_path_factory.mktemp("azurite"))
        yield started
    finally:
        for server in started.values():
            server.stop()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The figures tests measured (`record_property`, e.g. the reliability suite's `figure`), at the end of the
    run. Read from the test reports, so a run split over xdist workers prints them too."""
    figures = [
        (name, value)
        for reports in terminalreporter.stats.values()
        for report in reports
        if isinstance(report, pytest.TestReport) and report.when == "call"
        for name, value in report.user_properties
    ]
    if figures:
        terminalreporter.section("measured figures")
        for name, value in figures:
            terminalreporter.write_line(f"{name}: {value}")
