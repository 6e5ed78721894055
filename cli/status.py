"""`opentinker status`: one screen on the running stack (servers up, adapters, versions, slots, queue,
tokens/s, last reloads), read over the same gRPC APIs every client uses."""

from __future__ import annotations

from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rich.console import Console
from rich.table import Table

from opentinker.rpc.errors import describe
from opentinker.v1 import registry_pb2, registry_pb2_grpc, sampler_pb2, sampler_pb2_grpc, trainer_pb2, trainer_pb2_grpc

TIMEOUT = 5.0


def _health(channel: grpc.Channel) -> str:
    try:
        response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
    except grpc.RpcError as exc:
        return f"DOWN ({describe(exc)})"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))


def show_status(registry: str | None, trainer: str | None, sampler: str | None, token: str | None) -> bool:
    """Prints the view; returns False when a named server is not SERVING."""
    console = Console()
    metadata = [("authorization", f"Bearer {token}")] if token else None
    servers = Table("server", "address", "health", title="OpenTinker stack")
    healthy = True
    sections: list[Any] = []
    for name, address in (("registry", registry), ("trainer", trainer), ("sampler", sampler)):
        if not address:
            continue
        with grpc.insecure_channel(address) as channel:
            health = _health(channel)
            servers.add_row(name, address, health)
            if health != "SERVING":
                healthy = False
                continue
            try:
                sections.append(_SECTIONS[name](channel, metadata))
            except grpc.RpcError as exc:
                sections.append(f"{name}: {describe(exc)}")
    console.print(servers)
    for section in sections:
        console.print(section)
    return healthy


def _registry(channel: grpc.Channel, metadata: Any) -> Table:
    stub = registry_pb2_grpc.RegistryServiceStub(channel)
    adapters = stub.ListAdapters(registry_pb2.ListAdaptersRequest(page_size=1000), metadata=metadata, timeout=TIMEOUT)
    table = Table("adapter", "versions", "aliases", "rank", title=f"registry: {len(adapters.adapters)} adapters")
    for adapter in adapters.adapters:
        aliases = ", ".join(f"{k}->{v}" for k, v in sorted(adapter.aliases.items()))
        table.add_row(adapter.name, str(adapter.version_count), aliases, str(adapter.lora_config.rank))
    return table


def _trainer(channel: grpc.Channel, metadata: Any) -> Table:
    stub = trainer_pb2_grpc.TrainerServiceStub(channel)
    info = stub.GetTrainerInfo(trainer_pb2.GetTrainerInfoRequest(), metadata=metadata, timeout=TIMEOUT).base_model
    adapters = stub.ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest(), metadata=metadata, timeout=TIMEOUT)
    title = f"trainer: {info.architecture} on {info.device} ({info.dtype}), {len(adapters.adapters)} adapters"
    table = Table("adapter", "step", "tokens", "pending", "last snapshot", "resident", title=title)
    for adapter in adapters.adapters:
        table.add_row(adapter.name, str(adapter.step), str(adapter.tokens_trained), str(adapter.pending_batches),
                      str(adapter.last_snapshot_version or "-"), "yes" if adapter.resident else "no")  # fmt: skip
    return table


def _sampler(channel: grpc.Channel, metadata: Any) -> Table:
    stub = sampler_pb2_grpc.SamplerServiceStub(channel)
    stats = stub.GetStats(sampler_pb2.GetStatsRequest(), metadata=metadata, timeout=TIMEOUT)
    loaded = stub.ListLoaded(sampler_pb2.ListLoadedRequest(), metadata=metadata, timeout=TIMEOUT)
    title = (
        f"sampler: slots {stats.slots_used}/{stats.slots_total}, running {stats.running_requests}, waiting "
        f"{stats.waiting_requests}/{stats.max_waiting}, {stats.decode_tokens_per_second:.1f} tokens/s, "
        f"{stats.reloads_total} loads ({stats.reload_failures_total} failed)"
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


_SECTIONS = {"registry": _registry, "trainer": _trainer, "sampler": _sampler}
