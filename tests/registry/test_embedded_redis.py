"""The embedded Redis: starts on a free port, is used, and leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from opentinker.registry.embedded_redis import EmbeddedRedis


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_starts_serves_and_stops(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path).start()
    assert server.process is not None
    pid = server.process.pid
    assert server.port not in (0, 6379)
    client = redis.Redis.from_url(server.url)
    client.set("k", "v")
    assert client.get("k") == b"v"
    assert client.config_get("appendonly")["appendonly"] == "yes"
    client.close()
    server.stop()
    assert not pid_alive(pid)
    assert (tmp_path / "redis.log").exists()


def test_data_persists_across_restart(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path) as server:
        client = redis.Redis.from_url(server.url)
        client.xadd("events", {"n": "1"})
        client.close()
    with EmbeddedRedis(tmp_path) as server:
        client = redis.Redis.from_url(server.url)
        assert client.xlen("events") == 1
        client.close()


def test_dies_with_its_parent(tmp_path: Path) -> None:
    """A SIGKILLed owner must not leave an orphan redis-server behind."""
    script = (
        "import sys, time; from pathlib import Path;"
        "from opentinker.registry.embedded_redis import EmbeddedRedis;"
        f"s = EmbeddedRedis(Path({str(tmp_path)!r})).start();"
        "print(s.process.pid, flush=True); time.sleep(60)"
    )
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    redis_pid = int(owner.stdout.readline())
    assert pid_alive(redis_pid)
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    deadline = time.monotonic() + 10
    while pid_alive(redis_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(redis_pid)


def test_relative_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`registry serve --data-dir registry-data` (a relative path) must work: redis changes directory first."""
    monkeypatch.chdir(tmp_path)
    with EmbeddedRedis(Path("relative") / "redis") as server:
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        client.close()
    assert (tmp_path / "relative" / "redis" / "redis.log").exists()
