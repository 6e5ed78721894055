"""A training example and its parts: token chunks, the model input, dense tensors, the Datum.

Every type is a frozen, slotted dataclass holding tuples (and plain dicts for mappings, so that values
pickle); helpers that "modify" one return a new object. torch is optional: it is imported only inside the
methods that take or return tensors. Import them from `opentinker.client` or `opentinker.client.datum`.
"""

from __future__ import annotations

import math
import operator
import sys
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

if TYPE_CHECKING:
    import torch

__all__ = ["DType", "Datum", "EncodedTextChunk", "LossFnInput", "ModelInput", "TensorData"]

DType: TypeAlias = Literal["int64", "float32"]
_DTYPES: tuple[DType, ...] = ("int64", "float32")
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_INT_KEYS = frozenset({"target_tokens"})


def int64(value: Any) -> int:
    """An int64 token id / value; floats are refused rather than truncated."""
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"expected an integer, got {type(value).__name__} {value!r}") from None
    if not _INT64_MIN <= number <= _INT64_MAX:
        raise ValueError(f"{number} does not fit in int64")
    return number


def int64s(values: Iterable[Any]) -> tuple[int, ...]:
    return tuple(int64(v) for v in values)


def _float32s(values: Iterable[Any]) -> tuple[float, ...]:
    # Rounded to float32 now, so that a value survives the trip through the wire (float32) unchanged.
    return tuple(array("f", [float(v) for v in values]).tolist())


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
        object.__setattr__(self, "tokens", int64s(tokens))

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
        return ModelInput((*self.chunks[:-1], EncodedTextChunk((*last.tokens, *int64s(tokens)))))


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
        values: tuple[float, ...] | tuple[int, ...] = int64s(data) if dtype == "int64" else _float32s(data)
        dims = (len(values),) if shape is None else int64s(shape)
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
