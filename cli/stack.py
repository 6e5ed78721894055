"""`opentinker up --config FILE`: the whole stack from one TOML file, stopped cleanly on Ctrl-C or SIGTERM.

Each server is a child process started as `opentinker <server> serve --config FILE`, so it reads its own
section (and the shared keys, and its `OPENTINKER_<SERVER>_*` variables) exactly as it would when started by
hand. `up` adds only the wiring: the trainer and the sampler get the address of the registry it started,
the registry's artifact store unless they name their own, and the sampler follows every adapter (`--follow
'*'`) unless the file says otherwise. Logs and ready files go under `[up] workdir` (default `opentinker-up`).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from rich.console import Console
from rich.table import Table

from opentinker.cli.launch import ServerProcess, opentinker_command
from opentinker.rpc.config import SERVER_SECTIONS, UP_SECTION, ConfigError, read_config, resolve_value
from opentinker.rpc.progress import spinner

STARTUP_SECONDS = {"registry": 60.0, "trainer": 300.0, "sampler": 300.0}


@dataclass(slots=True)
class StackPlan:
    config_path: Path
    workdir: Path
    services: list[str]
    registry_store: Path
    config: dict[str, Any]

    def args(self, service: str, registry_address: str | None) -> list[str]:
        args = opentinker_command(service, "serve", "--config", str(self.config_path))
        if service == "registry":
            return args
        if registry_address is not None:  # the registry this stack started; command line wins over the file
            args += ["--registry", registry_address]
        if resolve_value(self.config, service, "store") is None:
            args += ["--store", str(self.registry_store)]
        if service == "sampler" and resolve_value(self.config, "sampler", "follow") is None:
            args += ["--follow", "*"]
        return args


def plan_stack(config_path: Path, workdir: Path | None = None) -> StackPlan:
    """Reads the file and decides what to start; ConfigError on anything `up` cannot use."""
    config = read_config(config_path)
    up = config.get(UP_SECTION, {})
    services = up.get("services", list(SERVER_SECTIONS))
    if not isinstance(services, list) or not services or any(s not in SERVER_SECTIONS for s in services):
        raise ConfigError(f"{config_path}: [up] services must be a non-empty list of {list(SERVER_SECTIONS)}")
    if workdir is None:
        workdir = Path(str(up.get("workdir", "opentinker-up")))
    data_dir = Path(str(resolve_value(config, "registry", "data_dir", "registry-data")))
    store = resolve_value(config, "registry", "store")
    registry_store = Path(str(store)) if store is not None else data_dir / "artifacts"
    ordered = [s for s in SERVER_SECTIONS if s in services]  # the registry first: the others need it
    return StackPlan(config_path.resolve(), workdir, ordered, registry_store, config)


@dataclass
class Stack:
    plan: StackPlan
    quiet: bool = False
    servers: dict[str, ServerProcess] = field(default_factory=dict)

    def start(self) -> None:
        """The registry first (the others need its address), then the trainer and the sampler side by side.

        Every child is started from this (the main) thread: it dies with the thread that started it."""
        registry_address = None
        if "registry" in self.plan.services:
            with spinner("starting the registry", quiet=self.quiet):
                self.servers["registry"] = self._spawn("registry", None)
                self.servers["registry"].wait_ready(STARTUP_SECONDS["registry"])
            registry_address = self.servers["registry"].address
        rest = [s for s in self.plan.services if s != "registry"]
        for service in rest:  # kept in self.servers as soon as they run, so stop() ends them on any failure
            self.servers[service] = self._spawn(service, registry_address)
        with spinner(f"starting {' and '.join(rest)} (loading the model)", quiet=self.quiet):
            for service in rest:
                self.servers[service].wait_ready(STARTUP_SECONDS[service])

    def _spawn(self, service: str, registry_address: str | None) -> ServerProcess:
        # Own session: Ctrl-C reaches only `up`, which then stops the servers itself, in order.
        return ServerProcess(self.plan.args(service, registry_address), self.plan.workdir / service,
                             own_session=True, wait=False)  # fmt: skip

    def exited(self) -> str | None:
        """The first server that is no longer running, if any."""
        for service, server in self.servers.items():
            if server.process.poll() is not None:
                return service
        return None

    def stop(self) -> dict[str, int]:
        """SIGTERM (graceful) to the trainer and the sampler together, then to the registry; their exit codes."""
        codes: dict[str, int] = {}
        for group in ([s for s in self.servers if s != "registry"], [s for s in self.servers if s == "registry"]):
            for service in group:
                if self.servers[service].process.poll() is None:
                    self.servers[service].process.send_signal(signal.SIGTERM)
            for service in group:
                server = self.servers[service]
                try:
                    codes[service] = server.terminate(timeout=60)
                except subprocess.TimeoutExpired:  # still running after its grace period: SIGKILL
                    server.kill()
                    codes[service] = server.process.returncode
        return codes

    def describe(self) -> dict[str, dict[str, object]]:
        return {
            service: {
                "address": server.address,
                "metrics_address": server.metrics_address,
                "pid": server.process.pid,
                "log": str(server.log_path),
            }
            for service, server in self.servers.items()
        }


def _print_addresses(stack: Stack, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"event": "serving", "servers": stack.describe()}, sort_keys=True), flush=True)
        return
    table = Table("server", "address", "metrics", "pid", "log")
    for service, info in stack.describe().items():
        table.add_row(service, str(info["address"]), f"http://{info['metrics_address']}/metrics",
                      str(info["pid"]), str(info["log"]))  # fmt: skip
    console = Console()
    console.print(table)
    console.print("Ctrl-C stops everything.")


def run_up(config_path: Path, workdir: Path | None, as_json: bool) -> int:
    """Starts the stack, waits for SIGINT/SIGTERM (or a server exiting), stops it; returns the exit code."""
    plan = plan_stack(config_path, workdir)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    stack = Stack(plan, quiet=as_json)
    code = 0
    try:
        try:
            stack.start()
        except (RuntimeError, TimeoutError) as exc:
            if not stop.is_set():
                lines = str(exc).splitlines()  # the server's whole log follows the first line: show its end
                shown = lines if len(lines) <= 20 else [lines[0], "...", *lines[-18:]]
                print("opentinker up: " + "\n".join(shown), file=sys.stderr, flush=True)
                code = 1
        if code == 0 and not stop.is_set():
            _print_addresses(stack, as_json)
            while not stop.wait(0.5):
                gone = stack.exited()
                if gone is not None:
                    returncode = stack.servers[gone].process.returncode
                    print(f"opentinker up: {gone} exited with {returncode}; stopping (log: "
                          f"{stack.servers[gone].log_path})", file=sys.stderr, flush=True)  # fmt: skip
                    code = 1
                    break
    finally:
        codes = stack.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if as_json:
        print(json.dumps({"event": "stopped", "exit_codes": codes}, sort_keys=True), flush=True)
    else:
        print("stopped " + ", ".join(f"{s} (exit {c})" for s, c in codes.items()), flush=True)
    if any(c != 0 for c in codes.values()):
        code = 1
    return code
