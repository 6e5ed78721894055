"""A real sampler around misuse: edge values, tiny temperatures, unloads in use, full queues, tenants."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from badsampleutil import CONTEXT, INVALID, VOCAB, Published, publish_good, sample_error
from registryutil import unique_name
from samplerutil import (
    Sampler,
    greedy,
    loaded,
    params,
    prompt,
    request,
    run,
    score,
    snapshot,
    stats,
    trained_adapter,
    wait_until,
)
from serverproc import ServerProcess, start_sampler
from tlsutil import Bearer
from trainerutil import Trainer, assert_status, create, rpc_error

from opentinker.v1 import sampler_pb2, sampler_pb2_grpc


@pytest.fixture(scope="module")
def good(trainer: Trainer, sampler: Sampler) -> Published:
    return publish_good(trainer, sampler)


def test_edge_values_are_served_and_release_their_slot(sampler: Sampler, good: Published) -> None:
    """Values at the edge of what is valid: served, and nothing stays held afterwards."""
    top_seed = 2**64 - 1  # seed + sample index must not overflow
    sampling = params(temperature=1.0, seed=top_seed, max_tokens=6)
    first = run(sampler, request(good.ref, good.prompt, sampling, num_samples=3))
    again = run(sampler, request(good.ref, good.prompt, sampling, num_samples=3))
    assert {i: s.tokens for i, s in first.samples.items()} == {i: s.tokens for i, s in again.samples.items()}
    # A temperature so small that logits / temperature overflow float32: the argmax, not a failed engine step.
    tiny = run(sampler, request(good.ref, good.prompt, params(temperature=1e-45, seed=1)))
    assert tiny.only.tokens == good.tokens
    # The whole context: a prompt of context - 1 tokens and one new token.
    edge = run(sampler, request(good.ref, [5] * (CONTEXT - 1), params(max_tokens=1))).only
    assert len(edge.tokens) == 1 and edge.stop_reason == sampler_pb2.STOP_REASON_LENGTH
    # top_k above the vocabulary means no top-k.
    wide = run(sampler, request(good.ref, good.prompt, params(temperature=1.0, seed=3, top_k=10 * VOCAB)))
    assert wide.only.tokens == run(sampler, request(good.ref, good.prompt, params(temperature=1.0, seed=3))).only.tokens
    assert wait_until(lambda: all(a.active_requests == 0 for a in loaded(sampler).values()))


def test_overflowing_temperature_does_not_fail_the_batch(sampler: Sampler, good: Published) -> None:
    """Other sequences in the same steps as a tiny-temperature one complete with their own tokens."""
    long_req = request("base", prompt(1), params(max_tokens=300))
    solo = run(sampler, long_req).only.tokens
    stream = sampler.Sample(long_req, timeout=60)
    first = next(stream)
    tiny = [run(sampler, request(good.ref, good.prompt, params(temperature=1e-45, seed=s))) for s in range(3)]
    assert all(t.only.tokens == good.tokens for t in tiny)
    assert [t for m in [first, *stream] for t in m.tokens] == solo


# --- adapter management ----------------------------------------------------------------------------------------


def test_load_unload_list(sampler: Sampler, good: Published) -> None:
    response: sampler_pb2.LoadAdapterResponse = sampler.LoadAdapter(
        sampler_pb2.LoadAdapterRequest(reference=good.ref, pin=True)
    )
    adapter = response.adapter
    assert adapter.pinned and adapter.slot > 0 and adapter.rank == 4 and adapter.active_requests == 0
    assert (adapter.version.adapter, adapter.version.version) == (good.name, 1)
    assert adapter.version.artifact_sha256 == good.version.artifact_sha256
    listing: sampler_pb2.ListLoadedResponse = sampler.ListLoaded(sampler_pb2.ListLoadedRequest())
    assert listing.slots_total == 8
    assert {a.slot for a in listing.adapters} == {a.slot for a in loaded(sampler).values()}  # one slot each
    assert loaded(sampler)[good.ref].pinned
    # Loading again (by alias, without pin) finds the same slot and keeps the pin.
    again: sampler_pb2.LoadAdapterResponse = sampler.LoadAdapter(sampler_pb2.LoadAdapterRequest(reference=good.name))
    assert again.adapter.slot == adapter.slot and again.adapter.pinned
    assert_status(
        rpc_error(sampler.LoadAdapter, sampler_pb2.LoadAdapterRequest(reference="base")), INVALID, "INVALID_REFERENCE"
    )
    assert greedy(sampler, good.ref, good.prompt) == good.tokens  # a pinned version serves like any other

    unloaded: sampler_pb2.UnloadAdapterResponse = sampler.UnloadAdapter(
        sampler_pb2.UnloadAdapterRequest(reference=good.ref)
    )
    assert unloaded.freed_now and good.ref not in loaded(sampler)
    error = rpc_error(sampler.UnloadAdapter, sampler_pb2.UnloadAdapterRequest(reference=good.ref))
    assert_status(error, grpc.StatusCode.NOT_FOUND, "ADAPTER_NOT_LOADED")
    error = rpc_error(sampler.UnloadAdapter, sampler_pb2.UnloadAdapterRequest(reference=unique_name("nobody")))
    assert_status(error, grpc.StatusCode.NOT_FOUND, "ADAPTER_NOT_FOUND")
    error = rpc_error(sampler.UnloadAdapter, sampler_pb2.UnloadAdapterRequest(reference="base"))
    assert_status(error, INVALID, "INVALID_REFERENCE")
    # Sampling loads it again on demand.
    assert greedy(sampler, good.ref, good.prompt) == good.tokens and good.ref in loaded(sampler)


def test_unload_while_in_use_frees_after_the_last_request(sampler: Sampler, good: Published) -> None:
    long_req = request(good.ref, good.prompt, params(max_tokens=1500))
    solo = run(sampler, long_req).only.tokens
    stream = sampler.Sample(long_req, timeout=60)
    chunks = [next(stream)]
    response: sampler_pb2.UnloadAdapterResponse = sampler.UnloadAdapter(
        sampler_pb2.UnloadAdapterRequest(reference=good.ref)
    )
    assert not response.freed_now
    still = loaded(sampler)[good.ref]
    assert still.active_requests == 1
    chunks.extend(stream)
    assert [t for c in chunks for t in c.tokens] == solo  # the running request kept its weights to the end
    assert wait_until(lambda: good.ref not in loaded(sampler))


# --- a small sampler: 1 sequence at a time, 2 waiting, 2 adapter slots, bearer tokens for two tenants ----------

TOKENS = {"admin": "tok-admin", "team-a": "tok-a", "team-b": "tok-b"}


@pytest.fixture(scope="module")
def small_server(
    tiny_model: Path, registry_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    workdir = tmp_path_factory.mktemp("small-sampler")
    tokens = workdir / "tokens.json"
    entries = [{"token": t, "tenant": n, "role": "admin" if n == "admin" else "user"} for n, t in TOKENS.items()]
    tokens.write_text(json.dumps({"tokens": entries}))
    server = start_sampler(
        workdir,
        tiny_model,
        registry_server,
        "--max-waiting",
        "2",
        "--max-seqs",
        "1",
        "--max-slots",
        "2",
        "--tokens-file",
        str(tokens),
    )
    yield server
    assert server.terminate() == 0, server.log()


@contextlib.contextmanager
def stub_as(server: ServerProcess, who: str) -> Iterator[Sampler]:
    with grpc.insecure_channel(server.address) as channel:
        yield sampler_pb2_grpc.SamplerServiceStub(grpc.intercept_channel(channel, Bearer(TOKENS[who])))


@pytest.fixture(scope="module")
def small(small_server: ServerProcess) -> Iterator[Sampler]:
    with stub_as(small_server, "admin") as stub:
        yield stub


def test_full_waiting_queue_is_resource_exhausted(small: Sampler, good: Published) -> None:
    running = small.Sample(request("base", prompt(1), params(max_tokens=CONTEXT - 10)), timeout=60)
    next(running)
    waiting = [small.Sample(request(good.ref, good.prompt), timeout=60) for _ in range(2)]
    assert wait_until(lambda: stats(small).waiting_requests == 2), stats(small)
    error = sample_error(small, request("base", [1, 2, 3]))
    assert_status(error, grpc.StatusCode.RESOURCE_EXHAUSTED, "QUEUE_FULL")
    running.cancel()
    for stream in waiting:  # they run once the long one is gone, with the right tokens
        assert [t for m in stream for t in m.tokens] == good.tokens
    # More samples in one request than the queue holds: refused at once, even when idle.
    assert wait_until(lambda: stats(small).running_requests == 0)
    error = sample_error(small, request("base", [1, 2, 3], num_samples=3))
    assert_status(error, grpc.StatusCode.RESOURCE_EXHAUSTED, "QUEUE_FULL")
    assert greedy(small, good.ref, good.prompt) == good.tokens


def test_no_free_slot_when_every_slot_is_pinned(small: Sampler, trainer: Trainer, good: Published) -> None:
    others = [trained_adapter(trainer, seed=320 + i)[0] for i in range(2)]
    for name in others:
        small.LoadAdapter(sampler_pb2.LoadAdapterRequest(reference=f"{name}@1", pin=True))
    assert {a.pinned for a in loaded(small).values()} == {True} and len(loaded(small)) == 2
    failures = stats(small).reload_failures_total
    error = sample_error(small, request(good.ref, good.prompt))
    assert_status(error, grpc.StatusCode.RESOURCE_EXHAUSTED, "NO_FREE_SLOT")
    error = rpc_error(small.LoadAdapter, sampler_pb2.LoadAdapterRequest(reference=good.ref))
    assert_status(error, grpc.StatusCode.RESOURCE_EXHAUSTED, "NO_FREE_SLOT")
    assert stats(small).reload_failures_total == failures + 2
    assert set(loaded(small)) == {f"{n}@1" for n in others}
    # The base model needs no slot.
    assert run(small, request("base", [1, 2, 3])).only.stop_reason == sampler_pb2.STOP_REASON_LENGTH
    # Unpinning (unload) one makes room; the idle unpinned one is then evicted for the next version.
    small.UnloadAdapter(sampler_pb2.UnloadAdapterRequest(reference=f"{others[0]}@1"))
    assert greedy(small, good.ref, good.prompt) == good.tokens
    assert set(loaded(small)) == {f"{others[1]}@1", good.ref}
    small.UnloadAdapter(sampler_pb2.UnloadAdapterRequest(reference=f"{others[1]}@1"))
    assert all(a.active_requests == 0 for a in loaded(small).values())


def test_tenants_see_and_touch_only_their_own_adapters(
    small_server: ServerProcess, small: Sampler, trainer: Trainer
) -> None:
    own = create(trainer, f"team-a/{unique_name('own')}", seed=330).name
    snapshot(trainer, own)
    p = prompt(330)
    with stub_as(small_server, "team-a") as team_a, stub_as(small_server, "team-b") as team_b:
        assert len(greedy(team_a, f"{own}@1", p)) == 12
        team_a.LoadAdapter(sampler_pb2.LoadAdapterRequest(reference=f"{own}@1"))
        for call in (
            lambda: greedy(team_b, f"{own}@1", p),
            lambda: score(team_b, f"{own}@1", p),
            lambda: team_b.LoadAdapter(sampler_pb2.LoadAdapterRequest(reference=f"{own}@1", pin=True)),
            lambda: team_b.UnloadAdapter(sampler_pb2.UnloadAdapterRequest(reference=f"{own}@1")),
        ):
            assert_status(rpc_error(call), grpc.StatusCode.PERMISSION_DENIED, "PERMISSION_DENIED")
        assert f"{own}@1" in loaded(team_a) and f"{own}@1" in loaded(small)  # the owner and the admin see it
        assert f"{own}@1" not in loaded(team_b)  # another tenant does not learn it exists
        assert len(greedy(team_b, "base", p)) == 12  # the base model is everyone's
    with grpc.insecure_channel(small_server.address) as channel:
        anonymous = sampler_pb2_grpc.SamplerServiceStub(channel)
        error = rpc_error(anonymous.ListLoaded, sampler_pb2.ListLoadedRequest())
        assert_status(error, grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
    small.UnloadAdapter(sampler_pb2.UnloadAdapterRequest(reference=f"{own}@1"))
