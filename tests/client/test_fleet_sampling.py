"""Sampling through the fleet, against one registry and three sampler processes on loopback: requests for an
adapter go to its home replica (each adapter resident on one replica under sequential traffic), every result
names its replica, and SIGKILL of a replica while 60 greedy streams run fails none of them: each equals, token
for token, an uninterrupted run of the same version."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from registryutil import create_adapter, publish_lora, unique_name
from samplerutil import prompt, wait_until
from serverproc import ServerProcess, start_registry, start_sampler
from typer.testing import CliRunner

from opentinker.cli.main import app
from opentinker.client import SamplingParams, ServiceClient
from opentinker.client.fleet_router import hash_order
from opentinker.v1 import registry_pb2_grpc

SAMPLERS = 3
ADAPTERS = 12


@dataclass
class Fleet:
    registry: ServerProcess
    samplers: list[ServerProcess]
    adapters: list[str]


@pytest.fixture(scope="module")
def fleet(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    work = tmp_path_factory.mktemp("fleet")
    registry = start_registry(work / "registry")
    flags = ("--heartbeat-s", "0.2", "--max-slots", "16", "--max-seqs", "32")
    samplers = [start_sampler(work / f"sampler-{i}", tiny_model, registry, *flags) for i in range(SAMPLERS)]
    with grpc.insecure_channel(registry.address) as channel:
        stub = registry_pb2_grpc.RegistryServiceStub(channel)
        adapters = [unique_name(f"fleet{i}") for i in range(ADAPTERS)]
        for i, name in enumerate(adapters):
            create_adapter(stub, name)
            publish_lora(stub, tiny_model, name, seed=900 + i)
    state = Fleet(registry, samplers, adapters)
    with ServiceClient(registry=registry.address) as client:
        assert wait_until(lambda: len(client.registry_client().list_replicas("sampler")) == SAMPLERS, timeout=30)
    yield state
    for sampler in samplers:
        sampler.kill()
    registry.terminate()


GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def test_each_adapter_is_served_by_its_home_replica(fleet: Fleet) -> None:
    with ServiceClient(registry=fleet.registry.address) as client:
        replicas = client.registry_client().list_replicas("sampler")
        for round_ in range(2):
            for i, name in enumerate(fleet.adapters):
                result = client.create_sampling_client(f"{name}@1").sample(prompt(i), GREEDY)
                home = hash_order(name, replicas)[0].address
                assert result.sequences[0].replicas == (home,), (name, round_)
                assert result.sequences[0].version.version == 1
        resident: dict[str, set[str]] = {}
        for replica in client.registry_client().list_replicas("sampler"):
            for version in replica.resident:
                resident.setdefault(version, set()).add(replica.address)
        assert all(len(resident.get(f"{name}@1", ())) == 1 for name in fleet.adapters), resident
        assert len({hash_order(n, replicas)[0].address for n in fleet.adapters}) > 1  # spread over the fleet
        scored = client.create_sampling_client(f"{fleet.adapters[0]}@1").compute_logprobs(prompt(3))
        assert len(scored) == len(prompt(3)) - 1

        async def on_the_async_channel() -> tuple[str, ...]:
            sampling = client.create_sampling_client(f"{fleet.adapters[1]}@1")
            result = await sampling.sample_async(prompt(1), GREEDY)
            assert len(await sampling.compute_logprobs_async(prompt(2))) == len(prompt(2)) - 1
            await client.aclose()
            return result.sequences[0].replicas

        assert asyncio.run(on_the_async_channel()) == (hash_order(fleet.adapters[1], replicas)[0].address,)


def test_opentinker_sample_goes_through_the_fleet(fleet: Fleet) -> None:
    name = fleet.adapters[2]
    args = ["sample", f"{name}@1", "hello", "--registry", fleet.registry.address, "--max-tokens", "4"]
    result = CliRunner().invoke(app, [*args, "--temperature", "0"])
    assert result.exit_code == 0, result.output
    assert f"[{name}@1, stop:" in result.stderr
    with ServiceClient(registry=fleet.registry.address) as client:
        home = hash_order(name, client.registry_client().list_replicas("sampler"))[0]
        assert f"{name}@1" in home.resident


def test_sigkill_of_a_replica_fails_no_stream_and_greedy_output_is_unchanged(fleet: Fleet) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0)
    with ServiceClient(registry=fleet.registry.address) as client:
        replicas = client.registry_client().list_replicas("sampler")
        jobs = [(fleet.adapters[i % ADAPTERS], i) for i in range(60)]
        expected = {
            job: client.create_sampling_client(f"{job[0]}@1").sample(prompt(job[1]), params).sequences[0].tokens
            for job in jobs
        }
        victim_address = hash_order(fleet.adapters[0], replicas)[0].address
        victim = next(s for s in fleet.samplers if s.address == victim_address)
        results: dict[tuple[str, int], tuple[int, ...]] = {}
        moved: dict[tuple[str, int], tuple[str, ...]] = {}
        errors: list[BaseException] = []
        started = threading.Event()

        def run(job: tuple[str, int]) -> None:
            try:
                chunks = client.create_sampling_client(f"{job[0]}@1").stream(prompt(job[1]), params)
                tokens: list[int] = []
                seen: list[str] = []
                for chunk in chunks:
                    tokens.extend(chunk.tokens)
                    if chunk.replica not in seen:
                        seen.append(chunk.replica)
                    if len(tokens) >= 4:
                        started.set()
                results[job], moved[job] = tuple(tokens), tuple(seen)
            except BaseException as error:
                errors.append(error)

        threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
        for thread in threads:
            thread.start()
        assert started.wait(60)
        victim.process.kill()  # SIGKILL while streams are delivering tokens
        killed_at = time.monotonic()
        for thread in threads:
            thread.join(180)
        assert not errors, errors[:3]
        assert results == expected
        continued = [job for job, seen in moved.items() if len(seen) > 1]
        assert continued and all(seen[0] == victim_address for seen in (moved[j] for j in continued))
        print(
            f"{len(continued)} of 60 streams continued on another replica; "
            f"done {time.monotonic() - killed_at:.1f} s after the kill"
        )
        # New requests for the victim's adapters go to their next replica at once.
        after = client.create_sampling_client(f"{fleet.adapters[0]}@1").sample(prompt(0), GREEDY)
        assert after.sequences[0].replicas == (hash_order(fleet.adapters[0], replicas)[1].address,)
