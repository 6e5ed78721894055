"""Offloading: a trainer holding at most 2 adapters resident trains 5 round-robin, moving weights, pending
gradients and AdamW moments off and back, and ends bitwise where a trainer without a limit ends. A spill file
round-trips the whole training state exactly, and one that is not the file the trainer wrote for that adapter
(another adapter's, an older one, a pickle) is refused with DATA_LOSS, without running anything, changing
nothing."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from registryutil import unique_name
from serverproc import ServerProcess, registry_store, start_trainer
from trainerutil import (
    Trainer,
    assert_same_training,
    assert_status,
    create,
    forward_backward,
    get_adapter,
    lora,
    optim_step,
    rpc_error,
    save_state,
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
    assert spilled == sorted(f"{name}.safetensors" for name in names[:3])

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
    spilled = spill_file(limited, names[0])
    limited.trainer.DeleteAdapter(trainer_pb2.TrainerServiceDeleteAdapterRequest(name=names[0]))
    assert not spilled.exists()
    listed = limited.trainer.ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest(prefix="spill-")).adapters
    assert sorted(a.name for a in listed) == sorted(names[1:])


def spill_file(limited: Limited, name: str) -> Path:
    """The adapter's spill file (its name is the adapter's, whatever the format's extension)."""
    (path,) = [p for p in limited.spill.iterdir() if p.name.split(".", 1)[0] == name]
    return path


def spill_out(limited: Limited, *names: str) -> None:
    """Uses two fresh adapters, so that (with 2 resident at most) every one of `names` goes to disk."""
    for i in range(2):
        train_step(limited.trainer, create(limited.trainer, unique_name("filler"), seed=90 + i).name, data(0, i))
    assert not any(get_adapter(limited.trainer, name).resident for name in names)


def trained(limited: Limited, seed: int) -> str:
    """An adapter with dropout (its RNG advances), two steps taken and one batch pending."""
    name = create(limited.trainer, unique_name("sp"), seed=seed, config=CONFIGS[1]).name
    for round_ in range(2):
        train_step(limited.trainer, name, data(seed, round_))
    forward_backward(limited.trainer, name, data(seed, 2))
    return name


def test_a_spill_round_trips_the_whole_training_state(limited: Limited) -> None:
    name = trained(limited, 1)
    before = save_state(limited.trainer, name)  # weights, gradients, AdamW (moments, step), RNG, ledger
    spill_out(limited, name)
    assert spill_file(limited, name).exists()
    # content-addressed: the same id is the same bytes of every file of the state
    assert save_state(limited.trainer, name) == before
    assert get_adapter(limited.trainer, name).resident
    assert not [p for p in limited.spill.iterdir() if p.name.split(".", 1)[0] == name]  # gone once restored


def assert_refused(limited: Limited, name: str, reason: str) -> str:
    """Every request that needs the adapter's state is DATA_LOSS `reason`; the adapter stays offloaded."""
    before = get_adapter(limited.trainer, name)
    for call in (
        lambda: forward_backward(limited.trainer, name, data(0, 0)),
        lambda: optim_step(limited.trainer, name),
        lambda: save_state(limited.trainer, name),
    ):
        error = rpc_error(call)
        assert_status(error, grpc.StatusCode.DATA_LOSS, reason)
    assert get_adapter(limited.trainer, name) == before
    assert isinstance(error, grpc.Call)
    return str(error.details())


def test_another_adapters_spill_file_is_refused(limited: Limited) -> None:
    victim, other = trained(limited, 2), trained(limited, 3)  # the same LoRA config: the tensors would fit
    state = save_state(limited.trainer, victim)
    spill_out(limited, victim, other)
    own = spill_file(limited, victim).read_bytes()
    spill_file(limited, victim).write_bytes(spill_file(limited, other).read_bytes())

    details = assert_refused(limited, victim, "SPILL_MISMATCH")
    assert "holds another adapter's state" in details and victim in details
    assert other not in details and str(limited.spill) not in details  # nothing of another adapter, nor paths
    spill_file(limited, victim).write_bytes(own)  # its own file back: exactly as before, nothing was changed
    assert save_state(limited.trainer, victim) == state
    assert save_state(limited.trainer, other) != state


def test_an_older_spill_of_the_same_adapter_is_refused(limited: Limited) -> None:
    name = trained(limited, 4)
    spill_out(limited, name)
    old = spill_file(limited, name).read_bytes()
    train_step(limited.trainer, name, data(4, 3))  # restored, stepped, then spilled again
    state = save_state(limited.trainer, name)
    spill_out(limited, name)
    current = spill_file(limited, name).read_bytes()
    spill_file(limited, name).write_bytes(old)

    assert "not the one this trainer wrote" in assert_refused(limited, name, "SPILL_MISMATCH")
    spill_file(limited, name).write_bytes(current)
    assert save_state(limited.trainer, name) == state


class Planted:
    """Unpickling this runs os.mkdir(marker): the proof that a loader executed what the file held."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.mkdir, (str(self.marker),)


def test_a_pickled_spill_file_is_refused_without_running_it(limited: Limited, tmp_path: Path) -> None:
    name = trained(limited, 5)
    spill_out(limited, name)
    marker = tmp_path / "pickle-ran"
    path = spill_file(limited, name)
    own = path.read_bytes()
    torch.save(Planted(marker), path)

    assert "not a safetensors file" in assert_refused(limited, name, "SPILL_CORRUPT")
    assert not marker.exists()
    path.write_bytes(own)
    assert get_adapter(limited.trainer, name).step == 2
    forward_backward(limited.trainer, name, data(5, 3))
    assert get_adapter(limited.trainer, name).resident
