"""`opentinker status` against the session's real servers, and with one server down."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from registryutil import unique_name
from serverproc import ServerProcess
from trainerutil import create, sft_batch, train_step

from opentinker.v1 import sampler_pb2, sampler_pb2_grpc, trainer_pb2, trainer_pb2_grpc


def run_status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "opentinker.cli.main", "status", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    )


def test_status_shows_the_stack(
    registry_server: ServerProcess,
    trainer_server: ServerProcess,
    sampler_server: ServerProcess,
    trainer: trainer_pb2_grpc.TrainerServiceStub,
    sampler: sampler_pb2_grpc.SamplerServiceStub,
) -> None:
    name = create(trainer, unique_name("status")).name
    train_step(trainer, name, sft_batch(seed=77))
    trainer.SaveSnapshot(trainer_pb2.SaveSnapshotRequest(adapter=name))
    sampler.LoadAdapter(sampler_pb2.LoadAdapterRequest(reference=f"{name}@1"))
    result = run_status(
        "--registry", registry_server.address, "--trainer", trainer_server.address, "--sampler", sampler_server.address
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.count("SERVING") == 3
    assert name in out and "latest->1" in out  # registry section
    assert "trainer: qwen2 on cpu" in out  # trainer section
    assert f"{name}@1" in out and "sampler: slots" in out  # sampler section


def test_status_reports_a_down_server() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        address = f"127.0.0.1:{sock.getsockname()[1]}"
        result = run_status("--sampler", address)
    assert result.returncode == 1
    assert "DOWN (UNAVAILABLE" in result.stdout
    assert "Traceback" not in result.stderr
