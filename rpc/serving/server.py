"""Start a gRPC server the one way every OpenTinker server starts.

`run_server` binds (port 0 = a free port, printed), adds health + reflection + the service interceptor,
serves Prometheus metrics on a side port, and on SIGTERM/SIGINT shuts down gracefully: health
NOT_SERVING, a drain pause so load balancers notice, then stop with a grace period for in-flight RPCs.
"""

from __future__ import annotations

import asyncio
import faulthandler
import ipaddress
import json
import logging
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from opentinker.rpc.serving.auth import TokenTable
from opentinker.rpc.serving.interceptor import ServiceInterceptor, TenantCalls

log = logging.getLogger("opentinker.rpc")

# A dependency's health, for the standard health service under the dependency's own name: True while it works.
HealthCheck = Callable[[], Awaitable[bool]]
HEALTH_CHECK_INTERVAL_S = 1.0

# Weights never travel in one message (they move as files or chunked streams); 64 MiB bounds batches.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass(slots=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 0
    # None: no metrics endpoint; 0: a free port.
    metrics_port: int | None = 0
    tokens_file: Path | None = None
    insecure_public: bool = False
    tls_cert: Path | None = None
    tls_key: Path | None = None
    drain_seconds: float = 0.5
    grace_seconds: float = 10.0
    # Written as JSON {"address", "metrics_address", "pid"} once serving (for supervisors and tests).
    ready_file: Path | None = None
    # gRPC max send/receive message length (--max-message-mb).
    max_message_bytes: int = MAX_MESSAGE_BYTES
    # Calls one user tenant may have in flight (--max-calls-per-tenant; 0: no limit; interceptor.TenantCalls).
    max_calls_per_tenant: int = 0


@dataclass(slots=True)
class ServiceBinding:
    """One gRPC service to serve: its full name and the generated add_*_to_server call."""

    name: str
    add_to_server: Callable[[aio.Server], None]


@dataclass(slots=True)
class RunningServer:
    server: aio.Server
    health: HealthServicer
    address: str
    metrics_address: str | None
    service_names: list[str] = field(default_factory=list)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)

    def request_stop(self) -> None:
        self.stopping.set()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ServerConfigError(ValueError):
    """Refusal to start with an unsafe or inconsistent configuration."""


def _check_exposure(options: ServerOptions, tokens: TokenTable | None) -> None:
    if tokens is None and not is_loopback(options.host) and not options.insecure_public:
        raise ServerConfigError(
            f"refusing to bind {options.host} without authentication: configure tokens "
            "(--tokens-file or OPENTINKER_TOKENS_FILE) or pass --insecure-public"
        )
    if (options.tls_cert is None) != (options.tls_key is None):
        raise ServerConfigError("--tls-cert and --tls-key go together")


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


async def start_server(component: str, bindings: Sequence[ServiceBinding], options: ServerOptions) -> RunningServer:
    tokens = TokenTable.load(options.tokens_file)
    _check_exposure(options, tokens)
    server = aio.server(
        interceptors=[ServiceInterceptor(tokens, TenantCalls(options.max_calls_per_tenant, "--max-calls-per-tenant"))],
        options=[
            ("grpc.max_receive_message_length", options.max_message_bytes),
            ("grpc.max_send_message_length", options.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ],
    )
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = [binding.name for binding in bindings]
    for binding in bindings:
        binding.add_to_server(server)
    reflection.enable_server_reflection(
        [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], server
    )

    target = f"[{options.host}]:{options.port}" if ":" in options.host else f"{options.host}:{options.port}"
    if options.tls_cert is not None and options.tls_key is not None:
        credentials = grpc.ssl_server_credentials([(options.tls_key.read_bytes(), options.tls_cert.read_bytes())])
        port = server.add_secure_port(target, credentials)
    else:
        port = server.add_insecure_port(target)
    if port == 0:
        raise ServerConfigError(f"cannot bind {target}")
    await server.start()
    host = f"[{options.host}]" if ":" in options.host else options.host
    address = f"{host}:{port}"

    metrics_address = None
    if options.metrics_port is not None:
        metrics_port = options.metrics_port or _free_port(options.host)
        http_server, _ = start_http_server(metrics_port, addr=options.host)
        metrics_address = f"{host}:{http_server.server_port}"

    for name in ["", *names]:
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    running = RunningServer(server, health, address, metrics_address, names)
    log.info("%s serving on %s (metrics %s)", component, address, metrics_address)
    print(
        f"opentinker {component} serving on {address}" + (f", metrics on {metrics_address}" if metrics_address else ""),
        flush=True,
    )
    if options.ready_file is not None:
        write_ready_file(options.ready_file, address, metrics_address)
    return running


def write_ready_file(path: Path, address: str, metrics_address: str | None) -> None:
    """Written aside and renamed: a supervisor polling for the file never reads it half-written."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({"address": address, "metrics_address": metrics_address}))
    partial.replace(path)


async def stop_server(running: RunningServer, options: ServerOptions) -> None:
    await running.health.enter_graceful_shutdown()
    await asyncio.sleep(options.drain_seconds)
    await running.server.stop(options.grace_seconds)


@dataclass(frozen=True, slots=True)
class ServerHooks:
    """What a server runs around serving, in order: ``on_start(address)`` once it serves (the sampler registers
    with the fleet there), ``on_drain()`` on SIGTERM before the health service flips (it tells the registry it
    drains, so routers stop first), ``on_stop()`` after the last RPC. ``health_checks``: dependencies
    reported in the health service under their own names (report_health)."""

    on_start: Callable[[str], Awaitable[None]] | None = None
    on_drain: Callable[[], Awaitable[None]] | None = None
    on_stop: Callable[[], Awaitable[None]] | None = None
    health_checks: Mapping[str, HealthCheck] = field(default_factory=dict)


async def run_server(
    component: str, bindings: Sequence[ServiceBinding], options: ServerOptions, hooks: ServerHooks | None = None
) -> None:
    """Serve until SIGTERM/SIGINT, then shut down gracefully, running the hooks on the way."""
    hooks = hooks or ServerHooks()
    running = await start_server(component, bindings, options)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, running.request_stop)
    reporter = asyncio.create_task(report_health(running.health, hooks.health_checks))
    try:
        if hooks.on_start is not None:
            await hooks.on_start(running.address)
        await running.stopping.wait()
        log.info("%s shutting down", component)
        if hooks.on_drain is not None:
            await hooks.on_drain()
        await stop_server(running, options)
    finally:
        reporter.cancel()
        if hooks.on_stop is not None:
            await hooks.on_stop()
    print(f"opentinker {component} stopped", flush=True)


async def report_health(health: HealthServicer, checks: Mapping[str, HealthCheck]) -> None:
    """Every second, each dependency's check as the health status of its name (``opentinker.store``: SERVING or
    NOT_SERVING). The server's own status ("") is not touched: a sampler whose store is down still serves
    every version it holds, so a load balancer must keep it; a prober asks for the dependency by name."""
    for name in checks:
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)  # until a check says otherwise
    while checks:
        for name, check in checks.items():
            try:
                ok = await check()
            except Exception:  # a check that breaks is a dependency not known to work
                log.exception("health check %s failed", name)
                ok = False
            status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
            await health.set(name, status)  # ignored once graceful shutdown has set everything NOT_SERVING
        await asyncio.sleep(HEALTH_CHECK_INTERVAL_S)


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def exit_if_unsafe(component: str, options: ServerOptions) -> None:
    """The exposure checks of start_server, run before a slow startup (loading a model): exit 2 at once."""
    try:
        _check_exposure(options, TokenTable.load(options.tokens_file))
    except ServerConfigError as exc:
        print(f"opentinker {component}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def serve_forever(
    component: str,
    bindings: Sequence[ServiceBinding],
    options: ServerOptions,
    hooks: ServerHooks | None = None,
) -> None:
    """Process entry point: run the server; a configuration refusal exits 2 with one clear line."""
    # A crash in native code (grpc, torch) kills the process with a signal and no Python traceback; this puts the
    # stacks of every thread in the server's log (stderr) instead, so an exit code like -11 has a cause to read.
    faulthandler.enable()
    try:
        asyncio.run(run_server(component, bindings, options, hooks))
    except ServerConfigError as exc:
        print(f"opentinker {component}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
