"""One registry per data dir (issue Lifecycle, item 3): a second registry on a locked data dir, or on a busy port,
exits 2 with one line before it starts a Redis; the first keeps serving with its data intact. The default data
dir is per user, never the current directory. A watcher that leaves mid-stream logs no asyncio ERROR."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from registryutil import unique_name
from serverproc import ServerProcess, opentinker_command, start_registry

from opentinker.v1 import registry_pb2, registry_pb2_grpc


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    """A registry that is expected not to start: its exit code and output."""
    return subprocess.run(opentinker_command("registry", "serve", *args), capture_output=True, text=True, timeout=60)


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_registry(tmp_path_factory.mktemp("first"))
    yield server
    assert server.terminate() == 0, server.log()


def names(server: ServerProcess) -> set[str]:
    with grpc.insecure_channel(server.address) as channel:
        stub = registry_pb2_grpc.RegistryServiceStub(channel)
        return {a.name for a in stub.ListAdapters(registry_pb2.ListAdaptersRequest(), timeout=10).adapters}


def create(server: ServerProcess, name: str) -> None:
    with grpc.insecure_channel(server.address) as channel:
        registry_pb2_grpc.RegistryServiceStub(channel).CreateAdapter(
            registry_pb2.CreateAdapterRequest(name=name), timeout=10
        )


def test_a_second_registry_on_the_same_data_dir_exits_2_and_the_first_keeps_its_data(first: ServerProcess) -> None:
    data_dir = first.ready_file.parent
    before = unique_name("dd-before")
    create(first, before)
    aof_before = sorted(p.name for p in (data_dir / "redis").rglob("*"))

    result = serve("--port", "0", "--data-dir", str(data_dir))

    assert result.returncode == 2
    line = one_line(result)
    assert line == (
        f"opentinker registry: data dir {data_dir.resolve()} is in use by another registry "
        f"(pid {first.process.pid}); stop it or pass another --data-dir"
    )
    # Nothing of the second one touched the data: same files, and the first serves what it had, and more.
    assert sorted(p.name for p in (data_dir / "redis").rglob("*")) == aof_before
    after = unique_name("dd-after")
    create(first, after)
    assert {before, after} <= names(first)


def test_a_busy_port_is_found_before_the_lock_and_redis(first: ServerProcess, tmp_path: Path) -> None:
    port = first.address.rsplit(":", 1)[1]
    result = serve("--port", port, "--data-dir", str(tmp_path / "second"))
    assert result.returncode == 2
    assert one_line(result) == (
        f"opentinker registry: port {port} on 127.0.0.1 is in use; stop what holds it or "
        "pass another --port (0 picks a free one)"
    )
    assert not (tmp_path / "second").exists()  # no lock file, no Redis started on it


def test_the_data_dir_is_free_again_once_the_registry_stopped(tmp_path: Path) -> None:
    server = start_registry(tmp_path / "reused")
    name = unique_name("dd-reuse")
    create(server, name)
    assert server.terminate() == 0
    again = start_registry(tmp_path / "reused")
    try:
        assert name in names(again)  # same data dir, same data
    finally:
        assert again.terminate() == 0


def test_the_default_data_dir_is_per_user_not_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cwd, xdg = tmp_path / "cwd", tmp_path / "xdg"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # the registry process starts here
    args = opentinker_command("registry", "serve", "--port", "0")
    server = ServerProcess(args, tmp_path / "run", env={"XDG_DATA_HOME": str(xdg)})
    try:
        create(server, unique_name("dd-default"))
        pid = server.process.pid
    finally:
        assert server.terminate() == 0
    data_dir = xdg / "opentinker" / "registry"
    assert (data_dir / "redis").is_dir() and (data_dir / "artifacts").is_dir()
    assert (data_dir / "registry.lock").read_text().strip() == str(pid)
    assert list(cwd.iterdir()) == []


def test_a_watcher_leaving_mid_stream_logs_no_task_exception(first: ServerProcess) -> None:
    """The interceptor's stream, dropped by gRPC at a `yield` when the client left, used to be closed by asyncio's
    finalizer in another context: `Task exception was never retrieved ... ContextVar ... different Context`."""
    stop = threading.Event()

    def churn() -> None:  # events keep flowing, so the watches are cut while messages are being sent
        with grpc.insecure_channel(first.address) as channel:
            stub = registry_pb2_grpc.RegistryServiceStub(channel)
            while not stop.is_set():
                stub.CreateAdapter(registry_pb2.CreateAdapterRequest(name=unique_name("dd-churn")), timeout=10)

    writer = threading.Thread(target=churn)
    writer.start()
    try:
        for _ in range(10):
            channel = grpc.insecure_channel(first.address)
            stream = registry_pb2_grpc.RegistryServiceStub(channel).WatchEvents(
                registry_pb2.WatchEventsRequest(after_event_id="0")
            )
            for count, _message in enumerate(stream):
                if count >= 5:
                    break
            channel.close()  # mid-stream
    finally:
        stop.set()
        writer.join()
    create(first, unique_name("dd-after-watch"))  # a round trip: the registry handled the closes by now
    log = first.log()
    assert "Task exception was never retrieved" not in log
    assert "different Context" not in log


def test_after_a_sigkill_the_next_registry_gets_the_data_dir_and_the_data(tmp_path: Path) -> None:
    """The embedded Redis inherits the lock and outlives a SIGKILLed registry by its flush: the next registry
    waits for it (the recorded owner is dead) instead of refusing, and finds every acknowledged write."""
    server = start_registry(tmp_path / "killed")
    name = unique_name("dd-killed")
    create(server, name)
    server.kill()
    again = start_registry(tmp_path / "killed")
    try:
        assert name in names(again)
        assert (tmp_path / "killed" / "registry.lock").read_text().strip() == str(again.process.pid)
    finally:
        assert again.terminate() == 0
