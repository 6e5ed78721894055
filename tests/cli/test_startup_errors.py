"""Startup errors of every server and of `up` (issue Lifecycle, item 5): one line naming the server, what is wrong
and what to do; exit 2 for a configuration error; a busy port found before the model loads; the traceback only
at --log-level debug."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from serverproc import opentinker_command


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(opentinker_command(*args), capture_output=True, text=True, timeout=120)


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def server_args(server: str, model: str, tmp_path: Path, *extra: str) -> list[str]:
    return [
        server,
        "serve",
        "--model",
        model,
        "--registry",
        "127.0.0.1:1",
        "--store",
        str(tmp_path / "store"),
        "--device",
        "cpu",
        *extra,
    ]


@pytest.mark.parametrize("server", ["trainer", "sampler"])
def test_a_missing_model_is_one_line_and_exit_2(server: str, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    result = run(*server_args(server, str(missing), tmp_path, "--port", "0"))
    assert result.returncode == 2
    assert one_line(result) == (
        f"opentinker {server}: base model '{missing}' is neither a local directory nor a valid hub model id (--model)"
    )


@pytest.mark.parametrize("server", ["trainer", "sampler"])
def test_a_directory_that_is_no_model_is_one_line_and_exit_2(server: str, tmp_path: Path) -> None:
    result = run(*server_args(server, str(tmp_path), tmp_path, "--port", "0"))
    assert result.returncode == 2
    line = one_line(result)
    assert line.startswith(f"opentinker {server}: --model {tmp_path}: ") and "no config.json" in line


@pytest.mark.parametrize("server", ["trainer", "sampler"])
def test_a_busy_port_is_found_before_the_model_loads(server: str, tmp_path: Path, busy_port: int) -> None:
    # A model directory that passes the existence check but cannot load: had the model been loaded first, the
    # error would be the load's, not the port's.
    model = tmp_path / "unloadable"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "none"}))
    result = run(*server_args(server, str(model), tmp_path, "--port", str(busy_port)))
    assert result.returncode == 2
    assert one_line(result) == (
        f"opentinker {server}: port {busy_port} on 127.0.0.1 is in use; stop what holds it "
        "or pass another --port (0 picks a free one)"
    )


def test_a_busy_metrics_port_names_its_flag(tmp_path: Path, busy_port: int) -> None:
    result = run("registry", "serve", "--port", "0", "--metrics-port", str(busy_port), "--data-dir", str(tmp_path))
    assert result.returncode == 2
    assert "pass another --metrics-port" in one_line(result)


def test_a_bad_flag_value_is_one_line(tiny_model: Path, tmp_path: Path) -> None:
    result = run(*server_args("trainer", str(tiny_model), tmp_path, "--port", "0", "--dtype", "float8"))
    assert result.returncode == 2
    assert one_line(result) == "opentinker trainer: invalid value for --dtype: dtype must be auto, float32 or bfloat16"


def test_a_tenant_queue_beyond_the_sampler_queue_is_one_line(tiny_model: Path, tmp_path: Path) -> None:
    extra = ("--port", "0", "--max-waiting", "8", "--max-queued-per-tenant", "9")
    result = run(*server_args("sampler", str(tiny_model), tmp_path, *extra))
    assert result.returncode == 2
    assert one_line(result) == (
        "opentinker sampler: invalid value for --max-queued-per-tenant: 9 is more than "
        "--max-waiting (8); 0 means no limit"
    )


def test_the_gateway_names_its_busy_port(busy_port: int) -> None:
    result = run(
        "gateway", "serve", "--trainer", "a:1", "--sampler", "b:1", "--registry", "c:1", "--port", str(busy_port)
    )
    assert result.returncode == 2
    assert one_line(result).startswith(f"opentinker gateway: port {busy_port} on 127.0.0.1 is in use")


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    result = run(*server_args("trainer", str(missing), tmp_path, "--port", "0", "--log-level", "debug"))
    assert result.returncode == 2
    assert "Traceback" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("opentinker trainer: base model")


def test_up_refuses_a_missing_model_naming_the_section_before_starting_anything(tmp_path: Path) -> None:
    config = tmp_path / "stack.toml"
    config.write_text(f'port = 0\n[trainer]\nmodel = "{tmp_path / "nope"}"\n[sampler]\nmodel = "{tmp_path}"\n')
    result = run("up", "--config", str(config), "--workdir", str(tmp_path / "run"))
    assert result.returncode == 2
    assert one_line(result).startswith(f"opentinker up: [trainer]: base model '{tmp_path / 'nope'}' is neither")
    assert not (tmp_path / "run" / "registry").exists()  # nothing started


def test_up_refuses_a_bad_flag_value_naming_the_section(tiny_model: Path, tmp_path: Path) -> None:
    config = tmp_path / "stack.toml"
    config.write_text(f'port = 0\nmodel = "{tiny_model}"\n[sampler]\nmax_waiting = "many"\n')
    result = run("up", "--config", str(config), "--workdir", str(tmp_path / "run"))
    assert result.returncode == 2
    line = one_line(result)
    assert line.startswith("opentinker up: [sampler]: ") and "--max-waiting" in line, line


def test_up_names_the_server_that_failed_and_its_log(tiny_model: Path, tmp_path: Path) -> None:
    """The registry of this stack finds its data dir held by another registry: `up` says which server failed,
    why (the server's own line) and where its log is; exit 2 as the server's."""
    data_dir = tmp_path / "shared"
    holder = subprocess.Popen(
        opentinker_command(
            "registry",
            "serve",
            "--port",
            "0",
            "--data-dir",
            str(data_dir),
            "--ready-file",
            str(tmp_path / "ready.json"),
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        ready = tmp_path / "ready.json"
        for _ in range(600):
            if ready.exists() or holder.poll() is not None:
                break
            time.sleep(0.1)
        assert ready.exists(), "the first registry did not start"
        config = tmp_path / "stack.toml"
        config.write_text(
            f'port = 0\nmodel = "{tiny_model}"\ndevice = "cpu"\n[registry]\ndata_dir = "{data_dir}"\n'
            '[up]\nservices = ["registry"]\n'
        )
        result = run("up", "--config", str(config), "--workdir", str(tmp_path / "run"))
    finally:
        holder.terminate()
        holder.wait(30)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines == [
        f"opentinker up: the registry failed to start (exit 2): opentinker registry: data dir {data_dir.resolve()} "
        f"is in use by another registry (pid {holder.pid}); stop it or pass another --data-dir; its log: "
        f"{tmp_path / 'run' / 'registry' / 'server.log'}"
    ], result.stderr


def test_up_refuses_tokens_it_cannot_provision_for_naming_the_fix(tiny_model: Path, tmp_path: Path) -> None:
    config = tmp_path / "stack.toml"
    config.write_text(f'port = 0\nmodel = "{tiny_model}"\ndevice = "cpu"\n')
    env = {**os.environ, "OPENTINKER_TOKENS": "tok-a=team-a"}
    result = subprocess.run(
        opentinker_command("up", "--config", str(config), "--workdir", str(tmp_path / "run")),
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 2
    assert one_line(result) == (
        "opentinker up: the registry takes tokens from OPENTINKER_TOKENS but no registry_token is set for the "
        "trainer and the sampler: set registry_token (an admin token), or use tokens_file and `up` provisions one"
    )
    assert not (tmp_path / "run" / "registry").exists()
