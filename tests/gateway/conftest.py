"""One gateway process per test module, over the session's trainer, sampler and registry. A module passes extra
gateway flags in a module-level GATEWAY_FLAGS tuple."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from gatewayutil import start_gateway
from serverproc import ServerProcess


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
