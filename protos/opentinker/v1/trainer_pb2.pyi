import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from opentinker.v1 import common_pb2 as _common_pb2
from opentinker.v1 import registry_pb2 as _registry_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StartKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    START_KIND_UNSPECIFIED: _ClassVar[StartKind]
    START_KIND_FRESH: _ClassVar[StartKind]
    START_KIND_VERSION: _ClassVar[StartKind]
    START_KIND_STATE: _ClassVar[StartKind]
START_KIND_UNSPECIFIED: StartKind
START_KIND_FRESH: StartKind
START_KIND_VERSION: StartKind
START_KIND_STATE: StartKind

class MoveAdapterRequest(_message.Message):
    __slots__ = ("adapter", "to")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    TO_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    to: str
    def __init__(self, adapter: _Optional[str] = ..., to: _Optional[str] = ...) -> None: ...

class MoveAdapterResponse(_message.Message):
    __slots__ = ("placement", "state_id")
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    STATE_ID_FIELD_NUMBER: _ClassVar[int]
    placement: _registry_pb2.Placement
    state_id: str
    def __init__(self, placement: _Optional[_Union[_registry_pb2.Placement, _Mapping]] = ..., state_id: _Optional[str] = ...) -> None: ...

class GetTrainerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetTrainerInfoResponse(_message.Message):
    __slots__ = ("base_model", "loss_fns", "max_resident_adapters")
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    LOSS_FNS_FIELD_NUMBER: _ClassVar[int]
    MAX_RESIDENT_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    base_model: _common_pb2.BaseModelInfo
    loss_fns: _containers.RepeatedScalarFieldContainer[str]
    max_resident_adapters: int
    def __init__(self, base_model: _Optional[_Union[_common_pb2.BaseModelInfo, _Mapping]] = ..., loss_fns: _Optional[_Iterable[str]] = ..., max_resident_adapters: _Optional[int] = ...) -> None: ...

class TrainingAdapter(_message.Message):
    __slots__ = ("name", "lora_config", "adam_params", "seed", "step", "tokens_trained", "datums_trained", "pending_batches", "last_snapshot_version", "num_parameters", "create_time", "resident", "parent_adapter")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_CONFIG_FIELD_NUMBER: _ClassVar[int]
    ADAM_PARAMS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    DATUMS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    PENDING_BATCHES_FIELD_NUMBER: _ClassVar[int]
    LAST_SNAPSHOT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    PARENT_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    name: str
    lora_config: _common_pb2.LoraConfig
    adam_params: _common_pb2.AdamParams
    seed: int
    step: int
    tokens_trained: int
    datums_trained: int
    pending_batches: int
    last_snapshot_version: int
    num_parameters: int
    create_time: _timestamp_pb2.Timestamp
    resident: bool
    parent_adapter: str
    def __init__(self, name: _Optional[str] = ..., lora_config: _Optional[_Union[_common_pb2.LoraConfig, _Mapping]] = ..., adam_params: _Optional[_Union[_common_pb2.AdamParams, _Mapping]] = ..., seed: _Optional[int] = ..., step: _Optional[int] = ..., tokens_trained: _Optional[int] = ..., datums_trained: _Optional[int] = ..., pending_batches: _Optional[int] = ..., last_snapshot_version: _Optional[int] = ..., num_parameters: _Optional[int] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., resident: _Optional[bool] = ..., parent_adapter: _Optional[str] = ...) -> None: ...

class TrainerServiceCreateAdapterRequest(_message.Message):
    __slots__ = ("name", "lora_config", "adam_params", "seed", "init_from", "resume_state", "attach_existing", "labels", "fresh", "placement_epoch")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_CONFIG_FIELD_NUMBER: _ClassVar[int]
    ADAM_PARAMS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    INIT_FROM_FIELD_NUMBER: _ClassVar[int]
    RESUME_STATE_FIELD_NUMBER: _ClassVar[int]
    ATTACH_EXISTING_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    FRESH_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    name: str
    lora_config: _common_pb2.LoraConfig
    adam_params: _common_pb2.AdamParams
    seed: int
    init_from: str
    resume_state: str
    attach_existing: bool
    labels: _containers.ScalarMap[str, str]
    fresh: bool
    placement_epoch: int
    def __init__(self, name: _Optional[str] = ..., lora_config: _Optional[_Union[_common_pb2.LoraConfig, _Mapping]] = ..., adam_params: _Optional[_Union[_common_pb2.AdamParams, _Mapping]] = ..., seed: _Optional[int] = ..., init_from: _Optional[str] = ..., resume_state: _Optional[str] = ..., attach_existing: _Optional[bool] = ..., labels: _Optional[_Mapping[str, str]] = ..., fresh: _Optional[bool] = ..., placement_epoch: _Optional[int] = ...) -> None: ...

class StartedFrom(_message.Message):
    __slots__ = ("kind", "adapter", "version", "state_id", "description")
    KIND_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_ID_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    kind: StartKind
    adapter: str
    version: int
    state_id: str
    description: str
    def __init__(self, kind: _Optional[_Union[StartKind, str]] = ..., adapter: _Optional[str] = ..., version: _Optional[int] = ..., state_id: _Optional[str] = ..., description: _Optional[str] = ...) -> None: ...

class TrainerServiceCreateAdapterResponse(_message.Message):
    __slots__ = ("adapter", "started_from")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    STARTED_FROM_FIELD_NUMBER: _ClassVar[int]
    adapter: TrainingAdapter
    started_from: StartedFrom
    def __init__(self, adapter: _Optional[_Union[TrainingAdapter, _Mapping]] = ..., started_from: _Optional[_Union[StartedFrom, _Mapping]] = ...) -> None: ...

class TrainerServiceGetAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class TrainerServiceGetAdapterResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: TrainingAdapter
    def __init__(self, adapter: _Optional[_Union[TrainingAdapter, _Mapping]] = ...) -> None: ...

class TrainerServiceListAdaptersRequest(_message.Message):
    __slots__ = ("prefix",)
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    def __init__(self, prefix: _Optional[str] = ...) -> None: ...

class TrainerServiceListAdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[TrainingAdapter]
    def __init__(self, adapters: _Optional[_Iterable[_Union[TrainingAdapter, _Mapping]]] = ...) -> None: ...

class TrainerServiceDeleteAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class TrainerServiceDeleteAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LossFnOutput(_message.Message):
    __slots__ = ("tensors",)
    class TensorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _common_pb2.TensorData
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_common_pb2.TensorData, _Mapping]] = ...) -> None: ...
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.MessageMap[str, _common_pb2.TensorData]
    def __init__(self, tensors: _Optional[_Mapping[str, _common_pb2.TensorData]] = ...) -> None: ...

class ForwardBackwardRequest(_message.Message):
    __slots__ = ("adapter", "datums", "loss_fn", "loss_fn_config", "trace_ids")
    class LossFnConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    DATUMS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_CONFIG_FIELD_NUMBER: _ClassVar[int]
    TRACE_IDS_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    datums: _containers.RepeatedCompositeFieldContainer[_common_pb2.Datum]
    loss_fn: str
    loss_fn_config: _containers.ScalarMap[str, float]
    trace_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, adapter: _Optional[str] = ..., datums: _Optional[_Iterable[_Union[_common_pb2.Datum, _Mapping]]] = ..., loss_fn: _Optional[str] = ..., loss_fn_config: _Optional[_Mapping[str, float]] = ..., trace_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ForwardBackwardResponse(_message.Message):
    __slots__ = ("loss_fn_outputs", "metrics", "batch_digest", "step", "saved_state_id")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    LOSS_FN_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    BATCH_DIGEST_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SAVED_STATE_ID_FIELD_NUMBER: _ClassVar[int]
    loss_fn_outputs: _containers.RepeatedCompositeFieldContainer[LossFnOutput]
    metrics: _containers.ScalarMap[str, float]
    batch_digest: str
    step: int
    saved_state_id: str
    def __init__(self, loss_fn_outputs: _Optional[_Iterable[_Union[LossFnOutput, _Mapping]]] = ..., metrics: _Optional[_Mapping[str, float]] = ..., batch_digest: _Optional[str] = ..., step: _Optional[int] = ..., saved_state_id: _Optional[str] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("adapter", "datums", "loss_fn", "loss_fn_config")
    class LossFnConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    DATUMS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_CONFIG_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    datums: _containers.RepeatedCompositeFieldContainer[_common_pb2.Datum]
    loss_fn: str
    loss_fn_config: _containers.ScalarMap[str, float]
    def __init__(self, adapter: _Optional[str] = ..., datums: _Optional[_Iterable[_Union[_common_pb2.Datum, _Mapping]]] = ..., loss_fn: _Optional[str] = ..., loss_fn_config: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("loss_fn_outputs", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    LOSS_FN_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    loss_fn_outputs: _containers.RepeatedCompositeFieldContainer[LossFnOutput]
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, loss_fn_outputs: _Optional[_Iterable[_Union[LossFnOutput, _Mapping]]] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class OptimStepRequest(_message.Message):
    __slots__ = ("adapter", "adam_params")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ADAM_PARAMS_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    adam_params: _common_pb2.AdamParams
    def __init__(self, adapter: _Optional[str] = ..., adam_params: _Optional[_Union[_common_pb2.AdamParams, _Mapping]] = ...) -> None: ...

class OptimStepResponse(_message.Message):
    __slots__ = ("step", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    step: int
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, step: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class SaveSnapshotRequest(_message.Message):
    __slots__ = ("adapter", "aliases", "skip_latest", "metrics", "request_id")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    SKIP_LATEST_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    aliases: _containers.RepeatedScalarFieldContainer[str]
    skip_latest: bool
    metrics: _containers.ScalarMap[str, float]
    request_id: str
    def __init__(self, adapter: _Optional[str] = ..., aliases: _Optional[_Iterable[str]] = ..., skip_latest: _Optional[bool] = ..., metrics: _Optional[_Mapping[str, float]] = ..., request_id: _Optional[str] = ...) -> None: ...

class SaveSnapshotResponse(_message.Message):
    __slots__ = ("version", "event_id")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    version: _registry_pb2.Version
    event_id: str
    def __init__(self, version: _Optional[_Union[_registry_pb2.Version, _Mapping]] = ..., event_id: _Optional[str] = ...) -> None: ...

class SaveStateRequest(_message.Message):
    __slots__ = ("adapter", "label")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    label: str
    def __init__(self, adapter: _Optional[str] = ..., label: _Optional[str] = ...) -> None: ...

class SaveStateResponse(_message.Message):
    __slots__ = ("state_id", "step", "size_bytes")
    STATE_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    state_id: str
    step: int
    size_bytes: int
    def __init__(self, state_id: _Optional[str] = ..., step: _Optional[int] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class LoadStateRequest(_message.Message):
    __slots__ = ("adapter", "state_id", "weights_only")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    STATE_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_ONLY_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    state_id: str
    weights_only: bool
    def __init__(self, adapter: _Optional[str] = ..., state_id: _Optional[str] = ..., weights_only: _Optional[bool] = ...) -> None: ...

class LoadStateResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: TrainingAdapter
    def __init__(self, adapter: _Optional[_Union[TrainingAdapter, _Mapping]] = ...) -> None: ...

class ResetAdapterRequest(_message.Message):
    __slots__ = ("adapter", "reference", "keep_optimizer")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    KEEP_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    reference: str
    keep_optimizer: bool
    def __init__(self, adapter: _Optional[str] = ..., reference: _Optional[str] = ..., keep_optimizer: _Optional[bool] = ...) -> None: ...

class ResetAdapterResponse(_message.Message):
    __slots__ = ("adapter", "version", "optimizer_kept")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_KEPT_FIELD_NUMBER: _ClassVar[int]
    adapter: TrainingAdapter
    version: _registry_pb2.Version
    optimizer_kept: bool
    def __init__(self, adapter: _Optional[_Union[TrainingAdapter, _Mapping]] = ..., version: _Optional[_Union[_registry_pb2.Version, _Mapping]] = ..., optimizer_kept: _Optional[bool] = ...) -> None: ...

class DeleteStateRequest(_message.Message):
    __slots__ = ("state_id",)
    STATE_ID_FIELD_NUMBER: _ClassVar[int]
    state_id: str
    def __init__(self, state_id: _Optional[str] = ...) -> None: ...

class DeleteStateResponse(_message.Message):
    __slots__ = ("bytes_freed",)
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    bytes_freed: int
    def __init__(self, bytes_freed: _Optional[int] = ...) -> None: ...
