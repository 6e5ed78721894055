"""`opentinker status`: one screen on the running stack (servers up, adapters, versions, slots, queue,
tokens/s, last reloads), read through the SDK's clients and connections (plaintext, or TLS with ca_cert)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpc_health.v1 import health_pb2, health_pb2_grpc
from rich.console import Console
from rich.table import Table

from opentinker.cli.failure import describe
from opentinker.client import OpenTinkerError, RegistryClient, ServiceClient
from opentinker.client.connection import Connection
from opentinker.v1 import sampler_pb2, sampler_pb2_grpc

TIMEOUT = 5.0


def _health(address: str, ca_cert: Path | None) -> str:
    # The health service answers without a token, as load balancers ask it.
    connection = Connection(address, health_pb2_grpc.HealthStub, None, timeout=TIMEOUT, ca_cert=ca_cert)
    try:
        response = connection.unary("Check", health_pb2.HealthCheckRequest(), health_pb2.HealthCheckResponse)
    except OpenTinkerError as exc:
        return f"DOWN ({describe(exc, ca_cert)})"
    finally:
        connection.close()
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))


def show_status(
    registry: str | None, trainer: str | None, sampler: str | None, token: str | None, ca_cert: Path | None = None
) -> bool:
    """Prints the view; returns False when a named server is not SERVING."""
    console = Console()
    servers = Table("server", "address", "health", title="OpenTinker stack")
    healthy = True
    sections: list[Any] = []
    for name, address in (("registry", registry), ("trainer", trainer), ("sampler", sampler)):
        if not address:
            continue
        health = _health(address, ca_cert)
        servers.add_row(name, address, health)
        if health != "SERVING":
            healthy = False
            continue
        try:
            sections.append(_SECTIONS[name](address, token, ca_cert))
        except OpenTinkerError as exc:
            sections.append(f"{name}: {describe(exc, ca_cert)}")
    console.print(servers)
    for section in sections:
        console.print(section)
    return healthy


def _registry(address: str, token: str | None, ca_cert: Path | None) -> Table:
    with RegistryClient(address, token, timeout=TIMEOUT, ca_cert=ca_cert) as client:
        adapters = client.list_adapters()
    table = Table("adapter", "versions", "aliases", "rank", title=f"registry: {len(adapters)} adapters")
    for adapter in adapters:
        aliases = ", ".join(f"{k}->{v}" for k, v in sorted(adapter.aliases.items()))
        table.add_row(adapter.name, str(adapter.version_count), aliases, str(adapter.rank))
    return table


def _trainer(address: str, token: str | None, ca_cert: Path | None) -> Table:
    with ServiceClient(trainer=address, token=token, timeout=TIMEOUT, ca_cert=ca_cert) as client:
        info = client.get_trainer_info()
        adapters = client.list_training_adapters()
    title = f"trainer: {info.architecture} on {info.device} ({info.dtype}), {len(adapters)} adapters"
    table = Table("adapter", "step", "tokens", "pending", "last snapshot", "resident", title=title)
    for adapter in adapters:
        table.add_row(adapter.name, str(adapter.step), str(adapter.tokens_trained), str(adapter.pending_batches),
                      str(adapter.last_snapshot_version or "-"), "yes" if adapter.resident else "no")  # fmt: skip
    return table


def _sampler(address: str, token: str | None, ca_cert: Path | None) -> Table:
    # The SDK's records of a sampler carry no reload history and no slot listing: read the replies themselves,
    # over the SDK's connection (channel, credentials and token built in one place).
    connection = Connection(address, sampler_pb2_grpc.SamplerServiceStub, token, timeout=TIMEOUT, ca_cert=ca_cert)
    try:
        stats = connection.unary("GetStats", sampler_pb2.GetStatsRequest(), sampler_pb2.GetStatsResponse)
        loaded = connection.unary("ListLoaded", sampler_pb2.ListLoadedRequest(), sampler_pb2.ListLoadedResponse)
    finally:
        connection.close()
    title = (
        f"sampler: slots {stats.slots_used}/{stats.slots_total}, running {stats.running_requests}, waiting "
        f"{stats.waiting_requests}/{stats.max_waiting}, {stats.decode_tokens_per_second:.1f} tokens/s, "
        f"{stats.adapter_loads_total} loads ({stats.reload_failures_total} failed)"
    )
    table = Table("slot", "version", "serving", "rank", "requests", "pinned", title=title)
    for adapter in loaded.adapters:
        table.add_row(str(adapter.slot), f"{adapter.version.adapter}@{adapter.version.version}",
                      ", ".join(adapter.serving_aliases), str(adapter.rank), str(adapter.active_requests),
                      "yes" if adapter.pinned else "")  # fmt: skip
    for record in list(stats.recent_reloads)[-5:]:
        outcome = f"{record.latency_seconds * 1000:.1f} ms" if record.ok else f"failed: {record.error}"
        table.add_row("", f"{record.adapter}@{record.to_version}", f"reload {record.alias}", "", "", outcome)
    return table


_SECTIONS: dict[str, Callable[[str, str | None, Path | None], Table]] = {
    "registry": _registry,
    "trainer": _trainer,
    "sampler": _sampler,
}
