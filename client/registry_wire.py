"""Registry protos <-> the SDK's records (registry_types), both ways."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Final

from google.protobuf.timestamp_pb2 import Timestamp

from opentinker.client.registry_types import Adapter, BatchRecord, Event, Lineage, Reconcile, Version
from opentinker.v1 import registry_pb2
from opentinker.weights.names import LATEST

_EVENT_PREFIX: Final = "EVENT_TYPE_"


# Proto -> record


def _time(stamp: Timestamp) -> datetime:
    return stamp.ToDatetime(tzinfo=UTC)


def batch_from_proto(proto: registry_pb2.BatchRecord) -> BatchRecord:
    return BatchRecord(
        digest=proto.digest,
        trace_ids=tuple(proto.trace_ids),
        step=proto.step,
        num_datums=proto.num_datums,
        num_tokens=proto.num_tokens,
        loss_fn=proto.loss_fn,
        time=_time(proto.time) if proto.HasField("time") else None,
    )


def lineage_from_proto(proto: registry_pb2.Lineage) -> Lineage:
    return Lineage(
        parent_version=proto.parent_version,
        trainer_step=proto.trainer_step,
        tokens_trained=proto.tokens_trained,
        datums_trained=proto.datums_trained,
        batches=tuple(batch_from_proto(b) for b in proto.batches),
        metrics=dict(proto.metrics),
        base_model_digest=proto.base_model_digest,
        parent_adapter=proto.parent_adapter,
        state_id=proto.state_id,
    )


def adapter_from_proto(proto: registry_pb2.Adapter) -> Adapter:
    lora = proto.lora_config
    return Adapter(
        name=proto.name,
        tenant=proto.tenant,
        rank=lora.rank,
        alpha=lora.alpha,
        target_modules=tuple(lora.target_modules),
        aliases=dict(proto.aliases),
        latest_version=proto.latest_version,
        version_count=proto.version_count,
        created_at=_time(proto.create_time),
        created_by=proto.created_by,
        labels=dict(proto.labels),
        description=proto.description,
        base_model_digest=proto.base_model_digest,
        dropout=lora.dropout,
        serving_alias=proto.serving_alias or LATEST,
    )


def version_from_proto(proto: registry_pb2.Version) -> Version:
    return Version(
        adapter=proto.adapter,
        number=proto.version,
        sha256=proto.artifact_sha256,
        artifact_uri=proto.artifact_uri,
        size_bytes=proto.artifact_size_bytes,
        created_at=_time(proto.publish_time),
        aliases=tuple(proto.aliases),
        published_by=proto.published_by,
        artifact_deleted=proto.artifact_deleted,
        lineage=lineage_from_proto(proto.lineage),
        rank=proto.lora_config.rank,
        alpha=proto.lora_config.alpha,
        target_modules=tuple(proto.lora_config.target_modules),
        dropout=proto.lora_config.dropout,
    )


def _event_type(value: int) -> str:
    try:
        name = registry_pb2.EventType.Name(value)
    except ValueError:
        # proto3 enums are open: a newer server may send a type this SDK does not know yet.
        return f"UNKNOWN_{value}"
    return name.removeprefix(_EVENT_PREFIX)


def event_from_proto(proto: registry_pb2.Event) -> Event:
    return Event(
        event_id=proto.event_id,
        type=_event_type(proto.type),
        adapter=proto.adapter,
        version=proto.version,
        alias=proto.alias,
        previous_version=proto.previous_version,
        aliases=dict(proto.aliases),
        time=_time(proto.time),
        actor=proto.actor,
        cause=proto.cause,
        artifact_sha256=proto.artifact_sha256,
        serving_alias=proto.serving_alias or LATEST,
    )


def reconcile_from_proto(proto: registry_pb2.Reconcile) -> Reconcile:
    return Reconcile(
        event_id=proto.event_id,
        aliases={entry.adapter: dict(entry.aliases) for entry in proto.adapters},
        reason=proto.reason,
        serving_aliases={entry.adapter: entry.serving_alias for entry in proto.adapters if entry.serving_alias},
    )


# Record -> proto


def batch_to_proto(batch: BatchRecord) -> registry_pb2.BatchRecord:
    return registry_pb2.BatchRecord(
        digest=batch.digest,
        trace_ids=list(batch.trace_ids),
        step=batch.step,
        num_datums=batch.num_datums,
        num_tokens=batch.num_tokens,
        loss_fn=batch.loss_fn,
        time=batch.time,  # None leaves the field unset
    )


def lineage_to_proto(lineage: Lineage) -> registry_pb2.Lineage:
    return registry_pb2.Lineage(
        parent_version=lineage.parent_version,
        trainer_step=lineage.trainer_step,
        tokens_trained=lineage.tokens_trained,
        datums_trained=lineage.datums_trained,
        batches=[batch_to_proto(b) for b in lineage.batches],
        metrics=lineage.metrics,
        base_model_digest=lineage.base_model_digest,
        parent_adapter=lineage.parent_adapter,
        state_id=lineage.state_id,
    )
