"""`opentinker status`: one screen on the running stack (servers up, adapters, versions, slots, queue,
tokens/s, last reloads), read through the SDK's clients and connections (plaintext, or TLS with ca_cert).

`--json` prints the same as one document: every server's address and health, and each serving one's replies in
the wire's JSON form with every field (zeros and empty lists included), so a script never meets a missing key.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rich.table import Table

from opentinker.cli.console import table_console
from opentinker.cli.failure import describe
from opentinker.cli.registry_json import adapter_json
from opentinker.client import OpenTinkerError, RegistryClient, SamplerStats
from opentinker.client.connection import Connection
from opentinker.client.wire import sampler_stats_from_proto
from opentinker.v1 import sampler_pb2, sampler_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from opentinker.weights.artifact_bucket import STORE_HEALTH

TIMEOUT = 5.0
RECENT_RELOADS = 5


@dataclass(frozen=True, slots=True)
class Section:
    tables: list[Table | str]
    data: dict[str, Any]


def _dump(message: Message) -> dict[str, Any]:
    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _health(address: str, ca_cert: Path | None, service: str = "") -> str | None:
    """The server's health ("": the server itself), or a dependency's (STORE_HEALTH); None when the server
    reports no such dependency (a trainer or sampler on a folder store)."""
    # The health service answers without a token, as load balancers ask it.
    connection = Connection(address, health_pb2_grpc.HealthStub, None, timeout=TIMEOUT, ca_cert=ca_cert)
    request = health_pb2.HealthCheckRequest(service=service)
    try:
        response = connection.unary("Check", request, health_pb2.HealthCheckResponse)
    except OpenTinkerError as exc:
        if service and exc.code == grpc.StatusCode.NOT_FOUND:
            return None
        return f"DOWN ({describe(exc, ca_cert)})"
    finally:
        connection.close()
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))


def show_status(
    registry: str | None,
    trainer: str | None,
    sampler: str | None,
    token: str | None,
    ca_cert: Path | None = None,
    as_json: bool = False,
) -> bool:
    """Prints the view; returns False when a named server is not SERVING."""
    servers = Table("server", "address", "health", title="OpenTinker stack")
    healthy = True
    document: dict[str, Any] = {"servers": {}}
    sections: list[Table | str] = []
    for name, address in (("registry", registry), ("trainer", trainer), ("sampler", sampler)):
        if not address:
            continue
        health = _health(address, ca_cert) or "DOWN"  # never None for the server itself
        store = _health(address, ca_cert, STORE_HEALTH) if health == "SERVING" and name != "registry" else None
        servers.add_row(name, address, health + (f" (store {store})" if store else ""))
        entry: dict[str, Any] = {"address": address, "health": health}
        if store:
            entry["store_health"] = store  # NOT_SERVING: its object store is down; what it holds still serves
        document["servers"][name] = entry
        if health != "SERVING":
            healthy = False
            continue
        try:
            section = _SECTIONS[name](address, token, ca_cert)
        except OpenTinkerError as exc:
            entry["error"] = describe(exc, ca_cert)
            sections.append(f"{name}: {entry['error']}")
            continue
        entry.update(section.data)
        sections.extend(section.tables)
    if as_json:
        print(json.dumps(document, indent=2, sort_keys=True))
        return healthy
    console = table_console()
    console.print(servers)
    for item in sections:
        console.print(item)
    return healthy


def _registry(address: str, token: str | None, ca_cert: Path | None) -> Section:
    with RegistryClient(address, token, timeout=TIMEOUT, ca_cert=ca_cert) as client:
        adapters = client.list_adapters()
    table = Table("adapter", "versions", "aliases", "rank", title=f"registry: {len(adapters)} adapters")
    for adapter in adapters:
        aliases = ", ".join(f"{k}->{v}" for k, v in sorted(adapter.aliases.items()))
        table.add_row(adapter.name, str(adapter.version_count), aliases, str(adapter.rank))
    return Section([table], {"adapters": [adapter_json(a) for a in adapters]})


def _trainer(address: str, token: str | None, ca_cert: Path | None) -> Section:
    # The replies themselves, as for the sampler: the JSON keeps every field of the wire form.
    connection = Connection(address, trainer_pb2_grpc.TrainerServiceStub, token, timeout=TIMEOUT, ca_cert=ca_cert)
    try:
        info = connection.unary(
            "GetTrainerInfo", trainer_pb2.GetTrainerInfoRequest(), trainer_pb2.GetTrainerInfoResponse
        )
        listed = connection.unary(
            "ListAdapters",
            trainer_pb2.TrainerServiceListAdaptersRequest(),
            trainer_pb2.TrainerServiceListAdaptersResponse,
        )
    finally:
        connection.close()
    base = info.base_model
    title = f"trainer: {base.architecture} on {base.device} ({base.dtype}), {len(listed.adapters)} adapters"
    table = Table("adapter", "step", "tokens", "pending", "last snapshot", "resident", title=title)
    for adapter in listed.adapters:
        table.add_row(
            adapter.name,
            str(adapter.step),
            str(adapter.tokens_trained),
            str(adapter.pending_batches),
            str(adapter.last_snapshot_version or "-"),
            "yes" if adapter.resident else "no",
        )
    return Section([table], {"info": _dump(info), "adapters": [_dump(a) for a in listed.adapters]})


def _sampler(address: str, token: str | None, ca_cert: Path | None) -> Section:
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
    slots = Table("slot", "version", "serving", "rank", "requests", "pinned", title=title)
    for adapter in loaded.adapters:
        slots.add_row(
            str(adapter.slot),
            f"{adapter.version.adapter}@{adapter.version.version}",
            ", ".join(adapter.serving_aliases),
            str(adapter.rank),
            str(adapter.active_requests),
            "yes" if adapter.pinned else "",
        )
    tables: list[Table | str] = [slots, kv_cache_line(sampler_stats_from_proto(stats))]
    recent = list(stats.recent_reloads)[-RECENT_RELOADS:]
    if recent:  # a table of their own: a reload's outcome is no slot's "pinned"
        reloads = Table("version", "alias", "outcome", title=f"sampler: last {len(recent)} reloads")
        for record in recent:
            outcome = f"{record.latency_seconds * 1000:.1f} ms" if record.ok else f"failed: {record.error}"
            reloads.add_row(f"{record.adapter}@{record.to_version}", record.alias, outcome)
        tables.append(reloads)
    return Section(tables, {"stats": _dump(stats), "loaded": [_dump(a) for a in loaded.adapters]})


def kv_cache_line(stats: SamplerStats) -> str:
    """The paged KV cache at a glance: blocks (engine-wide, an admin's view), the caller's own prefix-cache
    hit rate, preemptions."""
    own = stats.own_prompt_tokens_cached + stats.own_prompt_tokens_computed
    rate = f"hit rate {stats.prefix_cache_hit_rate:.0%} of {own:,} prompt tokens"
    if not stats.kv_blocks_total:  # a tenant's caller: the engine-wide books are not its to see
        return f"KV cache: {rate}"
    return (
        f"KV cache: blocks used {stats.kv_blocks_used}, cached {stats.kv_blocks_cached}, free "
        f"{stats.kv_blocks_free} of {stats.kv_blocks_total} ({stats.kv_block_size} tokens each), {rate}, "
        f"{stats.kv_blocks_evicted} evicted, {stats.preemptions_total} preemptions"
    )


_SECTIONS: dict[str, Callable[[str, str | None, Path | None], Section]] = {
    "registry": _registry,
    "trainer": _trainer,
    "sampler": _sampler,
}
