"""The sampler SIGKILLed while it streams: every open stream ends with UNAVAILABLE (no client hangs), and the
restarted sampler serves what the registry's aliases say now. Clients that disconnect mid-stream, 1,000 times,
leave no running sequence, no slot reference and no memory behind."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from faultutil import SOAK, ForkedServer, fork_sampler, long_prompt, wait_for
from registryutil import create_adapter, publish_lora, unique_name
from samplerutil import loaded, params, request, stats
from serverproc import ServerProcess

from opentinker.v1 import registry_pb2, registry_pb2_grpc, sampler_pb2, sampler_pb2_grpc

STREAM_TOKENS = 400  # long enough to still be streaming when the sampler dies or the client leaves
DISCONNECTS = 10_000 if SOAK else 1_000
WARMUP = 200
MEMORY_BOUND = 32 << 20  # bytes the sampler may grow over DISCONNECTS disconnects after WARMUP of them


@dataclass
class Stack:
    name: str
    model: Path
    registry: registry_pb2_grpc.RegistryServiceStub
    registry_server: ServerProcess
    workdir: Path
    sampler: ForkedServer


def start(stack: Stack, tag: str) -> ForkedServer:
    return fork_sampler(
        stack.workdir / tag, stack.model, stack.registry_server, "--follow", stack.name, "--max-slots", "4"
    )


def serving(sampler: sampler_pb2_grpc.SamplerServiceStub, name: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for adapter in loaded(sampler).values():
        if adapter.version.adapter == name:
            out.update({alias: adapter.version.version for alias in adapter.serving_aliases})
    return out


@pytest.fixture(scope="module")
def stack(
    tiny_model: Path, registry_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    channel = grpc.insecure_channel(registry_server.address)
    registry = registry_pb2_grpc.RegistryServiceStub(channel)
    name = unique_name("skill")
    create_adapter(registry, name)
    publish_lora(registry, tiny_model, name, seed=1)
    publish_lora(registry, tiny_model, name, seed=2)
    registry.SetAlias(registry_pb2.SetAliasRequest(adapter=name, alias="stable", version=1))
    workdir = tmp_path_factory.mktemp("sampler-kill")
    result = Stack(name, tiny_model, registry, registry_server, workdir, None)  # type: ignore[arg-type]
    result.sampler = start(result, "first")
    yield result
    result.sampler.kill()
    channel.close()


@dataclass
class Outcome:
    messages: int = 0
    code: grpc.StatusCode | None = None  # None: the stream completed
    ended_at: float = 0.0


def test_killed_sampler_ends_every_stream_with_unavailable_and_restart_serves_current_aliases(
    stack: Stack, figure: Callable[[str, object], None]
) -> None:
    with grpc.insecure_channel(stack.sampler.address) as channel:
        sampler = sampler_pb2_grpc.SamplerServiceStub(channel)
        assert wait_for(lambda: serving(sampler, stack.name) == {"latest": 2, "stable": 1})
        prompt = long_prompt(sampler, f"{stack.name}@2", STREAM_TOKENS)
        outcomes = [Outcome() for _ in range(4)]
        started = threading.Barrier(len(outcomes) + 1, timeout=60)

        def stream(outcome: Outcome) -> None:
            call = sampler.Sample(
                request(f"{stack.name}@latest", prompt, params(max_tokens=STREAM_TOKENS)), timeout=120
            )
            try:
                for _ in call:
                    outcome.messages += 1
                    if outcome.messages == 1:
                        started.wait()
            except grpc.RpcError as error:
                outcome.code = error.code()
            outcome.ended_at = time.monotonic()

        threads = [threading.Thread(target=stream, args=(o,)) for o in outcomes]
        for thread in threads:
            thread.start()
        started.wait()  # every stream has tokens flowing
        killed_at = time.monotonic()
        assert stack.sampler.kill() == -9
        for thread in threads:
            thread.join(30)
        assert not any(t.is_alive() for t in threads), "a client stream still hangs 30 s after the sampler died"
    for outcome in outcomes:
        assert outcome.messages >= 1 and outcome.code == grpc.StatusCode.UNAVAILABLE, outcome
    figure(
        "sampler SIGKILL: open streams ended UNAVAILABLE within (s)",
        f"{max(o.ended_at for o in outcomes) - killed_at:.3f}",
    )

    # While it is down, the registry moves on: a new latest, stable moved forward.
    publish_lora(stack.registry, stack.model, stack.name, seed=3)
    stack.registry.SetAlias(registry_pb2.SetAliasRequest(adapter=stack.name, alias="stable", version=2))
    stack.sampler = start(stack, "second")
    with grpc.insecure_channel(stack.sampler.address) as channel:
        sampler = sampler_pb2_grpc.SamplerServiceStub(channel)
        for reference, want in (("", 3), ("@latest", 3), ("@stable", 2)):
            short = request(stack.name + reference, prompt, params(max_tokens=2))
            first = next(iter(sampler.Sample(short, timeout=60)))
            assert (first.version.adapter, first.version.version) == (stack.name, want), reference
        assert wait_for(lambda: serving(sampler, stack.name) == {"latest": 3, "stable": 2}), loaded(sampler)


def test_thousand_mid_stream_disconnects_leak_nothing(stack: Stack, figure: Callable[[str, object], None]) -> None:
    with grpc.insecure_channel(stack.sampler.address) as channel:
        sampler = sampler_pb2_grpc.SamplerServiceStub(channel)
        reference = f"{stack.name}@latest"
        prompt = long_prompt(sampler, reference, STREAM_TOKENS)
        rng = random.Random(11)
        lock = threading.Lock()

        def disconnect(_: int) -> int:
            with lock:
                after = rng.choice((1, 1, 2, 5))  # messages to read before leaving
            call = sampler.Sample(request(reference, prompt, params(max_tokens=STREAM_TOKENS)), timeout=60)
            got = 0
            for _message in call:
                got += 1
                if got == after:
                    break
            call.cancel()
            return got

        def idle() -> bool:
            s = stats(sampler)
            return s.running_requests == 0 and s.waiting_requests == 0

        def refs() -> list[int]:
            return [a.active_requests for a in loaded(sampler).values()]

        with ThreadPoolExecutor(4) as pool:
            assert all(got >= 1 for got in pool.map(disconnect, range(WARMUP)))
            assert wait_for(idle, timeout=30), stats(sampler)
            memory_before = stack.sampler.memory()
            tokens_before = stats(sampler).tokens_generated
            assert all(got >= 1 for got in pool.map(disconnect, range(DISCONNECTS)))  # each one left mid-stream
        assert wait_for(idle, timeout=30), stats(sampler)
        # The server stopped each abandoned generation instead of finishing it for nobody.
        generated = stats(sampler).tokens_generated - tokens_before
        assert generated < DISCONNECTS * STREAM_TOKENS // 4, generated
        assert wait_for(lambda: not any(refs()), timeout=30), loaded(sampler)
        memory_after = stack.sampler.memory()
        mib = (memory_before / 2**20, memory_after / 2**20)
        figure(
            f"sampler after {DISCONNECTS} mid-stream disconnects: memory (MiB, server + engine PSS), tokens generated",
            f"{mib[0]:.1f} -> {mib[1]:.1f}, {generated} (max {DISCONNECTS * STREAM_TOKENS} if never aborted)",
        )
        assert memory_after - memory_before < MEMORY_BOUND, (memory_before, memory_after)
        # Still serving normally afterwards.
        message = next(iter(sampler.Sample(request(reference, prompt, params(max_tokens=2)), timeout=60)))
        assert message.version.adapter == stack.name
        assert stats(sampler).slots_used <= 4
        assert isinstance(message, sampler_pb2.SampleResponse)
