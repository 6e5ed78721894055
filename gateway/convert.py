"""tinker wire formats <-> opentinker.v1 messages.

The tinker protobuf schema is the SDK's own (``tinker.proto.tinker_public_pb2``); nothing is re-declared
here. Tokens travel as int32 bytes, tensors as dense (or CSR) bytes of a declared dtype; ours are repeated
fields. Results the SDK reads as protobuf (ForwardBackwardOutput, SampleResponse) are built here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import zstandard
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as tpb

from opentinker.gateway.errors import RequestFailed, bad_request
from opentinker.v1 import common_pb2, sampler_pb2, trainer_pb2

MAX_BODY_BYTES = 256 << 20  # decompressed forward_backward body
_INT_KEYS = frozenset({"target_tokens"})
_NUMPY: dict[object, np.dtype[Any]] = {
    tpb.DTYPE_FLOAT32: np.dtype(np.float32),
    tpb.DTYPE_INT64: np.dtype(np.int64),
    tpb.DTYPE_INT32: np.dtype(np.int32),
}

# Requests


def decompress(body: bytes, content_encoding: str) -> bytes:
    encoding = content_encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding != "zstd":
        raise bad_request(f"unsupported Content-Encoding {content_encoding!r} (zstd or none)", "BAD_ENCODING")
    try:
        declared = zstandard.frame_content_size(body)
        if declared > MAX_BODY_BYTES:
            raise bad_request(f"decompressed body exceeds {MAX_BODY_BYTES} bytes", "BODY_TOO_LARGE")
        # A truncated or corrupt frame raises; an undeclared size is bounded by max_output_size.
        data = zstandard.ZstdDecompressor().decompress(body, max_output_size=MAX_BODY_BYTES)
    except zstandard.ZstdError as exc:
        raise bad_request(f"body is not valid zstd: {exc}", "BAD_ENCODING") from exc
    return data


def parse_forward_backward(body: bytes) -> Any:
    """A tinker ForwardBackwardRequest; 400 when the bytes are not one."""
    message = tpb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except (DecodeError, RuntimeWarning) as exc:
        raise bad_request(f"body is not a tinker ForwardBackwardRequest protobuf: {exc}", "MALFORMED_PROTOBUF") from exc
    if not message.model_id:
        raise bad_request("model_id is required", "MISSING_MODEL_ID")
    return message


def _tensor_values(tensor: Any, key: str) -> tuple[npt.NDArray[Any], list[int]]:
    """A tinker Tensor as a flat numpy array and its shape (CSR densified with 0 in unlisted cells)."""
    dtype: np.dtype[Any]
    if tensor.dtype == tpb.DTYPE_BFLOAT16:
        dtype = np.dtype(np.uint16)
    elif tensor.dtype in _NUMPY:
        dtype = _NUMPY[tensor.dtype]
    else:
        raise RequestFailed(f"loss_fn_inputs[{key!r}]: unsupported dtype {tensor.dtype}")
    shape = [int(d) for d in tensor.shape]
    try:
        if tensor.WhichOneof("encoding") == "sparse_csr":
            csr = tensor.sparse_csr
            values = np.frombuffer(csr.values, dtype=dtype)
            crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
            col = np.frombuffer(csr.col_indices, dtype=np.int64)
            if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values):
                raise ValueError("inconsistent sparse CSR tensor")
            dense = np.zeros(shape, dtype=dtype)
            rows = np.repeat(np.arange(shape[0]), np.diff(crow))
            dense[rows, col] = values
            flat = dense.reshape(-1)
        else:
            flat = np.frombuffer(tensor.dense, dtype=dtype)
    except ValueError as exc:
        raise RequestFailed(f"loss_fn_inputs[{key!r}]: {exc}") from exc
    if tensor.dtype == tpb.DTYPE_BFLOAT16:
        flat = (flat.astype(np.uint32) << 16).view(np.float32)
    if not shape:
        shape = [len(flat)]
    if int(np.prod(shape)) != len(flat):
        raise RequestFailed(f"loss_fn_inputs[{key!r}]: shape {shape} does not hold {len(flat)} values")
    return flat, shape


def _tensor(tensor: Any, key: str) -> common_pb2.TensorData:
    flat, shape = _tensor_values(tensor, key)
    if key in _INT_KEYS:
        return common_pb2.TensorData(
            dtype=common_pb2.D_TYPE_INT64, shape=shape, int64_values=flat.astype(np.int64).tolist()
        )
    return common_pb2.TensorData(
        dtype=common_pb2.D_TYPE_FLOAT32, shape=shape, float32_values=flat.astype(np.float32).tolist()
    )


def _model_input(chunks: Sequence[Any], where: str) -> common_pb2.ModelInput:
    result = common_pb2.ModelInput()
    for chunk in chunks:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise RequestFailed(f"{where}: {kind or 'empty'} chunks are not supported (text tokens only)")
        tokens = np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32)
        result.chunks.add().encoded_text.tokens.extend(tokens.tolist())
    return result


def datums(message: Any) -> list[common_pb2.Datum]:
    out = []
    for i, datum in enumerate(message.data):
        converted = common_pb2.Datum(model_input=_model_input(datum.model_input, f"datum {i}"))
        for key, tensor in datum.loss_fn_inputs.items():
            converted.loss_fn_inputs[key].CopyFrom(_tensor(tensor, f"{key}"))
        out.append(converted)
    if not out:
        raise RequestFailed("forward_backward needs at least one datum")
    return out


def loss_fn_config(message: Any) -> dict[str, float]:
    """The loss's keyword arguments: the v2 map when set (numbers only here), else the legacy float map."""
    if message.loss_fn_config_v2:
        config = {}
        for key, value in message.loss_fn_config_v2.items():
            if value.WhichOneof("value") != "number":
                raise RequestFailed(f"loss_fn_config[{key!r}]: only numbers are supported")
            config[key] = float(value.number)
        return config
    return {key: float(value) for key, value in message.loss_fn_config.items()}


def trace_ids(message: Any, session_id: str) -> list[str]:
    """Lineage trace ids: the Tinker session, then every sampled sequence the datums' provenance names."""
    sequences: dict[str, None] = {}
    for datum in message.data:
        for span in (*datum.model_input_spans, *datum.loss_fn_input_spans):
            arm = span.WhichOneof("span")
            if arm is not None and getattr(span, arm).sequence_id:
                sequences[getattr(span, arm).sequence_id] = None
    return [f"tinker-session:{session_id}", *(f"tinker-sequence:{s}" for s in sequences)]


def lora_config(rank: int, train_attn: bool, train_mlp: bool) -> common_pb2.LoraConfig:
    """Tinker's "which parts to train" as target modules (the unembedding is never trained here)."""
    if rank < 1:
        raise RequestFailed(f"lora rank must be at least 1, got {rank}")
    if train_attn and train_mlp:
        targets = ["all-linear"]
    elif train_attn or train_mlp:
        targets = ["attn" if train_attn else "mlp"]
    else:
        raise RequestFailed("train_attn or train_mlp must be set: this server trains no unembedding LoRA")
    return common_pb2.LoraConfig(rank=rank, target_modules=targets)


def adam_params(params: Mapping[str, object]) -> common_pb2.AdamParams:
    fields = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
    values: dict[str, float] = {}
    for name in fields:
        value = params.get(name)
        if value is None:
            continue
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise RequestFailed(f"adam_params.{name} must be a number")
        values[name] = float(value)
    return common_pb2.AdamParams(**values)


# Results


def forward_backward_output(outputs: Sequence[trainer_pb2.LossFnOutput], metrics: Mapping[str, float]) -> bytes:
    """The trainer's per-datum outputs as one tinker ArrayRecord (each field: every datum's values back
    to back, with byte offsets)."""
    record = tpb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(outputs))
    names = sorted({name for out in outputs for name in out.tensors})
    for name in names:
        parts = [np.asarray(out.tensors[name].float32_values, dtype=np.float32) for out in outputs]
        sizes = np.array([0, *(p.nbytes for p in parts)], dtype=np.int64)
        field = record.fields[name]
        field.dtype = tpb.DTYPE_FLOAT32
        field.data = b"".join(p.tobytes() for p in parts)
        field.offsets = np.cumsum(sizes).astype(np.int64).tobytes()
    message = tpb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=dict(metrics))
    message.loss_fn_outputs.append(record)
    return bytes(message.SerializeToString())


def sampling_params(params: Mapping[str, object], default_max_tokens: int) -> sampler_pb2.SamplingParams:
    """tinker SamplingParams JSON -> ours. ``stop``: a string or strings are stop strings, integers stop
    tokens; None (and []) keep the model's end-of-sequence tokens."""

    def number(name: str, default: float) -> float:
        value = params.get(name)
        if value is None:
            return default
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise RequestFailed(f"sampling_params.{name} must be a number")
        return float(value)

    max_tokens = int(number("max_tokens", default_max_tokens))
    if max_tokens < 1:
        raise RequestFailed(f"sampling_params.max_tokens must be at least 1, got {max_tokens}")
    top_k = int(number("top_k", -1))
    result = sampler_pb2.SamplingParams(
        temperature=number("temperature", 1.0),
        top_k=0 if top_k < 0 else top_k,
        top_p=number("top_p", 1.0),
        max_tokens=max_tokens,
        logprobs=True,
    )
    seed = params.get("seed")
    if seed is not None:
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise RequestFailed("sampling_params.seed must be a non-negative integer")
        result.seed = seed
    stop = params.get("stop")
    if isinstance(stop, str):
        result.stop_strings.append(stop)
    elif isinstance(stop, list):
        strings = [s for s in stop if isinstance(s, str)]
        ids = [s for s in stop if isinstance(s, int) and not isinstance(s, bool)]
        if len(strings) == len(stop):
            result.stop_strings.extend(strings)
        elif len(ids) == len(stop):
            result.stop_token_ids.extend(ids)
        else:
            raise RequestFailed("sampling_params.stop must be a string, a list of strings or a list of token ids")
    elif stop is not None:
        raise RequestFailed("sampling_params.stop must be a string, a list of strings or a list of token ids")
    return result


def prompt_tokens(prompt: object) -> list[int]:
    """tinker ModelInput JSON (``{"chunks": [{"type": "encoded_text", "tokens": [...]}]}``) -> token ids."""
    chunks = prompt.get("chunks") if isinstance(prompt, dict) else None
    if not isinstance(chunks, list):
        raise RequestFailed("prompt must be a ModelInput with chunks")
    tokens: list[int] = []
    for chunk in chunks:
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            kind = chunk.get("type") if isinstance(chunk, dict) else None
            raise RequestFailed(f"prompt: {kind or 'unknown'} chunks are not supported (text tokens only)")
        values = chunk.get("tokens")
        if not isinstance(values, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in values):
            raise RequestFailed("prompt chunk tokens must be a list of integers")
        tokens.extend(values)
    if not tokens:
        raise RequestFailed("prompt must hold at least one token")
    return tokens


_STOPPED = frozenset({sampler_pb2.STOP_REASON_STOP_TOKEN, sampler_pb2.STOP_REASON_STOP_STRING})


def sample_response(
    sequences: Sequence[tuple[list[int], list[float], int]], prompt_logprobs: Sequence[float] | None
) -> bytes:
    """(tokens, logprobs, our stop reason) per sample -> tinker SampleResponse. Prompt logprobs get NaN
    for the first token, which has no context."""
    message = tpb.SampleResponse()
    for tokens, logprobs, stop in sequences:
        seq = message.sequences.add()
        seq.stop_reason = tpb.STOP_REASON_STOP if stop in _STOPPED else tpb.STOP_REASON_LENGTH
        seq.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        message.prompt_logprobs = np.asarray([np.nan, *prompt_logprobs], dtype=np.float32).tobytes()
    return bytes(message.SerializeToString())
