"""`--json` output of the registry admin commands: the SDK's records written in the wire's JSON form.

The form is protobuf's JSON mapping of the RegistryService replies (proto field names, 64-bit integers as
strings, every field printed, zeros and empty lists too): each record is turned back into its message and
printed by protobuf's own encoder, so the output keeps the wire's exact shape.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any, cast

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp

from opentinker.client import (
    Adapter,
    AliasMove,
    BatchRecord,
    Event,
    GarbageCollection,
    Lineage,
    Reconcile,
    ServingAliasMove,
    Version,
)
from opentinker.v1 import common_pb2, registry_pb2
from opentinker.weights.names import LATEST

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_EVENT_PREFIX = "EVENT_TYPE_"


def print_json(value: object) -> None:
    print(json.dumps(value, indent=2, sort_keys=True))


def line(value: object) -> str:
    """One JSON document on one line (a stream of them: `watch --json`)."""
    return json.dumps(value, sort_keys=True)


def dump(message: Message) -> dict[str, Any]:
    # Every field, zeros and empty lists included: a script reading `version_count` never meets a KeyError.
    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _stamp(when: datetime | None, into: Timestamp) -> None:
    # An unset time reads back as the epoch: leave it unset, as the server did.
    if when is not None and when != _EPOCH:
        into.FromDatetime(when)


def _lora(rank: int, alpha: float, dropout: float, targets: tuple[str, ...]) -> common_pb2.LoraConfig:
    return common_pb2.LoraConfig(rank=rank, alpha=alpha, dropout=dropout, target_modules=list(targets))


def _batch(batch: BatchRecord) -> registry_pb2.BatchRecord:
    proto = registry_pb2.BatchRecord(
        digest=batch.digest,
        trace_ids=list(batch.trace_ids),
        step=batch.step,
        num_datums=batch.num_datums,
        num_tokens=batch.num_tokens,
        loss_fn=batch.loss_fn,
    )
    _stamp(batch.time, proto.time)
    return proto


def _lineage(lineage: Lineage) -> registry_pb2.Lineage:
    return registry_pb2.Lineage(
        parent_version=lineage.parent_version,
        trainer_step=lineage.trainer_step,
        tokens_trained=lineage.tokens_trained,
        datums_trained=lineage.datums_trained,
        batches=[_batch(b) for b in lineage.batches],
        metrics=lineage.metrics,
        base_model_digest=lineage.base_model_digest,
    )


def adapter_message(adapter: Adapter) -> registry_pb2.Adapter:
    proto = registry_pb2.Adapter(
        name=adapter.name,
        tenant=adapter.tenant,
        lora_config=_lora(adapter.rank, adapter.alpha, adapter.dropout, adapter.target_modules),
        base_model_digest=adapter.base_model_digest,
        aliases=adapter.aliases,
        latest_version=adapter.latest_version,
        version_count=adapter.version_count,
        created_by=adapter.created_by,
        labels=adapter.labels,
        description=adapter.description,
        serving_alias="" if adapter.serving_alias == LATEST else adapter.serving_alias,
    )
    _stamp(adapter.created_at, proto.create_time)
    return proto


def version_message(version: Version) -> registry_pb2.Version:
    proto = registry_pb2.Version(
        adapter=version.adapter,
        version=version.number,
        artifact_uri=version.artifact_uri,
        artifact_sha256=version.sha256,
        artifact_size_bytes=version.size_bytes,
        lora_config=_lora(version.rank, version.alpha, version.dropout, version.target_modules),
        lineage=_lineage(version.lineage),
        aliases=list(version.aliases),
        published_by=version.published_by,
        artifact_deleted=version.artifact_deleted,
    )
    _stamp(version.created_at, proto.publish_time)
    return proto


def adapter_json(adapter: Adapter) -> dict[str, Any]:
    return dump(adapter_message(adapter))


def version_json(version: Version) -> dict[str, Any]:
    return dump(version_message(version))


def created_json(adapter: Adapter) -> dict[str, Any]:
    return dump(registry_pb2.CreateAdapterResponse(adapter=adapter_message(adapter), event_id=adapter.event_id))


def alias_set_json(move: AliasMove) -> dict[str, Any]:
    reply = registry_pb2.SetAliasResponse(
        previous_version=move.previous_version, version=move.version, event_id=move.event_id
    )
    return dump(reply)


def alias_rm_json(move: AliasMove) -> dict[str, Any]:
    return dump(registry_pb2.DeleteAliasResponse(previous_version=move.previous_version, event_id=move.event_id))


def serving_alias_json(move: ServingAliasMove) -> dict[str, Any]:
    reply = registry_pb2.SetServingAliasResponse(
        previous_alias=move.previous_alias, alias=move.alias, version=move.version, event_id=move.event_id
    )
    return dump(reply)


def rollback_json(move: AliasMove) -> dict[str, Any]:
    reply = registry_pb2.RollbackResponse(
        alias=move.alias, from_version=move.previous_version, to_version=move.version, event_id=move.event_id
    )
    return dump(reply)


def gc_json(gc: GarbageCollection) -> dict[str, Any]:
    collected = [
        registry_pb2.CollectedVersion(
            adapter=adapter, version=number, artifact_sha256=artifact.sha256, size_bytes=artifact.size_bytes
        )
        for (adapter, number), artifact in zip(gc.collected, gc.artifacts, strict=True)
    ]
    return dump(registry_pb2.GarbageCollectResponse(collected=collected, bytes_freed=gc.bytes_freed))


def _event_type(name: str) -> registry_pb2.EventType:
    # The SDK names a type this version does not know UNKNOWN_<n>: the wire's JSON writes its number.
    if name.startswith("UNKNOWN_"):
        return cast("registry_pb2.EventType", int(name.removeprefix("UNKNOWN_")))
    return cast("registry_pb2.EventType", registry_pb2.EventType.Value(_EVENT_PREFIX + name))


def watch_json(message: Event | Reconcile) -> dict[str, Any]:
    if isinstance(message, Reconcile):
        adapters = [
            registry_pb2.AdapterAliases(adapter=a, aliases=aliases, serving_alias=message.serving_aliases.get(a, ""))
            for a, aliases in message.aliases.items()
        ]
        reconcile = registry_pb2.Reconcile(event_id=message.event_id, adapters=adapters, reason=message.reason)
        return dump(registry_pb2.WatchEventsResponse(reconcile=reconcile))
    event = registry_pb2.Event(
        event_id=message.event_id,
        type=_event_type(message.type),
        adapter=message.adapter,
        version=message.version,
        alias=message.alias,
        previous_version=message.previous_version,
        aliases=message.aliases,
        actor=message.actor,
        cause=message.cause,
        artifact_sha256=message.artifact_sha256,
        serving_alias="" if message.serving_alias == LATEST else message.serving_alias,
    )
    _stamp(message.time, event.time)
    return dump(registry_pb2.WatchEventsResponse(event=event))
