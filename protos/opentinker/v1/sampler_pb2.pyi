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

class StopReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STOP_REASON_UNSPECIFIED: _ClassVar[StopReason]
    STOP_REASON_LENGTH: _ClassVar[StopReason]
    STOP_REASON_STOP_TOKEN: _ClassVar[StopReason]
    STOP_REASON_STOP_STRING: _ClassVar[StopReason]
    STOP_REASON_CONTEXT_LENGTH: _ClassVar[StopReason]
STOP_REASON_UNSPECIFIED: StopReason
STOP_REASON_LENGTH: StopReason
STOP_REASON_STOP_TOKEN: StopReason
STOP_REASON_STOP_STRING: StopReason
STOP_REASON_CONTEXT_LENGTH: StopReason

class GetSamplerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetSamplerInfoResponse(_message.Message):
    __slots__ = ("base_model", "max_slots", "max_rank", "max_seqs", "max_batch_tokens", "lora_kernel", "max_pinned_per_tenant")
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MAX_RANK_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_KERNEL_FIELD_NUMBER: _ClassVar[int]
    MAX_PINNED_PER_TENANT_FIELD_NUMBER: _ClassVar[int]
    base_model: _common_pb2.BaseModelInfo
    max_slots: int
    max_rank: int
    max_seqs: int
    max_batch_tokens: int
    lora_kernel: str
    max_pinned_per_tenant: int
    def __init__(self, base_model: _Optional[_Union[_common_pb2.BaseModelInfo, _Mapping]] = ..., max_slots: _Optional[int] = ..., max_rank: _Optional[int] = ..., max_seqs: _Optional[int] = ..., max_batch_tokens: _Optional[int] = ..., lora_kernel: _Optional[str] = ..., max_pinned_per_tenant: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "max_tokens", "stop_token_ids", "stop_strings", "logprobs", "top_logprobs", "frequency_penalty", "presence_penalty")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    logprobs: bool
    top_logprobs: int
    frequency_penalty: float
    presence_penalty: float
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop_strings: _Optional[_Iterable[str]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ...) -> None: ...

class SampleRequest(_message.Message):
    __slots__ = ("model", "prompt", "sampling_params", "num_samples", "prompt_logprobs", "request_id", "prompt_text", "cache_salt", "constraint")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: _common_pb2.ModelInput
    sampling_params: SamplingParams
    num_samples: int
    prompt_logprobs: bool
    request_id: str
    prompt_text: str
    cache_salt: str
    constraint: Constraint
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[_Union[_common_pb2.ModelInput, _Mapping]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., num_samples: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., request_id: _Optional[str] = ..., prompt_text: _Optional[str] = ..., cache_salt: _Optional[str] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "lark")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    LARK_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    lark: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., lark: _Optional[str] = ...) -> None: ...

class SampleResponse(_message.Message):
    __slots__ = ("sample_index", "tokens", "logprobs", "stop_reason", "version", "prompt_logprobs", "prompt_tokens", "text", "top_logprobs", "replica")
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    sample_index: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    stop_reason: StopReason
    version: _common_pb2.ResolvedVersion
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_tokens: int
    text: str
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    replica: str
    def __init__(self, sample_index: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., stop_reason: _Optional[_Union[StopReason, str]] = ..., version: _Optional[_Union[_common_pb2.ResolvedVersion, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., prompt_tokens: _Optional[int] = ..., text: _Optional[str] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., replica: _Optional[str] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class ComputeLogprobsRequest(_message.Message):
    __slots__ = ("model", "inputs", "cache_salt")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    model: str
    inputs: _containers.RepeatedCompositeFieldContainer[_common_pb2.ModelInput]
    cache_salt: str
    def __init__(self, model: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[_common_pb2.ModelInput, _Mapping]]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprobs",)
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class ComputeLogprobsResponse(_message.Message):
    __slots__ = ("results", "version", "replica")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    version: _common_pb2.ResolvedVersion
    replica: str
    def __init__(self, results: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., version: _Optional[_Union[_common_pb2.ResolvedVersion, _Mapping]] = ..., replica: _Optional[str] = ...) -> None: ...

class LoadedAdapter(_message.Message):
    __slots__ = ("version", "slot", "rank", "pinned", "active_requests", "serving_aliases", "load_time", "last_used_time")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SERVING_ALIASES_FIELD_NUMBER: _ClassVar[int]
    LOAD_TIME_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_TIME_FIELD_NUMBER: _ClassVar[int]
    version: _common_pb2.ResolvedVersion
    slot: int
    rank: int
    pinned: bool
    active_requests: int
    serving_aliases: _containers.RepeatedScalarFieldContainer[str]
    load_time: _timestamp_pb2.Timestamp
    last_used_time: _timestamp_pb2.Timestamp
    def __init__(self, version: _Optional[_Union[_common_pb2.ResolvedVersion, _Mapping]] = ..., slot: _Optional[int] = ..., rank: _Optional[int] = ..., pinned: _Optional[bool] = ..., active_requests: _Optional[int] = ..., serving_aliases: _Optional[_Iterable[str]] = ..., load_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., last_used_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("reference", "pin")
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    reference: str
    pin: bool
    def __init__(self, reference: _Optional[str] = ..., pin: _Optional[bool] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: LoadedAdapter
    def __init__(self, adapter: _Optional[_Union[LoadedAdapter, _Mapping]] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("reference",)
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    reference: str
    def __init__(self, reference: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ("freed_now",)
    FREED_NOW_FIELD_NUMBER: _ClassVar[int]
    freed_now: bool
    def __init__(self, freed_now: _Optional[bool] = ...) -> None: ...

class ListLoadedRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListLoadedResponse(_message.Message):
    __slots__ = ("adapters", "slots_total")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[LoadedAdapter]
    slots_total: int
    def __init__(self, adapters: _Optional[_Iterable[_Union[LoadedAdapter, _Mapping]]] = ..., slots_total: _Optional[int] = ...) -> None: ...

class ReloadRecord(_message.Message):
    __slots__ = ("adapter", "alias", "from_version", "to_version", "latency_seconds", "ok", "error", "time")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    FROM_VERSION_FIELD_NUMBER: _ClassVar[int]
    TO_VERSION_FIELD_NUMBER: _ClassVar[int]
    LATENCY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    alias: str
    from_version: int
    to_version: int
    latency_seconds: float
    ok: bool
    error: str
    time: _timestamp_pb2.Timestamp
    def __init__(self, adapter: _Optional[str] = ..., alias: _Optional[str] = ..., from_version: _Optional[int] = ..., to_version: _Optional[int] = ..., latency_seconds: _Optional[float] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("running_requests", "waiting_requests", "max_waiting", "slots_used", "slots_total", "tokens_generated", "decode_tokens_per_second", "kv_cache_usage", "reloads_total", "reload_failures_total", "last_event_id", "recent_reloads", "adapter_loads_total", "prompt_tokens_computed", "prompt_tokens_cached", "prompt_tokens_shared", "kv_blocks_total", "kv_blocks_used", "kv_blocks_cached", "kv_blocks_evicted", "preemptions_total", "kv_block_size", "own_prompt_tokens_cached", "own_prompt_tokens_computed", "own_prompt_tokens_shared", "store")
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_FIELD_NUMBER: _ClassVar[int]
    SLOTS_USED_FIELD_NUMBER: _ClassVar[int]
    SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    RELOADS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RELOAD_FAILURES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    RECENT_RELOADS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_LOADS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_CACHED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_SHARED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_EVICTED_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    OWN_PROMPT_TOKENS_CACHED_FIELD_NUMBER: _ClassVar[int]
    OWN_PROMPT_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    OWN_PROMPT_TOKENS_SHARED_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    running_requests: int
    waiting_requests: int
    max_waiting: int
    slots_used: int
    slots_total: int
    tokens_generated: int
    decode_tokens_per_second: float
    kv_cache_usage: float
    reloads_total: int
    reload_failures_total: int
    last_event_id: str
    recent_reloads: _containers.RepeatedCompositeFieldContainer[ReloadRecord]
    adapter_loads_total: int
    prompt_tokens_computed: int
    prompt_tokens_cached: int
    prompt_tokens_shared: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached: int
    kv_blocks_evicted: int
    preemptions_total: int
    kv_block_size: int
    own_prompt_tokens_cached: int
    own_prompt_tokens_computed: int
    own_prompt_tokens_shared: int
    store: StoreStatus
    def __init__(self, running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., max_waiting: _Optional[int] = ..., slots_used: _Optional[int] = ..., slots_total: _Optional[int] = ..., tokens_generated: _Optional[int] = ..., decode_tokens_per_second: _Optional[float] = ..., kv_cache_usage: _Optional[float] = ..., reloads_total: _Optional[int] = ..., reload_failures_total: _Optional[int] = ..., last_event_id: _Optional[str] = ..., recent_reloads: _Optional[_Iterable[_Union[ReloadRecord, _Mapping]]] = ..., adapter_loads_total: _Optional[int] = ..., prompt_tokens_computed: _Optional[int] = ..., prompt_tokens_cached: _Optional[int] = ..., prompt_tokens_shared: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_cached: _Optional[int] = ..., kv_blocks_evicted: _Optional[int] = ..., preemptions_total: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., own_prompt_tokens_cached: _Optional[int] = ..., own_prompt_tokens_computed: _Optional[int] = ..., own_prompt_tokens_shared: _Optional[int] = ..., store: _Optional[_Union[StoreStatus, _Mapping]] = ...) -> None: ...

class StoreStatus(_message.Message):
    __slots__ = ("url", "reachable", "last_error", "failures_total", "bytes_pulled_total", "cache_bytes")
    URL_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    FAILURES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BYTES_PULLED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    url: str
    reachable: bool
    last_error: str
    failures_total: int
    bytes_pulled_total: int
    cache_bytes: int
    def __init__(self, url: _Optional[str] = ..., reachable: _Optional[bool] = ..., last_error: _Optional[str] = ..., failures_total: _Optional[int] = ..., bytes_pulled_total: _Optional[int] = ..., cache_bytes: _Optional[int] = ...) -> None: ...
