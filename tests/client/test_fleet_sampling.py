"""Sampling through the fleet, against one registry and three sampler processes on loopback: requests for an
adapter go to its home replica (each adapter resident on one replica under sequential traffic), every result
names its replica, and SIGKILL of a replica while 60 greedy streams run fails none of them: each equals, token
for token, an uninterrupted run of the same version."""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import signal
import threading
import time
from collections import Counter
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
from opentinker.client.fleet_sampling import LISTING_TTL_S
from opentinker.client.tiny_model import TinyModelSpec, make_tiny_model
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
    with ServiceClient(registry=registry.address) as client:
        assert wait_until(lambda: len(client.registry_client().list_replicas("sampler")) == SAMPLERS, timeout=30)
        base = client.registry_client().list_replicas("sampler")[0].base_fingerprint  # the model's digest
    with grpc.insecure_channel(registry.address) as channel:
        stub = registry_pb2_grpc.RegistryServiceStub(channel)
        adapters = [unique_name(f"fleet{i}") for i in range(ADAPTERS)]
        for i, name in enumerate(adapters):
            create_adapter(stub, name, base_model_digest=base)  # as a trainer records it: routing filters on it
            publish_lora(stub, tiny_model, name, seed=900 + i)
    state = Fleet(registry, samplers, adapters)
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


def test_uniform_concurrent_traffic_keeps_each_adapter_on_at_most_two_replicas(fleet: Fleet) -> None:
    jobs = [(name, i) for i in range(4) for name in fleet.adapters]
    with ServiceClient(registry=fleet.registry.address) as client:

        def run(job: tuple[str, int]) -> tuple[str, ...]:
            return client.create_sampling_client(f"{job[0]}@1").sample(prompt(job[1]), GREEDY).sequences[0].replicas

        # 4 at once: with L <= 3 others in flight the bound, ceil(1.25 (L + 1) / 3), can never be met by an
        # adapter's first two replicas together, so nothing reaches a third (from L = 6 on it could).
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            served = dict(zip(jobs, pool.map(run, jobs), strict=True))
    replicas_of: dict[str, set[str]] = {}
    for (name, _), (replica,) in served.items():
        replicas_of.setdefault(name, set()).add(replica)
    assert all(len(r) <= 2 for r in replicas_of.values()), replicas_of


def test_a_hot_adapter_spills_and_no_replica_holds_more_than_the_bound(fleet: Fleet) -> None:
    """24 streams of one adapter at once from one client: its home takes what the bound allows, the rest
    spill; held at once, no replica has more than ceil(1.25 x 24 / 3) + 1."""
    hot = fleet.adapters[5]
    start = threading.Barrier(24)
    long = SamplingParams(max_tokens=32, temperature=0.0)
    with ServiceClient(registry=fleet.registry.address) as client:
        home = hash_order(hot, client.registry_client().list_replicas("sampler"))[0].address
        sampling = client.create_sampling_client(f"{hot}@1")
        sampling.sample(prompt(0), GREEDY)  # the listing and the adapter's base are read before the burst

        def run(seed: int) -> str:
            start.wait(30)
            (replica,) = sampling.sample(prompt(seed), long).sequences[0].replicas
            return replica

        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            counts = Counter(pool.map(run, range(24)))
    assert len(counts) > 1 and counts[home] == max(counts.values()), counts
    assert max(counts.values()) <= math.ceil(1.25 * 24 / SAMPLERS) + 1, counts


def test_a_replica_of_another_base_is_never_chosen(fleet: Fleet, tmp_path: Path) -> None:
    other_model = make_tiny_model(tmp_path / "other-model", TinyModelSpec(arch="qwen2", seed=1))
    other = start_sampler(tmp_path / "other", other_model, fleet.registry, "--heartbeat-s", "0.2")
    try:
        with ServiceClient(registry=fleet.registry.address) as client:
            registry = client.registry_client()
            assert wait_until(lambda: other.address in {r.address for r in registry.list_replicas("sampler")}, 10)
            listed = {r.address: r for r in registry.list_replicas("sampler")}
            assert listed[other.address].base_fingerprint != listed[fleet.samplers[0].address].base_fingerprint
            for i, name in enumerate(fleet.adapters * 2):
                result = client.create_sampling_client(f"{name}@1").sample(prompt(i), GREEDY)
                assert other.address not in result.sequences[0].replicas, name
    finally:
        other.terminate()
    with ServiceClient(registry=fleet.registry.address) as client:
        gone = lambda: other.address not in {r.address for r in client.registry_client().list_replicas()}  # noqa: E731
        assert wait_until(gone, timeout=10)


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


def test_a_draining_replica_gets_no_new_request_and_finishes_its_stream(fleet: Fleet) -> None:
    """SIGTERM of a replica serving a long stream: the registry lists it DRAINING, new requests for its
    adapters go elsewhere without a failure, and its stream ends complete (runs after the SIGKILL test: the
    two replicas left)."""
    live = [s for s in fleet.samplers if s.process.poll() is None]
    with ServiceClient(registry=fleet.registry.address) as client:
        registry = client.registry_client()
        replicas = registry.list_replicas("sampler")
        victim = live[0]
        theirs = [n for n in fleet.adapters if hash_order(n, replicas)[0].address == victim.address]
        assert theirs, "the victim is home to some adapter"
        long = SamplingParams(max_tokens=120, temperature=0.0)
        stream = client.create_sampling_client(f"{theirs[0]}@1").stream(prompt(1), long)
        first = next(stream)
        assert first.replica == victim.address
        victim.process.send_signal(signal.SIGTERM)
        draining = lambda: any(r.address == victim.address and not r.serving for r in registry.list_replicas())  # noqa: E731
        assert wait_until(draining, timeout=5)
        time.sleep(LISTING_TTL_S)  # the client's listing is at most this old
        for i, name in enumerate(theirs * 2):
            result = client.create_sampling_client(f"{name}@1").sample(prompt(i), GREEDY)
            assert result.sequences[0].replicas == (live[1].address,), name
        rest = list(stream)
        assert sum(len(c.tokens) for c in [first, *rest]) == 120
        assert {c.replica for c in rest} <= {victim.address}  # finished where it began
    assert victim.process.wait(30) == 0
