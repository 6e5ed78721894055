"""Noisy neighbours, the trainer's part: team-a abuses the trainer while team-b runs its normal seeded workload
at the same time. team-b gets 0 errors and the same outputs as a run alone; team-a gets a precise status;
the trainer's memory after the abuse stays within a stated bound of before. One registry and one trainer
(tokens on, loopback) for the whole module."""

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
import torch
import trainerutil
from safetensors.torch import load, save
from serverproc import ServerProcess, registry_store, start_registry, start_trainer
from trainerabuse import (
    Refusal,
    Tenant,
    _snapshot,
    beside,
    fresh,
    memory_mib,
    micro_groups,
    padded,
    refusal,
    seeded_training,
    status,
    team_adapters,
    tenant,
)
from trainerutil import assert_same, random_tokens, read_state, sft_batch, sft_datum

from opentinker.client import Datum, LoraConfig, ModelInput, ServiceClient
from opentinker.v1 import trainer_pb2
from opentinker.weights.artifact_store import ArtifactStore

T = TypeVar("T")
TENANTS = ("team-a", "team-b")
ADMIN = "ops"
MEMORY_BOUND_MIB = 64  # the trainer's PSS after an abuse, over its PSS before


@dataclass
class Stack:
    registry: ServerProcess
    trainer: ServerProcess
    store: Path
    tenants: dict[str, Tenant]

    def __getitem__(self, who: str) -> Tenant:
        return self.tenants[who]


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("noisy-trainer")
    tokens = {who: f"tok-{who}-{secrets.token_hex(8)}" for who in (*TENANTS, ADMIN, "svc")}
    roles = {ADMIN: "admin", "svc": "admin"}
    tokens_file = workdir / "tokens.json"
    tokens_file.write_text(
        json.dumps(
            {
                "tokens": [
                    {"token": token, "tenant": who, "role": roles.get(who, "user")} for who, token in tokens.items()
                ]
            }
        )
    )
    registry = start_registry(workdir / "registry", "--tokens-file", str(tokens_file))
    try:
        # --max-serving-rank 0: case 11 creates rank-512 adapters for their memory, never to serve them.
        trainer = start_trainer(
            workdir / "trainer",
            tiny_model,
            registry,
            "--tokens-file",
            str(tokens_file),
            "--registry-token",
            tokens["svc"],
            "--max-adapters-per-tenant",
            str(QUOTA),
            "--micro-batch-positions",
            str(MICRO),
            "--max-serving-rank",
            "0",
        )
    except BaseException:
        registry.terminate()
        raise
    tenants = {who: tenant(trainer, who, tokens[who]) for who in (*TENANTS, ADMIN)}
    yield Stack(registry, trainer, registry_store(registry), tenants)
    assert {"trainer": trainer.terminate(), "registry": registry.terminate()} == {"trainer": 0, "registry": 0}


@pytest.fixture(scope="module")
def alone(stack: Stack) -> list[float]:
    """team-b's seeded workload with nobody else on the trainer: the reference every abuse test compares to."""
    outputs: list[float] = seeded_training(stack["team-b"], fresh("team-b"))
    return outputs


# --- case 1: an optimizer step that blows the weights up is undone and refused ---------------------------------


def test_exploding_step_is_undone_and_refused(
    stack: Stack, alone: list[float], figure: Callable[[str, object], None]
) -> None:
    a = stack["team-a"]
    name = fresh("team-a")
    a.create(name, seed=3)
    a.forward_backward(name, sft_batch(1, count=3))
    before_id = a.save_state(name)
    before_logprobs = a.forward_logprobs(name, sft_batch(5))
    memory_before = memory_mib(stack.trainer)

    def abuse() -> list[tuple[grpc.StatusCode | None, str]]:
        steps = [(1e30, 0.0), (1e12, 0.0), (3e38, 0.0), (1e30, 1e-3)]  # (learning rate, grad clip norm)
        return [status(functools.partial(a.optim_step, name, lr=lr, clip=clip)) for lr, clip in steps]

    refused = beside(stack["team-b"], abuse, alone)
    assert refused == [(grpc.StatusCode.FAILED_PRECONDITION, "WEIGHTS_OUT_OF_RANGE")] * 4
    # Bitwise as before: weights, gradients, AdamW moments, step, ledger (the state artifact is content-addressed).
    after_id = a.save_state(name)
    assert_same(read_state(stack.store, before_id).weights, read_state(stack.store, after_id).weights)
    assert_same(read_state(stack.store, before_id).grads, read_state(stack.store, after_id).grads)
    assert read_state(stack.store, before_id).meta == read_state(stack.store, after_id).meta
    assert after_id == before_id
    assert a.forward_logprobs(name, sft_batch(5)) == before_logprobs
    # The adapter still trains (its pending gradients were kept) and snapshots at a sane learning rate.
    assert a.optim_step(name).step == 1
    assert a.call("SaveSnapshot", trainer_pb2.SaveSnapshotRequest(adapter=name)).version.version == 1
    memory_after = memory_mib(stack.trainer)
    figure("case 1 trainer PSS before/after exploding steps (MiB)", f"{memory_before:.0f} -> {memory_after:.0f}")
    assert memory_after <= memory_before + MEMORY_BOUND_MIB


def test_snapshot_refuses_out_of_range_weights_of_a_loaded_state(stack: Stack) -> None:
    """A state whose weights break the rule (written elsewhere, here by hand into the store) loads, but cannot be
    snapshotted: SaveSnapshot answers FAILED_PRECONDITION WEIGHTS_OUT_OF_RANGE and publishes nothing."""
    a = stack["team-a"]
    name = fresh("team-a")
    a.create(name)
    saved = trainerutil.artifact_dir(stack.store, a.save_state(name))
    files = {p.name: p.read_bytes() for p in saved.iterdir() if p.name != "manifest.json"}
    weights = load(files["weights.safetensors"])
    weights = {key: torch.full_like(value, 3e38) for key, value in weights.items()}
    files["weights.safetensors"] = save(weights)
    forged = ArtifactStore(stack.store).commit_files(files).uri
    a.call("LoadState", trainer_pb2.LoadStateRequest(adapter=name, state_id=forged))
    refused = status(lambda: a.call("SaveSnapshot", trainer_pb2.SaveSnapshotRequest(adapter=name)))
    assert refused == (grpc.StatusCode.FAILED_PRECONDITION, "WEIGHTS_OUT_OF_RANGE")
    assert (
        a.call("GetAdapter", trainer_pb2.TrainerServiceGetAdapterRequest(name=name)).adapter.last_snapshot_version == 0
    )


# --- case 7: a state resumed into another adapter trains and snapshots from that adapter's own history ---------


def test_resumed_state_snapshots_in_its_own_history(stack: Stack, alone: list[float]) -> None:
    a = stack["team-a"]
    source, copy = fresh("team-a"), fresh("team-a")

    def resume_and_snapshot() -> list[tuple[int, int]]:
        a.create(source, seed=1)
        versions = []
        for step in range(2):  # the source has versions 1 and 2: the copy must not take 2 as its parent
            a.forward_backward(source, sft_batch(10 + step))
            a.optim_step(source)
            versions.append(_snapshot(a, source))
        state_id = a.save_state(source)
        created = a.create(copy, resume_state=state_id)
        assert created.step == 2 and created.last_snapshot_version == 0
        for step in range(2):
            a.forward_backward(copy, sft_batch(20 + step))
            a.optim_step(copy)
            versions.append(_snapshot(a, copy))
        return versions

    versions = beside(stack["team-b"], resume_and_snapshot, alone)
    assert versions == [(1, 0), (2, 1), (1, 0), (2, 1)]


def test_resume_into_another_adapter_through_the_sdk(stack: Stack) -> None:
    """The SDK's create_training_client(..., resume_state=...) on a state of another adapter: trains, snapshots."""
    token = stack["team-a"].metadata[0][1].removeprefix("Bearer ")
    datums = [
        Datum(
            model_input=ModelInput.from_ints([5, 6, 7, 8]),
            loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [1.0] * 4},
        )
    ]
    with ServiceClient(stack.trainer.address, token=token, timeout=120) as client:
        source = client.create_training_client(fresh("team-a"), LoraConfig(rank=4), seed=2)
        source.forward_backward(datums)
        source.optim_step()
        assert source.save_snapshot().number == 1
        resumed = client.create_training_client(
            fresh("team-a"), LoraConfig(rank=4), resume_state=source.save_state().state_id
        )
        resumed.forward_backward(datums)
        assert resumed.optim_step().step == 2
        first, second = resumed.save_snapshot(), resumed.save_snapshot()
        assert (first.number, second.number) == (1, 2)


# --- case 8: another tenant's saved states and versions are unreachable, and their existence is not revealed ----


def test_states_and_versions_of_another_tenant_are_unreachable(stack: Stack, alone: list[float]) -> None:
    a, b, admin = stack["team-a"], stack["team-b"], stack[ADMIN]
    victim = fresh("team-b")
    b.create(victim, seed=4)
    b.forward_backward(victim, sft_batch(30))
    b.optim_step(victim)
    b.call("SaveSnapshot", trainer_pb2.SaveSnapshotRequest(adapter=victim))
    stolen = b.save_state(victim)
    attacker = fresh("team-a")
    a.create(attacker, seed=5)
    before = a.save_state(attacker)
    nowhere = "sha256:" + "0" * 64

    def load(state_id: str) -> Callable[[], object]:
        return lambda: a.call("LoadState", trainer_pb2.LoadStateRequest(adapter=attacker, state_id=state_id))

    def abuse() -> dict[str, tuple[Refusal, Refusal]]:
        return {
            "LoadState": (refusal(load(stolen), stolen), refusal(load(nowhere), nowhere)),
            "resume_state": (
                refusal(lambda: a.create(fresh("team-a"), resume_state=stolen), stolen),
                refusal(lambda: a.create(fresh("team-a"), resume_state=nowhere), nowhere),
            ),
            "init_from": (
                refusal(lambda: a.create(fresh("team-a"), init_from=f"{victim}@1"), victim),
                refusal(lambda: a.create(fresh("team-a"), init_from="team-b/no-such@1"), "team-b/no-such"),
            ),
        }

    answers = beside(stack["team-b"], abuse, alone)
    for what, (theirs, missing) in answers.items():
        assert theirs == missing, f"{what}: another tenant's answer differs from a missing one's: {theirs} {missing}"
    assert answers["LoadState"][0][:2] == (grpc.StatusCode.NOT_FOUND, "STATE_NOT_FOUND")
    assert answers["resume_state"][0][:2] == (grpc.StatusCode.NOT_FOUND, "STATE_NOT_FOUND")
    assert answers["init_from"][0][:2] == (grpc.StatusCode.PERMISSION_DENIED, "PERMISSION_DENIED")
    assert a.save_state(attacker) == before  # nothing of team-b's reached team-a's adapter
    assert read_state(stack.store, stolen).meta["owner"] == "team-b"
    # The owner and an admin still may.
    b.create(fresh("team-b"), resume_state=stolen)
    admin.create(fresh(ADMIN), resume_state=stolen)
    a.call("LoadState", trainer_pb2.LoadStateRequest(adapter=attacker, state_id=before))


# --- case 3: padding counts: a batch is limited in padded positions (datums x longest), not only real tokens ---

DEFAULT_MAX_BATCH_POSITIONS = 131072  # the trainer's --max-batch-positions default (64 x 2048)


def test_padded_batches_are_bounded(stack: Stack, alone: list[float], figure: Callable[[str, object], None]) -> None:
    a = stack["team-a"]
    name = fresh("team-a")
    a.create(name)
    memory_before = memory_mib(stack.trainer)
    too_wide = (DEFAULT_MAX_BATCH_POSITIONS // 2047) + 1  # 65 rows of 2,047: just over the default

    def abuse() -> list[tuple[grpc.StatusCode | None, str]]:
        answers = []
        for short in (too_wide - 1, 4095):  # 65 and 4,096 datums: only 2,111 and 6,142 real tokens
            answers.append(status(functools.partial(a.forward_backward, name, padded(short))))
            request = trainer_pb2.ForwardRequest(adapter=name, datums=padded(short), loss_fn="cross_entropy")
            answers.append(status(functools.partial(a.call, "Forward", request)))
        return answers

    answers = beside(stack["team-b"], abuse, alone)
    assert answers == [(grpc.StatusCode.RESOURCE_EXHAUSTED, "BATCH_TOO_LARGE")] * 4
    adapter = a.call("GetAdapter", trainer_pb2.TrainerServiceGetAdapterRequest(name=name)).adapter
    assert adapter.pending_batches == 0 and adapter.tokens_trained == 0  # refused before anything was computed
    memory_after = memory_mib(stack.trainer)
    figure("case 3 trainer PSS before/after padded batches (MiB)", f"{memory_before:.0f} -> {memory_after:.0f}")
    assert memory_after <= memory_before + MEMORY_BOUND_MIB


# --- case 11: a tenant's adapters are bounded in number, and deleting them gives the memory back ---------------

QUOTA = 24  # the module's --max-adapters-per-tenant (the default is 64)


def test_adapter_quota_and_memory_after_delete(
    stack: Stack, alone: list[float], figure: Callable[[str, object], None]
) -> None:
    a = stack["team-a"]
    memory_before = memory_mib(stack.trainer)
    held_before = len(team_adapters(a))

    def abuse() -> tuple[list[str], tuple[grpc.StatusCode | None, str]]:
        made: list[str] = []
        while True:  # rank-512 adapters, each trained once (weights, gradients, moments: ~16 MB each)
            name = fresh("team-a")
            answer = status(functools.partial(a.create, name, rank=512))
            if answer[0] is not None:
                return made, answer
            made.append(name)
            a.forward_backward(name, sft_batch(3))
            a.optim_step(name)

    made, refused = beside(stack["team-b"], abuse, alone)
    assert refused == (grpc.StatusCode.RESOURCE_EXHAUSTED, "TENANT_QUOTA")
    assert len(made) == QUOTA - held_before and len(team_adapters(a)) == QUOTA
    memory_full = memory_mib(stack.trainer)
    stack["team-b"].create(fresh("team-b"))  # another tenant's quota is its own
    stack[ADMIN].create(fresh("team-a"))  # admins are not counted
    token = a.metadata[0][1].removeprefix("Bearer ")
    with ServiceClient(stack.trainer.address, token=token, timeout=120) as client:
        client.delete_training_adapter(made[0])  # through the SDK too
    for name in made[1:]:
        a.delete(name)
    a.create(fresh("team-a"))  # a place is free again
    memory_after = memory_mib(stack.trainer)
    figure(
        "case 11 trainer PSS before / with the quota's adapters / after deleting them (MiB)",
        f"{memory_before:.0f} / {memory_full:.0f} / {memory_after:.0f} ({len(made)} rank-512 adapters)",
    )
    assert memory_full > memory_before + len(made) * 8  # the adapters did take memory ...
    assert memory_after <= memory_before + MEMORY_BOUND_MIB  # ... and gave it back


# --- case 3, part two: a big request runs in micro-batches, and computes what separate requests would -----------

MICRO = 4096  # the module's --micro-batch-positions (also the default)
LENGTHS = [700, 300, 900, 50, 1000, 400, 800, 200, 600, 100, 500, 1000]  # 12 x 1000 padded: over MICRO


def test_big_request_runs_in_micro_batches(
    stack: Stack, alone: list[float], figure: Callable[[str, object], None]
) -> None:
    a = stack["team-a"]
    whole, parted = fresh("team-a"), fresh("team-a")
    for name in (whole, parted):
        a.create(name, seed=11)
    datums = [sft_datum(random_tokens(50 + i, n + 1)) for i, n in enumerate(LENGTHS)]
    groups = micro_groups(LENGTHS, MICRO)
    assert len(groups) > 2
    memory_before = memory_mib(stack.trainer)

    def big_and_parts() -> tuple[trainer_pb2.ForwardBackwardResponse, list[trainer_pb2.ForwardBackwardResponse]]:
        big = a.forward_backward(whole, datums)  # one request: the trainer splits it
        parts = [a.forward_backward(parted, [datums[i] for i in group]) for group in groups]
        return big, parts

    big, parts = beside(stack["team-b"], big_and_parts, alone)
    assert [list(o.tensors["logprobs"].float32_values) for o in big.loss_fn_outputs] == [
        list(o.tensors["logprobs"].float32_values) for p in parts for o in p.loss_fn_outputs
    ]
    for key in ("loss:sum", "weights:sum", "tokens:sum", "datums:sum"):
        assert big.metrics[key] == sum(p.metrics[key] for p in parts), key
    assert a.forward_logprobs(whole, datums) == [
        row for g in groups for row in a.forward_logprobs(parted, [datums[i] for i in g])
    ]
    a.optim_step(whole)
    a.optim_step(parted)
    saved = [read_state(stack.store, a.save_state(name)) for name in (whole, parted)]
    assert_same(saved[0].weights, saved[1].weights)  # gradient accumulation over the parts: bitwise the same step
    assert_same(saved[0].optimizer, saved[1].optimizer)
    assert len(saved[0].meta["ledger"]["batches"]) == 1  # one request, one batch in the ledger
    memory_after = memory_mib(stack.trainer)
    figure(
        "case 3 micro-batches",
        f"{len(LENGTHS)} datums, {len(LENGTHS) * max(LENGTHS)} padded positions -> "
        f"{len(groups)} parts of <= {MICRO}; PSS {memory_before:.0f} -> {memory_after:.0f} MiB",
    )
    assert memory_after <= memory_before + MEMORY_BOUND_MIB
