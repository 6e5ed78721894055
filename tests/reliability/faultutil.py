"""Helpers for the fault tests (tests/reliability/test_fault_*.py): fast restarts of real server processes,
valid LoRA artifacts for the tiny model, Prometheus scraping, memory (PSS).

Restarting a trainer or sampler with `python -m opentinker.cli.main` costs 5-10 s here, mostly imports
(torch, transformers). The fault tests kill and restart servers dozens of times, so they start them from a
*zygote*: one helper process that imports everything once and then forks a child per server. Each child is a
real, separate OS process that runs the same CLI entry point (`opentinker trainer serve ...`) with its own
environment, log and ready file, and is SIGKILLed for real. The zygote never creates a gRPC channel, a torch
thread pool or a thread of its own before forking, so the children start clean.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import io
import json
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

from serverproc import ServerProcess, registry_store

from opentinker.cli.launch import tree_memory
from opentinker.v1 import sampler_pb2, sampler_pb2_grpc

SOAK = os.environ.get("OPENTINKER_SOAK") == "1"
HERE = Path(__file__).resolve().parent

# Imported once by the zygote; children inherit them already loaded.
_PRELOAD = (
    "grpc",
    "grpc.aio",
    "grpc_health.v1.health",
    "grpc_reflection.v1alpha.reflection",
    "prometheus_client",
    "redis.asyncio",
    "torch",
    "safetensors.torch",
    "transformers",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.auto.tokenization_auto",
    "opentinker.cli.main",
    "opentinker.rpc.serving.server",
    "opentinker.trainer_server.service",
    "opentinker.trainer_server.trainer",
    "opentinker.trainer_server.base_model",
    "opentinker.sampler_server.service",
    "opentinker.sampler_server.engine",
    "opentinker.sampler_server.follower",
    "opentinker.sampler_server.model.llama",
)


def _die_with_parent(sig: int = signal.SIGKILL) -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, sig)  # PR_SET_PDEATHSIG


# --- the zygote (runs in its own process) ---------------------------------------------------------------


def zygote_main() -> None:
    """Entry point of the zygote: preload, then fork one child per JSON line read from stdin."""
    for module in _PRELOAD:
        importlib.import_module(module)
    out = os.fdopen(os.dup(1), "w", buffering=1)
    out.write(json.dumps({"ready": True}) + "\n")
    children: set[int] = set()
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.05)
        _reap(children, out)
        if not readable:
            continue
        data = os.read(0, 65536)
        if not data:
            break
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            out.flush()
            pid = os.fork()
            if pid == 0:
                out.close()
                _child(request["argv"], request["env"], request["log"])
            children.add(pid)
            out.write(json.dumps({"id": request["id"], "pid": pid}) + "\n")
    for pid in children:
        os.kill(pid, signal.SIGKILL)
    for pid in children:
        os.waitpid(pid, 0)


def _reap(children: set[int], out: io.TextIOBase) -> None:
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        children.discard(pid)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        out.write(json.dumps({"exit": pid, "code": code}) + "\n")


def _child(argv: list[str], env: dict[str, str], log: str) -> None:
    code = 1
    try:
        _die_with_parent()
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 -- the process's stdout
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.environ.update(env)
        from opentinker.cli.main import app

        try:
            app(args=argv, prog_name="opentinker")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


# --- the test side ----------------------------------------------------------------------------------------


class Zygote:
    def __init__(self) -> None:
        path = os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")])
        self.process = subprocess.Popen(
            [sys.executable, "-c", "import faultutil; faultutil.zygote_main()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"},
            preexec_fn=_die_with_parent,  # noqa: PLW1509 -- only prctl
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self._stdin = self.process.stdin
        first = self.process.stdout.readline()
        if not first:
            raise RuntimeError(f"zygote failed to start (exit {self.process.wait()})")
        self._cond = threading.Condition()
        self._pids: dict[int, int] = {}
        self._exits: dict[int, int] = {}
        self._next = 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            message = json.loads(line)
            with self._cond:
                if "exit" in message:
                    self._exits[message["exit"]] = message["code"]
                else:
                    self._pids[message["id"]] = message["pid"]
                self._cond.notify_all()

    def spawn(self, argv: list[str], env: dict[str, str], log: Path) -> int:
        with self._cond:
            self._next += 1
            key = self._next
            self._stdin.write((json.dumps({"id": key, "argv": argv, "env": env, "log": str(log)}) + "\n").encode())
            self._stdin.flush()
            if not self._cond.wait_for(lambda: key in self._pids, timeout=30):
                raise RuntimeError("zygote did not fork")
            return self._pids.pop(key)

    def exit_code(self, pid: int) -> int | None:
        with self._cond:
            return self._exits.get(pid)

    def wait(self, pid: int, timeout: float) -> int:
        with self._cond:
            if not self._cond.wait_for(lambda: pid in self._exits, timeout=timeout):
                raise TimeoutError(f"process {pid} still running after {timeout}s")
            return self._exits[pid]

    def stop(self) -> None:
        if self.process.poll() is None:
            self._stdin.close()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()


_ZYGOTES: list[Zygote] = []
_ZYGOTE_LOCK = threading.Lock()


def zygote() -> Zygote:
    """The session's zygote, started on first use (about as long as one server start), stopped at exit."""
    with _ZYGOTE_LOCK:
        if not _ZYGOTES:
            _ZYGOTES.append(Zygote())
            atexit.register(_ZYGOTES[0].stop)
        return _ZYGOTES[0]


class ForkedServer:
    """A server process forked by the zygote; the same interface as serverproc.ServerProcess."""

    def __init__(
        self, argv: list[str], workdir: Path, *, env: dict[str, str] | None = None, timeout: float = 60
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.ready_file = workdir / "ready.json"
        self.ready_file.unlink(missing_ok=True)
        self.log_path = workdir / "server.log"
        self.zygote = zygote()
        self.pid = self.zygote.spawn([*argv, "--ready-file", str(self.ready_file)], env or {}, self.log_path)
        deadline = time.monotonic() + timeout
        while (info := self._ready()) is None:
            if self.returncode is not None:
                raise RuntimeError(f"server exited with {self.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"server not ready after {timeout}s:\n{self.log()}")
            time.sleep(0.02)
        self.address: str = str(info["address"])
        self.metrics_address: str | None = info["metrics_address"]

    def _ready(self) -> dict[str, str | None] | None:
        """The ready file's content once the server has written it (None before)."""
        try:
            info: dict[str, str | None] = json.loads(self.ready_file.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return info

    @property
    def returncode(self) -> int | None:
        return self.zygote.exit_code(self.pid)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float = 30) -> int:
        return self.zygote.wait(self.pid, timeout)

    def kill(self) -> int:
        """SIGKILL (no shutdown code runs); returns the exit code (-9)."""
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)
        return self.wait()

    def terminate(self, timeout: float = 30) -> int:
        if self.returncode is None:
            os.kill(self.pid, signal.SIGTERM)
        return self.wait(timeout)

    def memory(self) -> int:
        """PSS of the server and its children (the sampler's engine process)."""
        return tree_memory(self.pid)


def trainer_argv(model: Path, registry: str, store: Path, workdir: Path, *extra: str) -> list[str]:
    return [
        "trainer",
        "serve",
        "--model",
        str(model),
        "--registry",
        registry,
        "--store",
        str(store),
        "--port",
        "0",
        "--device",
        "cpu",
        "--spill-dir",
        str(workdir / "spill"),
        *extra,
    ]


def sampler_argv(model: Path, registry: str, store: Path, *extra: str) -> list[str]:
    return [
        "sampler",
        "serve",
        "--model",
        str(model),
        "--registry",
        registry,
        "--store",
        str(store),
        "--port",
        "0",
        "--device",
        "cpu",
        *extra,
    ]


def fork_trainer(
    workdir: Path, model: Path, registry: ServerProcess, *extra: str, env: dict[str, str] | None = None
) -> ForkedServer:
    argv = trainer_argv(model, registry.address, registry_store(registry), workdir, *extra)
    return ForkedServer(argv, workdir, env=env)


def fork_sampler(workdir: Path, model: Path, registry: ServerProcess, *extra: str) -> ForkedServer:
    return ForkedServer(sampler_argv(model, registry.address, registry_store(registry), *extra), workdir)


# --- observing servers ----------------------------------------------------------------------------------------


def wait_for(condition: Callable[[], object], timeout: float = 30.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return bool(condition())


def kill_delays(seed: int, count: int, low: float, high: float) -> Iterator[float]:
    rng = random.Random(seed)
    for _ in range(count):
        yield rng.uniform(low, high)


def long_prompt(sampler: sampler_pb2_grpc.SamplerServiceStub, reference: str, max_tokens: int) -> list[int]:
    """A prompt whose greedy continuation under `reference` runs all `max_tokens` (no end-of-sequence token),
    so that a stream of it is still open whenever a test cuts it."""
    from samplerutil import params, request
    from trainerutil import random_tokens

    for seed in range(20):
        prompt = random_tokens(20_000 + seed, 8)
        stop = sampler_pb2.STOP_REASON_UNSPECIFIED
        for message in sampler.Sample(request(reference, prompt, params(max_tokens=max_tokens)), timeout=120):
            stop = message.stop_reason or stop
        if stop == sampler_pb2.STOP_REASON_LENGTH:
            return prompt
    raise AssertionError(f"no prompt of 20 runs {max_tokens} greedy tokens under {reference}")
