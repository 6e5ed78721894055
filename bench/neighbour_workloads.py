"""The tenants' workloads of bench/noisy_neighbours.py, case by case: team-b's timed calls and team-a's abuses."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx
import zstandard
from neighbour_stack import Clients, asample_body, result
from stack import model_input

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the tests' artifact builders

from registryutil import upload
from tinker.proto import tinker_public_pb2 as tpb
from trainerutil import random_tokens, sft_datum

from opentinker.v1 import common_pb2, registry_pb2, sampler_pb2, trainer_pb2


class CallFailed(Exception):
    """team-b's HTTP call through the gateway got an error answer."""


def prompt_of(seed: int) -> common_pb2.ModelInput:
    return model_input(random_tokens(seed, 24))


def sample_request(model: str, seed: int, num_samples: int = 1) -> sampler_pb2.SampleRequest:
    params = sampler_pb2.SamplingParams(temperature=1.0, seed=seed, max_tokens=8)
    return sampler_pb2.SampleRequest(
        model=model, prompt=prompt_of(seed), sampling_params=params, num_samples=num_samples
    )


def refused(call: Callable[[], object]) -> None:
    """One abuse attempt: its refusal (an RpcError) is expected and dropped here; tests/reliability/test_noisy_*.py
    assert the exact statuses."""
    with contextlib.suppress(grpc.RpcError):
        call()


# team-b's workloads: one call each, timed


def team_b_sample(stack: Clients) -> Callable[[int], None]:
    _, _, sampler = stack.stubs()

    def call(i: int) -> None:
        for _ in sampler.Sample(sample_request("team-b/policy", i % 8), metadata=stack.md("team-b"), timeout=120):
            pass

    return call


def team_b_registry(stack: Clients) -> Callable[[int], None]:
    registry, _, _ = stack.stubs()

    def call(i: int) -> None:
        registry.GetAdapter(
            registry_pb2.GetAdapterRequest(name="team-b/policy"), metadata=stack.md("team-b"), timeout=60
        )
        registry.Resolve(
            registry_pb2.ResolveRequest(reference="team-b/policy@latest"), metadata=stack.md("team-b"), timeout=60
        )

    return call


def team_b_train(stack: Clients) -> Callable[[int], None]:
    _, trainer, _ = stack.stubs()
    datums = [sft_datum(random_tokens(100 + i, 33)) for i in range(4)]

    def call(i: int) -> None:
        request = trainer_pb2.ForwardBackwardRequest(adapter="team-b/trained", datums=datums, loss_fn="cross_entropy")
        trainer.ForwardBackward(request, metadata=stack.md("team-b"), timeout=300)

    return call


def team_b_gateway(clients: Clients) -> Callable[[int], None]:
    """A seeded 8-token asample through the gateway and its retrieve_future (the tinker protocol)."""
    http = clients.http()

    def call(i: int) -> None:
        sent = clients.post(http, "team-b", "asample", asample_body(clients, i % 8))
        if sent.status_code != 200:
            raise CallFailed(f"asample: {sent.status_code} {sent.text[:200]}")
        reply = result(clients, http, "team-b", sent.json()["request_id"])
        if reply.status_code != 200 or not reply.headers["content-type"].startswith("application/x-protobuf"):
            raise CallFailed(f"retrieve_future: {reply.status_code} {reply.text[:200]}")

    return call


# team-a's abuses: one attempt each (run in a loop by several threads)


def exploding(stack: Clients) -> Callable[[], None]:
    _, _, sampler = stack.stubs()
    return lambda: refused(
        lambda: list(
            sampler.Sample(
                sample_request("team-a/exploding", 3, num_samples=2), metadata=stack.md("team-a"), timeout=120
            )
        )
    )


def huge_prompt(stack: Clients) -> Callable[[], None]:
    _, _, sampler = stack.stubs()
    text = "x" * (10 << 20)
    params = sampler_pb2.SamplingParams(max_tokens=4)
    request = sampler_pb2.SampleRequest(model="base", prompt_text=text, sampling_params=params)
    return lambda: refused(lambda: list(sampler.Sample(request, metadata=stack.md("team-a"), timeout=120)))


def sampler_flood(stack: Clients) -> Callable[[], None]:
    """24 long generations at once (4 samples of 128 tokens each): more than the batch holds; beyond team-a's
    share of the slots they wait in team-a's own queue, beyond --max-queued-per-tenant they are refused."""
    _, _, sampler = stack.stubs()
    pool = concurrent.futures.ThreadPoolExecutor(24)
    params = sampler_pb2.SamplingParams(temperature=0.0, max_tokens=128)

    def one(seed: int) -> None:
        request = sampler_pb2.SampleRequest(model="base", prompt=prompt_of(seed), sampling_params=params, num_samples=4)
        refused(lambda: list(sampler.Sample(request, metadata=stack.md("team-a"), timeout=300)))

    def attempt() -> None:
        for _ in pool.map(one, range(24)):
            pass

    return attempt


def logprobs_flood(stack: Clients) -> Callable[[], None]:
    """20 ComputeLogprobs at once, each one input as long as the context allows: scheduled in team-a's share of
    the batch (before, each ran whole and inline on the engine thread, between two of everyone's steps)."""
    _, _, sampler = stack.stubs()
    info = sampler.GetSamplerInfo(sampler_pb2.GetSamplerInfoRequest(), metadata=stack.md("team-a"), timeout=60)
    length, vocab = info.base_model.max_position_embeddings - 1, info.base_model.vocab_size
    pool = concurrent.futures.ThreadPoolExecutor(20)

    def one(seed: int) -> None:
        tokens = [(seed * 7919 + i * 104729) % vocab for i in range(length)]
        request = sampler_pb2.ComputeLogprobsRequest(model="base", inputs=[model_input(tokens)])
        refused(lambda: sampler.ComputeLogprobs(request, metadata=stack.md("team-a"), timeout=600))

    def attempt() -> None:
        for _ in pool.map(one, range(20)):
            pass

    return attempt


def watch_flood(stack: Clients) -> Callable[[], None]:
    registry, _, _ = stack.stubs()

    def attempt() -> None:  # 100 streams open at once, held a moment, then cancelled
        calls = [
            registry.WatchEvents(registry_pb2.WatchEventsRequest(send_snapshot=True), metadata=stack.md("team-a"))
            for _ in range(100)
        ]
        for call in calls:
            with contextlib.suppress(grpc.RpcError):
                next(call)  # the first message (or the refusal) of each
        time.sleep(0.5)
        for call in calls:
            call.cancel()

    return attempt


def many_files(stack: Clients) -> Callable[[], None]:
    registry, _, _ = stack.stubs()
    files = {f"f{i:05d}": b"" for i in range(50_000)}
    return lambda: refused(lambda: upload(registry, files, metadata=stack.md("team-a"), timeout=120))


def padded_batch(stack: Clients, rows: int) -> Callable[[], None]:
    _, trainer, _ = stack.stubs()
    datums = [sft_datum(random_tokens(1, 2048)), *(sft_datum([5, 6]) for _ in range(rows - 1))]
    request = trainer_pb2.ForwardBackwardRequest(adapter="team-a/trained", datums=datums, loss_fn="cross_entropy")
    return lambda: refused(lambda: trainer.ForwardBackward(request, metadata=stack.md("team-a"), timeout=600))


def _sent(call: Callable[[], httpx.Response]) -> None:
    """One abuse attempt over HTTP: its refusal (a 4xx answer) is expected; tests/reliability/test_noisy_gateway.py
    asserts the exact statuses."""
    with contextlib.suppress(httpx.HTTPError):
        call()


def gateway_absurd(clients: Clients) -> Callable[[], None]:
    http = clients.http()
    bodies: list[bytes | dict[str, object]] = [
        asample_body(clients, 1, num_samples=10_000_000),
        asample_body(clients, 1, sampling_params={"max_tokens": 1e12}),
        asample_body(clients, 1, sampling_params={"max_tokens": 4, "top_k": 1e20}),
        asample_body(clients, 1, sampling_params={"max_tokens": 4, "seed": 2**64}),
        ("[" * 100_000 + "]" * 100_000).encode(),
    ]
    turn = iter(range(1 << 62))
    return lambda: _sent(lambda: clients.post(http, "team-a", "asample", bodies[next(turn) % len(bodies)]))


def _inflating_body(model_id: str, seq_id: int, inflated: int) -> bytes:
    """A zstd forward_backward body of a few KB that inflates to ``inflated`` bytes."""
    message = tpb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    message.data.add().model_input.add().encoded_text.tokens = bytes(inflated)
    return bytes(zstandard.ZstdCompressor().compress(message.SerializeToString()))


def gateway_parked(clients: Clients) -> Callable[[], None]:
    """A model of team-a whose seq_id 1 never comes: every attempt sends the next id's 12 MiB body, parked (until
    the model's or the tenant's pending bytes are full, then 429; past the window 400) and failed after the TTL."""
    http = clients.http()
    session = clients.post(http, "team-a", "create_session", {"tags": [], "sdk_version": "0.38.0"}).json()
    created = clients.post(
        http,
        "team-a",
        "create_model",
        {
            "session_id": session["session_id"],
            "model_seq_id": 0,
            "base_model": clients.base_model,
            "lora_config": {"rank": 4, "seed": 1},
        },
    ).json()
    model_id = str(created["model_id"])
    result(clients, http, "team-a", created["request_id"])
    bodies = [_inflating_body(model_id, seq_id, 12 << 20) for seq_id in range(2, 22)]
    turn = iter(range(1 << 62))
    headers = {"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"}
    return lambda: _sent(
        lambda: clients.post(http, "team-a", "forward_backward", bodies[next(turn) % len(bodies)], headers)
    )


def gateway_big_json(clients: Clients) -> Callable[[], None]:
    """asample bodies of 8,000,000 bytes (a 1,000,000-token prompt), parsed (on a worker thread), then refused for
    num_samples."""
    http = clients.http()
    body = asample_body(clients, 1, num_samples=10_000_000)
    body["prompt"] = {"chunks": [{"type": "encoded_text", "tokens": list(range(100_000, 1_100_000))}]}
    raw = json.dumps(body, separators=(", ", ": ")).encode()
    assert len(raw) <= 8 << 20, len(raw)
    return lambda: _sent(lambda: clients.post(http, "team-a", "asample", raw))


ABUSES: dict[str, Callable[[Clients], Callable[[], None]]] = {
    "sampler flood": sampler_flood,
    "exploding adapter": exploding,
    "huge prompt text": huge_prompt,
    "logprobs flood": logprobs_flood,
    "watch flood": watch_flood,
    "many-file upload": many_files,
    "padded batch": lambda clients: padded_batch(clients, 65),
    "limit batch": lambda clients: padded_batch(clients, 64),
    "gateway absurd": gateway_absurd,
    "gateway parked": gateway_parked,
    "gateway 8 MiB JSON": gateway_big_json,
}
