"""Offloading: a trainer holding at most 2 adapters resident trains 5 round-robin, moving weights, pending
gradients and AdamW moments off and back, and ends bitwise where a trainer without a limit ends."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from registryutil import unique_name
from serverproc import ServerProcess, registry_store, start_trainer
from trainerutil import (
    Trainer,
    assert_same_training,
    create,
    forward_backward,
    get_adapter,
    lora,
    optim_step,
    sft_batch,
    state_of,
    train_step,
)

from opentinker.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc

ADAPTERS = 5
ROUNDS = 3
CONFIGS = [
    lora(
        rank=2 + i,
        alpha=8.0,
        dropout=0.1 * (i % 2),
        targets=[["all-linear"], ["attn"], ["mlp"], ["q_proj", "v_proj"]][i % 4],
    )
    for i in range(ADAPTERS)
]


@dataclass
class Limited:
    server: ServerProcess
    trainer: Trainer
    spill: Path


@pytest.fixture(scope="module")
def limited(
    tiny_model: Path, registry_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Limited]:
    workdir = tmp_path_factory.mktemp("offload")
    server = start_trainer(workdir, tiny_model, registry_server, "--max-resident-adapters", "2")
    try:
        with grpc.insecure_channel(server.address) as channel:
            yield Limited(server, trainer_pb2_grpc.TrainerServiceStub(channel), workdir / "spill")
    finally:
        assert server.terminate() == 0, server.log()


def data(adapter: int, round_: int) -> list[common_pb2.Datum]:
    return sft_batch(seed=500 + 10 * adapter + round_, count=2, length=10 + adapter)


def train_round_robin(trainer: Trainer, names: list[str]) -> list[float]:
    """Each round: every adapter's ForwardBackward (gradients pend while others run), then every OptimStep;
    then one more full step per adapter in turn. Returns every loss and gradient norm in order."""
    out: list[float] = []
    for round_ in range(ROUNDS):
        for i, name in enumerate(names):
            out.append(forward_backward(trainer, name, data(i, round_)).metrics["loss:sum"])
        for name in names:
            out.append(optim_step(trainer, name).metrics["grad_norm:value"])
        for i, name in enumerate(names):
            loss, response = train_step(trainer, name, data(i, ROUNDS + round_))
            out += [loss, response.metrics["grad_norm:value"]]
    for i, name in enumerate(names):  # leave gradients pending everywhere
        out.append(forward_backward(trainer, name, data(i, 2 * ROUNDS)).metrics["loss:sum"])
    return out


def test_offloaded_training_is_bitwise_equal(
    limited: Limited, trainer: Trainer, registry_server: ServerProcess
) -> None:
    info: trainer_pb2.GetTrainerInfoResponse = limited.trainer.GetTrainerInfo(trainer_pb2.GetTrainerInfoRequest())
    assert info.max_resident_adapters == 2
    names = [create(limited.trainer, seed=600 + i, config=CONFIGS[i]).name for i in range(ADAPTERS)]
    reference = [create(trainer, seed=600 + i, config=CONFIGS[i]).name for i in range(ADAPTERS)]

    offloaded = train_round_robin(limited.trainer, names)
    unlimited = train_round_robin(trainer, reference)
    assert offloaded == unlimited

    adapters = [get_adapter(limited.trainer, name) for name in names]
    assert [a.resident for a in adapters] == [False, False, False, True, True]  # LRU: the last two stay
    assert all(a.step == 2 * ROUNDS and a.pending_batches == 1 for a in adapters)
    assert all(get_adapter(trainer, name).resident for name in reference)
    for adapter, ref in zip(adapters, reference, strict=True):  # offloaded or not, the same adapter to clients
        expected = get_adapter(trainer, ref)
        expected.name, expected.resident, expected.create_time.seconds = adapter.name, adapter.resident, 0
        adapter.create_time.seconds = 0
        assert adapter == expected
    spilled = sorted(p.name for p in limited.spill.iterdir())
    assert spilled == sorted(f"{name}.pt" for name in names[:3])

    store = registry_store(registry_server)
    for name, ref in zip(names, reference, strict=True):
        assert_same_training(state_of(limited.trainer, store, name), state_of(trainer, store, ref))
    # Still exact after the states were saved (which brought each adapter back in turn): apply the pending step.
    for name, ref in zip(names, reference, strict=True):
        assert optim_step(limited.trainer, name).metrics == optim_step(trainer, ref).metrics
        assert_same_training(state_of(limited.trainer, store, name), state_of(trainer, store, ref))
    assert sum(get_adapter(limited.trainer, name).resident for name in names) == 2


def test_delete_of_an_offloaded_adapter_removes_its_spill_file(limited: Limited) -> None:
    names = [create(limited.trainer, unique_name("spill"), seed=i).name for i in range(3)]
    assert not get_adapter(limited.trainer, names[0]).resident
    assert (limited.spill / f"{names[0]}.pt").exists()
    limited.trainer.DeleteAdapter(trainer_pb2.TrainerServiceDeleteAdapterRequest(name=names[0]))
    assert not (limited.spill / f"{names[0]}.pt").exists()
    listed = limited.trainer.ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest(prefix="spill-")).adapters
    assert sorted(a.name for a in listed) == sorted(names[1:])
