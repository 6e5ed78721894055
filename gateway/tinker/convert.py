"""tinker wire formats <-> opentinker.v1 messages.

The tinker protobuf schema is the SDK's own (``tinker.proto.tinker_public_pb2``); nothing is re-declared
here. Tokens travel as int32 bytes, tensors as dense (or CSR) bytes of a declared dtype; ours are repeated
fields. Results the SDK reads as protobuf (ForwardBackwardOutput, SampleResponse) are built here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import zstandard
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as tpb

from opentinker.gateway.errors import GatewayError, RequestFailed, bad_request
from opentinker.gateway.tinker import fields
from opentinker.v1 import common_pb2, sampler_pb2, trainer_pb2
from opentinker.weights.base_model import UNEMBED_MODULE
from opentinker.weights.peft import MAX_RANK

MAX_BODY_BYTES = 64 << 20  # decompressed forward_backward body (default; --max-body-bytes); the SDK sends <= 5 MB
MAX_TENSOR_VALUES = 1 << 22  # cells of all loss_fn_inputs tensors of one request (sparse ones are densified here)
_INT_KEYS = frozenset({"target_tokens"})
_NUMPY: dict[object, np.dtype[Any]] = {
    tpb.DTYPE_FLOAT32: np.dtype(np.float32),
    tpb.DTYPE_INT64: np.dtype(np.int64),
    tpb.DTYPE_INT32: np.dtype(np.int32),
}

# Requests


def decompress(body: bytes, content_encoding: str, limit: int | None = None) -> bytes:
    """The body as sent, or zstd-decoded: at most ``limit`` bytes (MAX_BODY_BYTES by default) come out."""
    limit = MAX_BODY_BYTES if limit is None else limit
    encoding = content_encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding != "zstd":
        raise bad_request(f"unsupported Content-Encoding {content_encoding!r} (zstd or none)", "BAD_ENCODING")
    try:
        declared = zstandard.frame_content_size(body)
        if declared > limit:
            raise GatewayError(413, "BODY_TOO_LARGE", f"decompressed body exceeds {limit} bytes")
        # A truncated or corrupt frame raises; an undeclared size is bounded by max_output_size.
        data = zstandard.ZstdDecompressor().decompress(body, max_output_size=limit)
    except zstandard.ZstdError as exc:
        raise bad_request(f"body is not valid zstd: {exc}", "BAD_ENCODING") from exc
    return data


def parse_forward_backward(body: bytes, max_string: int = 4096) -> Any:
    """A tinker ForwardBackwardRequest; 400 when the bytes are not one or its names are longer than
    ``max_string``."""
    message = tpb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except (DecodeError, RuntimeWarning) as exc:
        raise bad_request(f"body is not a tinker ForwardBackwardRequest protobuf: {exc}", "MALFORMED_PROTOBUF") from exc
    if not message.model_id:
        raise bad_request("model_id is required", "MISSING_MODEL_ID")
    if len(message.model_id) > max_string or len(message.loss_fn) > max_string:
        raise bad_request(f"model_id and loss_fn are at most {max_string} characters", "STRING_TOO_LONG")
    return message


def check_sizes(message: Any) -> None:
    """Refuses (400) a request whose tensors declare negative dimensions or more cells in all than
    MAX_TENSOR_VALUES, before anything is built from it: a small sparse tensor can declare a huge shape."""
    cells = 0
    for i, datum in enumerate(message.data):
        for key, tensor in datum.loss_fn_inputs.items():
            shape = list(tensor.shape)
            if len(key) > 128:
                raise bad_request(f"datum {i}: a loss_fn_inputs key is longer than 128 characters", "STRING_TOO_LONG")
            if any(d < 0 for d in shape) or len(shape) > 8:
                raise bad_request(f"datum {i} loss_fn_inputs[{key[:64]!r}]: invalid shape", "INVALID_TENSOR")
            cells += math.prod(shape) if shape else 0
            if cells > MAX_TENSOR_VALUES:
                raise bad_request(
                    f"loss_fn_inputs tensors declare more than {MAX_TENSOR_VALUES} cells in all", "INVALID_TENSOR"
                )


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
            if crow[0] != 0 or crow[-1] != len(values) or np.any(np.diff(crow) < 0):
                raise ValueError("sparse CSR row offsets must rise from 0 to the number of values")
            if len(col) and (col.min() < 0 or col.max() >= shape[1]):
                raise ValueError("sparse CSR column index out of range")
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
    if math.prod(shape) != len(flat):
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
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise RequestFailed(f"{where}: tokens are int32 bytes; got {len(raw)} bytes")
        tokens = np.frombuffer(raw, dtype=np.int32)
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


def lora_config(lora: Mapping[str, object]) -> tuple[common_pb2.LoraConfig, int | None]:
    """tinker LoraConfig JSON -> ours and its seed (None: draw one). Tinker's "which parts to train" become target
    modules exactly: train_attn -> attn, train_mlp -> mlp, train_unembed -> lm_head (every one defaults to true).
    400 INVALID_FIELD for a rank or seed out of range, or nothing to train."""
    rank = fields.integer(lora, "rank", 1, MAX_RANK, default=32, where="lora_config.")
    seed = fields.integer(lora, "seed", 0, fields.UINT64_MAX, where="lora_config.")
    parts = {
        target: fields.boolean(lora, flag, default=True, where="lora_config.")
        for flag, target in (("train_attn", "attn"), ("train_mlp", "mlp"), ("train_unembed", UNEMBED_MODULE))
    }
    targets = [target for target, wanted in parts.items() if wanted]
    if not targets:
        raise bad_request(
            "lora_config: train_attn, train_mlp and train_unembed are all false, so there is nothing to train",
            "INVALID_FIELD",
        )
    return common_pb2.LoraConfig(rank=rank, target_modules=targets), seed


def adam_params(params: Mapping[str, object]) -> common_pb2.AdamParams:
    """tinker AdamParams JSON -> ours: each a finite float32 (400 INVALID_FIELD otherwise); the trainer checks
    what values make sense."""
    values: dict[str, float] = {}
    for name in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"):
        value = fields.number(params, name, where="adam_params.")
        if value is not None:
            values[name] = value
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


MAX_SAMPLE_TOKENS = 1 << 20  # max_tokens: above any context this gateway serves (the sampler checks the context)
MAX_STOP = 16  # stop strings or stop tokens (the sampler's MAX_STOP_STRINGS)
_P = "sampling_params."


def sampling_params(params: Mapping[str, object], default_max_tokens: int) -> sampler_pb2.SamplingParams:
    """tinker SamplingParams JSON -> ours, every field in range (400 INVALID_FIELD otherwise). ``stop``: a string
    or strings are stop strings, integers stop tokens; None (and []) keep the model's end-of-sequence tokens.
    ``top_p`` 0 is greedy: the limit of a shrinking nucleus, the most likely token alone (sent as temperature 0,
    since the sampler reads top_p 0 as "off")."""
    max_tokens = fields.integer(params, "max_tokens", 1, MAX_SAMPLE_TOKENS, default=default_max_tokens, where=_P)
    top_k = fields.integer(params, "top_k", -1, fields.INT32_MAX, default=-1, where=_P)
    assert max_tokens is not None and top_k is not None
    result = sampler_pb2.SamplingParams(
        temperature=fields.number(params, "temperature", 0.0, 1e4, default=1.0, where=_P),
        top_k=max(top_k, 0),
        top_p=fields.number(params, "top_p", 0.0, 1.0, default=1.0, where=_P),
        max_tokens=max_tokens,
        logprobs=True,
    )
    if result.top_p == 0.0:  # read back as float32: a positive top_p too small for it is 0 as well
        result.temperature = 0.0
    seed = fields.integer(params, "seed", 0, fields.UINT64_MAX, where=_P)
    if seed is not None:
        result.seed = seed
    stop = params.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(stop, list):
        if len(stop) > MAX_STOP:
            raise bad_request(f"sampling_params.stop holds {len(stop)} entries; at most {MAX_STOP}", "INVALID_FIELD")
        strings = [s for s in stop if isinstance(s, str)]
        ids = [s for s in stop if isinstance(s, int) and not isinstance(s, bool)]
        if len(strings) == len(stop):
            result.stop_strings.extend(strings)
        elif len(ids) == len(stop) and all(0 <= t <= fields.INT32_MAX for t in ids):
            result.stop_token_ids.extend(ids)
        else:
            raise bad_request(_STOP_FORMS, "INVALID_FIELD")
    elif stop is not None:
        raise bad_request(_STOP_FORMS, "INVALID_FIELD")
    return result


_STOP_FORMS = "sampling_params.stop must be a string, a list of strings or a list of token ids (0..2**31-1)"


def prompt_tokens(prompt: object) -> list[int]:
    """tinker ModelInput JSON (``{"chunks": [{"type": "encoded_text", "tokens": [...]}]}``) -> token ids, each a
    non-negative int32 (what the SDK's token ids are); 400 otherwise."""
    chunks = prompt.get("chunks") if isinstance(prompt, dict) else None
    if not isinstance(chunks, list):
        raise bad_request("prompt must be a ModelInput with chunks", "INVALID_FIELD")
    tokens: list[int] = []
    for chunk in chunks:
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            kind = chunk.get("type") if isinstance(chunk, dict) else None
            raise bad_request(
                f"prompt: {str(kind or 'unknown')[:64]} chunks are not supported (text tokens only)", "INVALID_FIELD"
            )
        values = chunk.get("tokens")
        if not isinstance(values, list) or not all(type(t) is int and 0 <= t <= fields.INT32_MAX for t in values):
            raise bad_request("prompt chunk tokens must be a list of token ids (0..2**31-1)", "INVALID_FIELD")
        tokens.extend(values)
    if not tokens:
        raise bad_request("prompt must hold at least one token", "INVALID_FIELD")
    return tokens


_STOPPED = frozenset({sampler_pb2.STOP_REASON_STOP_TOKEN, sampler_pb2.STOP_REASON_STOP_STRING})


TOPK_MASK_LOGPROB = -99999.0  # the SDK's TopkLogprobs filler (tinker.types.topk_logprobs.MASK_LOGPROB)


def sample_response(
    sequences: Sequence[tuple[list[int], list[float], int, list[sampler_pb2.TopLogprobs]]],
    prompt_logprobs: Sequence[float] | None,
    top_k: int = 0,
) -> bytes:
    """(tokens, logprobs, our stop reason, top logprobs) per sample -> tinker SampleResponse. Prompt logprobs get
    NaN for the first token, which has no context. With ``top_k`` (the request's topk_sample_logprobs) each
    sequence's top logprobs go in the SDK's dense [tokens, k] matrices, most likely first, the SDK's filler where
    a position has fewer (a vocabulary smaller than k)."""
    message = tpb.SampleResponse()
    for tokens, logprobs, stop, top in sequences:
        seq = message.sequences.add()
        seq.stop_reason = tpb.STOP_REASON_STOP if stop in _STOPPED else tpb.STOP_REASON_LENGTH
        seq.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()
        if top_k:
            if len(top) != len(tokens):
                raise RequestFailed(f"the sampler answered {len(top)} top logprobs for {len(tokens)} tokens", "server")
            ids = np.zeros((len(top), top_k), dtype=np.int32)  # [T, k]
            values = np.full((len(top), top_k), TOPK_MASK_LOGPROB, dtype=np.float32)  # [T, k]
            for row, position in enumerate(top):
                ids[row, : len(position.token_ids)] = position.token_ids[:top_k]
                values[row, : len(position.logprobs)] = position.logprobs[:top_k]
            seq.topk_sampled_logprobs.CopyFrom(
                tpb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=values.tobytes(), k=top_k, length=len(top))
            )
    if prompt_logprobs is not None:
        message.prompt_logprobs = np.asarray([np.nan, *prompt_logprobs], dtype=np.float32).tobytes()
    return bytes(message.SerializeToString())
