"""Real processes for the benchmarks: a registry (embedded Redis) and samplers started as users start them,
adapters published the way a trainer publishes (artifact into the shared store, then PublishVersion), and
an asyncio client that streams Sample requests and timestamps every message."""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc

from opentinker.cli.launch import ServerProcess, opentinker_command, registry_store, start_registry
from opentinker.client.registry_client import RegistryClient
from opentinker.v1 import common_pb2, sampler_pb2, sampler_pb2_grpc
from opentinker.weights.artifact_store import ArtifactStore

T = TypeVar("T")


@dataclass
class Stack:
    registry: ServerProcess
    samplers: dict[str, ServerProcess]
    client: RegistryClient
    store: ArtifactStore

    def stop(self) -> None:
        stop_servers([*self.samplers.values(), self.registry])
        self.client.close()


def stop_servers(servers: Iterable[ServerProcess]) -> None:
    """Terminates each server in turn (killing the ones that do not stop cleanly)."""
    for server in servers:
        try:
            server.terminate()
        except Exception:
            server.kill()


def start_stack(work: Path, model: Path, samplers: dict[str, list[str]], *, threads: int = 1) -> Stack:
    """A registry, then the named samplers (extra CLI flags each) started in parallel. `threads`: torch threads
    of every sampler (OMP_NUM_THREADS), 1 by default like the in-process benchmarks (see sampler_multilora.py)."""
    registry = start_registry(work / "registry")
    store = registry_store(registry)

    def start(name: str) -> ServerProcess:
        args = opentinker_command(
            "sampler",
            "serve",
            "--model",
            str(model),
            "--registry",
            registry.address,
            "--store",
            str(store),
            "--port",
            "0",
            "--metrics-port",
            "-1",
            "--device",
            "cpu",
            *samplers[name],
        )
        return ServerProcess(args, work / name, timeout=300, env={"OMP_NUM_THREADS": str(threads)})

    with concurrent.futures.ThreadPoolExecutor(max(1, len(samplers))) as pool:
        futures = {name: pool.submit(start, name) for name in samplers}
        started = {name: future.result() for name, future in futures.items()}
    return Stack(registry, started, RegistryClient(registry.address), ArtifactStore(store))


def publish(stack: Stack, adapter: str, files: dict[str, bytes]) -> int:
    """Commits the artifact into the shared store (as the trainer does) and publishes it; returns the version."""
    ref = stack.store.commit_files(files)
    return stack.client.publish_version(adapter, ref.uri, ref.sha256, size_bytes=ref.size_bytes).number


def model_input(tokens: list[int]) -> common_pb2.ModelInput:
    chunk = common_pb2.ModelInputChunk(encoded_text=common_pb2.EncodedTextChunk(tokens=tokens))
    return common_pb2.ModelInput(chunks=[chunk])


def sample_request(model: str, prompt: list[int], max_tokens: int) -> sampler_pb2.SampleRequest:
    """Greedy; EOS may end a sample early (the server stops on the model's EOS)."""
    params = sampler_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return sampler_pb2.SampleRequest(model=model, prompt=model_input(prompt), sampling_params=params)


@dataclass
class Stream:
    """One Sample call as the client saw it (monotonic seconds)."""

    start: float
    first: float = math.nan  # first message with tokens
    end: float = math.nan
    tokens: int = 0
    versions: set[tuple[str, int]] = field(default_factory=set)
    error: str = ""
    messages: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens) per message


async def stream(stub: sampler_pb2_grpc.SamplerServiceStub, request: sampler_pb2.SampleRequest) -> Stream:
    result = Stream(start=time.monotonic())
    try:
        async for message in stub.Sample(request, timeout=300):
            now = time.monotonic()
            if message.tokens and math.isnan(result.first):
                result.first = now
            result.tokens += len(message.tokens)
            result.messages.append((now, len(message.tokens)))
            result.versions.add((message.version.adapter, message.version.version))
    except grpc.aio.AioRpcError as exc:
        result.error = f"{exc.code().name}: {exc.details()}"
    result.end = time.monotonic()
    return result


async def closed_loop(
    stub: sampler_pb2_grpc.SamplerServiceStub,
    next_request: Callable[[int], sampler_pb2.SampleRequest],
    concurrency: int,
    stop: asyncio.Event,
) -> list[Stream]:
    """`concurrency` clients, each sending its next request as soon as the previous one ends, until `stop`.
    next_request(i) gives the i-th request overall."""
    done: list[Stream] = []
    counter = iter(range(1 << 62))

    async def client() -> None:
        while not stop.is_set():
            done.append(await stream(stub, next_request(next(counter))))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return done


def tokens_between(streams: list[Stream], start: float, end: float) -> int:
    """Tokens that reached the clients in [start, end)."""
    return sum(n for s in streams for t, n in s.messages if start <= t < end)


def aio_stub(address: str) -> tuple[grpc.aio.Channel, sampler_pb2_grpc.SamplerServiceStub]:
    channel = grpc.aio.insecure_channel(address)
    return channel, sampler_pb2_grpc.SamplerServiceStub(channel)


async def alternate_sides(sides: Mapping[str, Callable[[], Awaitable[T]]], reps: int) -> dict[str, list[T]]:
    """Runs every side once per repetition, in order on even repetitions and reversed on odd ones ((a, b), (b, a),
    ...), so the machine's drift lands on every side alike; each side's results in repetition order."""
    runs: dict[str, list[T]] = {side: [] for side in sides}
    order = list(sides)
    for rep in range(reps):
        for side in order if rep % 2 == 0 else order[::-1]:
            runs[side].append(await sides[side]())
    return runs
