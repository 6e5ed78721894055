"""No server binds a non-loopback address without authentication unless told --insecure-public: each of the
three CLIs exits 2 with one clear line, and --insecure-public lets it serve (reached here over loopback)."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serverproc import ServerProcess, opentinker_command

PUBLIC = "0.0.0.0"  # every interface: not loopback


def serve_args(component: str, workdir: Path, model: Path, registry: str) -> list[str]:
    if component == "registry":
        return opentinker_command("registry", "serve", "--data-dir", str(workdir), "--port", "0")
    return opentinker_command(
        component,
        "serve",
        "--model",
        str(model),
        "--registry",
        registry,
        "--store",
        str(workdir / "store"),
        "--device",
        "cpu",
        "--port",
        "0",
    )


def without_tokens() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("OPENTINKER_TOKENS", "OPENTINKER_TOKENS_FILE")}


def test_public_bind_without_auth_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    def refuse(component: str) -> subprocess.CompletedProcess[str]:
        args = [*serve_args(component, tmp_path / component, tiny_model, "127.0.0.1:1"), "--host", PUBLIC]
        return subprocess.run(args, capture_output=True, text=True, timeout=180, env=without_tokens())

    components = ("registry", "trainer", "sampler")
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        results = dict(zip(components, pool.map(refuse, components), strict=True))
    for component, result in results.items():
        assert result.returncode == 2, (component, result.returncode, result.stderr[-2000:])
        line = f"opentinker {component}: refusing to bind {PUBLIC} without authentication"
        assert line in result.stderr, (component, result.stderr[-2000:])
        assert "--insecure-public" in result.stderr and "Traceback" not in result.stderr
        assert "serving on" not in result.stdout


def test_insecure_public_allows_it(tiny_model: Path, tmp_path: Path) -> None:
    def start(component: str, registry: str) -> ServerProcess:
        args = [
            *serve_args(component, tmp_path / component, tiny_model, registry),
            "--host",
            PUBLIC,
            "--insecure-public",
        ]
        return ServerProcess(args, tmp_path / component, timeout=180, env=without_tokens())

    registry = start("registry", "")
    port = registry.address.rsplit(":", 1)[1]
    servers = {"registry": registry}
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = {c: pool.submit(start, c, f"127.0.0.1:{port}") for c in ("trainer", "sampler")}
            servers.update({c: f.result() for c, f in futures.items()})
        for component, server in servers.items():
            assert server.address.startswith(f"{PUBLIC}:"), server.address
            loopback = "127.0.0.1:" + server.address.rsplit(":", 1)[1]
            with grpc.insecure_channel(loopback) as channel:
                check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
            assert check.status == health_pb2.HealthCheckResponse.SERVING, component
    finally:
        codes = {component: server.terminate() for component, server in servers.items()}
    assert set(codes.values()) == {0}, codes


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_loopback_needs_no_flag(tmp_path: Path, host: str) -> None:
    args = [
        *opentinker_command("registry", "serve", "--data-dir", str(tmp_path), "--port", "0"),
        "--host",
        host,
        "--metrics-port",
        "-1",
    ]
    try:
        server = ServerProcess(args, tmp_path, timeout=60, env=without_tokens())
    except RuntimeError as error:
        if host == "::1" and "cannot bind" in str(error):
            pytest.skip("no IPv6 loopback here")
        raise
    assert server.terminate() == 0, server.log()[-3000:]
