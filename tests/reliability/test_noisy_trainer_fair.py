"""Noisy neighbours, the trainer's per-tenant share: team-a floods the compute queue from many adapters and creates
adapters past its memory quota while team-b runs its normal seeded workload. team-b gets 0 errors and bitwise the
losses and logprobs of a run alone; team-a gets RESOURCE_EXHAUSTED with the precise reason and a message naming
the flag; a refused request changes nothing (no batch recorded, no adapter, no memory held). One registry and one
trainer (tokens on, loopback) for the module."""

from __future__ import annotations

import functools
import json
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
import pytest
from serverproc import ServerProcess, start_registry, start_trainer
from trainerabuse import Tenant, beside, fresh, memory_mib, seeded_training, tenant
from trainerutil import sft_batch

from opentinker.rpc.serving.errors import error_info
from opentinker.v1 import trainer_pb2

T = TypeVar("T")
TENANTS = ("team-a", "team-b")
MAX_QUEUED = 4  # the module's --max-queued-per-tenant (the default is 64)
MAX_MEMORY_MB = 100  # the module's --max-tenant-memory-mb (the default is 16384)
MiB = 1 << 20
LORA_BYTES_PER_PARAM = 16  # float32 weight + gradient + two AdamW moments
REFUSAL_MEMORY_BOUND_MIB = 16  # PSS after the refused creations over before: under one refused adapter (32 MiB)

Answer = tuple[grpc.StatusCode | None, str, str]  # (code, ErrorInfo reason, message)


@dataclass
class Stack:
    registry: ServerProcess
    trainer: ServerProcess
    tenants: dict[str, Tenant]

    def __getitem__(self, who: str) -> Tenant:
        return self.tenants[who]


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("noisy-trainer-fair")
    tokens = {who: f"tok-{who}-{secrets.token_hex(8)}" for who in (*TENANTS, "svc")}
    tokens_file = workdir / "tokens.json"
    tokens_file.write_text(
        json.dumps(
            {
                "tokens": [
                    {"token": token, "tenant": who, "role": "admin" if who == "svc" else "user"}
                    for who, token in tokens.items()
                ]
            }
        )
    )
    registry = start_registry(workdir / "registry", "--tokens-file", str(tokens_file))
    try:
        # --max-serving-rank 0: rank-512 and rank-1024 adapters are created for their memory, never to be served.
        trainer = start_trainer(
            workdir / "trainer",
            tiny_model,
            registry,
            "--tokens-file",
            str(tokens_file),
            "--registry-token",
            tokens["svc"],
            "--max-queued-per-tenant",
            str(MAX_QUEUED),
            "--max-tenant-memory-mb",
            str(MAX_MEMORY_MB),
            "--max-serving-rank",
            "0",
        )
    except BaseException:
        registry.terminate()
        raise
    yield Stack(registry, trainer, {who: tenant(trainer, who, tokens[who]) for who in TENANTS})
    assert {"trainer": trainer.terminate(), "registry": registry.terminate()} == {"trainer": 0, "registry": 0}


@pytest.fixture(scope="module")
def alone(stack: Stack) -> list[float]:
    """team-b's seeded workload with nobody else on the trainer: the reference every abuse test compares to."""
    outputs: list[float] = seeded_training(stack["team-b"], fresh("team-b"))
    return outputs


def answer(call: Callable[[], object]) -> Answer:
    try:
        call()
    except grpc.RpcError as error:
        info = error_info(error)
        return error.code(), info.reason if info is not None else "", str(error.details())
    return None, "", ""


def adapter(who: Tenant, name: str) -> trainer_pb2.TrainingAdapter:
    found: trainer_pb2.TrainingAdapter = who.call(
        "GetAdapter", trainer_pb2.TrainerServiceGetAdapterRequest(name=name)
    ).adapter
    return found


def team_adapters(who: Tenant) -> list[trainer_pb2.TrainingAdapter]:
    request = trainer_pb2.TrainerServiceListAdaptersRequest(prefix=f"{who.name}/")
    return list(who.call("ListAdapters", request).adapters)


# --- the compute queue: team-a's requests from many adapters at once are bounded per tenant ------------------------

FLOOD_ADAPTERS = 8
FLOOD_PER_ADAPTER = 4


def test_queue_flood_from_many_adapters_is_bounded_per_tenant(
    stack: Stack, alone: list[float], figure: Callable[[str, object], None]
) -> None:
    a = stack["team-a"]
    names = [fresh("team-a") for _ in range(FLOOD_ADAPTERS)]
    for seed, name in enumerate(names):
        a.create(name, seed=seed)

    def flood() -> list[tuple[str, Answer]]:
        """All of team-a's ForwardBackwards sent at once (gRPC futures on one channel), then every answer."""
        sent = []
        for index in range(FLOOD_PER_ADAPTER):
            for name in names:
                request = trainer_pb2.ForwardBackwardRequest(
                    adapter=name, datums=sft_batch(200 + index, count=8, length=64), loss_fn="cross_entropy"
                )
                sent.append((name, a.stub.ForwardBackward.future(request, metadata=a.metadata, timeout=120)))
        return [(name, answer(future.result)) for name, future in sent]

    answers = beside(stack["team-b"], flood, alone)
    refused = [(name, got) for name, got in answers if got[0] is not None]
    accepted = [name for name, got in answers if got[0] is None]
    assert refused, "team-a's 32 requests at once never went over its queue limit"
    assert len(accepted) >= MAX_QUEUED  # the first places were all given
    for _, (code, reason, message) in refused:
        assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "TOO_MANY_REQUESTS")
        assert f"--max-queued-per-tenant {MAX_QUEUED}" in message and "'team-a'" in message
    # A refused request changed nothing: each adapter recorded exactly its accepted batches.
    for name in names:
        assert adapter(a, name).pending_batches == accepted.count(name)
    # The places were given back: team-a's next requests are admitted.
    for name in names[:2]:
        a.forward_backward(name, sft_batch(300))
        a.optim_step(name)
    figure(
        "fair share: team-a's flood at once",
        f"{len(answers)} sent from {FLOOD_ADAPTERS} adapters, "
        f"{len(accepted)} run, {len(refused)} refused TOO_MANY_REQUESTS (limit {MAX_QUEUED})",
    )


# --- LoRA memory: team-a's adapters hold at most --max-tenant-memory-mb, weighed before anything is allocated -----


def held_mib(who: Tenant) -> float:
    return sum(found.num_parameters for found in team_adapters(who)) * LORA_BYTES_PER_PARAM / MiB


def test_memory_quota_refuses_before_allocating(
    stack: Stack, alone: list[float], figure: Callable[[str, object], None]
) -> None:
    a, b = stack["team-a"], stack["team-b"]
    held_before = held_mib(a)
    count_before = len(team_adapters(a))

    def fill() -> tuple[list[str], Answer]:
        made: list[str] = []
        while True:  # rank-512 adapters of the tiny model: 16 MiB each (weights, gradients, moments)
            name = fresh("team-a")
            got = answer(functools.partial(a.create, name, rank=512))
            if got[0] is not None:
                return made, got
            made.append(name)
            a.forward_backward(name, sft_batch(3))  # gradients and moments really allocated
            a.optim_step(name)

    made, (code, reason, message) = beside(stack["team-b"], fill, alone)
    per_adapter = 16.0
    assert len(made) == int((MAX_MEMORY_MB - held_before) // per_adapter)
    assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "TENANT_QUOTA")
    held = held_before + len(made) * per_adapter
    assert f"holds {held:.1f} MiB" in message and f"needs {per_adapter:.1f} MiB" in message
    assert f"--max-tenant-memory-mb {MAX_MEMORY_MB}" in message
    assert held_mib(a) == held

    # Bigger refusals (rank 1024: 32 MiB each) leave the trainer's memory and team-a's adapters as they were.
    memory_before = memory_mib(stack.trainer)

    def refused_big() -> list[Answer]:
        return [answer(lambda: a.create(fresh("team-a"), rank=1024)) for _ in range(4)]

    big = beside(stack["team-b"], refused_big, alone)
    assert [got[:2] for got in big] == [(grpc.StatusCode.RESOURCE_EXHAUSTED, "TENANT_QUOTA")] * 4
    assert all("needs 32.0 MiB" in got[2] for got in big)
    memory_after = memory_mib(stack.trainer)
    assert len(team_adapters(a)) == count_before + len(made) and held_mib(a) == held
    assert memory_after <= memory_before + REFUSAL_MEMORY_BOUND_MIB

    b.create(fresh("team-b"), rank=512)  # another tenant's quota is its own
    a.delete(made[0])
    a.create(fresh("team-a"), rank=512)  # deleting gives the quota back
    figure(
        "memory quota: team-a's rank-512 adapters",
        f"{len(made)} of 16 MiB created ({held:.0f} of "
        f"{MAX_MEMORY_MB} MiB held), then refused; PSS around 4 refused rank-1024 creations "
        f"{memory_before:.0f} -> {memory_after:.0f} MiB",
    )
