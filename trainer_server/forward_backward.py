"""Forward and backward of one (micro-)batch for one adapter: activate its LoRA weights in the base model, gather
the target tokens' logprobs, compute the loss and (training) add its gradients to the adapter's own parameters;
and the undo of a ForwardBackward whose client gave up before the answer."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from opentinker.trainer_server.adapter import AdapterState
from opentinker.trainer_server.base_model import BaseModel
from opentinker.trainer_server.batch import Batch
from opentinker.trainer_server.ledger import BatchRecord
from opentinker.trainer_server.losses import compute_loss


@dataclass(frozen=True, slots=True)
class StepOutput:
    logprobs: list[list[float]]  # per datum, one per target token
    metrics: dict[str, float]


@dataclass(frozen=True, slots=True)
class GradientMark:
    grads: list[torch.Tensor | None]  # copies, in the adapter's parameter order
    pending: int  # batches awaiting the optimizer step
    rng: torch.Tensor  # dropout generator state


def target_logprobs(base: BaseModel, state: AdapterState, batch: Batch, *, training: bool) -> torch.Tensor:
    """[N]: the logprob of every valid position's target token under the adapter, datums concatenated."""
    device = base.device
    with base.activate(state.modules, training=training):
        logits = base.model(
            input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device)
        ).logits  # [B, T, V]
    valid = batch.attention_mask.to(device).bool()  # [B, T]
    flat = logits[valid].float()  # [N, V], datums in order
    logprobs: torch.Tensor = flat.log_softmax(-1).gather(1, batch.targets.to(device)[:, None]).squeeze(1)  # [N]
    return logprobs


def _output(logprobs: torch.Tensor, batch: Batch, metrics: dict[str, float]) -> StepOutput:
    values = logprobs.detach().cpu().tolist()
    rows, start = [], 0
    for length in batch.lengths:
        rows.append(values[start : start + length])
        start += length
    counts = {"tokens:sum": float(batch.num_tokens), "datums:sum": float(len(batch.lengths))}
    return StepOutput(rows, {**metrics, **counts})


def accumulate(
    base: BaseModel, state: AdapterState, batch: Batch, loss_fn: str, config: dict[str, float]
) -> StepOutput:
    """Forward and backward: adds the batch's gradients to the adapter's; no ledger entry."""
    logprobs = target_logprobs(base, state, batch, training=True)  # [N]
    inputs = {key: value.to(logprobs.device) for key, value in batch.inputs.items()}  # each [N]
    result = compute_loss(loss_fn, logprobs, inputs, config)
    result.loss.backward()  # type: ignore[no-untyped-call]
    return _output(logprobs, batch, result.metrics)


def forward(base: BaseModel, state: AdapterState, batch: Batch, loss_fn: str, config: dict[str, float]) -> StepOutput:
    """Logprobs and loss metrics without gradients (dropout off)."""
    with torch.no_grad():
        logprobs = target_logprobs(base, state, batch, training=False)  # [N]
        inputs = {key: value.to(logprobs.device) for key, value in batch.inputs.items()}  # each [N]
        result = compute_loss(loss_fn, logprobs, inputs, config)
    return _output(logprobs, batch, result.metrics)


def record_batch(state: AdapterState, batch: Batch, loss_fn: str, trace_ids: list[str]) -> None:
    """The request's batch (all its micro-batches) goes into the ledger, for the next optimizer step."""
    state.ledger.pending.append(
        BatchRecord(
            digest=batch.digest,
            trace_ids=tuple(trace_ids),
            step=state.step + 1,
            num_datums=len(batch.lengths),
            num_tokens=batch.num_tokens,
            loss_fn=loss_fn,
            time_ns=time.time_ns(),
        )
    )


def gradient_mark(state: AdapterState) -> GradientMark:
    """What a ForwardBackward changes (gradients, pending batches, dropout RNG), to undo it if its client
    gave up before the answer (the work must then leave no trace, or a retry would count twice)."""
    grads = [None if p.grad is None else p.grad.clone() for p in state.params]
    return GradientMark(grads, len(state.ledger.pending), state.generator.get_state())


def undo_forward_backward(state: AdapterState, mark: GradientMark) -> None:
    for param, grad in zip(state.params, mark.grads, strict=True):
        param.grad = grad
    del state.ledger.pending[mark.pending :]
    state.generator.set_state(mark.rng)
