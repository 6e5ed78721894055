"""One training example as the trainer core takes it: its tokens and its loss function's input columns."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class DType(enum.Enum):
    UNSPECIFIED = 0  # inferred from which values are given
    INT64 = 1
    FLOAT32 = 2


@dataclass(frozen=True, slots=True)
class TensorValues:
    """A 1-D loss input as sent: batch.py checks its dtype, shape and length against the datum's tokens."""

    dtype: DType
    shape: tuple[int, ...]
    int64_values: list[int]
    float32_values: list[float]


@dataclass(frozen=True, slots=True)
class Datum:
    tokens: list[int]  # the model input, every chunk's tokens in order
    loss_fn_inputs: dict[str, TensorValues]  # e.g. target_tokens, weights, logprobs, advantages
