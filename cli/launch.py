"""Start OpenTinker servers as child processes and wait until they serve (used by the demo, the
benchmarks and the tests). Each server writes its address to --ready-file once it is serving."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from opentinker.rpc.process.children import die_with_parent


class ServerExited(RuntimeError):
    """The server exited before it served; the message holds its whole log, `reason` its last line."""

    def __init__(self, returncode: int, log_path: Path, log: str) -> None:
        super().__init__(f"server exited with {returncode}:\n{log}")
        self.returncode = returncode
        self.log_path = log_path
        lines = [line for line in log.splitlines() if line.strip()]
        self.reason = lines[-1].strip() if lines else "(its log is empty)"


class ServerProcess:
    def __init__(
        self,
        args: list[str],
        workdir: Path,
        *,
        timeout: float = 60.0,
        env: dict[str, str] | None = None,
        own_session: bool = False,
        wait: bool = True,
    ) -> None:
        """own_session: the child gets its own session (a terminal's Ctrl-C or a signal to our process group
        does not reach it, so only we stop it, in order) and dies with us even on SIGKILL (with the thread that
        started it: start it from a thread that outlives it). wait=False: call wait_ready() before use."""
        workdir.mkdir(parents=True, exist_ok=True)
        self.ready_file = workdir / "ready.json"
        self.ready_file.unlink(missing_ok=True)
        self.log_path = workdir / "server.log"
        self._log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [*args, "--ready-file", str(self.ready_file)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
            start_new_session=own_session,
            preexec_fn=die_with_parent if own_session else None,  # noqa: PLW1509 -- only prctl
        )
        if wait:
            self.wait_ready(timeout)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until the server writes its ready file; sets address and metrics_address."""
        deadline = time.monotonic() + timeout
        while not self.ready_file.exists():
            if self.process.poll() is not None:
                raise ServerExited(self.process.returncode, self.log_path, self.log())
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"server not ready after {timeout}s:\n{self.log()}")
            time.sleep(0.05)
        info = json.loads(self.ready_file.read_text())
        self.address: str = info["address"]
        self.metrics_address: str | None = info["metrics_address"]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM (graceful shutdown) and wait; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def wait(self, timeout: float) -> int:
        """Waits for an exit already asked for, without asking again: a second SIGTERM that lands after the server's
        graceful shutdown put the default handler back kills it (exit -15)."""
        code = self.process.wait(timeout)
        self._log.close()
        return code

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._log.close()


def opentinker_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "opentinker.cli.main", *args]


def start_registry(workdir: Path, *extra: str, env: dict[str, str] | None = None) -> ServerProcess:
    """A registry process; without --redis-url in extra it runs its own embedded Redis under workdir."""
    args = opentinker_command(
        "registry", "serve", "--port", "0", "--data-dir", str(workdir), "--store", str(workdir / "artifacts"), *extra
    )
    return ServerProcess(args, workdir, env=env)


def registry_store(registry: ServerProcess) -> Path:
    return registry.ready_file.parent / "artifacts"


def start_trainer(
    workdir: Path, model: Path, registry: ServerProcess, *extra: str, env: dict[str, str] | None = None
) -> ServerProcess:
    """A trainer process on the given model, sharing the registry's artifact store."""
    return _model_server("trainer", workdir, model, registry, "--spill-dir", str(workdir / "spill"), *extra, env=env)


def start_sampler(
    workdir: Path, model: Path, registry: ServerProcess, *extra: str, env: dict[str, str] | None = None
) -> ServerProcess:
    """A sampler process on the given model, sharing the registry's artifact store."""
    return _model_server("sampler", workdir, model, registry, *extra, env=env)


def _model_server(
    role: str, workdir: Path, model: Path, registry: ServerProcess, *extra: str, env: dict[str, str] | None
) -> ServerProcess:
    """`opentinker <role> serve` on the CPU, any free port, the model and the registry's store: the flags
    model_server_flags gives both servers."""
    store = str(registry_store(registry))
    args = opentinker_command(
        role,
        "serve",
        "--model",
        str(model),
        "--registry",
        registry.address,
        "--store",
        store,
        "--port",
        "0",
        "--device",
        "cpu",
        *extra,
    )
    return ServerProcess(args, workdir, timeout=120, env=env)


def tree_memory(pid: int) -> int:
    """Bytes of memory a server holds: the proportional set size (PSS) of its process and of its children (the
    sampler's engine process), so that the pages they share (adapter slots) count once, not once per process."""
    import psutil

    root = psutil.Process(pid)
    return sum(int(p.memory_full_info().pss) for p in (root, *root.children(recursive=True)))
