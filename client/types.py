"""The training SDK's data types (Tinker-style) and their conversion to and from the wire protos.

    from opentinker.client import Datum, ModelInput

    datum = Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [0.0] * 3 + [1.0] * (len(tokens) - 4)},
    )

Every type is a frozen, slotted dataclass holding tuples (and plain dicts for mappings, so that values
pickle); helpers that "modify" one return a new object. torch is optional: it is imported only inside the
methods that take or return tensors.

The `*_to_proto` / `*_from_proto` functions at the end of this module are the SDK's wire conversion. They
are used by the clients and are not part of the public API: no protobuf message appears in a public
signature.
"""

from __future__ import annotations

import math
import operator
import sys
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, cast

from opentinker.v1 import common_pb2, sampler_pb2, trainer_pb2

if TYPE_CHECKING:
    import torch

__all__ = [
    "AdamParams",
    "DType",
    "Datum",
    "EncodedTextChunk",
    "ForwardBackwardOutput",
    "LoadedAdapter",
    "LoraConfig",
    "LossFnInput",
    "ModelInput",
    "OptimStepResult",
    "SampleChunk",
    "SampleResult",
    "SampledSequence",
    "SampledVersion",
    "SamplerStats",
    "SamplingParams",
    "SavedState",
    "StopReason",
    "TensorData",
    "TrainerInfo",
    "TrainingAdapterInfo",
]

DType: TypeAlias = Literal["int64", "float32"]
StopReason: TypeAlias = Literal["length", "stop_token", "stop_string", "context_length"]
"""Why a sample ended: max_tokens reached, an end-of-sequence / stop token sampled (and included), a stop
string appeared in the text, or the model's context was full."""
_DTYPES: tuple[DType, ...] = ("int64", "float32")
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_ALL_LINEAR = "all-linear"
_INT_KEYS = frozenset({"target_tokens"})


def _token(value: Any) -> int:
    """An int64 token id / value; floats are refused rather than truncated."""
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"expected an integer, got {type(value).__name__} {value!r}") from None
    if not _INT64_MIN <= number <= _INT64_MAX:
        raise ValueError(f"{number} does not fit in int64")
    return number


def _ints(values: Iterable[Any]) -> tuple[int, ...]:
    return tuple(_token(v) for v in values)


def _float32s(values: Iterable[Any]) -> tuple[float, ...]:
    # Rounded to float32 now, so that a value survives the trip through the wire (float32) unchanged.
    return tuple(array("f", [float(v) for v in values]).tolist())


def _strings(values: Iterable[str], what: str) -> tuple[str, ...]:
    # A bare string is iterable too; ("stable") instead of ("stable",) would otherwise become 6 items.
    if isinstance(values, str):
        raise TypeError(f"{what} must be a sequence of strings, not a single string")
    return tuple(values)


def _is_tensor(value: object) -> bool:
    # Without importing torch: if torch was never imported, nothing can be a tensor.
    torch_module = sys.modules.get("torch")
    return torch_module is not None and isinstance(value, torch_module.Tensor)


# Model inputs


@dataclass(frozen=True, slots=True, init=False)
class EncodedTextChunk:
    """A run of token ids."""

    tokens: tuple[int, ...]

    def __init__(self, tokens: Iterable[int]) -> None:
        object.__setattr__(self, "tokens", _ints(tokens))

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True, slots=True, init=False)
class ModelInput:
    """The tokens fed to the model: the concatenation of its chunks."""

    chunks: tuple[EncodedTextChunk, ...]

    def __init__(self, chunks: Iterable[EncodedTextChunk] = ()) -> None:
        normalized = tuple(chunks)
        for chunk in normalized:
            if not isinstance(chunk, EncodedTextChunk):
                raise TypeError(f"ModelInput chunks must be EncodedTextChunk, got {type(chunk).__name__}")
        object.__setattr__(self, "chunks", normalized)

    @classmethod
    def empty(cls) -> ModelInput:
        return cls(())

    @classmethod
    def from_ints(cls, tokens: Iterable[int]) -> ModelInput:
        """One chunk holding ``tokens`` (a list, tuple, range or 1-D integer tensor)."""
        return cls((EncodedTextChunk(tokens),))

    def to_ints(self) -> list[int]:
        """Every token id, chunks concatenated."""
        return [token for chunk in self.chunks for token in chunk.tokens]

    @property
    def length(self) -> int:
        return sum(chunk.length for chunk in self.chunks)

    def append(self, chunk: EncodedTextChunk) -> ModelInput:
        """A new ModelInput with ``chunk`` added at the end."""
        return ModelInput((*self.chunks, chunk))

    def append_int(self, token: int) -> ModelInput:
        """A new ModelInput with one token added to the last chunk (or to a new chunk if there is none)."""
        return self.extend_ints((token,))

    def extend_ints(self, tokens: Iterable[int]) -> ModelInput:
        """A new ModelInput with ``tokens`` added to the last chunk (or to a new chunk if there is none)."""
        if not self.chunks:
            return ModelInput.from_ints(tokens)
        last = self.chunks[-1]
        return ModelInput((*self.chunks[:-1], EncodedTextChunk((*last.tokens, *_ints(tokens)))))


# Tensors


def _flatten(values: Any) -> tuple[list[Any], tuple[int, ...]]:
    """Nested sequences -> (row-major values, shape); ragged nesting is refused."""
    if isinstance(values, (str, bytes)):
        raise TypeError("TensorData values must be numbers or nested sequences of numbers, not a string")
    if not isinstance(values, Sequence):
        if hasattr(values, "tolist"):  # numpy arrays and scalars
            return _flatten(values.tolist())
        raise TypeError(f"expected a sequence of numbers, got {type(values).__name__}")
    if not values or not any(isinstance(v, Sequence) or getattr(v, "ndim", 0) > 0 for v in values):
        return list(values), (len(values),)
    parts = [_flatten(v) for v in values]
    inner = parts[0][1]
    if any(shape != inner for _, shape in parts):
        raise ValueError("ragged nested sequence: every row must have the same shape")
    return [v for flat, _ in parts for v in flat], (len(values), *inner)


@dataclass(frozen=True, slots=True, init=False)
class TensorData:
    """A dense, row-major tensor of int64 or float32 values.

    ``TensorData(data, dtype, shape)``; shape None means one dimension of ``len(data)``. float32 values are
    rounded to float32 on construction, so a TensorData survives the wire unchanged.
    """

    data: tuple[float, ...] | tuple[int, ...]
    dtype: DType
    shape: tuple[int, ...]

    def __init__(self, data: Iterable[float] | Iterable[int], dtype: DType, shape: Iterable[int] | None = None) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
        values: tuple[float, ...] | tuple[int, ...] = _ints(data) if dtype == "int64" else _float32s(data)
        dims = (len(values),) if shape is None else _ints(shape)
        if any(d < 0 for d in dims) or math.prod(dims) != len(values):
            raise ValueError(f"shape {dims} does not hold {len(values)} values")
        object.__setattr__(self, "data", values)
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "shape", dims)

    @classmethod
    def from_list(cls, values: Any, dtype: DType | None = None) -> TensorData:
        """From a (nested) list or tuple of numbers; also numpy arrays and torch tensors.

        dtype None infers it: int64 when every value is an int, else float32.
        """
        if _is_tensor(values):
            return cls.from_torch(values, dtype)
        flat, shape = _flatten(values)
        if dtype is None:
            integral = all(isinstance(v, int) and not isinstance(v, bool) for v in flat)
            dtype = "int64" if flat and integral else "float32"
        return cls(flat, dtype, shape)

    @classmethod
    def from_torch(cls, tensor: torch.Tensor, dtype: DType | None = None) -> TensorData:
        """From a tensor on any device. dtype None: float32 for floating tensors, int64 for integer or bool."""
        import torch

        if tensor.is_complex():
            raise TypeError("complex tensors are not supported")
        if dtype is None:
            dtype = "float32" if tensor.is_floating_point() else "int64"
        target = torch.float32 if dtype == "float32" else torch.int64
        values = tensor.detach().to(device="cpu", dtype=target).reshape(-1).tolist()
        return cls(values, dtype, tuple(tensor.shape))

    def tolist(self) -> list[Any]:
        """The values nested by shape (a flat list for a 1-D tensor)."""
        data = self.data

        def nest(offset: int, dims: tuple[int, ...]) -> list[Any]:
            if len(dims) <= 1:
                return list(data[offset : offset + (dims[0] if dims else len(data))])
            stride = math.prod(dims[1:])
            return [nest(offset + i * stride, dims[1:]) for i in range(dims[0])]

        return nest(0, self.shape)

    def to_torch(self) -> torch.Tensor:
        import torch

        dtype = torch.int64 if self.dtype == "int64" else torch.float32
        return torch.tensor(self.data, dtype=dtype).reshape(self.shape)


LossFnInput: TypeAlias = "TensorData | Sequence[int] | Sequence[float] | torch.Tensor"
"""What Datum accepts per loss_fn_inputs key; anything but a TensorData is converted (see Datum)."""


def _loss_input(key: str, value: LossFnInput) -> TensorData:
    if isinstance(value, TensorData):
        return value
    dtype: DType = "int64" if key in _INT_KEYS else "float32"
    if _is_tensor(value):
        return TensorData.from_torch(value, dtype)  # type: ignore[arg-type]
    return TensorData.from_list(value, dtype)


@dataclass(frozen=True, slots=True, init=False)
class Datum:
    """One training example: position i of ``model_input`` predicts ``loss_fn_inputs["target_tokens"][i]``.

    ``loss_fn_inputs`` values may be TensorData, lists/tuples of numbers or torch tensors; anything but a
    TensorData is converted: "target_tokens" to int64, every other key to float32. Each input holds one
    value per model_input position. Keys: "target_tokens" (always), "weights" (cross_entropy),
    "logprobs" and "advantages" (policy-gradient losses).
    """

    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData]

    def __init__(self, model_input: ModelInput, loss_fn_inputs: Mapping[str, LossFnInput]) -> None:
        if not isinstance(model_input, ModelInput):
            raise TypeError(f"model_input must be a ModelInput, got {type(model_input).__name__}")
        inputs = {str(key): _loss_input(str(key), value) for key, value in loss_fn_inputs.items()}
        object.__setattr__(self, "model_input", model_input)
        object.__setattr__(self, "loss_fn_inputs", inputs)

    @classmethod
    def create(cls, model_input: ModelInput, loss_fn_inputs: Mapping[str, LossFnInput]) -> Datum:
        """Same as the constructor; spelled out for readers who expect a converting factory."""
        return cls(model_input, loss_fn_inputs)


# Configuration


@dataclass(frozen=True, slots=True)
class LoraConfig:
    """LoRA hyper-parameters. alpha None means alpha = rank (scaling 1).

    target_modules: "attn", "mlp", "all-linear" or explicit module names ("q_proj", "down_proj", ...).
    """

    rank: int = 32
    alpha: float | None = None
    dropout: float = 0.0
    target_modules: tuple[str, ...] = (_ALL_LINEAR,)

    def __post_init__(self) -> None:
        # Lists are accepted (and stored as a tuple, keeping the config hashable); a bare string is refused.
        object.__setattr__(self, "target_modules", _strings(self.target_modules, "target_modules"))


@dataclass(frozen=True, slots=True)
class AdamParams:
    """AdamW parameters of an optimizer step (Tinker defaults). grad_clip_norm 0 disables clipping.

    The trainer reads a zero field as "use the default", so beta1 = 0 or beta2 = 0 cannot be requested.
    """

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


# Results


@dataclass(frozen=True, slots=True)
class ForwardBackwardOutput:
    """The result of forward_backward (or forward).

    ``logprobs[i]`` holds datum i's target-token logprobs, one per model_input position;
    ``loss_fn_outputs[i]`` every per-datum output tensor ("logprobs" always). ``metrics`` are named
    "name:reduction" ("loss:sum", "tokens:sum", ...). ``batch_digest`` is the batch's id in the adapter's
    data ledger and ``step`` the optimizer step these gradients go into; forward sets neither ("" and 0).
    """

    logprobs: tuple[tuple[float, ...], ...]
    loss_fn_outputs: tuple[dict[str, TensorData], ...]
    metrics: dict[str, float]
    batch_digest: str = ""
    step: int = 0

    @property
    def loss(self) -> float:
        """The summed loss of the batch (metrics["loss:sum"])."""
        return self.metrics["loss:sum"]


@dataclass(frozen=True, slots=True)
class OptimStepResult:
    """step: the adapter's step count after this step. metrics: "grad_norm:value", "learning_rate:value"."""

    step: int
    metrics: dict[str, float]


@dataclass(frozen=True, slots=True)
class TrainingAdapterInfo:
    """An adapter's training state as the trainer holds it.

    ``pending_batches``: forward_backward calls whose gradients await the next optim_step;
    ``last_snapshot_version``: the last version save_snapshot published (0: none); ``resident``: False
    while its state is offloaded from the training device; ``adam``: the defaults optim_step uses.
    """

    name: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    step: int
    tokens_trained: int
    datums_trained: int
    pending_batches: int
    last_snapshot_version: int
    num_parameters: int
    resident: bool
    dropout: float
    seed: int
    adam: AdamParams
    created_at: datetime | None

    @property
    def lora(self) -> LoraConfig:
        return LoraConfig(rank=self.rank, alpha=self.alpha, dropout=self.dropout, target_modules=self.target_modules)


@dataclass(frozen=True, slots=True)
class SavedState:
    """A saved training state: pass ``state_id`` to load_state or create_training_client(resume_state=...)."""

    state_id: str
    step: int
    size_bytes: int


@dataclass(frozen=True, slots=True)
class TrainerInfo:
    """The base model a trainer holds and what it can train."""

    model: str
    model_digest: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_position_embeddings: int
    dtype: str
    device: str
    loss_fns: tuple[str, ...]
    lora_target_modules: tuple[str, ...] = ()
    max_resident_adapters: int = 0


# Sampling


@dataclass(frozen=True, slots=True, init=False)
class SamplingParams:
    """How a sampler generates. temperature 0: greedy; top_k 0 and top_p 1: off.

    ``SamplingParams(max_tokens=16, temperature=1.0, top_k=0, top_p=1.0, seed=None, stop=(),
    stop_token_ids=(), logprobs=True)``. ``seed``: same seed, prompt and version, same output (sample i of a
    request uses seed + i); None draws a fresh one. ``stop``: stop strings (a single string is one stop
    string); ``stop_token_ids``: tokens that end a sample (besides the model's end-of-sequence tokens),
    included in its output. ``logprobs``: return the logprob of every sampled token. The sampler checks the
    values (INVALID_ARGUMENT), except max_tokens, checked here: at least 1 (the wire reads 0 as "default").
    """

    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    logprobs: bool

    def __init__(
        self,
        max_tokens: int = 16,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: str | Iterable[str] = (),
        stop_token_ids: Iterable[int] = (),
        logprobs: bool = True,
    ) -> None:
        max_tokens = _token(max_tokens)
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        object.__setattr__(self, "max_tokens", max_tokens)
        object.__setattr__(self, "temperature", float(temperature))
        object.__setattr__(self, "top_k", _token(top_k))
        object.__setattr__(self, "top_p", float(top_p))
        object.__setattr__(self, "seed", None if seed is None else _token(seed))
        object.__setattr__(self, "stop", (stop,) if isinstance(stop, str) else tuple(stop))
        object.__setattr__(self, "stop_token_ids", _ints(stop_token_ids))
        object.__setattr__(self, "logprobs", bool(logprobs))


@dataclass(frozen=True, slots=True)
class SampledVersion:
    """The exact adapter version that produced a sample: ``adapter`` "" and ``version`` 0 for the base model.

    ``reference`` is the reference the request named ("name@stable"); ``sha256`` the artifact's manifest
    digest ("" for the base model).
    """

    adapter: str
    version: int
    reference: str
    sha256: str

    @property
    def exact(self) -> str:
        """ "name@N", or "base" for the base model."""
        return f"{self.adapter}@{self.version}" if self.adapter else "base"


@dataclass(frozen=True, slots=True)
class SampledSequence:
    """One completed sample: its tokens (a stop token included), their logprobs (empty unless
    SamplingParams.logprobs), its text and why it ended."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    stop_reason: StopReason
    version: SampledVersion


@dataclass(frozen=True, slots=True)
class SampleChunk:
    """A streamed piece of sample ``sample_index``: the tokens produced since its previous chunk.

    ``stop_reason`` is set on the sample's last chunk only. ``text`` may lag behind ``tokens`` while a
    multi-byte character is incomplete; the concatenated texts are the sample's text.
    """

    sample_index: int
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    stop_reason: StopReason | None
    version: SampledVersion


@dataclass(frozen=True, slots=True)
class SampleResult:
    """The samples of one request, in sample order. ``prompt_logprobs``: logprobs of prompt tokens 1..n-1
    (None unless requested); ``prompt_tokens``: the prompt's length in tokens."""

    sequences: tuple[SampledSequence, ...]
    prompt_logprobs: tuple[float, ...] | None
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class LoadedAdapter:
    """A version resident in one of the sampler's slots. ``active_requests``: requests holding it now."""

    version: SampledVersion
    slot: int
    rank: int
    pinned: bool
    active_requests: int
    serving_aliases: tuple[str, ...]
    load_time: datetime | None


@dataclass(frozen=True, slots=True)
class SamplerStats:
    """A sampler's load: requests, adapter slots, throughput (decode tokens/s over the last seconds) and
    hot reloads."""

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


# Wire conversion (internal)


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
    targets = [] if lora.target_modules == (_ALL_LINEAR,) else list(lora.target_modules)
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
        target_modules=tuple(lora.target_modules) or (_ALL_LINEAR,),
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
    )


def forward_output_from_proto(
    outputs: Iterable[trainer_pb2.LossFnOutput],
    metrics: Mapping[str, float],
    batch_digest: str = "",
    step: int = 0,
) -> ForwardBackwardOutput:
    tensors = tuple({key: tensor_data_from_proto(value) for key, value in out.tensors.items()} for out in outputs)
    logprobs = tuple(
        tuple(float(v) for v in out["logprobs"].data) if "logprobs" in out else () for out in tensors
    )  # fmt: skip
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
    )


_STOP_REASONS: dict[int, StopReason] = {
    sampler_pb2.STOP_REASON_LENGTH: "length",
    sampler_pb2.STOP_REASON_STOP_TOKEN: "stop_token",
    sampler_pb2.STOP_REASON_STOP_STRING: "stop_string",
    sampler_pb2.STOP_REASON_CONTEXT_LENGTH: "context_length",
}


def sampling_params_to_proto(params: SamplingParams) -> sampler_pb2.SamplingParams:
    return sampler_pb2.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        seed=params.seed,
        max_tokens=params.max_tokens,
        stop_token_ids=params.stop_token_ids,
        stop_strings=params.stop,
        logprobs=params.logprobs,
    )


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
    )
