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
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from rich.console import Console
from rich.table import Table

from opentinker.cli.launch import ServerExited, ServerProcess, opentinker_command
from opentinker.cli.stack_file import remove_stack_file, write_stack_file
from opentinker.cli.up_auth import StackAuth, needs_service_token, provision, refuse_unprovisionable
from opentinker.rpc.process.config import SERVER_SECTIONS, UP_SECTION, ConfigError, read_config, resolve_value
from opentinker.rpc.process.dir_lock import DirLock, DirLocked
from opentinker.rpc.process.progress import spinner
from opentinker.rpc.process.startup import StartupError
from opentinker.rpc.serving.errors import InvalidArgument
from opentinker.weights.model_check import check_model
from opentinker.weights.object_store import parse_store_url

STARTUP_SECONDS = {"registry": 60.0, "trainer": 300.0, "sampler": 300.0}
LOCK_NAME = "up"
CONFIG_ERROR_EXIT = 2


class ServiceFailed(Exception):
    """One server of the stack did not start: which one, how it exited, and where its log is."""

    def __init__(self, service: str, returncode: int | None, reason: str, log_path: Path) -> None:
        how = f"exit {returncode}" if returncode is not None else "timed out"
        super().__init__(f"the {service} failed to start ({how}): {reason}; its log: {log_path}")
        self.service = service
        self.returncode = returncode


@dataclass(slots=True)
class StackPlan:
    config_path: Path
    workdir: Path
    services: list[str]
    registry_store: str  # a resolved folder or a bucket URL
    config: dict[str, Any]
    data_dir: Path | None = None  # set when the file names none: WORKDIR/registry
    auth: StackAuth | None = None
    store_override: str | None = None  # `up --store`: every server's store, over the file's

    def args(self, service: str, registry_address: str | None) -> list[str]:
        args = opentinker_command(service, "serve", "--config", str(self.config_path))
        if self.auth is not None:
            args += self.auth.args(service, self.config)
        if self.store_override is not None:
            args += ["--store", self.store_override]
        if service == "registry":
            return args + (["--data-dir", str(self.data_dir)] if self.data_dir is not None else [])
        if registry_address is not None:  # the registry this stack started; command line wins over the file
            args += ["--registry", registry_address]
        configured = resolve_value(self.config, service, "store")
        if self.store_override is None and configured is None:
            args += ["--store", self.registry_store]
        store = self.store_override or (str(configured) if configured is not None else self.registry_store)
        if _is_bucket(store) and resolve_value(self.config, service, "cache_dir") is None:
            args += ["--cache-dir", str(self.workdir / service / "cache")]  # a bucket needs a local cache
        if service == "sampler" and resolve_value(self.config, "sampler", "follow") is None:
            args += ["--follow", "*"]
        return args

    def env(self, service: str) -> dict[str, str]:
        return self.auth.env(service) if self.auth is not None else {}


def _is_bucket(store: str) -> bool:
    try:
        return parse_store_url(store).remote
    except InvalidArgument as exc:
        raise ConfigError(f"store {store!r}: {exc.message}") from None


def plan_stack(config_path: Path, workdir: Path | None = None, store_override: str | None = None) -> StackPlan:
    """Reads the file and decides what to start; ConfigError on anything `up` cannot use."""
    config = read_config(config_path)
    up = config.get(UP_SECTION, {})
    services = up.get("services", list(SERVER_SECTIONS))
    if not isinstance(services, list) or not services or any(s not in SERVER_SECTIONS for s in services):
        raise ConfigError(f"{config_path}: [up] services must be a non-empty list of {list(SERVER_SECTIONS)}")
    if workdir is None:
        workdir = Path(str(up.get("workdir", "opentinker-up")))
    workdir = workdir.resolve()
    configured = resolve_value(config, "registry", "data_dir")
    data_dir = Path(str(configured)) if configured is not None else workdir / "registry"
    store = store_override or resolve_value(config, "registry", "store")
    registry_store = str(store) if store is not None else str(data_dir / "artifacts")
    if not _is_bucket(registry_store):
        registry_store = str(Path(registry_store).resolve())
    ordered = [s for s in SERVER_SECTIONS if s in services]  # the registry first: the others need it
    return StackPlan(
        config_path.resolve(),
        workdir,
        ordered,
        registry_store,
        config,
        data_dir=None if configured is not None else data_dir,
        store_override=store_override,
    )


def validate(plan: StackPlan) -> None:
    """Each server's flags parsed as its own command will parse them (types, ranges, required flags, files that
    must exist), and the model found: ConfigError naming the server before any of them starts."""
    import typer.main

    from opentinker.registry.cli import registry_app
    from opentinker.sampler_server.cli import sampler_app
    from opentinker.trainer_server.cli import trainer_app

    apps = {"registry": registry_app, "trainer": trainer_app, "sampler": sampler_app}
    for service in plan.services:
        group = typer.main.get_command(apps[service])
        command = getattr(group, "commands", {}).get("serve", group)  # an app of one command is that command
        # Any address will do for the check: the real one is known once the registry serves.
        full = plan.args(service, "127.0.0.1:1" if "registry" in plan.services else None)
        args = full[full.index("serve") + 1 :]
        try:
            with command.make_context(f"opentinker {service} serve", args) as ctx:
                model, params = ctx.params.get("model"), ctx.params
        except Exception as exc:  # click's usage errors: the message names the flag
            message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
            raise ConfigError(f"[{service}]: {message}") from None
        if model is not None:
            try:
                check_model(str(model), params.get("revision"), params.get("served_model_name"))
            except StartupError as exc:
                raise ConfigError(f"[{service}]: {exc}") from None


class Interrupted(Exception):
    """SIGINT or SIGTERM while the stack was starting."""


@dataclass
class Stack:
    plan: StackPlan
    quiet: bool = False
    servers: dict[str, ServerProcess] = field(default_factory=dict)
    stop_requested: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        """The registry first (the others need its address), then the trainer and the sampler side by side;
        ServiceFailed names the first that does not start.

        Every child is started from this (the main) thread: it dies with the thread that started it."""
        registry_address = None
        if "registry" in self.plan.services:
            with spinner("starting the registry", quiet=self.quiet):
                self.servers["registry"] = self._spawn("registry", None)
                self._wait(["registry"])
            registry_address = self.servers["registry"].address
        rest = [s for s in self.plan.services if s != "registry"]
        for service in rest:  # kept in self.servers as soon as they run, so stop() ends them on any failure
            self.servers[service] = self._spawn(service, registry_address)
        with spinner(f"starting {' and '.join(rest)} (loading the model)", quiet=self.quiet):
            self._wait(rest)

    def _wait(self, services: list[str]) -> None:
        """Until each serves; the first to exit (or to run past its startup time) fails the stack at once."""
        deadline = {s: time.monotonic() + STARTUP_SECONDS[s] for s in services}
        pending = list(services)
        while pending:
            if self.stop_requested.is_set():
                raise Interrupted
            for service in list(pending):
                server = self.servers[service]
                if server.ready_file.exists() or server.process.poll() is not None:
                    try:
                        server.wait_ready(1.0)
                    except ServerExited as exc:
                        raise ServiceFailed(service, exc.returncode, exc.reason, exc.log_path) from None
                    pending.remove(service)
                elif time.monotonic() > deadline[service]:
                    raise ServiceFailed(
                        service, None, f"not serving after {STARTUP_SECONDS[service]:.0f}s", server.log_path
                    )
            time.sleep(0.05)

    def _spawn(self, service: str, registry_address: str | None) -> ServerProcess:
        # Own session: Ctrl-C reaches only `up`, which then stops the servers itself, in order.
        return ServerProcess(
            self.plan.args(service, registry_address),
            self.plan.workdir / service,
            env=self.plan.env(service),
            own_session=True,
            wait=False,
        )

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
                    codes[service] = server.wait(timeout=60)  # signalled above, once
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
        table.add_row(
            service,
            str(info["address"]),
            f"http://{info['metrics_address']}/metrics",
            str(info["pid"]),
            str(info["log"]),
        )
    console = Console()
    console.print(table)
    console.print("Ctrl-C stops everything.")


def _lock_workdir(workdir: Path) -> DirLock:
    try:
        return DirLock.acquire(workdir, LOCK_NAME, orphan_wait_s=0)
    except DirLocked as exc:
        holder = exc.pid or "unknown"
        raise StartupError(
            f"workdir {exc.directory} is in use by another `opentinker up` (pid {holder}); stop it "
            "or pass another --workdir"
        ) from None


def prepare(config_path: Path, workdir: Path | None, store: str | None = None) -> tuple[StackPlan, DirLock]:
    """Everything before the first server starts: the plan, the workdir's lock, the service token, the checks.
    ConfigError or StartupError (one line each) when the stack cannot start as configured."""
    plan = plan_stack(config_path, workdir, store)
    lock = _lock_workdir(plan.workdir)
    try:
        refuse_unprovisionable(plan.config, plan.services)
        if needs_service_token(plan.config, plan.services):
            plan.auth = provision(plan.config, plan.workdir)
        validate(plan)
    except BaseException:
        lock.release()
        raise
    return plan, lock


def run_up(config_path: Path, workdir: Path | None, as_json: bool, store: str | None = None) -> int:
    """Starts the stack, waits for SIGINT/SIGTERM (or a server exiting), stops it; returns the exit code."""
    try:
        plan, lock = prepare(config_path, workdir, store)
    except (ConfigError, StartupError) as exc:
        print(f"opentinker up: {exc}", file=sys.stderr, flush=True)
        return CONFIG_ERROR_EXIT
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    stack = Stack(plan, quiet=as_json, stop_requested=stop)
    code = 0
    reported: set[str] = set()  # servers whose exit was already named; the stop report does not repeat them
    try:
        try:
            stack.start()
        except Interrupted:
            pass
        except ServiceFailed as exc:
            if not stop.is_set():
                print(f"opentinker up: {exc}", file=sys.stderr, flush=True)
                code = CONFIG_ERROR_EXIT if exc.returncode == CONFIG_ERROR_EXIT else 1
            reported.add(exc.service)
        if code == 0 and not stop.is_set():
            write_stack_file(plan.workdir, stack.describe(), plan.auth.token_file if plan.auth else None)
            _print_addresses(stack, as_json)
            while not stop.wait(0.5):
                gone = stack.exited()
                if gone is not None:
                    returncode = stack.servers[gone].process.returncode
                    print(
                        f"opentinker up: the {gone} exited with {returncode}; stopping the stack (its log: "
                        f"{stack.servers[gone].log_path})",
                        file=sys.stderr,
                        flush=True,
                    )
                    code = 1
                    reported.add(gone)
                    break
    finally:
        remove_stack_file(plan.workdir)
        codes = stack.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        lock.release()
    if as_json:
        print(json.dumps({"event": "stopped", "exit_codes": codes}, sort_keys=True), flush=True)
    else:
        print("stopped " + ", ".join(f"{s} (exit {c})" for s, c in codes.items()), flush=True)
    failed = {service: c for service, c in codes.items() if c != 0 and service not in reported}
    for service, returncode in failed.items():  # a stop that went wrong names who and where to look
        print(
            f"opentinker up: the {service} exited with {returncode} while stopping (its log: "
            f"{stack.servers[service].log_path})",
            file=sys.stderr,
            flush=True,
        )
    if code == 0 and failed:
        code = 1
    return code
