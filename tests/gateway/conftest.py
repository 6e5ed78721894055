"""One gateway process per test module, over the session's trainer, sampler and registry. A module passes extra
gateway flags in a module-level GATEWAY_FLAGS tuple."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from gatewayutil import start_gateway
from serverproc import ServerProcess

from opentinker.client import ServiceClient


@pytest.fixture(scope="module")
def gateway(
    request: pytest.FixtureRequest,
    trainer_server: ServerProcess,
    sampler_server: ServerProcess,
    registry_server: ServerProcess,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ServerProcess]:
    flags: tuple[str, ...] = getattr(request.module, "GATEWAY_FLAGS", ())
    workdir = tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2])
    server = start_gateway(workdir, trainer_server, sampler_server, registry_server, *flags)
    yield server
    assert server.terminate() == 0, server.log()


@pytest.fixture(scope="module")
def service(
    trainer_server: ServerProcess, sampler_server: ServerProcess, registry_server: ServerProcess
) -> Iterator[ServiceClient]:
    """The SDK over the session's servers (a module of the tinker surface has its own, the tinker SDK's)."""
    with ServiceClient(trainer_server.address, sampler_server.address, registry_server.address) as client:
        yield client
