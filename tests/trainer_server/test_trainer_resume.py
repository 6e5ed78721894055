"""Exact resume: a state saved by a trainer that is then SIGKILLed, restored into a new trainer process, trains
on bitwise as if never interrupted (weights, AdamW moments, step, RNG of dropout, pending gradients)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from registryutil import unique_name
from serverproc import ServerProcess, registry_store, start_trainer
from trainerutil import (
    Trainer,
    assert_same,
    assert_same_training,
    assert_status,
    create,
    forward_backward,
    get_adapter,
    lora,
    optim_step,
    read_state,
    rpc_error,
    save_state,
    sft_batch,
    state_of,
    train_step,
)

from opentinker.v1 import common_pb2, registry_pb2, registry_pb2_grpc, trainer_pb2, trainer_pb2_grpc

N, M = 3, 3
SEED = 41
CONFIG = lora(rank=4, alpha=8.0, dropout=0.1)  # dropout: the resumed RNG must continue the same masks


def data(step: int) -> list[common_pb2.Datum]:
    return sft_batch(seed=400 + step, count=2, length=12)


@dataclass
class Saved:
    name: str
    state_id: str
    losses: list[tuple[float, float]]


@dataclass
class Resumed:
    store: Path
    trainer: Trainer
    full: Saved  # saved after N full steps, resumed with CreateAdapter(resume_state=...)
    pending: Saved  # saved after N steps plus one ForwardBackward, resumed with CreateAdapter + LoadState
    killed: ServerProcess


def steps(trainer: Trainer, name: str, first: int, last: int) -> list[tuple[float, float]]:
    out = []
    for step in range(first, last):
        loss, response = train_step(trainer, name, data(step))
        assert response.step == step + 1
        out.append((loss, response.metrics["grad_norm:value"]))
    return out


@pytest.fixture(scope="module")
def resumed(
    tiny_model: Path, registry_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Resumed]:
    """Two adapters trained and saved on a first trainer process, which is then SIGKILLed; a second process."""
    workdir = tmp_path_factory.mktemp("resume")
    first = start_trainer(workdir / "first", tiny_model, registry_server)
    try:
        with grpc.insecure_channel(first.address) as channel:
            stub = trainer_pb2_grpc.TrainerServiceStub(channel)
            full, pending = unique_name("full"), unique_name("pending")
            create(stub, full, seed=SEED, config=CONFIG)
            create(stub, pending, seed=SEED, config=CONFIG)
            saved_full = Saved(full, "", steps(stub, full, 0, N))
            saved_full.state_id = save_state(stub, full)
            saved_pending = Saved(pending, "", steps(stub, pending, 0, N))
            loss = forward_backward(stub, pending, data(N)).metrics["loss:sum"]
            saved_pending.state_id = save_state(stub, pending)
            saved_pending.losses.append((loss, 0.0))
            # Work after the save is lost with the process.
            steps(stub, full, N, N + 1)
    finally:
        first.kill()  # SIGKILL: no shutdown hook runs
    assert first.process.returncode == -signal.SIGKILL

    second = start_trainer(workdir / "second", tiny_model, registry_server)
    try:
        with grpc.insecure_channel(second.address) as channel:
            yield Resumed(
                registry_store(registry_server),
                trainer_pb2_grpc.TrainerServiceStub(channel),
                saved_full,
                saved_pending,
                first,
            )
    finally:
        assert second.terminate() == 0, second.log()


def test_resume_state_continues_bitwise(resumed: Resumed) -> None:
    trainer, saved = resumed.trainer, resumed.full
    adapter = create(trainer, saved.name, seed=SEED, config=CONFIG, attach_existing=True, resume_state=saved.state_id)
    assert adapter.step == N and adapter.pending_batches == 0 and adapter.datums_trained == 2 * N
    late = steps(trainer, saved.name, N, N + M)

    reference = create(trainer, seed=SEED, config=CONFIG).name
    uninterrupted = steps(trainer, reference, 0, N + M)
    assert uninterrupted[:N] == saved.losses  # the first process computed exactly the same
    assert late == uninterrupted[N:]  # losses and gradient norms of the last M steps, exactly
    got, want = get_adapter(trainer, saved.name), get_adapter(trainer, reference)
    assert (got.step, got.tokens_trained, got.datums_trained) == (want.step, want.tokens_trained, want.datums_trained)
    assert got.step == N + M
    assert_same_training(state_of(trainer, resumed.store, saved.name), state_of(trainer, resumed.store, reference))


def test_load_state_restores_pending_gradients(resumed: Resumed) -> None:
    trainer, saved = resumed.trainer, resumed.pending
    create(trainer, saved.name, seed=SEED + 1, config=CONFIG, attach_existing=True)  # another seed: overwritten
    response: trainer_pb2.LoadStateResponse = trainer.LoadState(
        trainer_pb2.LoadStateRequest(adapter=saved.name, state_id=saved.state_id)
    )
    assert response.adapter.step == N and response.adapter.pending_batches == 1
    first = optim_step(trainer, saved.name)  # applies the gradients computed before the kill
    late = [(saved.losses[N][0], first.metrics["grad_norm:value"]), *steps(trainer, saved.name, N + 1, N + M)]

    reference = create(trainer, seed=SEED, config=CONFIG).name
    uninterrupted = steps(trainer, reference, 0, N + M)
    assert uninterrupted[:N] == saved.losses[:N]
    assert late == uninterrupted[N:]
    assert_same_training(state_of(trainer, resumed.store, saved.name), state_of(trainer, resumed.store, reference))


def test_load_state_weights_only_starts_a_fresh_optimizer(resumed: Resumed) -> None:
    """weights_only takes the saved LoRA weights alone: no gradients, fresh AdamW moments, the adapter's own step."""
    trainer, saved = resumed.trainer, resumed.pending
    name = create(trainer, seed=SEED + 2, config=CONFIG).name
    steps(trainer, name, 0, 1)  # moments and a step of its own, which the load must clear / keep
    response: trainer_pb2.LoadStateResponse = trainer.LoadState(
        trainer_pb2.LoadStateRequest(adapter=name, state_id=saved.state_id, weights_only=True)
    )
    assert response.adapter.step == 1 and response.adapter.pending_batches == 0
    assert_status(rpc_error(optim_step, trainer, name), grpc.StatusCode.FAILED_PRECONDITION, "NO_GRADIENTS")
    loaded, source = state_of(trainer, resumed.store, name), read_state(resumed.store, saved.state_id)
    assert_same(loaded.weights, source.weights, "weights")
    assert loaded.optimizer["state"] == {} and source.optimizer["state"]
    _, stepped = train_step(trainer, name, data(N))  # training goes on from the loaded weights
    assert stepped.step == 2 and state_of(trainer, resumed.store, name).optimizer["state"]


def test_bad_states_are_refused_and_change_nothing(
    resumed: Resumed, registry: registry_pb2_grpc.RegistryServiceStub
) -> None:
    trainer, store = resumed.trainer, resumed.store
    name = create(trainer, seed=SEED, config=CONFIG).name
    train_step(trainer, name, data(0))
    forward_backward(trainer, name, data(1))  # pending gradients must survive too
    snapshot: trainer_pb2.SaveSnapshotResponse = trainer.SaveSnapshot(trainer_pb2.SaveSnapshotRequest(adapter=name))
    before = state_of(trainer, store, name)

    def load(state_id: str) -> object:
        return trainer.LoadState(trainer_pb2.LoadStateRequest(adapter=name, state_id=state_id))

    assert_status(rpc_error(load, "sha256:" + "0" * 64), grpc.StatusCode.NOT_FOUND, "STATE_NOT_FOUND")
    assert_status(rpc_error(load, "not-a-state"), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARTIFACT_URI")
    error = rpc_error(load, snapshot.version.artifact_uri)  # an artifact, but a snapshot, not a state
    assert_status(error, grpc.StatusCode.NOT_FOUND, "STATE_NOT_FOUND")
    # A state of another LoRA shape does not fit.
    other = create(trainer, seed=SEED, config=lora(rank=2)).name
    error = rpc_error(load, save_state(trainer, other))
    assert_status(error, grpc.StatusCode.FAILED_PRECONDITION, "INCOMPATIBLE_STATE")
    after = state_of(trainer, store, name)
    assert_same_training(before, after)
    assert_same(before.meta, after.meta)

    # CreateAdapter with a state that does not exist leaves no adapter behind, in the trainer or the registry.
    fresh = unique_name("fresh")
    request = trainer_pb2.TrainerServiceCreateAdapterRequest(
        name=fresh, lora_config=CONFIG, seed=SEED, resume_state="sha256:" + "1" * 64
    )
    assert_status(rpc_error(trainer.CreateAdapter, request), grpc.StatusCode.NOT_FOUND, "STATE_NOT_FOUND")
    error = rpc_error(trainer.GetAdapter, trainer_pb2.TrainerServiceGetAdapterRequest(name=fresh))
    assert_status(error, grpc.StatusCode.NOT_FOUND, "ADAPTER_NOT_FOUND")
    error = rpc_error(registry.GetAdapter, registry_pb2.GetAdapterRequest(name=fresh))
    assert_status(error, grpc.StatusCode.NOT_FOUND, "ADAPTER_NOT_FOUND")
    request.resume_state = save_state(trainer, other)  # exists, but another LoRA config
    assert_status(rpc_error(trainer.CreateAdapter, request), grpc.StatusCode.FAILED_PRECONDITION, "INCOMPATIBLE_STATE")
    error = rpc_error(registry.GetAdapter, registry_pb2.GetAdapterRequest(name=fresh))
    assert_status(error, grpc.StatusCode.NOT_FOUND, "ADAPTER_NOT_FOUND")
