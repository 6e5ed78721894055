"""Datum records -> validated tensors. Every check runs before any compute, so a rejected request
changes nothing; errors name the field and the datum index."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from opentinker.rpc.serving.errors import InvalidArgument, ResourceExhausted
from opentinker.trainer_server.datum import Datum, DType, TensorValues
from opentinker.trainer_server.losses import default_input, input_error, optional_inputs, required_inputs

MAX_DATUMS = 4096
# Padded positions (datums x longest datum) per request: the compute and memory a batch costs, whatever its real
# token count (one long datum padded 63 short ones to 64 x 2048). 64 x 2048, a cookbook-sized SFT batch, fits.
DEFAULT_MAX_BATCH_POSITIONS = 1 << 17


@dataclass(frozen=True, slots=True)
class Batch:
    input_ids: torch.Tensor  # [B, T] right-padded
    attention_mask: torch.Tensor  # [B, T]
    lengths: list[int]  # valid positions per datum
    targets: torch.Tensor  # [N] target token of every valid position, datums concatenated
    inputs: dict[str, torch.Tensor]  # loss inputs, each [N] float32
    digest: str  # sha256 over tokens and loss inputs (the ledger's batch id)

    @property
    def num_tokens(self) -> int:
        return int(self.targets.numel())

    @property
    def padded_positions(self) -> int:
        return int(self.input_ids.numel())


def _values(
    datum_index: int, key: str, tensor: TensorValues, length: int, *, integer: bool = False
) -> list[float] | list[int]:
    field = f"datums[{datum_index}].loss_fn_inputs[{key!r}]"
    values: list[float] | list[int]
    if tensor.dtype == DType.INT64 or (tensor.int64_values and not tensor.float32_values):
        values = list(tensor.int64_values)
    elif integer and (tensor.dtype == DType.FLOAT32 or tensor.float32_values):
        raise InvalidArgument(
            f"{field} must be int64 token ids, got float32 values",
            reason="INVALID_DATUM",
            field=field,
            datum=datum_index,
        )
    else:
        values = list(tensor.float32_values)
    shape = list(tensor.shape)
    if shape and (len(shape) != 1 or shape[0] != len(values)):
        raise InvalidArgument(
            f"{field}: shape {shape} does not match its {len(values)} values",
            reason="INVALID_DATUM",
            field=field,
            datum=datum_index,
        )
    if len(values) != length:
        raise InvalidArgument(
            f"{field} has {len(values)} values but model_input has {length} tokens",
            reason="INVALID_DATUM",
            field=field,
            datum=datum_index,
        )
    if any(not math.isfinite(v) for v in values):
        raise InvalidArgument(f"{field} contains NaN or inf", reason="INVALID_DATUM", field=field, datum=datum_index)
    return values


def build_batch(
    datums: Sequence[Datum],
    loss_fn: str,
    *,
    vocab_size: int,
    max_positions: int,
    pad_id: int,
    max_batch_positions: int = DEFAULT_MAX_BATCH_POSITIONS,
) -> Batch:
    if not datums:
        raise InvalidArgument("empty batch: send at least one datum", reason="EMPTY_BATCH", field="datums")
    if len(datums) > MAX_DATUMS:
        raise ResourceExhausted(f"at most {MAX_DATUMS} datums per request", reason="BATCH_TOO_LARGE", field="datums")
    needed = required_inputs(loss_fn)
    optional = optional_inputs(loss_fn)
    sequences: list[list[int]] = []
    targets: list[int] = []
    inputs: dict[str, list[float]] = {key: [] for key in needed if key != "target_tokens"}
    # per optional input: its values ([N], 0 where not given) and whether the datum gave them ([N])
    given: dict[str, tuple[list[float], list[bool]]] = {key: ([], []) for key in optional}
    digest = hashlib.sha256(loss_fn.encode())
    longest = 0
    for index, datum in enumerate(datums):
        tokens = datum.tokens
        if not tokens:
            raise InvalidArgument(
                f"datums[{index}].model_input is empty",
                reason="INVALID_DATUM",
                field=f"datums[{index}].model_input",
                datum=index,
            )
        longest = max(longest, len(tokens))
        if len(datums) * longest > max_batch_positions:  # refused as soon as it is known, before any tensor
            raise ResourceExhausted(
                f"{len(datums)} datums padded to the longest (datums[{index}], {longest} tokens) make "
                f"{len(datums) * longest} positions; the limit is {max_batch_positions} (--max-batch-positions): "
                "send fewer or similar-length datums per request",
                reason="BATCH_TOO_LARGE",
                field="datums",
                datum=index,
            )
        if len(tokens) > max_positions:
            raise InvalidArgument(
                f"datums[{index}] has {len(tokens)} tokens; the model's limit is {max_positions}",
                reason="SEQUENCE_TOO_LONG",
                field=f"datums[{index}].model_input",
                datum=index,
            )
        unknown = sorted(set(datum.loss_fn_inputs) - set(needed) - {"weights", "logprobs", "advantages"})
        if unknown:
            raise InvalidArgument(
                f"datums[{index}].loss_fn_inputs has unknown keys {unknown}",
                reason="INVALID_DATUM",
                field=f"datums[{index}].loss_fn_inputs",
                datum=index,
            )
        for key in needed:
            if key not in datum.loss_fn_inputs:
                raise InvalidArgument(
                    f"datums[{index}].loss_fn_inputs lacks {key!r}, required by {loss_fn}",
                    reason="INVALID_DATUM",
                    field=f"datums[{index}].loss_fn_inputs[{key!r}]",
                    datum=index,
                )
        datum_targets = [
            int(t)
            for t in _values(index, "target_tokens", datum.loss_fn_inputs["target_tokens"], len(tokens), integer=True)
        ]
        for label, ids in (("model_input", tokens), ("loss_fn_inputs['target_tokens']", datum_targets)):
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise InvalidArgument(
                    f"datums[{index}].{label} has token id {bad} outside the vocabulary [0, {vocab_size})",
                    reason="TOKEN_OUT_OF_RANGE",
                    field=f"datums[{index}].{label}",
                    datum=index,
                )
        sequences.append(tokens)
        targets.extend(datum_targets)
        digest.update(repr((tokens, datum_targets)).encode())
        for key, column in inputs.items():
            values = [float(v) for v in _values(index, key, datum.loss_fn_inputs[key], len(tokens))]
            column.extend(values)
            digest.update(f"{key}:{values!r}".encode())
        for key, (column, mask) in given.items():
            if key not in datum.loss_fn_inputs:
                column.extend([0.0] * len(tokens))
                mask.extend([False] * len(tokens))
                continue
            values = [float(v) for v in _values(index, key, datum.loss_fn_inputs[key], len(tokens))]
            problem = input_error(loss_fn, key, values)
            if problem is not None:
                field = f"datums[{index}].loss_fn_inputs[{key!r}]"
                raise InvalidArgument(f"{field}: {problem}", reason="INVALID_DATUM", field=field, datum=index)
            column.extend(values)
            mask.extend([True] * len(tokens))
            # only what the datum sent: a datum without it keeps the digest it had before the input existed
            digest.update(f"{key}:{values!r}".encode())
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, tokens in enumerate(sequences):
        input_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        attention_mask[row, : len(tokens)] = 1
    tensors = {key: torch.tensor(values, dtype=torch.float32) for key, values in inputs.items()}
    for key, (column, mask) in given.items():
        defaults = default_input(loss_fn, key, tensors)  # [N]
        tensors[key] = torch.where(torch.tensor(mask), torch.tensor(column, dtype=torch.float32), defaults)  # [N]
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        lengths=[len(s) for s in sequences],
        targets=torch.tensor(targets, dtype=torch.long),
        inputs=tensors,
        digest=digest.hexdigest(),
    )


def split_batch(batch: Batch, max_positions: int) -> list[Batch]:
    """Consecutive groups of the batch's datums, each padded to its own longest and within max_positions (a datum
    longer than that alone). Each part is exactly the batch a request of those datums would build, so running
    the parts one after another with gradient accumulation is running separate requests: every loss is a sum
    over tokens (losses.py), and the parts' losses and gradients add up to the whole batch's."""
    groups: list[tuple[int, int]] = []  # [first row, end row)
    longest = 0
    for row, length in enumerate(batch.lengths):
        if groups and (row - groups[-1][0] + 1) * max(longest, length) <= max_positions:
            groups[-1] = (groups[-1][0], row + 1)
            longest = max(longest, length)
        else:
            groups.append((row, row + 1))
            longest = length
    if len(groups) == 1:
        return [batch]
    offsets = [0]
    for length in batch.lengths:
        offsets.append(offsets[-1] + length)
    parts = []
    for first, end in groups:
        width = max(batch.lengths[first:end])
        start, stop = offsets[first], offsets[end]
        parts.append(
            Batch(
                input_ids=batch.input_ids[first:end, :width].contiguous(),
                attention_mask=batch.attention_mask[first:end, :width].contiguous(),
                lengths=batch.lengths[first:end],
                targets=batch.targets[start:stop].contiguous(),
                inputs={key: value[start:stop].contiguous() for key, value in batch.inputs.items()},
                digest=batch.digest,
            )
        )
    return parts


def active_tokens(batch: Batch) -> int:
    """The tokens a loss's ":mean" metrics average over (A != 0; every token without advantages)."""
    advantages = batch.inputs.get("advantages")
    return batch.num_tokens if advantages is None else int((advantages != 0).sum())
