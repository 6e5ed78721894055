"""The SDK's wire conversion: the public records of training_types, sampling_types and datum to and from the
opentinker.v1 protobuf messages. Internal to the clients: no protobuf message appears in a public signature.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC
from typing import Literal, cast

from opentinker.client.constraints import Constraint, JsonObject, JsonSchema, Regex
from opentinker.client.datum import Datum, EncodedTextChunk, ModelInput, TensorData
from opentinker.client.sampling_types import (
    LoadedAdapter,
    SampleChunk,
    SampledVersion,
    SamplerStats,
    SamplingParams,
    StopReason,
)
from opentinker.client.training_types import (
    ALL_LINEAR,
    AdamParams,
    ForwardBackwardOutput,
    LoraConfig,
    ResetResult,
    StartedFrom,
    TrainerInfo,
    TrainingAdapterInfo,
)
from opentinker.v1 import common_pb2, sampler_pb2, trainer_pb2


def tensor_data_to_proto(tensor: TensorData) -> common_pb2.TensorData:
    if tensor.dtype == "int64":
        ints = cast("tuple[int, ...]", tensor.data)
        return common_pb2.TensorData(dtype=common_pb2.D_TYPE_INT64, shape=tensor.shape, int64_values=ints)
    return common_pb2.TensorData(dtype=common_pb2.D_TYPE_FLOAT32, shape=tensor.shape, float32_values=tensor.data)


def tensor_data_from_proto(proto: common_pb2.TensorData) -> TensorData:
    is_int = proto.dtype == common_pb2.D_TYPE_INT64 or (
        proto.dtype == common_pb2.D_TYPE_UNSPECIFIED and bool(proto.int64_values) and not proto.float32_values
    )
    shape = tuple(proto.shape) or None  # empty: one dimension of the value count
    if is_int:
        return TensorData(proto.int64_values, "int64", shape)
    return TensorData(proto.float32_values, "float32", shape)


def model_input_to_proto(model_input: ModelInput) -> common_pb2.ModelInput:
    return common_pb2.ModelInput(
        chunks=[
            common_pb2.ModelInputChunk(encoded_text=common_pb2.EncodedTextChunk(tokens=chunk.tokens))
            for chunk in model_input.chunks
        ]
    )


def model_input_from_proto(proto: common_pb2.ModelInput) -> ModelInput:
    return ModelInput(
        EncodedTextChunk(chunk.encoded_text.tokens)
        for chunk in proto.chunks
        if chunk.WhichOneof("chunk") == "encoded_text"
    )


def datum_to_proto(datum: Datum) -> common_pb2.Datum:
    return common_pb2.Datum(
        model_input=model_input_to_proto(datum.model_input),
        loss_fn_inputs={key: tensor_data_to_proto(value) for key, value in datum.loss_fn_inputs.items()},
    )


def datum_from_proto(proto: common_pb2.Datum) -> Datum:
    return Datum(
        model_input_from_proto(proto.model_input),
        {key: tensor_data_from_proto(value) for key, value in proto.loss_fn_inputs.items()},
    )


def lora_config_to_proto(lora: LoraConfig) -> common_pb2.LoraConfig:
    # The contract spells "all-linear" as an empty list (the registry's module-name check rejects the
    # literal), and alpha None as alpha = rank; sending rank explicitly keeps scaling 1 on every server.
    targets = [] if lora.target_modules == (ALL_LINEAR,) else list(lora.target_modules)
    alpha = float(lora.rank) if lora.alpha is None else lora.alpha
    return common_pb2.LoraConfig(rank=lora.rank, alpha=alpha, dropout=lora.dropout, target_modules=targets)


def adam_params_to_proto(adam: AdamParams) -> common_pb2.AdamParams:
    return common_pb2.AdamParams(
        learning_rate=adam.learning_rate,
        beta1=adam.beta1,
        beta2=adam.beta2,
        eps=adam.eps,
        weight_decay=adam.weight_decay,
        grad_clip_norm=adam.grad_clip_norm,
    )


def adam_params_from_proto(proto: common_pb2.AdamParams) -> AdamParams:
    return AdamParams(
        learning_rate=proto.learning_rate,
        beta1=proto.beta1,
        beta2=proto.beta2,
        eps=proto.eps,
        weight_decay=proto.weight_decay,
        grad_clip_norm=proto.grad_clip_norm,
    )


def training_adapter_from_proto(proto: trainer_pb2.TrainingAdapter) -> TrainingAdapterInfo:
    lora = proto.lora_config
    return TrainingAdapterInfo(
        name=proto.name,
        rank=lora.rank,
        alpha=lora.alpha,
        target_modules=tuple(lora.target_modules) or (ALL_LINEAR,),
        step=proto.step,
        tokens_trained=proto.tokens_trained,
        datums_trained=proto.datums_trained,
        pending_batches=proto.pending_batches,
        last_snapshot_version=proto.last_snapshot_version,
        num_parameters=proto.num_parameters,
        resident=proto.resident,
        dropout=lora.dropout,
        seed=proto.seed,
        adam=adam_params_from_proto(proto.adam_params),
        created_at=proto.create_time.ToDatetime(tzinfo=UTC) if proto.HasField("create_time") else None,
        parent_adapter=proto.parent_adapter,
    )


_START_KINDS: dict[int, Literal["fresh", "version", "state"]] = {
    trainer_pb2.START_KIND_VERSION: "version",
    trainer_pb2.START_KIND_STATE: "state",
}


def started_from_proto(proto: trainer_pb2.StartedFrom) -> StartedFrom:
    return StartedFrom(
        kind=_START_KINDS.get(proto.kind, "fresh"),
        adapter=proto.adapter,
        version=proto.version,
        state_id=proto.state_id,
        description=proto.description,
    )


def reset_result_from_proto(proto: trainer_pb2.ResetAdapterResponse) -> ResetResult:
    return ResetResult(
        adapter=proto.version.adapter,
        version=proto.version.version,
        optimizer_kept=proto.optimizer_kept,
        info=training_adapter_from_proto(proto.adapter),
    )


def forward_output_from_proto(
    outputs: Iterable[trainer_pb2.LossFnOutput],
    metrics: Mapping[str, float],
    batch_digest: str = "",
    step: int = 0,
) -> ForwardBackwardOutput:
    tensors = tuple({key: tensor_data_from_proto(value) for key, value in out.tensors.items()} for out in outputs)
    logprobs = tuple(tuple(float(v) for v in out["logprobs"].data) if "logprobs" in out else () for out in tensors)
    return ForwardBackwardOutput(
        logprobs=logprobs, loss_fn_outputs=tensors, metrics=dict(metrics), batch_digest=batch_digest, step=step
    )


def trainer_info_from_proto(proto: trainer_pb2.GetTrainerInfoResponse) -> TrainerInfo:
    base = proto.base_model
    return TrainerInfo(
        model=base.model,
        model_digest=base.model_digest,
        architecture=base.architecture,
        vocab_size=base.vocab_size,
        hidden_size=base.hidden_size,
        num_layers=base.num_layers,
        max_position_embeddings=base.max_position_embeddings,
        dtype=base.dtype,
        device=base.device,
        loss_fns=tuple(proto.loss_fns),
        lora_target_modules=tuple(base.lora_target_modules),
        max_resident_adapters=proto.max_resident_adapters,
        served_name=base.served_name,
    )


_STOP_REASONS: dict[int, StopReason] = {
    sampler_pb2.STOP_REASON_LENGTH: "length",
    sampler_pb2.STOP_REASON_STOP_TOKEN: "stop_token",
    sampler_pb2.STOP_REASON_STOP_STRING: "stop_string",
    sampler_pb2.STOP_REASON_CONTEXT_LENGTH: "context_length",
}


def sampling_params_to_proto(params: SamplingParams) -> sampler_pb2.SamplingParams:
    proto = sampler_pb2.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        seed=params.seed,
        max_tokens=params.max_tokens,
        stop_token_ids=params.stop_token_ids,
        stop_strings=params.stop,
        logprobs=params.logprobs,
        top_logprobs=params.top_logprobs,
        frequency_penalty=params.frequency_penalty,
        presence_penalty=params.presence_penalty,
    )
    # top_p 0 is greedy (SamplingParams' docstring), which the wire would read as "off"; read back as float32, so a
    # positive top_p too small for it counts as 0 too.
    if proto.top_p == 0.0:
        proto.temperature = 0.0
    return proto


def constraint_to_proto(constraint: Constraint) -> sampler_pb2.Constraint:
    if isinstance(constraint, JsonSchema):
        return sampler_pb2.Constraint(json_schema=constraint.schema)
    if isinstance(constraint, JsonObject):
        return sampler_pb2.Constraint(json_object=True)
    if isinstance(constraint, Regex):
        return sampler_pb2.Constraint(regex=constraint.pattern)
    return sampler_pb2.Constraint(lark=constraint.lark)


def stop_reason_from_proto(value: int) -> StopReason | None:
    """None while the sample continues (STOP_REASON_UNSPECIFIED); an unknown value reads as "length"."""
    if value == sampler_pb2.STOP_REASON_UNSPECIFIED:
        return None
    return _STOP_REASONS.get(value, "length")


def sampled_version_from_proto(proto: common_pb2.ResolvedVersion) -> SampledVersion:
    return SampledVersion(
        adapter=proto.adapter, version=proto.version, reference=proto.reference, sha256=proto.artifact_sha256
    )


def sample_chunk_from_proto(proto: sampler_pb2.SampleResponse) -> SampleChunk:
    return SampleChunk(
        sample_index=proto.sample_index,
        tokens=tuple(proto.tokens),
        logprobs=tuple(proto.logprobs),
        text=proto.text,
        stop_reason=stop_reason_from_proto(proto.stop_reason),
        version=sampled_version_from_proto(proto.version),
        top_logprobs=tuple(tuple(zip(top.token_ids, top.logprobs, strict=True)) for top in proto.top_logprobs),
        replica=proto.replica,
    )


def loaded_adapter_from_proto(proto: sampler_pb2.LoadedAdapter) -> LoadedAdapter:
    return LoadedAdapter(
        version=sampled_version_from_proto(proto.version),
        slot=proto.slot,
        rank=proto.rank,
        pinned=proto.pinned,
        active_requests=proto.active_requests,
        serving_aliases=tuple(proto.serving_aliases),
        load_time=proto.load_time.ToDatetime(tzinfo=UTC) if proto.HasField("load_time") else None,
    )


def sampler_stats_from_proto(proto: sampler_pb2.GetStatsResponse) -> SamplerStats:
    return SamplerStats(
        running_requests=proto.running_requests,
        waiting_requests=proto.waiting_requests,
        max_waiting=proto.max_waiting,
        slots_used=proto.slots_used,
        slots_total=proto.slots_total,
        tokens_generated=proto.tokens_generated,
        decode_tokens_per_second=proto.decode_tokens_per_second,
        kv_cache_usage=proto.kv_cache_usage,
        reloads_total=proto.reloads_total,
        reload_failures_total=proto.reload_failures_total,
        last_event_id=proto.last_event_id,
        adapter_loads_total=proto.adapter_loads_total,
        kv_block_size=proto.kv_block_size,
        kv_blocks_total=proto.kv_blocks_total,
        kv_blocks_used=proto.kv_blocks_used,
        kv_blocks_cached=proto.kv_blocks_cached,
        kv_blocks_evicted=proto.kv_blocks_evicted,
        preemptions_total=proto.preemptions_total,
        own_prompt_tokens_cached=proto.own_prompt_tokens_cached,
        own_prompt_tokens_computed=proto.own_prompt_tokens_computed,
        own_prompt_tokens_shared=proto.own_prompt_tokens_shared,
    )
