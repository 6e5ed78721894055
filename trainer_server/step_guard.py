"""The magnitude rule applied to an adapter's live weights, and the undo of an optimizer step that breaks it.

A step with a huge learning rate (or a gradient blow-up) can leave weights that are finite but enormous; a
snapshot of them would make every sampler batch they join overflow. So a step is checked right after AdamW
ran, and a step that breaks the rule is undone: weights, gradients, AdamW moments and hyperparameters go back
bitwise to what they were before the call. Only the adapter's own parameters are copied (about 4x its LoRA
bytes for the duration of one step), never the base model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from opentinker.rpc.serving.errors import FailedPrecondition
from opentinker.trainer_server.adapter import AdapterState
from opentinker.weights.peft import LoraMagnitudeError, check_lora_magnitudes, lora_a_key, lora_b_key


@dataclass(frozen=True, slots=True)
class StepMark:
    data: list[torch.Tensor]  # copies, in the adapter's parameter order
    grads: list[torch.Tensor | None]
    moments: list[dict[str, Any] | None]  # AdamW's per-parameter state (exp_avg, exp_avg_sq, step)
    groups: list[dict[str, Any]]  # AdamW's hyperparameters per group (lr, betas, ...), without the params


def _clone(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def mark_step(state: AdapterState) -> StepMark:
    params = state.params
    moments = [state.optimizer.state.get(p) for p in params]
    return StepMark(
        data=[p.detach().clone() for p in params],
        grads=[None if p.grad is None else p.grad.clone() for p in params],
        moments=[None if m is None else {k: _clone(v) for k, v in m.items()} for m in moments],
        groups=[{k: v for k, v in group.items() if k != "params"} for group in state.optimizer.param_groups],
    )


def undo_step(state: AdapterState, mark: StepMark) -> None:
    params = state.params
    with torch.no_grad():
        for param, data, grad in zip(params, mark.data, mark.grads, strict=True):
            param.copy_(data)
            param.grad = grad
    state.optimizer.state.clear()
    for param, moments in zip(params, mark.moments, strict=True):
        if moments is not None:
            state.optimizer.state[param] = moments
    for group, saved in zip(state.optimizer.param_groups, mark.groups, strict=True):
        group.update(saved)


def lora_tensors(state: AdapterState) -> dict[str, torch.Tensor]:
    """The adapter's live weights under peft's key names (no copies, on their device)."""
    tensors: dict[str, torch.Tensor] = {}
    for name, weights in state.modules.items():
        tensors[lora_a_key(name)] = weights.a.detach()
        tensors[lora_b_key(name)] = weights.b.detach()
    return tensors


def lora_scaling_of(state: AdapterState) -> float:
    return state.lora.alpha / state.lora.rank


def check_weights(state: AdapterState, what: str) -> None:
    """FAILED_PRECONDITION WEIGHTS_OUT_OF_RANGE unless the adapter's weights pass the one magnitude rule."""
    try:
        check_lora_magnitudes(lora_tensors(state), lora_scaling_of(state))
    except LoraMagnitudeError as exc:
        raise FailedPrecondition(
            f"{what}: the weights of adapter {state.name!r} are out of range: {exc}",
            reason="WEIGHTS_OUT_OF_RANGE",
            adapter=state.name,
        ) from None
