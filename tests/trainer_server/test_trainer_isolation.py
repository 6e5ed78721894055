"""Adapters on one trainer are isolated: one adapter's requests never change another's weights, gradients,
AdamW state, step or RNG, and interleaving two adapters' training changes neither result."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from serverproc import ServerProcess, registry_store
from trainerutil import (
    Trainer,
    assert_same,
    assert_same_training,
    create,
    forward_backward,
    get_adapter,
    lora,
    optim_step,
    read_state,
    save_state,
    sft_batch,
    snapshot_weights,
    state_of,
    train_step,
)

from opentinker.v1 import common_pb2, trainer_pb2

STEPS = 6
# Different shapes, dropout on (so each adapter's RNG matters), different data.
CONFIG_A = lora(rank=4, alpha=8.0, dropout=0.1)
CONFIG_B = lora(rank=8, alpha=8.0, dropout=0.2, targets=["attn"])


@pytest.fixture(scope="module")
def store(registry_server: ServerProcess) -> Path:
    return registry_store(registry_server)


def data_a(step: int) -> list[common_pb2.Datum]:
    return sft_batch(seed=100 + step, count=2, length=14)


def data_b(step: int) -> list[common_pb2.Datum]:
    return sft_batch(seed=200 + step, count=3, length=10)


Data = Callable[[int], list[common_pb2.Datum]]


def run(
    trainer: Trainer, name: str, data: Data, steps: int = STEPS, barrier: threading.Barrier | None = None
) -> list[tuple[float, float]]:
    """`steps` train steps; returns (loss, grad_norm) of each. With a barrier, threads run steps in lockstep."""
    out = []
    for step in range(steps):
        if barrier is not None:
            barrier.wait(timeout=30)
        loss, response = train_step(trainer, name, data(step))
        assert response.step == step + 1
        out.append((loss, response.metrics["grad_norm:value"]))
    return out


def snapshot_uri(trainer: Trainer, name: str) -> str:
    response: trainer_pb2.SaveSnapshotResponse = trainer.SaveSnapshot(trainer_pb2.SaveSnapshotRequest(adapter=name))
    return response.version.artifact_uri


def test_interleaved_training_equals_training_alone(trainer: Trainer, store: Path) -> None:
    a, b = create(trainer, seed=11, config=CONFIG_A).name, create(trainer, seed=12, config=CONFIG_B).name
    barrier = threading.Barrier(2)  # both adapters' requests are in flight together at every step
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        future_a = pool.submit(run, trainer, a, data_a, STEPS, barrier)
        future_b = pool.submit(run, trainer, b, data_b, STEPS, barrier)
        interleaved_a, interleaved_b = future_a.result(), future_b.result()

    alone_a = create(trainer, seed=11, config=CONFIG_A).name
    assert run(trainer, alone_a, data_a) == interleaved_a
    alone_b = create(trainer, seed=12, config=CONFIG_B).name
    assert run(trainer, alone_b, data_b) == interleaved_b

    for together, alone in ((a, alone_a), (b, alone_b)):
        uri, alone_uri = snapshot_uri(trainer, together), snapshot_uri(trainer, alone)
        assert_same(snapshot_weights(store, uri), snapshot_weights(store, alone_uri))
        assert uri == alone_uri  # same weights and config: the same content-addressed artifact
        assert_same_training(state_of(trainer, store, together), state_of(trainer, store, alone))
    # Same seed, other adapter: the weights really moved apart from each other's data.
    assert snapshot_uri(trainer, a) != snapshot_uri(trainer, b)


def test_steps_of_one_adapter_leave_another_unchanged(trainer: Trainer, store: Path) -> None:
    a, b = create(trainer, seed=21, config=CONFIG_A).name, create(trainer, seed=21, config=CONFIG_A).name
    run(trainer, b, data_b, steps=2)
    before = save_state(trainer, b)
    run(trainer, a, data_a, steps=5)
    forward_backward(trainer, a, data_a(9))  # A left with pending gradients too
    after = save_state(trainer, b)
    assert after == before  # every file of the state (weights, grads, AdamW, RNG, ledger) is identical
    assert_same_training(read_state(store, before), read_state(store, after))
    adapter = get_adapter(trainer, b)
    assert adapter.step == 2 and adapter.pending_batches == 0
    assert get_adapter(trainer, a).pending_batches == 1


def test_optim_step_of_one_adapter_keeps_anothers_pending_gradients(trainer: Trainer, store: Path) -> None:
    b, reference, a = (create(trainer, seed=31, config=CONFIG_B).name for _ in range(3))
    # B accumulates gradients over two batches, then A trains several full steps before B's step.
    forward_backward(trainer, b, data_b(0))
    forward_backward(trainer, b, data_b(1))
    pending = save_state(trainer, b)
    assert read_state(store, pending).grads  # the gradients are part of the state
    run(trainer, a, data_b, steps=3)  # even the same data and seed as B
    assert save_state(trainer, b) == pending
    assert get_adapter(trainer, b).pending_batches == 2
    step_b = optim_step(trainer, b)

    forward_backward(trainer, reference, data_b(0))
    forward_backward(trainer, reference, data_b(1))
    step_reference = optim_step(trainer, reference)
    assert step_b.step == step_reference.step == 1
    assert step_b.metrics == step_reference.metrics
    assert_same_training(state_of(trainer, store, b), state_of(trainer, store, reference))
