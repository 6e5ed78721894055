"""Load: 200 concurrent streaming clients (grpc.aio) over 32 adapters for 10 s (60 s with OPENTINKER_SOAK=1)
while a trainer publishes a new version of one of them every second and the sampler hot-reloads it.
Asserted: zero errors, every stream complete and naming the adapter asked for, versions seen by each client
never going back, the last published version served at the end, and the sampler's memory (PSS of its processes)
bounded. The p99 latency is reported (printed in the run's summary and recorded in the test's report), not asserted."""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
import pytest
from samplerutil import wait_until
from serverproc import ServerProcess
from trainerutil import adam, lora, model_input, sft_batch

from opentinker.cli.launch import tree_memory
from opentinker.v1 import sampler_pb2, sampler_pb2_grpc, trainer_pb2, trainer_pb2_grpc

CLIENTS = 200
ADAPTERS = 32
SECONDS = 60.0 if os.environ.get("OPENTINKER_SOAK") == "1" else 10.0
MAX_TOKENS = 8
# Memory may grow by allocator warm-up and gRPC buffers, not with the number of requests or published versions.
MEMORY_GROWTH_BOUND = 256 << 20
MiB = 1 << 20


@dataclass
class Load:
    sampler: ServerProcess
    trainer: ServerProcess
    adapters: list[str]


@dataclass
class Outcome:
    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    tokens: int = 0
    published: list[int] = field(default_factory=list)


@pytest.fixture(scope="module")
def load(start_stack: Callable[..., dict[str, ServerProcess]]) -> Iterator[Load]:
    servers = start_stack(
        "load", sampler_args=("--max-slots", str(ADAPTERS + 16), "--max-seqs", "64", "--follow", "load-*")
    )
    names = [f"load-{i:02d}" for i in range(ADAPTERS)]
    with grpc.insecure_channel(servers["trainer"].address) as channel:
        trainer = trainer_pb2_grpc.TrainerServiceStub(channel)
        for seed, name in enumerate(names):
            request = trainer_pb2.TrainerServiceCreateAdapterRequest(name=name, lora_config=lora(), seed=seed)
            trainer.CreateAdapter(request, timeout=60)
            trainer.SaveSnapshot(trainer_pb2.SaveSnapshotRequest(adapter=name), timeout=60)
    with grpc.insecure_channel(servers["sampler"].address) as channel:
        sampler = sampler_pb2_grpc.SamplerServiceStub(channel)

        def all_loaded() -> bool:
            loaded = sampler.ListLoaded(sampler_pb2.ListLoadedRequest(), timeout=30)
            return len({a.version.adapter for a in loaded.adapters}) == ADAPTERS

        assert wait_until(all_loaded, timeout=120, interval=0.2), "the follower did not load every adapter"
    yield Load(servers["sampler"], servers["trainer"], names)


async def client(index: int, channel: grpc.aio.Channel, adapters: list[str], deadline: float, out: Outcome) -> None:
    stub = sampler_pb2_grpc.SamplerServiceStub(channel)
    rng = random.Random(index)
    seen: dict[str, int] = {}
    while time.monotonic() < deadline:
        name = adapters[rng.randrange(len(adapters))]
        params = sampler_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=rng.randrange(1 << 30))
        prompt = model_input([rng.randrange(3, 500) for _ in range(6)])
        started = time.perf_counter()
        try:
            tokens, stop, versions = 0, 0, set()
            async for message in stub.Sample(
                sampler_pb2.SampleRequest(model=name, prompt=prompt, sampling_params=params), timeout=60
            ):
                tokens += len(message.tokens)
                stop = message.stop_reason or stop
                versions.add((message.version.adapter, message.version.version))
            assert stop != sampler_pb2.STOP_REASON_UNSPECIFIED and 1 <= tokens <= MAX_TOKENS, (stop, tokens)
            assert len(versions) == 1, versions  # one exact version per request
            ((adapter, version),) = versions
            assert adapter == name and version >= seen.get(name, 1), (name, adapter, version, seen.get(name))
            seen[name] = version
        except (grpc.aio.AioRpcError, AssertionError) as error:
            out.errors.append(f"client {index}: {name}: {error!r}"[:500])
            continue
        out.latencies.append(time.perf_counter() - started)
        out.tokens += tokens


async def publisher(address: str, adapter: str, deadline: float, out: Outcome) -> None:
    """One train step and a new version of `adapter` every second."""
    async with grpc.aio.insecure_channel(address) as channel:
        trainer = trainer_pb2_grpc.TrainerServiceStub(channel)
        step = 0
        while time.monotonic() < deadline:
            tick = time.monotonic()
            try:
                batch = trainer_pb2.ForwardBackwardRequest(
                    adapter=adapter, datums=sft_batch(step), loss_fn="cross_entropy"
                )
                await trainer.ForwardBackward(batch, timeout=60)
                await trainer.OptimStep(trainer_pb2.OptimStepRequest(adapter=adapter, adam_params=adam()), timeout=60)
                saved = await trainer.SaveSnapshot(trainer_pb2.SaveSnapshotRequest(adapter=adapter), timeout=60)
                out.published.append(saved.version.version)
            except grpc.aio.AioRpcError as error:
                out.errors.append(f"publisher: {error!r}"[:500])
            step += 1
            await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))


async def run_load(load: Load, out: Outcome) -> None:
    deadline = time.monotonic() + SECONDS
    channels = [grpc.aio.insecure_channel(load.sampler.address) for _ in range(CLIENTS // 10)]
    try:
        await asyncio.gather(
            publisher(load.trainer.address, load.adapters[0], deadline, out),
            *(client(i, channels[i % len(channels)], load.adapters, deadline, out) for i in range(CLIENTS)),
        )
    finally:
        for channel in channels:
            await channel.close()


def served_version(load: Load, adapter: str) -> int:
    with grpc.insecure_channel(load.sampler.address) as channel:
        stub = sampler_pb2_grpc.SamplerServiceStub(channel)
        params = sampler_pb2.SamplingParams(max_tokens=1, temperature=0.0)
        request = sampler_pb2.SampleRequest(model=adapter, prompt=model_input([5, 6, 7]), sampling_params=params)
        version: int = next(iter(stub.Sample(request, timeout=60))).version.version
        return version


def test_many_streaming_clients_while_publishing(load: Load, figure: Callable[[str, object], None]) -> None:
    memory_start = tree_memory(load.sampler.process.pid)
    out = Outcome()
    started = time.monotonic()
    asyncio.run(run_load(load, out))
    elapsed = time.monotonic() - started
    memory_end = tree_memory(load.sampler.process.pid)
    assert out.errors == [], f"{len(out.errors)} errors, first: {out.errors[:5]}"
    assert len(out.published) >= SECONDS * 0.5, out.published  # about one version a second
    # The follower moves the alias to the last published version.
    last = out.published[-1]
    assert wait_until(lambda: served_version(load, load.adapters[0]) == last, timeout=30), last
    latencies = sorted(out.latencies)
    p50, p99 = statistics.median(latencies), latencies[int(0.99 * (len(latencies) - 1))]
    figure("load clients x adapters x seconds", f"{CLIENTS} x {ADAPTERS} x {SECONDS:.0f} (+1 version/s)")
    figure("load requests, errors, tokens/s", f"{len(latencies)}, {len(out.errors)}, {out.tokens / elapsed:.0f}")
    figure("load latency p50 / p99 (s, request to last token)", f"{p50:.3f} / {p99:.3f}")
    figure("load versions published", len(out.published))
    figure("load sampler PSS start -> end (MiB)", f"{memory_start / MiB:.0f} -> {memory_end / MiB:.0f}")
    assert len(latencies) >= CLIENTS  # every client completed requests
    assert memory_end - memory_start <= MEMORY_GROWTH_BOUND, (memory_start / MiB, memory_end / MiB)
