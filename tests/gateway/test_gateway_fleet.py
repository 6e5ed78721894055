"""The gateway with `--sampler fleet`: its per-token backend samples through the registry's fleet (the SDK's
FleetConnection), the same object its tinker and OpenAI surfaces stream from."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from registryutil import create_adapter, publish_lora, unique_name
from samplerutil import wait_until
from serverproc import ServerProcess, start_registry, start_sampler

from opentinker.client import RegistryClient
from opentinker.client.fleet_sampling import FleetConnection
from opentinker.gateway.backend import FLEET, Backends
from opentinker.v1 import registry_pb2_grpc, sampler_pb2


@pytest.fixture(scope="module")
def one_replica(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, ServerProcess, str]]:
    work = tmp_path_factory.mktemp("gateway-fleet")
    registry = start_registry(work / "registry")
    sampler = start_sampler(work / "sampler", tiny_model, registry, "--heartbeat-s", "0.2")
    name = unique_name("gwfleet")
    with grpc.insecure_channel(registry.address) as channel:
        stub = registry_pb2_grpc.RegistryServiceStub(channel)
        create_adapter(stub, name)
        publish_lora(stub, tiny_model, name, seed=77)
    with RegistryClient(registry.address) as client:
        assert wait_until(lambda: len(client.list_replicas("sampler")) == 1, timeout=30)
    yield registry, sampler, name
    sampler.terminate()
    registry.terminate()


def test_the_gateway_backend_streams_from_the_fleet(one_replica: tuple[ServerProcess, ServerProcess, str]) -> None:
    registry, sampler, name = one_replica
    backends = Backends("127.0.0.1:9", FLEET, registry.address)
    backend = backends.for_token(None)
    assert isinstance(backend.sampler, FleetConnection)
    request = sampler_pb2.SampleRequest(
        model=f"{name}@latest",
        prompt_text="hi",
        sampling_params=sampler_pb2.SamplingParams(max_tokens=3, temperature=0),
    )

    async def stream() -> list[sampler_pb2.SampleResponse]:
        try:
            return [m async for m in backend.sampler.sample_async(request)]
        finally:
            await backends.close()

    messages = asyncio.run(stream())
    assert {m.replica for m in messages} == {sampler.address}
    assert sum(len(m.tokens) for m in messages) == 3 and messages[0].version.version == 1
