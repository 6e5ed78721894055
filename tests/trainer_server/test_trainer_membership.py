"""A trainer process as a member of the fleet (the first part of a trainer pool): it registers with the role
TRAINER, its address, base fingerprint, resident-adapter limit and zone, beats the adapters it holds and its
queued work, is listed by the SDK and `opentinker fleet status` apart from the samplers, and on SIGTERM is
DRAINING in the registry before its health says NOT_SERVING."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from memberutil import assert_drains_before_health_flips
from registryutil import unique_name
from samplerutil import wait_until
from serverproc import ServerProcess, start_registry, start_trainer
from trainerutil import create
from typer.testing import CliRunner

from opentinker.cli.main import app
from opentinker.client import RegistryClient
from opentinker.v1 import registry_pb2, registry_pb2_grpc, trainer_pb2_grpc
from opentinker.weights.base_model import model_digest

BEAT_S = 0.2


@dataclass
class Member:
    registry: ServerProcess
    trainer_server: ServerProcess

    def trainer(self) -> trainer_pb2_grpc.TrainerServiceStub:
        return trainer_pb2_grpc.TrainerServiceStub(grpc.insecure_channel(self.trainer_server.address))

    def listed(
        self, role: registry_pb2.ReplicaRole = registry_pb2.REPLICA_ROLE_UNSPECIFIED
    ) -> list[registry_pb2.Replica]:
        stub = registry_pb2_grpc.RegistryServiceStub(grpc.insecure_channel(self.registry.address))
        replicas = stub.ListReplicas(registry_pb2.ListReplicasRequest(role=role), timeout=10).replicas
        return [r for r in replicas if r.address == self.trainer_server.address]


@pytest.fixture(scope="module")
def member(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Member]:
    workdir = tmp_path_factory.mktemp("trainer-membership")
    registry = start_registry(workdir / "registry")
    flags = ("--heartbeat-s", str(BEAT_S), "--zone", "zone-t", "--max-resident-adapters", "3")
    trainer = start_trainer(workdir / "trainer", tiny_model, registry, *flags)
    state = Member(registry, trainer)
    yield state
    state.trainer_server.terminate()
    state.registry.terminate()


def test_the_trainer_registers_and_beats_the_adapters_it_holds(member: Member, tiny_model: Path) -> None:
    assert wait_until(lambda: len(member.listed()) == 1, timeout=20), "the trainer did not register"
    (replica,) = member.listed()
    assert replica.role == registry_pb2.REPLICA_ROLE_TRAINER and replica.replica_id.startswith("trainer-")
    assert replica.base_fingerprint == model_digest(tiny_model)
    assert replica.max_slots == 3 and replica.zone == "zone-t"
    assert replica.state == registry_pb2.REPLICA_STATE_SERVING
    assert replica.lease_seconds == pytest.approx(3 * BEAT_S)
    assert replica.load.slots_total == 3 and replica.load.slots_used == 0 and not replica.resident
    names = sorted(unique_name("held") for _ in range(2))
    for name in names:
        create(member.trainer(), name)
    assert wait_until(lambda: list(member.listed()[0].resident) == names, timeout=10), member.listed()
    assert member.listed()[0].load.slots_used == 2
    # Samplers' routers filter by role: a trainer is never a sampler candidate.
    assert member.listed(registry_pb2.REPLICA_ROLE_SAMPLER) == []
    assert len(member.listed(registry_pb2.REPLICA_ROLE_TRAINER)) == 1


def test_the_sdk_and_the_cli_list_the_trainer(member: Member) -> None:
    assert wait_until(lambda: len(member.listed()) == 1, timeout=20)
    with RegistryClient(member.registry.address) as client:
        (replica,) = [r for r in client.list_replicas("trainer") if r.address == member.trainer_server.address]
        assert replica.role == "trainer" and replica.serving and replica.zone == "zone-t"
        assert not [r for r in client.list_replicas("sampler") if r.address == member.trainer_server.address]
    result = CliRunner().invoke(
        app, ["fleet", "status", "--registry", member.registry.address, "--role", "trainer", "--json"]
    )
    assert result.exit_code == 0, result.output
    (shown,) = [r for r in json.loads(result.stdout) if r["address"] == member.trainer_server.address]
    assert shown["role"] == "trainer" and shown["state"] == "serving"
    args = ["fleet", "status", "--registry", member.registry.address, "--role", "trainer"]
    table = CliRunner().invoke(app, args, env={"COLUMNS": "250"})
    assert table.exit_code == 0 and shown["replica_id"] in table.stdout and "zone-t" in table.stdout


def test_a_bad_advertise_flag_is_refused_before_the_model_loads(tiny_model: Path) -> None:
    flags = ["--model", str(tiny_model), "--registry", "127.0.0.1:1", "--store", "/nonexistent"]
    result = CliRunner().invoke(app, ["trainer", "serve", *flags, "--advertise", "no-port"])
    assert result.exit_code == 2 and "--advertise" in result.output and "host:port" in result.output


def test_sigterm_drains_in_the_registry_before_health_flips(member: Member) -> None:
    assert wait_until(lambda: len(member.listed()) == 1, timeout=20)
    assert_drains_before_health_flips(member.trainer_server, member.listed)
