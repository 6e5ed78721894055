"""Noisy neighbours, with real processes and tokens: team-b's latency while team-a abuses a shared resource, against
team-b alone, side by side in one run (windows alternate alone / during the abuse, order rotated each pair). Target
for every case: team-b's p99 during the abuse <= 3x its p99 alone.

case               shared resource                 team-a (in a loop, several threads)      team-b measures
sampler flood      the sampler's batch (KV slots)  24 x 4 greedy samples of 128 tokens each  a seeded 8-token Sample
exploding adapter  the sampler's batch             samples an adapter whose logits are NaN   a seeded 8-token Sample
huge prompt text   the sampler's event loop        sends 10 MiB prompt_text                  a seeded 8-token Sample
logprobs flood     the sampler's batch             20 concurrent max-length ComputeLogprobs  a seeded 8-token Sample
watch flood        the registry's Redis pool       holds 100 WatchEvents streams open        GetAdapter + Resolve
many-file upload   the registry's event loop       uploads manifests of 50,000 files         GetAdapter + Resolve
padded batch       the trainer's compute thread    ForwardBackward of 65 x 2,047 positions   ForwardBackward, 4 x 32
limit batch        the trainer's compute thread    ForwardBackward at --max-batch-positions   ForwardBackward, 4 x 32
gateway absurd     the gateway's event loop        asample num_samples 10,000,000 & co (400)  asample, 8 tokens (HTTP)
gateway parked     the gateway's memory            forward_backward bodies behind a seq_id   asample, 8 tokens (HTTP)
                                                   gap (12 MiB each inflated; 429/400/expired)
gateway 8 MiB JSON the gateway's event loop        8 MB JSON asample bodies (parsed, 400)     asample, 8 tokens (HTTP)

Every abuse but "sampler flood", "logprobs flood" and "limit batch" is refused by its bound
(tests/reliability/test_noisy_*.py assert the statuses); "sampler flood" and "logprobs flood" (each input a sequence of
the batch, chunked like a prompt) run within team-a's share of the batch (--max-seqs-per-tenant: a free slot goes to
the tenant holding the fewest), and "limit batch" is allowed and runs in micro-batches (--micro-batch-positions), so
team-b's jobs wait for at most one of them. The gateway cases go through a gateway process in front of the servers (a
keys file with both tenants); team-b's call there is the tinker protocol over HTTP: an asample and its retrieve_future.
team-b must see no error in any window.

  .venv/bin/python bench/noisy_neighbours.py [--quick] [--only CASE-PREFIX]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import multiprocessing
import os
import secrets
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import zstandard
from results import record
from workload import (
    ALPHA,
    FULL_SPEC,
    QUICK_SPEC,
    RANK,
    ModelSpec,
    linear_shapes,
    lora_weights,
    model_dir,
    peft_files,
    percentile,
)
from workload import spec_config as model_config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the tests' artifact builders

from overflowutil import overflowing_lora_files
from registryutil import upload
from tinker.proto import tinker_public_pb2 as tpb
from trainerutil import random_tokens, sft_datum

from opentinker.cli.launch import ServerProcess, opentinker_command, start_registry, start_sampler, start_trainer
from opentinker.v1 import (
    common_pb2,
    registry_pb2,
    registry_pb2_grpc,
    sampler_pb2,
    sampler_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)

TARGET = 3.0  # team-b's p99 during the abuse / alone


@dataclass(frozen=True, slots=True)
class Setup:
    pairs: int  # (alone, abuse) window pairs per case
    window_s: float
    abusers: int  # team-a threads
    abuser_nice: int = 0  # team-a's processes' niceness: 19 leaves the servers the cores, as clients on other hosts


FULL = Setup(pairs=3, window_s=6.0, abusers=4)
QUICK = Setup(pairs=2, window_s=2.5, abusers=2)


@dataclass
class Clients:
    """What a client process needs to reach the stack (picklable: team-a's abuse runs in processes of its own, so
    that its Python work does not take the GIL from team-b's timed calls)."""

    registry: str
    trainer: str
    sampler: str
    tokens: dict[str, str]  # principal -> token
    gateway: str = ""  # the gateway's http://host:port
    keys: dict[str, str] | None = None  # tenant -> the gateway API key
    base_model: str = ""  # what an asample through the gateway names

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.gateway, timeout=120)

    def post(
        self,
        http: httpx.Client,
        who: str,
        route: str,
        body: bytes | dict[str, object],
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        assert self.keys is not None
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        sent = {"X-API-Key": self.keys[who], "Content-Type": "application/json", **(headers or {})}
        return http.post(f"/api/v1/{route}", content=content, headers=sent)

    def md(self, who: str) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.tokens[who]}")]

    def stubs(
        self,
    ) -> tuple[
        registry_pb2_grpc.RegistryServiceStub, trainer_pb2_grpc.TrainerServiceStub, sampler_pb2_grpc.SamplerServiceStub
    ]:
        """Stubs on fresh channels (each caller its own, as separate clients would); they live as long as the
        process."""
        options = [("grpc.max_send_message_length", 64 << 20)]
        channels = [grpc.insecure_channel(a, options=options) for a in (self.registry, self.trainer, self.sampler)]
        return (
            registry_pb2_grpc.RegistryServiceStub(channels[0]),
            trainer_pb2_grpc.TrainerServiceStub(channels[1]),
            sampler_pb2_grpc.SamplerServiceStub(channels[2]),
        )


@dataclass
class Stack:
    registry_server: ServerProcess
    trainer_server: ServerProcess
    sampler_server: ServerProcess
    gateway_server: ServerProcess
    clients: Clients

    def stop(self) -> None:
        for server in (self.gateway_server, self.sampler_server, self.trainer_server, self.registry_server):
            try:
                server.terminate()
            except Exception:
                server.kill()


def start(work: Path, model: Path, sampler_args: tuple[str, ...] = ()) -> Stack:
    tokens = {who: f"tok-{who}-{secrets.token_hex(8)}" for who in ("team-a", "team-b", "svc")}
    roles = {"team-a": "user", "team-b": "user", "svc": "admin"}
    entries = [{"token": t, "tenant": who, "role": roles[who]} for who, t in tokens.items()]
    tokens_file = work / "tokens.json"
    tokens_file.write_text(json.dumps({"tokens": entries}))
    auth = ("--tokens-file", str(tokens_file))
    registry = start_registry(work / "registry", *auth)
    service = (*auth, "--registry-token", tokens["svc"])
    trainer = start_trainer(work / "trainer", model, registry, *service)
    sampler = start_sampler(work / "sampler", model, registry, *service, "--max-slots", "4", *sampler_args)
    keys = {who: f"tml-{who}-{secrets.token_hex(8)}" for who in ("team-a", "team-b")}
    keys_file = work / "keys.json"
    keys_file.write_text(
        json.dumps({"keys": [{"key": k, "tenant": who, "token": tokens[who]} for who, k in keys.items()]})
    )
    gateway = ServerProcess(
        opentinker_command(
            "gateway",
            "serve",
            "--trainer",
            trainer.address,
            "--sampler",
            sampler.address,
            "--registry",
            registry.address,
            "--keys-file",
            str(keys_file),
            "--port",
            "0",
            *GATEWAY_FLAGS,
        ),
        work / "gateway",
    )
    clients = Clients(
        registry.address, trainer.address, sampler.address, tokens, f"http://{gateway.address}", keys, str(model)
    )
    return Stack(registry, trainer, sampler, gateway, clients)


# The parked-bodies case reaches its bounds within a window: 16 ids ahead, 64 MiB per model, 128 MiB per tenant,
# parked bodies failed after 5 s (the defaults: 256, 256 MiB, 1 GiB, 300 s).
GATEWAY_FLAGS = (
    "--seq-window",
    "16",
    "--max-pending-bytes",
    str(64 << 20),
    "--max-tenant-pending-bytes",
    str(128 << 20),
    "--pending-ttl-seconds",
    "5",
)


class CallFailed(Exception):
    """team-b's HTTP call through the gateway got an error answer."""


def prompt_of(seed: int) -> common_pb2.ModelInput:
    chunk = common_pb2.ModelInputChunk(encoded_text=common_pb2.EncodedTextChunk(tokens=random_tokens(seed, 24)))
    return common_pb2.ModelInput(chunks=[chunk])


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


def _asample_body(clients: Clients, seed: int, **extra: object) -> dict[str, object]:
    return {
        "base_model": clients.base_model,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": random_tokens(seed, 24)}]},
        "sampling_params": {"max_tokens": 8, "temperature": 1.0, "seed": seed},
        **extra,
    }


def _result(clients: Clients, http: httpx.Client, who: str, request_id: str) -> httpx.Response:
    """retrieve_future until the result is there."""
    while True:
        reply = clients.post(http, who, "retrieve_future", {"request_id": request_id})
        if reply.status_code != 200 or reply.headers["content-type"].startswith("application/x-protobuf"):
            return reply
        if reply.json().get("type") != "try_again":
            return reply


def team_b_gateway(clients: Clients) -> Callable[[int], None]:
    """A seeded 8-token asample through the gateway and its retrieve_future (the tinker protocol)."""
    http = clients.http()

    def call(i: int) -> None:
        sent = clients.post(http, "team-b", "asample", _asample_body(clients, i % 8))
        if sent.status_code != 200:
            raise CallFailed(f"asample: {sent.status_code} {sent.text[:200]}")
        reply = _result(clients, http, "team-b", sent.json()["request_id"])
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
        chunk = common_pb2.ModelInputChunk(encoded_text=common_pb2.EncodedTextChunk(tokens=tokens))
        request = sampler_pb2.ComputeLogprobsRequest(model="base", inputs=[common_pb2.ModelInput(chunks=[chunk])])
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
        _asample_body(clients, 1, num_samples=10_000_000),
        _asample_body(clients, 1, sampling_params={"max_tokens": 1e12}),
        _asample_body(clients, 1, sampling_params={"max_tokens": 4, "top_k": 1e20}),
        _asample_body(clients, 1, sampling_params={"max_tokens": 4, "seed": 2**64}),
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
    _result(clients, http, "team-a", created["request_id"])
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
    body = _asample_body(clients, 1, num_samples=10_000_000)
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


def _abuse_process(case: str, clients: Clients, ready: Any, stop: Any, nice: int) -> None:
    os.nice(nice)
    abuse = ABUSES[case](clients)
    ready.release()
    while not stop.is_set():
        abuse()


def measure(
    workload: Callable[[int], None], case: str | None, clients: Clients, setup: Setup, abusers: int
) -> tuple[list[float], int]:
    """team-b's call latencies over one window, with `abusers` processes running team-a's `case` meanwhile
    (None: alone); and team-b's errors."""
    context = multiprocessing.get_context("spawn")
    stop, ready = context.Event(), context.Semaphore(0)
    work = (case, clients, ready, stop, setup.abuser_nice)
    processes = [context.Process(target=_abuse_process, args=work, daemon=True) for _ in range(abusers if case else 0)]
    for process in processes:
        process.start()
    for _ in processes:
        if not ready.acquire(timeout=120):
            raise TimeoutError("an abuse process did not start")
    latencies: list[float] = []
    errors = 0
    end = time.monotonic() + setup.window_s
    i = 0
    while time.monotonic() < end or not latencies:
        began = time.perf_counter()
        try:
            workload(i)
            latencies.append(time.perf_counter() - began)
        except grpc.RpcError as error:
            print(f"    team-b error: {error.code().name} {error.details()}")
            errors += 1
        except (CallFailed, httpx.HTTPError) as error:
            print(f"    team-b error: {error}")
            errors += 1
        i += 1
    stop.set()
    for process in processes:
        process.join(900)
    return latencies, errors


def run_case(
    name: str,
    workload: Callable[[int], None],
    clients: Clients,
    setup: Setup,
    abusers: int,
    config: dict[str, str | int | float | bool | None],
) -> None:
    alone: list[float] = []
    during: list[float] = []
    errors = 0
    for pair in range(setup.pairs):
        order = (None, name) if pair % 2 == 0 else (name, None)
        for side in order:
            latencies, failed = measure(workload, side, clients, setup, abusers)
            errors += failed
            (during if side else alone).extend(latencies)
    p50a, p99a = percentile(alone, 50), percentile(alone, 99)
    p50d, p99d = percentile(during, 50), percentile(during, 99)
    print(
        f"  {name:18s} team-b alone p50 {p50a * 1e3:7.1f} ms p99 {p99a * 1e3:7.1f} ms ({len(alone)} calls); "
        f"during p50 {p50d * 1e3:7.1f} ms p99 {p99d * 1e3:7.1f} ms ({len(during)} calls); "
        f"errors {errors}"
    )
    record(f"NN {name}: team-b p99 during / alone", p99d / p99a, target=TARGET, comparison="<=", config=config)
    record(f"NN {name}: team-b p50 during / alone", p50d / p50a, config=config)
    record(f"NN {name}: team-b errors", float(errors), target=0, comparison="<=", unit="requests", config=config)


def prepare(stack: Clients, model: Path, spec: ModelSpec) -> None:
    """team-b's adapter in the registry (random weights) and on the trainer; team-a's exploding adapter."""
    registry, trainer, _ = stack.stubs()
    policies = {
        "team-b/policy": (peft_files(lora_weights(linear_shapes(spec), seed=5)), RANK, float(ALPHA)),
        "team-a/exploding": (overflowing_lora_files(model), 4, 4096.0),
    }
    for name, (files, rank, alpha) in policies.items():
        md = stack.md(name.split("/")[0])
        lora = common_pb2.LoraConfig(rank=rank, alpha=alpha)
        registry.CreateAdapter(registry_pb2.CreateAdapterRequest(name=name, lora_config=lora), metadata=md, timeout=60)
        uri = upload(registry, files, metadata=md, timeout=60)
        publish = registry_pb2.PublishVersionRequest(adapter=name, artifact_uri=uri, lora_config=lora)
        registry.PublishVersion(publish, metadata=md, timeout=60)
    for tenant in ("team-a", "team-b"):
        create = trainer_pb2.TrainerServiceCreateAdapterRequest(
            name=f"{tenant}/trained", lora_config=common_pb2.LoraConfig(rank=8)
        )
        trainer.CreateAdapter(create, metadata=stack.md(tenant), timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default="", help="Run only the cases whose name starts with this.")
    parser.add_argument(
        "--sampler-args", default="", help="More `sampler serve` flags, e.g. '--mixed-prefill-tokens 16'."
    )
    parser.add_argument(
        "--abuser-nice", type=int, default=0, help="Niceness of team-a's processes (19: as if on other hosts)."
    )
    args = parser.parse_args()
    setup, spec = (QUICK, QUICK_SPEC) if args.quick else (FULL, FULL_SPEC)
    setup = dataclasses.replace(setup, abuser_nice=args.abuser_nice)
    model = model_dir(spec)
    config: dict[str, str | int | float | bool | None] = {
        **model_config(spec),
        "pairs": setup.pairs,
        "window_s": setup.window_s,
        "abusers": setup.abusers,
        "sampler_args": args.sampler_args,
        "abuser_nice": args.abuser_nice,
    }
    print(
        f"noisy neighbours ({spec.arch} hidden {spec.hidden_size}, {spec.num_hidden_layers} layers; {setup.pairs} x "
        f"{setup.window_s:g} s windows per side; {setup.abusers} team-a threads)"
    )
    with tempfile.TemporaryDirectory(prefix="nn-bench-") as tmp:
        stack = start(Path(tmp), model, tuple(shlex.split(args.sampler_args)))
        try:
            clients = stack.clients
            prepare(clients, model, spec)
            workloads = {
                "sample": team_b_sample(clients),
                "registry": team_b_registry(clients),
                "train": team_b_train(clients),
                "gateway": team_b_gateway(clients),
            }
            warmed = False
            for case, (workload, abusers) in {
                "sampler flood": ("sample", setup.abusers),
                "exploding adapter": ("sample", setup.abusers),
                "huge prompt text": ("sample", setup.abusers),
                "logprobs flood": ("sample", setup.abusers),
                "watch flood": ("registry", 1),
                "many-file upload": ("registry", setup.abusers),
                "padded batch": ("train", setup.abusers),
                "limit batch": ("train", 1),
                "gateway absurd": ("gateway", setup.abusers),
                "gateway parked": ("gateway", setup.abusers),
                "gateway 8 MiB JSON": ("gateway", setup.abusers),
            }.items():
                if args.only and not case.startswith(args.only):
                    continue
                if workload == "gateway" and not warmed:  # the gateway's first calls look up the base model
                    for i in range(5):
                        workloads["gateway"](i)
                    warmed = True
                run_case(case, workloads[workload], clients, setup, abusers, config)
        finally:
            stack.stop()


if __name__ == "__main__":
    main()
