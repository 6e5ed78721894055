import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from opentinker.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReplicaRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPLICA_ROLE_UNSPECIFIED: _ClassVar[ReplicaRole]
    REPLICA_ROLE_SAMPLER: _ClassVar[ReplicaRole]
    REPLICA_ROLE_TRAINER: _ClassVar[ReplicaRole]

class ReplicaState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPLICA_STATE_UNSPECIFIED: _ClassVar[ReplicaState]
    REPLICA_STATE_SERVING: _ClassVar[ReplicaState]
    REPLICA_STATE_DRAINING: _ClassVar[ReplicaState]

class EventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_TYPE_UNSPECIFIED: _ClassVar[EventType]
    EVENT_TYPE_ADAPTER_CREATED: _ClassVar[EventType]
    EVENT_TYPE_ADAPTER_DELETED: _ClassVar[EventType]
    EVENT_TYPE_VERSION_PUBLISHED: _ClassVar[EventType]
    EVENT_TYPE_ALIAS_SET: _ClassVar[EventType]
    EVENT_TYPE_ALIAS_DELETED: _ClassVar[EventType]
    EVENT_TYPE_ARTIFACT_DELETED: _ClassVar[EventType]
    EVENT_TYPE_SERVING_ALIAS_SET: _ClassVar[EventType]
REPLICA_ROLE_UNSPECIFIED: ReplicaRole
REPLICA_ROLE_SAMPLER: ReplicaRole
REPLICA_ROLE_TRAINER: ReplicaRole
REPLICA_STATE_UNSPECIFIED: ReplicaState
REPLICA_STATE_SERVING: ReplicaState
REPLICA_STATE_DRAINING: ReplicaState
EVENT_TYPE_UNSPECIFIED: EventType
EVENT_TYPE_ADAPTER_CREATED: EventType
EVENT_TYPE_ADAPTER_DELETED: EventType
EVENT_TYPE_VERSION_PUBLISHED: EventType
EVENT_TYPE_ALIAS_SET: EventType
EVENT_TYPE_ALIAS_DELETED: EventType
EVENT_TYPE_ARTIFACT_DELETED: EventType
EVENT_TYPE_SERVING_ALIAS_SET: EventType

class ReplicaLoad(_message.Message):
    __slots__ = ("slots_used", "slots_total", "waiting_sequences", "running_sequences", "kv_blocks_used", "kv_blocks_total", "tokens_per_second")
    SLOTS_USED_FIELD_NUMBER: _ClassVar[int]
    SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    WAITING_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    slots_used: int
    slots_total: int
    waiting_sequences: int
    running_sequences: int
    kv_blocks_used: int
    kv_blocks_total: int
    tokens_per_second: float
    def __init__(self, slots_used: _Optional[int] = ..., slots_total: _Optional[int] = ..., waiting_sequences: _Optional[int] = ..., running_sequences: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., tokens_per_second: _Optional[float] = ...) -> None: ...

class Replica(_message.Message):
    __slots__ = ("replica_id", "role", "address", "state", "base_fingerprint", "max_slots", "zone", "load", "resident", "lease_seconds", "register_time", "heartbeat_time")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BASE_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_SLOTS_FIELD_NUMBER: _ClassVar[int]
    ZONE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REGISTER_TIME_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIME_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    role: ReplicaRole
    address: str
    state: ReplicaState
    base_fingerprint: str
    max_slots: int
    zone: str
    load: ReplicaLoad
    resident: _containers.RepeatedScalarFieldContainer[str]
    lease_seconds: float
    register_time: _timestamp_pb2.Timestamp
    heartbeat_time: _timestamp_pb2.Timestamp
    def __init__(self, replica_id: _Optional[str] = ..., role: _Optional[_Union[ReplicaRole, str]] = ..., address: _Optional[str] = ..., state: _Optional[_Union[ReplicaState, str]] = ..., base_fingerprint: _Optional[str] = ..., max_slots: _Optional[int] = ..., zone: _Optional[str] = ..., load: _Optional[_Union[ReplicaLoad, _Mapping]] = ..., resident: _Optional[_Iterable[str]] = ..., lease_seconds: _Optional[float] = ..., register_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., heartbeat_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class RegisterReplicaRequest(_message.Message):
    __slots__ = ("replica",)
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    replica: Replica
    def __init__(self, replica: _Optional[_Union[Replica, _Mapping]] = ...) -> None: ...

class RegisterReplicaResponse(_message.Message):
    __slots__ = ("replica",)
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    replica: Replica
    def __init__(self, replica: _Optional[_Union[Replica, _Mapping]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("replica_id", "state", "load", "resident")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    state: ReplicaState
    load: ReplicaLoad
    resident: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, replica_id: _Optional[str] = ..., state: _Optional[_Union[ReplicaState, str]] = ..., load: _Optional[_Union[ReplicaLoad, _Mapping]] = ..., resident: _Optional[_Iterable[str]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("heartbeat_time", "placements")
    HEARTBEAT_TIME_FIELD_NUMBER: _ClassVar[int]
    PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    heartbeat_time: _timestamp_pb2.Timestamp
    placements: _containers.RepeatedCompositeFieldContainer[Placement]
    def __init__(self, heartbeat_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., placements: _Optional[_Iterable[_Union[Placement, _Mapping]]] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("adapter", "replica_id", "address", "epoch", "state_id", "state_step", "rank", "place_time", "base_fingerprint")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STATE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PLACE_TIME_FIELD_NUMBER: _ClassVar[int]
    BASE_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    replica_id: str
    address: str
    epoch: int
    state_id: str
    state_step: int
    rank: int
    place_time: _timestamp_pb2.Timestamp
    base_fingerprint: str
    def __init__(self, adapter: _Optional[str] = ..., replica_id: _Optional[str] = ..., address: _Optional[str] = ..., epoch: _Optional[int] = ..., state_id: _Optional[str] = ..., state_step: _Optional[int] = ..., rank: _Optional[int] = ..., place_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., base_fingerprint: _Optional[str] = ...) -> None: ...

class PlaceAdapterRequest(_message.Message):
    __slots__ = ("adapter", "rank", "base_fingerprint")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    BASE_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    rank: int
    base_fingerprint: str
    def __init__(self, adapter: _Optional[str] = ..., rank: _Optional[int] = ..., base_fingerprint: _Optional[str] = ...) -> None: ...

class PlaceAdapterResponse(_message.Message):
    __slots__ = ("placement", "placed")
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    PLACED_FIELD_NUMBER: _ClassVar[int]
    placement: Placement
    placed: bool
    def __init__(self, placement: _Optional[_Union[Placement, _Mapping]] = ..., placed: _Optional[bool] = ...) -> None: ...

class GetPlacementRequest(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    def __init__(self, adapter: _Optional[str] = ...) -> None: ...

class GetPlacementResponse(_message.Message):
    __slots__ = ("placement",)
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    placement: Placement
    def __init__(self, placement: _Optional[_Union[Placement, _Mapping]] = ...) -> None: ...

class MovePlacementRequest(_message.Message):
    __slots__ = ("adapter", "expected_epoch", "to_replica_id", "state_id", "state_step")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TO_REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_STEP_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    expected_epoch: int
    to_replica_id: str
    state_id: str
    state_step: int
    def __init__(self, adapter: _Optional[str] = ..., expected_epoch: _Optional[int] = ..., to_replica_id: _Optional[str] = ..., state_id: _Optional[str] = ..., state_step: _Optional[int] = ...) -> None: ...

class MovePlacementResponse(_message.Message):
    __slots__ = ("placement",)
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    placement: Placement
    def __init__(self, placement: _Optional[_Union[Placement, _Mapping]] = ...) -> None: ...

class RecordPlacementStateRequest(_message.Message):
    __slots__ = ("adapter", "epoch", "state_id", "state_step")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STATE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_STEP_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    epoch: int
    state_id: str
    state_step: int
    def __init__(self, adapter: _Optional[str] = ..., epoch: _Optional[int] = ..., state_id: _Optional[str] = ..., state_step: _Optional[int] = ...) -> None: ...

class RecordPlacementStateResponse(_message.Message):
    __slots__ = ("placement",)
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    placement: Placement
    def __init__(self, placement: _Optional[_Union[Placement, _Mapping]] = ...) -> None: ...

class ListReplicasRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: ReplicaRole
    def __init__(self, role: _Optional[_Union[ReplicaRole, str]] = ...) -> None: ...

class ListReplicasResponse(_message.Message):
    __slots__ = ("replicas",)
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    def __init__(self, replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ...) -> None: ...

class WatchReplicasRequest(_message.Message):
    __slots__ = ("role", "include_load")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_LOAD_FIELD_NUMBER: _ClassVar[int]
    role: ReplicaRole
    include_load: bool
    def __init__(self, role: _Optional[_Union[ReplicaRole, str]] = ..., include_load: _Optional[bool] = ...) -> None: ...

class WatchReplicasResponse(_message.Message):
    __slots__ = ("snapshot", "replicas", "left")
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    LEFT_FIELD_NUMBER: _ClassVar[int]
    snapshot: bool
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    left: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, snapshot: _Optional[bool] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ..., left: _Optional[_Iterable[str]] = ...) -> None: ...

class Adapter(_message.Message):
    __slots__ = ("name", "tenant", "lora_config", "base_model_digest", "aliases", "latest_version", "version_count", "create_time", "created_by", "labels", "description", "serving_alias")
    class AliasesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LORA_CONFIG_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_COUNT_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    CREATED_BY_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    SERVING_ALIAS_FIELD_NUMBER: _ClassVar[int]
    name: str
    tenant: str
    lora_config: _common_pb2.LoraConfig
    base_model_digest: str
    aliases: _containers.ScalarMap[str, int]
    latest_version: int
    version_count: int
    create_time: _timestamp_pb2.Timestamp
    created_by: str
    labels: _containers.ScalarMap[str, str]
    description: str
    serving_alias: str
    def __init__(self, name: _Optional[str] = ..., tenant: _Optional[str] = ..., lora_config: _Optional[_Union[_common_pb2.LoraConfig, _Mapping]] = ..., base_model_digest: _Optional[str] = ..., aliases: _Optional[_Mapping[str, int]] = ..., latest_version: _Optional[int] = ..., version_count: _Optional[int] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., created_by: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., description: _Optional[str] = ..., serving_alias: _Optional[str] = ...) -> None: ...

class BatchRecord(_message.Message):
    __slots__ = ("digest", "trace_ids", "step", "num_datums", "num_tokens", "loss_fn", "time")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    TRACE_IDS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_DATUMS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    digest: str
    trace_ids: _containers.RepeatedScalarFieldContainer[str]
    step: int
    num_datums: int
    num_tokens: int
    loss_fn: str
    time: _timestamp_pb2.Timestamp
    def __init__(self, digest: _Optional[str] = ..., trace_ids: _Optional[_Iterable[str]] = ..., step: _Optional[int] = ..., num_datums: _Optional[int] = ..., num_tokens: _Optional[int] = ..., loss_fn: _Optional[str] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class Lineage(_message.Message):
    __slots__ = ("parent_version", "trainer_step", "tokens_trained", "datums_trained", "batches", "metrics", "base_model_digest", "parent_adapter", "state_id")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    PARENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAINER_STEP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    DATUMS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PARENT_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    STATE_ID_FIELD_NUMBER: _ClassVar[int]
    parent_version: int
    trainer_step: int
    tokens_trained: int
    datums_trained: int
    batches: _containers.RepeatedCompositeFieldContainer[BatchRecord]
    metrics: _containers.ScalarMap[str, float]
    base_model_digest: str
    parent_adapter: str
    state_id: str
    def __init__(self, parent_version: _Optional[int] = ..., trainer_step: _Optional[int] = ..., tokens_trained: _Optional[int] = ..., datums_trained: _Optional[int] = ..., batches: _Optional[_Iterable[_Union[BatchRecord, _Mapping]]] = ..., metrics: _Optional[_Mapping[str, float]] = ..., base_model_digest: _Optional[str] = ..., parent_adapter: _Optional[str] = ..., state_id: _Optional[str] = ...) -> None: ...

class Version(_message.Message):
    __slots__ = ("adapter", "version", "artifact_uri", "artifact_sha256", "artifact_size_bytes", "lora_config", "lineage", "aliases", "publish_time", "published_by", "artifact_deleted")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_URI_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_SHA256_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LORA_CONFIG_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_TIME_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_BY_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_DELETED_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    version: int
    artifact_uri: str
    artifact_sha256: str
    artifact_size_bytes: int
    lora_config: _common_pb2.LoraConfig
    lineage: Lineage
    aliases: _containers.RepeatedScalarFieldContainer[str]
    publish_time: _timestamp_pb2.Timestamp
    published_by: str
    artifact_deleted: bool
    def __init__(self, adapter: _Optional[str] = ..., version: _Optional[int] = ..., artifact_uri: _Optional[str] = ..., artifact_sha256: _Optional[str] = ..., artifact_size_bytes: _Optional[int] = ..., lora_config: _Optional[_Union[_common_pb2.LoraConfig, _Mapping]] = ..., lineage: _Optional[_Union[Lineage, _Mapping]] = ..., aliases: _Optional[_Iterable[str]] = ..., publish_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., published_by: _Optional[str] = ..., artifact_deleted: _Optional[bool] = ...) -> None: ...

class CreateAdapterRequest(_message.Message):
    __slots__ = ("name", "lora_config", "base_model_digest", "labels", "description")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_CONFIG_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    name: str
    lora_config: _common_pb2.LoraConfig
    base_model_digest: str
    labels: _containers.ScalarMap[str, str]
    description: str
    def __init__(self, name: _Optional[str] = ..., lora_config: _Optional[_Union[_common_pb2.LoraConfig, _Mapping]] = ..., base_model_digest: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., description: _Optional[str] = ...) -> None: ...

class CreateAdapterResponse(_message.Message):
    __slots__ = ("adapter", "event_id")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    adapter: Adapter
    event_id: str
    def __init__(self, adapter: _Optional[_Union[Adapter, _Mapping]] = ..., event_id: _Optional[str] = ...) -> None: ...

class GetAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class GetAdapterResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: Adapter
    def __init__(self, adapter: _Optional[_Union[Adapter, _Mapping]] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ("prefix", "page_size", "page_token")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    page_size: int
    page_token: str
    def __init__(self, prefix: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters", "next_page_token")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[Adapter]
    next_page_token: str
    def __init__(self, adapters: _Optional[_Iterable[_Union[Adapter, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class DeleteAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteAdapterResponse(_message.Message):
    __slots__ = ("event_id",)
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    def __init__(self, event_id: _Optional[str] = ...) -> None: ...

class PublishVersionRequest(_message.Message):
    __slots__ = ("adapter", "artifact_uri", "artifact_sha256", "artifact_size_bytes", "lora_config", "lineage", "aliases", "skip_latest", "request_id", "expected_latest_version", "owner_epoch")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_URI_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_SHA256_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LORA_CONFIG_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    SKIP_LATEST_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    OWNER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    artifact_uri: str
    artifact_sha256: str
    artifact_size_bytes: int
    lora_config: _common_pb2.LoraConfig
    lineage: Lineage
    aliases: _containers.RepeatedScalarFieldContainer[str]
    skip_latest: bool
    request_id: str
    expected_latest_version: int
    owner_epoch: int
    def __init__(self, adapter: _Optional[str] = ..., artifact_uri: _Optional[str] = ..., artifact_sha256: _Optional[str] = ..., artifact_size_bytes: _Optional[int] = ..., lora_config: _Optional[_Union[_common_pb2.LoraConfig, _Mapping]] = ..., lineage: _Optional[_Union[Lineage, _Mapping]] = ..., aliases: _Optional[_Iterable[str]] = ..., skip_latest: _Optional[bool] = ..., request_id: _Optional[str] = ..., expected_latest_version: _Optional[int] = ..., owner_epoch: _Optional[int] = ...) -> None: ...

class PublishVersionResponse(_message.Message):
    __slots__ = ("version", "event_id")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    version: Version
    event_id: str
    def __init__(self, version: _Optional[_Union[Version, _Mapping]] = ..., event_id: _Optional[str] = ...) -> None: ...

class GetVersionRequest(_message.Message):
    __slots__ = ("adapter", "version")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    version: int
    def __init__(self, adapter: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class GetVersionResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: Version
    def __init__(self, version: _Optional[_Union[Version, _Mapping]] = ...) -> None: ...

class ListVersionsRequest(_message.Message):
    __slots__ = ("adapter", "page_size", "page_token")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    page_size: int
    page_token: str
    def __init__(self, adapter: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListVersionsResponse(_message.Message):
    __slots__ = ("versions", "next_page_token")
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[Version]
    next_page_token: str
    def __init__(self, versions: _Optional[_Iterable[_Union[Version, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class ResolveRequest(_message.Message):
    __slots__ = ("reference",)
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    reference: str
    def __init__(self, reference: _Optional[str] = ...) -> None: ...

class ResolveResponse(_message.Message):
    __slots__ = ("version", "resolved")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RESOLVED_FIELD_NUMBER: _ClassVar[int]
    version: Version
    resolved: _common_pb2.ResolvedVersion
    def __init__(self, version: _Optional[_Union[Version, _Mapping]] = ..., resolved: _Optional[_Union[_common_pb2.ResolvedVersion, _Mapping]] = ...) -> None: ...

class SetAliasRequest(_message.Message):
    __slots__ = ("adapter", "alias", "version", "expected_version")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    alias: str
    version: int
    expected_version: int
    def __init__(self, adapter: _Optional[str] = ..., alias: _Optional[str] = ..., version: _Optional[int] = ..., expected_version: _Optional[int] = ...) -> None: ...

class SetAliasResponse(_message.Message):
    __slots__ = ("previous_version", "version", "event_id")
    PREVIOUS_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    previous_version: int
    version: int
    event_id: str
    def __init__(self, previous_version: _Optional[int] = ..., version: _Optional[int] = ..., event_id: _Optional[str] = ...) -> None: ...

class SetServingAliasRequest(_message.Message):
    __slots__ = ("adapter", "alias")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    alias: str
    def __init__(self, adapter: _Optional[str] = ..., alias: _Optional[str] = ...) -> None: ...

class SetServingAliasResponse(_message.Message):
    __slots__ = ("previous_alias", "alias", "version", "event_id")
    PREVIOUS_ALIAS_FIELD_NUMBER: _ClassVar[int]
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    previous_alias: str
    alias: str
    version: int
    event_id: str
    def __init__(self, previous_alias: _Optional[str] = ..., alias: _Optional[str] = ..., version: _Optional[int] = ..., event_id: _Optional[str] = ...) -> None: ...

class DeleteAliasRequest(_message.Message):
    __slots__ = ("adapter", "alias", "expected_version")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    alias: str
    expected_version: int
    def __init__(self, adapter: _Optional[str] = ..., alias: _Optional[str] = ..., expected_version: _Optional[int] = ...) -> None: ...

class DeleteAliasResponse(_message.Message):
    __slots__ = ("previous_version", "event_id")
    PREVIOUS_VERSION_FIELD_NUMBER: _ClassVar[int]
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    previous_version: int
    event_id: str
    def __init__(self, previous_version: _Optional[int] = ..., event_id: _Optional[str] = ...) -> None: ...

class RollbackRequest(_message.Message):
    __slots__ = ("adapter", "alias", "to_version", "expected_version")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    TO_VERSION_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    alias: str
    to_version: int
    expected_version: int
    def __init__(self, adapter: _Optional[str] = ..., alias: _Optional[str] = ..., to_version: _Optional[int] = ..., expected_version: _Optional[int] = ...) -> None: ...

class RollbackResponse(_message.Message):
    __slots__ = ("alias", "from_version", "to_version", "event_id")
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    FROM_VERSION_FIELD_NUMBER: _ClassVar[int]
    TO_VERSION_FIELD_NUMBER: _ClassVar[int]
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    alias: str
    from_version: int
    to_version: int
    event_id: str
    def __init__(self, alias: _Optional[str] = ..., from_version: _Optional[int] = ..., to_version: _Optional[int] = ..., event_id: _Optional[str] = ...) -> None: ...

class GetLineageRequest(_message.Message):
    __slots__ = ("reference", "max_depth")
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    reference: str
    max_depth: int
    def __init__(self, reference: _Optional[str] = ..., max_depth: _Optional[int] = ...) -> None: ...

class GetLineageResponse(_message.Message):
    __slots__ = ("chain",)
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    chain: _containers.RepeatedCompositeFieldContainer[Version]
    def __init__(self, chain: _Optional[_Iterable[_Union[Version, _Mapping]]] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("event_id", "type", "adapter", "version", "alias", "previous_version", "aliases", "time", "actor", "cause", "artifact_sha256", "serving_alias")
    class AliasesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_VERSION_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    ACTOR_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_SHA256_FIELD_NUMBER: _ClassVar[int]
    SERVING_ALIAS_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    type: EventType
    adapter: str
    version: int
    alias: str
    previous_version: int
    aliases: _containers.ScalarMap[str, int]
    time: _timestamp_pb2.Timestamp
    actor: str
    cause: str
    artifact_sha256: str
    serving_alias: str
    def __init__(self, event_id: _Optional[str] = ..., type: _Optional[_Union[EventType, str]] = ..., adapter: _Optional[str] = ..., version: _Optional[int] = ..., alias: _Optional[str] = ..., previous_version: _Optional[int] = ..., aliases: _Optional[_Mapping[str, int]] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., actor: _Optional[str] = ..., cause: _Optional[str] = ..., artifact_sha256: _Optional[str] = ..., serving_alias: _Optional[str] = ...) -> None: ...

class AdapterAliases(_message.Message):
    __slots__ = ("adapter", "aliases", "serving_alias")
    class AliasesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    SERVING_ALIAS_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    aliases: _containers.ScalarMap[str, int]
    serving_alias: str
    def __init__(self, adapter: _Optional[str] = ..., aliases: _Optional[_Mapping[str, int]] = ..., serving_alias: _Optional[str] = ...) -> None: ...

class Reconcile(_message.Message):
    __slots__ = ("event_id", "adapters", "reason")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterAliases]
    reason: str
    def __init__(self, event_id: _Optional[str] = ..., adapters: _Optional[_Iterable[_Union[AdapterAliases, _Mapping]]] = ..., reason: _Optional[str] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("after_event_id", "adapters", "send_snapshot")
    AFTER_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    SEND_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    after_event_id: str
    adapters: _containers.RepeatedScalarFieldContainer[str]
    send_snapshot: bool
    def __init__(self, after_event_id: _Optional[str] = ..., adapters: _Optional[_Iterable[str]] = ..., send_snapshot: _Optional[bool] = ...) -> None: ...

class WatchEventsResponse(_message.Message):
    __slots__ = ("event", "reconcile")
    EVENT_FIELD_NUMBER: _ClassVar[int]
    RECONCILE_FIELD_NUMBER: _ClassVar[int]
    event: Event
    reconcile: Reconcile
    def __init__(self, event: _Optional[_Union[Event, _Mapping]] = ..., reconcile: _Optional[_Union[Reconcile, _Mapping]] = ...) -> None: ...

class GarbageCollectRequest(_message.Message):
    __slots__ = ("keep_last", "adapter", "dry_run", "grace_s")
    KEEP_LAST_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    keep_last: int
    adapter: str
    dry_run: bool
    grace_s: float
    def __init__(self, keep_last: _Optional[int] = ..., adapter: _Optional[str] = ..., dry_run: _Optional[bool] = ..., grace_s: _Optional[float] = ...) -> None: ...

class CollectedVersion(_message.Message):
    __slots__ = ("adapter", "version", "artifact_sha256", "size_bytes")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    version: int
    artifact_sha256: str
    size_bytes: int
    def __init__(self, adapter: _Optional[str] = ..., version: _Optional[int] = ..., artifact_sha256: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class GarbageCollectResponse(_message.Message):
    __slots__ = ("collected", "bytes_freed")
    COLLECTED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    collected: _containers.RepeatedCompositeFieldContainer[CollectedVersion]
    bytes_freed: int
    def __init__(self, collected: _Optional[_Iterable[_Union[CollectedVersion, _Mapping]]] = ..., bytes_freed: _Optional[int] = ...) -> None: ...

class DeleteVersionRequest(_message.Message):
    __slots__ = ("adapter", "version")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    version: int
    def __init__(self, adapter: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class DeleteVersionResponse(_message.Message):
    __slots__ = ("version", "bytes_freed")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    version: Version
    bytes_freed: int
    def __init__(self, version: _Optional[_Union[Version, _Mapping]] = ..., bytes_freed: _Optional[int] = ...) -> None: ...

class ArtifactFileHeader(_message.Message):
    __slots__ = ("path", "size_bytes", "sha256")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    path: str
    size_bytes: int
    sha256: str
    def __init__(self, path: _Optional[str] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class UploadArtifactRequest(_message.Message):
    __slots__ = ("manifest", "chunk")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    manifest: ArtifactManifest
    chunk: bytes
    def __init__(self, manifest: _Optional[_Union[ArtifactManifest, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class ArtifactManifest(_message.Message):
    __slots__ = ("files",)
    FILES_FIELD_NUMBER: _ClassVar[int]
    files: _containers.RepeatedCompositeFieldContainer[ArtifactFileHeader]
    def __init__(self, files: _Optional[_Iterable[_Union[ArtifactFileHeader, _Mapping]]] = ...) -> None: ...

class UploadArtifactResponse(_message.Message):
    __slots__ = ("artifact_uri", "artifact_sha256", "artifact_size_bytes")
    ARTIFACT_URI_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_SHA256_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    artifact_uri: str
    artifact_sha256: str
    artifact_size_bytes: int
    def __init__(self, artifact_uri: _Optional[str] = ..., artifact_sha256: _Optional[str] = ..., artifact_size_bytes: _Optional[int] = ...) -> None: ...

class DownloadArtifactRequest(_message.Message):
    __slots__ = ("artifact_uri",)
    ARTIFACT_URI_FIELD_NUMBER: _ClassVar[int]
    artifact_uri: str
    def __init__(self, artifact_uri: _Optional[str] = ...) -> None: ...

class DownloadArtifactResponse(_message.Message):
    __slots__ = ("manifest", "chunk")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    manifest: ArtifactManifest
    chunk: bytes
    def __init__(self, manifest: _Optional[_Union[ArtifactManifest, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...
