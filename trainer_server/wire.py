"""The trainer's service edge: protos in, typed records out (and back for replies), so the compute core
imports no generated message and a field renamed in a .proto changes only this file and the handlers."""

from __future__ import annotations

from collections.abc import Iterable

from opentinker.rpc.serving.model_input import tokens_of
from opentinker.trainer_server.adapter import AdapterState
from opentinker.trainer_server.adapter_config import ADAM_FIELDS, DEFAULT_ADAM, AdamParams, LoraConfig
from opentinker.trainer_server.base_model import BaseModel
from opentinker.trainer_server.datum import Datum, DType, TensorValues
from opentinker.trainer_server.forward_backward import StepOutput
from opentinker.trainer_server.ledger import BatchRecord
from opentinker.v1 import common_pb2, registry_pb2, trainer_pb2

_DTYPES = {common_pb2.D_TYPE_INT64: DType.INT64, common_pb2.D_TYPE_FLOAT32: DType.FLOAT32}


def lora_of(message: common_pb2.LoraConfig) -> LoraConfig:
    return LoraConfig(
        rank=message.rank,
        alpha=message.alpha,
        dropout=message.dropout,
        target_modules=tuple(message.target_modules),
    )


def lora_message(lora: LoraConfig) -> common_pb2.LoraConfig:
    return common_pb2.LoraConfig(
        rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, target_modules=list(lora.target_modules)
    )


def adam_of(message: common_pb2.AdamParams) -> AdamParams:
    """The request's values, Tinker's defaults for the fields it leaves unset."""
    values = {
        name: getattr(message, name) if message.HasField(name) else getattr(DEFAULT_ADAM, name) for name in ADAM_FIELDS
    }
    return AdamParams(**values)


def adam_message(adam: AdamParams) -> common_pb2.AdamParams:
    return common_pb2.AdamParams(**{name: getattr(adam, name) for name in ADAM_FIELDS})


def datum_of(message: common_pb2.Datum) -> Datum:
    inputs = {
        key: TensorValues(
            dtype=_DTYPES.get(tensor.dtype, DType.UNSPECIFIED),
            shape=tuple(tensor.shape),
            int64_values=list(tensor.int64_values),
            float32_values=list(tensor.float32_values),
        )
        for key, tensor in message.loss_fn_inputs.items()
    }
    return Datum(tokens=tokens_of(message.model_input), loss_fn_inputs=inputs)


def datums_of(messages: Iterable[common_pb2.Datum]) -> list[Datum]:
    return [datum_of(message) for message in messages]


def loss_outputs(result: StepOutput) -> list[trainer_pb2.LossFnOutput]:
    return [
        trainer_pb2.LossFnOutput(
            tensors={
                "logprobs": common_pb2.TensorData(dtype=common_pb2.D_TYPE_FLOAT32, shape=[len(row)], float32_values=row)
            }
        )
        for row in result.logprobs
    ]


def batch_record_message(record: BatchRecord) -> registry_pb2.BatchRecord:
    message = registry_pb2.BatchRecord(
        digest=record.digest,
        trace_ids=list(record.trace_ids),
        step=record.step,
        num_datums=record.num_datums,
        num_tokens=record.num_tokens,
        loss_fn=record.loss_fn,
    )
    message.time.FromNanoseconds(record.time_ns)
    return message


def adapter_message(state: AdapterState) -> trainer_pb2.TrainingAdapter:
    message = trainer_pb2.TrainingAdapter(
        name=state.name,
        lora_config=lora_message(state.lora),
        adam_params=adam_message(state.adam),
        seed=state.seed,
        step=state.step,
        tokens_trained=state.ledger.tokens_trained,
        datums_trained=state.ledger.datums_trained,
        pending_batches=len(state.ledger.pending),
        last_snapshot_version=state.last_snapshot_version,
        num_parameters=state.num_parameters,
        resident=state.resident,
        parent_adapter=state.parent_adapter,
    )
    message.create_time.FromSeconds(int(state.create_time))
    return message


def base_model_info(base: BaseModel) -> common_pb2.BaseModelInfo:
    return common_pb2.BaseModelInfo(
        model=base.model_path,
        model_digest=base.digest,
        architecture=str(base.config.model_type),
        vocab_size=base.vocab_size,
        hidden_size=int(base.config.hidden_size),
        num_layers=int(base.config.num_hidden_layers),
        max_position_embeddings=base.max_positions,
        dtype=base.dtype,
        device=str(base.device),
        lora_target_modules=sorted({n.rsplit(".", 1)[-1] for n in base.hooks}),
        served_name=base.served_name,
    )
