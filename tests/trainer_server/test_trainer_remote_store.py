"""A trainer that does not share the registry's artifact store: snapshots travel through the registry."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from registryutil import unique_name
from serverproc import ServerProcess, opentinker_command
from trainerutil import create, forward, logprobs, sft_batch, train_step

from opentinker.v1 import registry_pb2, registry_pb2_grpc, trainer_pb2, trainer_pb2_grpc


def flat(rows: list[list[float]]) -> list[float]:
    return [value for row in rows for value in row]


@pytest.fixture(scope="module")
def remote_trainer(
    tiny_model: Path, registry_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    workdir = tmp_path_factory.mktemp("remote-trainer")
    args = opentinker_command(
        "trainer",
        "serve",
        "--model",
        str(tiny_model),
        "--registry",
        registry_server.address,
        "--store",
        str(workdir / "own-store"),
        "--port",
        "0",
        "--device",
        "cpu",
    )
    server = ServerProcess(args, workdir, timeout=120)
    yield server
    assert server.terminate() == 0


def test_snapshot_uploads_and_init_from_downloads(
    remote_trainer: ServerProcess,
    trainer: trainer_pb2_grpc.TrainerServiceStub,
    registry: registry_pb2_grpc.RegistryServiceStub,
) -> None:
    batch = sft_batch(seed=5)
    with grpc.insecure_channel(remote_trainer.address) as channel:
        remote = trainer_pb2_grpc.TrainerServiceStub(channel)
        name = unique_name("remote")
        create(remote, name)
        for _ in range(2):
            train_step(remote, name, batch)
        # The registry does not have this artifact in its store: the trainer uploads it, then publishes.
        version = remote.SaveSnapshot(trainer_pb2.SaveSnapshotRequest(adapter=name)).version
        resolved = registry.Resolve(registry_pb2.ResolveRequest(reference=name)).version
        assert resolved.artifact_sha256 == version.artifact_sha256
        downloaded = list(
            registry.DownloadArtifact(registry_pb2.DownloadArtifactRequest(artifact_uri=version.artifact_uri))
        )
        assert len(downloaded) > 1
        expected = logprobs(forward(remote, name, batch))

    # The session trainer shares the registry's store; a fresh remote-store trainer must download instead.
    copy = unique_name("copy")
    create(trainer, copy, init_from=f"{name}@{version.version}")
    assert flat(logprobs(forward(trainer, copy, batch))) == pytest.approx(flat(expected), abs=1e-6)
    with grpc.insecure_channel(remote_trainer.address) as channel:
        remote = trainer_pb2_grpc.TrainerServiceStub(channel)
        other = unique_name("other")
        first = unique_name("first")
        create(trainer, first)
        train_step(trainer, first, batch)
        published = trainer.SaveSnapshot(trainer_pb2.SaveSnapshotRequest(adapter=first)).version
        create(remote, other, init_from=f"{first}@{published.version}")  # fetched from the registry
        ours, theirs = logprobs(forward(remote, other, batch)), logprobs(forward(trainer, first, batch))
        assert flat(ours) == pytest.approx(flat(theirs), abs=1e-6)
