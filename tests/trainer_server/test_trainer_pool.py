"""The trainer pool end to end: a registry and trainer processes on loopback, trained through
ServiceClient(registry=...) with no trainer address. Adapters spread over the trainers; a SIGKILLed trainer's
adapters train on elsewhere and end bitwise equal (fp32) to a run without the fault; a trainer stopped with
SIGSTOP and replaced cannot train or publish once resumed; a move on purpose and a SIGTERM drain lose no step;
a journal that would outgrow its bound saves a state instead."""

from __future__ import annotations

import json
import signal
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import torch
from registryutil import unique_name
from samplerutil import wait_until
from serverproc import ServerProcess, registry_store, start_registry, start_trainer
from trainerutil import assert_same, assert_status, random_tokens, read_state, rpc_error, sft_batch
from typer.testing import CliRunner

from opentinker.cli.main import app
from opentinker.client import AdamParams, Datum, LoraConfig, ModelInput, ServiceClient, TrainingClient
from opentinker.client.trainer_pool import PoolRoute
from opentinker.v1 import registry_pb2, registry_pb2_grpc, trainer_pb2, trainer_pb2_grpc

BEAT_S = 0.2  # leases of 0.6 s: a dead trainer's adapters move on within a second
FLAGS = ("--heartbeat-s", str(BEAT_S), "--autosave-every", "3")
LORA = LoraConfig(rank=4)
ADAM = AdamParams(learning_rate=1e-2)


@dataclass
class Pool:
    workdir: Path
    model: Path
    registry: ServerProcess
    trainers: list[ServerProcess] = field(default_factory=list)

    def start_trainer(self, *extra: str) -> ServerProcess:
        trainer = start_trainer(self.workdir / unique_name("trainer"), self.model, self.registry, *FLAGS, *extra)
        self.trainers.append(trainer)
        assert wait_until(lambda: trainer.address in self.serving(), timeout=20), "the trainer did not register"
        return trainer

    def serving(self) -> set[str]:
        stub = registry_pb2_grpc.RegistryServiceStub(grpc.insecure_channel(self.registry.address))
        request = registry_pb2.ListReplicasRequest(role=registry_pb2.REPLICA_ROLE_TRAINER)
        replicas = stub.ListReplicas(request, timeout=10).replicas
        return {r.address for r in replicas if r.state == registry_pb2.REPLICA_STATE_SERVING}

    def client(self, journal_max_steps: int = 64) -> ServiceClient:
        return ServiceClient(registry=self.registry.address, timeout=60, journal_max_steps=journal_max_steps)


@pytest.fixture(scope="module")
def pool(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    workdir = tmp_path_factory.mktemp("trainer-pool")
    state = Pool(workdir, tiny_model, start_registry(workdir / "registry"))
    state.start_trainer()
    state.start_trainer()
    yield state
    for trainer in state.trainers:
        trainer.kill()
    state.registry.terminate()


def _datum(seed: int) -> Datum:
    tokens = random_tokens(seed, 10)
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def _step(training: TrainingClient, seed: int) -> None:
    training.forward_backward([_datum(seed), _datum(seed + 1)])
    training.optim_step(ADAM)


def _placed_on(client: ServiceClient, trainer: ServerProcess, prefix: str, seed: int) -> TrainingClient:
    """A new adapter on `trainer` (the least loaded takes the next ones; ties go by replica id)."""
    for _ in range(8):
        training = client.create_training_client(unique_name(prefix), LORA, seed=seed)
        if training.trainer_address == trainer.address:
            return training
    pytest.fail(f"no adapter was placed on {trainer.address}")


def _weights(pool: Pool, training: TrainingClient) -> dict[str, torch.Tensor]:
    return read_state(registry_store(pool.registry), training.save_state("compare").state_id).weights


def test_adapters_spread_over_the_pool(pool: Pool) -> None:
    with pool.client() as client:
        adapters = [client.create_training_client(unique_name("spread"), LORA, seed=i) for i in range(6)]
        for i, training in enumerate(adapters):
            _step(training, i)
        owners = Counter(t.trainer_address for t in adapters)
    live = {t.address for t in pool.trainers if t.process.poll() is None}
    assert set(owners) <= live and len(owners) == len(live) and max(owners.values()) - min(owners.values()) <= 1


def test_a_killed_trainer_loses_no_step_and_the_result_is_bitwise_a_clean_run(pool: Pool) -> None:
    victim = pool.start_trainer()  # the least loaded: the next adapters go to it first
    names = [unique_name("kill") for _ in range(3)]
    with pool.client() as client:
        faulted = [client.create_training_client(n, LORA, seed=7 + i) for i, n in enumerate(names)]
        on_victim = [t for t in faulted if t.trainer_address == victim.address]
        assert on_victim, "no adapter was placed on the new trainer"
        for step in range(8):
            for i, training in enumerate(faulted):
                if step == 4 and i == 1:
                    victim.kill()  # SIGKILL mid-run, between two adapters' steps
                _step(training, 100 * step + i)
        assert all(t.trainer_address != victim.address for t in faulted)
        moved = [f for t in on_victim for f in t.failovers]
        assert moved and all(f.from_address == victim.address and f.to_address != victim.address for f in moved)
        assert all(f.state_step <= 4 for f in moved), moved  # resumed from a state before the kill
        for f in moved:  # the parts add up to the whole
            assert f.seconds == pytest.approx(f.placed_s + f.load_s + f.replay_s, abs=0.01), f
        # The same adapters without a fault, on the surviving trainers.
        clean = [client.create_training_client(unique_name("clean"), LORA, seed=7 + i) for i in range(3)]
        for step in range(8):
            for i, training in enumerate(clean):
                _step(training, 100 * step + i)
        for faulty, reference in zip(faulted, clean, strict=True):
            assert faulty.get_info().step == reference.get_info().step == 8
            assert_same(_weights(pool, faulty), _weights(pool, reference), "weights")


def test_a_trainer_stopped_and_replaced_can_neither_train_nor_publish(pool: Pool) -> None:
    sleeper = pool.start_trainer()
    with pool.client() as client:
        training = _placed_on(client, sleeper, "fence", 3)
        _step(training, 1)
        sleeper.process.send_signal(signal.SIGSTOP)
        try:
            _step(training, 2)  # waits out the stopped trainer's lease, then goes on elsewhere
            assert training.trainer_address != sleeper.address and training.failovers
            new_owner = training.trainer_address
        finally:
            sleeper.process.send_signal(signal.SIGCONT)
        stub = trainer_pb2_grpc.TrainerServiceStub(grpc.insecure_channel(sleeper.address))
        name = training.adapter
        calls = [
            (stub.ForwardBackward, trainer_pb2.ForwardBackwardRequest(adapter=name, datums=sft_batch(5))),
            (stub.OptimStep, trainer_pb2.OptimStepRequest(adapter=name)),
            (stub.SaveSnapshot, trainer_pb2.SaveSnapshotRequest(adapter=name)),
        ]
        for call, request in calls:
            details = assert_status(rpc_error(call, request), grpc.StatusCode.FAILED_PRECONDITION, "NOT_OWNER")
            assert details.get("owner") == new_owner, details
        _step(training, 3)  # the new owner trains on
        assert training.get_info().step == 3
    sleeper.kill()


def test_a_move_and_a_drain_lose_no_step(pool: Pool) -> None:
    leaving = pool.start_trainer()
    with pool.client() as client:
        moved = _placed_on(client, leaving, "move", 11)
        reference = client.create_training_client(unique_name("still"), LORA, seed=11)
        for step in range(2):
            _step(moved, step)
            _step(reference, step)
        target = next(t.address for t in pool.trainers if t.process.poll() is None and t is not leaving)
        command = ["trainer", "move", moved.adapter, "--to", target, "--registry", pool.registry.address, "--json"]
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 0, result.output
        done = json.loads(result.output)
        assert (done["from_address"], done["to_address"], done["state_step"]) == (leaving.address, target, 2)
        moved.forward_backward([_datum(50), _datum(51)])  # follows to the new owner
        assert moved.trainer_address == target
        moved.optim_step(ADAM)
        reference.forward_backward([_datum(50), _datum(51)])
        reference.optim_step(ADAM)
        drained = _placed_on(client, leaving, "drain", 12)
        twin = client.create_training_client(unique_name("twin"), LORA, seed=12)
        _step(drained, 60)
        _step(twin, 60)
        assert leaving.terminate() == 0  # SIGTERM: its adapters move away before it exits
        _step(drained, 61)
        _step(twin, 61)
        assert drained.trainer_address != leaving.address and drained.failovers
        for a, b in ((moved, reference), (drained, twin)):
            assert a.get_info().step == b.get_info().step
            assert_same(_weights(pool, a), _weights(pool, b), "weights")


def test_a_journal_at_its_bound_saves_instead_of_growing(pool: Pool) -> None:
    with pool.client(journal_max_steps=2) as client:
        training = client.create_training_client(unique_name("bound"), LORA, seed=5)
        sizes = []
        for step in range(7):
            _step(training, step)
            sizes.append(training.journal_bytes)
            route = training._pool
            assert route is not None
            assert route.journal_steps <= 2, (step, route.journal_steps)
        assert max(sizes) <= 2 * sizes[0] + 1, sizes  # bounded: saves emptied it, it did not grow with the run
        assert training.get_info().step == 7


def test_loading_a_state_starts_the_journal_again(pool: Pool) -> None:
    with pool.client() as client:
        training = client.create_training_client(unique_name("rebase"), LORA, seed=9)
        _step(training, 1)
        saved = training.save_state("back-to")
        _step(training, 2)
        _step(training, 3)
        route = training._pool
        assert isinstance(route, PoolRoute) and route.journal_steps == 2
        assert training.load_state(saved.state_id).step == 1
        # The journal cannot replay across a load: a state was saved right after it, and the journal is empty.
        assert route.journal_steps == 0 and route.base == route.position == (1, 0)
        _step(training, 4)
        assert training.get_info().step == 2 and route.journal_steps == 1
