"""`opentinker up --config FILE`: the whole stack from one small TOML file, used end to end, then stopped by
SIGTERM with every server exiting cleanly."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serverproc import opentinker_command
from trainerutil import create, model_input

from opentinker.v1 import registry_pb2, registry_pb2_grpc, sampler_pb2, sampler_pb2_grpc, trainer_pb2, trainer_pb2_grpc


def lines_of(stream: IO[str]) -> queue.Queue[str]:
    """The stream's lines, read by a thread so that the test can wait with a timeout."""
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        for line in stream:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return lines


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("up")
    config = root / "stack.toml"
    config.write_text(f"""\
port = 0
model = "{tiny_model}"
device = "cpu"

[registry]
data_dir = "{root / "registry"}"

[sampler]
max_slots = 4
max_seqs = 4

[up]
workdir = "{root / "run"}"
""")
    process = subprocess.Popen(
        opentinker_command("up", "--config", str(config), "--json"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    lines = lines_of(process.stdout)
    try:
        first = json.loads(lines.get(timeout=240))
    except queue.Empty:
        process.kill()
        pytest.fail(f"opentinker up printed nothing: {process.communicate()}")
    assert first["event"] == "serving", first
    state: dict[str, Any] = {"process": process, "lines": lines, "servers": first["servers"], "root": root}
    yield state
    if process.poll() is None:  # the test failed before stopping it
        process.kill()
        process.wait()
        for info in first["servers"].values():
            if psutil.pid_exists(info["pid"]):
                psutil.Process(info["pid"]).kill()


def test_up_serves_all_three_and_stops_cleanly_on_sigterm(stack: dict[str, Any]) -> None:
    servers = stack["servers"]
    assert set(servers) == {"registry", "trainer", "sampler"}
    for info in servers.values():
        with grpc.insecure_channel(info["address"]) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert Path(info["log"]).exists()

    with (
        grpc.insecure_channel(servers["registry"]["address"]) as r_channel,
        grpc.insecure_channel(servers["trainer"]["address"]) as t_channel,
        grpc.insecure_channel(servers["sampler"]["address"]) as s_channel,
    ):
        registry = registry_pb2_grpc.RegistryServiceStub(r_channel)
        trainer = trainer_pb2_grpc.TrainerServiceStub(t_channel)
        sampler = sampler_pb2_grpc.SamplerServiceStub(s_channel)
        # The trainer was wired to the registry `up` started, and shares its artifact store with the sampler.
        name = create(trainer, "up-stack").name
        assert registry.GetAdapter(registry_pb2.GetAdapterRequest(name=name), timeout=10).adapter.name == name
        version = trainer.SaveSnapshot(trainer_pb2.SaveSnapshotRequest(adapter=name), timeout=60).version
        loaded = sampler.LoadAdapter(sampler_pb2.LoadAdapterRequest(reference=name), timeout=60)
        assert (loaded.adapter.version.adapter, loaded.adapter.version.version) == (name, version.version)
        scored = sampler.ComputeLogprobs(
            sampler_pb2.ComputeLogprobsRequest(model=name, inputs=[model_input([5, 6, 7, 8])]), timeout=60
        )
        assert len(scored.results[0].logprobs) == 3
        info = sampler.GetSamplerInfo(sampler_pb2.GetSamplerInfoRequest(), timeout=10)
        assert info.max_slots == 4 and info.max_seqs == 4  # from the [sampler] section

    process: subprocess.Popen[str] = stack["process"]
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=90) == 0, process.communicate()
    last = json.loads(stack["lines"].get(timeout=10))
    assert last == {"event": "stopped", "exit_codes": {"registry": 0, "trainer": 0, "sampler": 0}}, last
    for info in servers.values():
        assert not psutil.pid_exists(info["pid"]) or psutil.Process(info["pid"]).status() == psutil.STATUS_ZOMBIE


def test_up_refuses_a_bad_config(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[up]\nservices = ['registry', 'gateway']\n")
    result = subprocess.run(
        opentinker_command("up", "--config", str(config)),
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert result.returncode == 2, result
    assert "services must be a non-empty list" in result.stderr.replace("│", " "), result.stderr
